"""The penalties' token histories, kept on the device between sampling steps.

Presence, frequency and repetition penalties count the tokens each row has seen. Uploading
every row's whole prompt and output each step costs ``rows x length`` ids per step, growing with
every token; but a decode batch changes little from one step to the next: each row gains one
token (a few after an accepted speculation). So, like the persistent block tables, the padded
histories stay on the device and a step uploads only what each row gained::

    output_ids [rows, capacity]   row i's output tokens in columns [0, lens[i]), zeros after
                                  (masked off); capacity doubles on the device when a row fills it
    prompt_ids / prompt_mask      [rows, prompt width], uploaded once (repetition penalty only)

The histories are rebuilt (everything uploaded, as before this module) when the batch's rows
change: another row set, another order, or a row whose history is not its earlier one plus new
tokens. A row is recognised by its token list object (a request's own ``all_token_ids``, which
only grows while the request runs); the lists are held until the next rebuild, so a finished
request's list can never be mistaken for a new request's.
"""
from __future__ import annotations

import numpy as np
import torch

# the host arrays this module adds to a step's upload (sampling_inputs.py sends them with the rest)
_PREFIX = "history_"


class PenaltyHistory:
    """One sampler's persistent penalty histories (see the module docstring).

    ``host_arrays(rows, repetition)`` returns what this step must upload (a rebuild or the new
    tokens); ``device_tensors(uploaded)`` takes those arrays back from the device and returns
    ``output_ids``, ``output_mask`` and, with repetition, ``prompt_ids`` / ``prompt_mask`` for
    the step. ``rebuilds`` counts the full uploads.
    """

    def __init__(self) -> None:
        self._lists: list[list[int]] = []  # each row's token list (held: see the module docstring)
        self._prompt_lens: list[int] = []
        self._lens: list[int] = []  # output tokens of each row on the device after this step
        self._with_prompt = False
        self._rebuilding = False
        self._output_ids: torch.Tensor | None = None  # [rows, capacity]
        self._prompt: dict[str, torch.Tensor] = {}
        self.rebuilds = 0

    # ------------------------------------------------------------------ host side
    def host_arrays(self, rows: list, repetition: bool) -> dict[str, np.ndarray]:
        """This step's arrays to upload: every history on a membership change, else the new tokens."""
        self._rebuilding = not self._same_rows(rows, repetition)
        arrays = self._rebuilt(rows, repetition) if self._rebuilding else self._appended(rows)
        arrays["lens"] = np.array(self._lens, dtype=np.int64)
        return {_PREFIX + k: v for k, v in arrays.items()}

    def _same_rows(self, rows: list, repetition: bool) -> bool:
        if len(rows) != len(self._lists) or (repetition and not self._with_prompt):
            return False
        return all(r.token_ids is ids and r.num_prompt_tokens == p and len(ids) >= p + n
                   for r, ids, p, n in zip(rows, self._lists, self._prompt_lens, self._lens))

    def _rebuilt(self, rows: list, repetition: bool) -> dict[str, np.ndarray]:
        self._lists = [r.token_ids for r in rows]
        self._prompt_lens = [r.num_prompt_tokens for r in rows]
        outputs = [r.output_token_ids for r in rows]
        self._lens = [len(x) for x in outputs]
        self._with_prompt = repetition
        arrays = {"output_ids": pad_token_lists(outputs, _capacity(max(self._lens, default=0)))[0]}
        if repetition:
            arrays["prompt_ids"], arrays["prompt_mask"] = pad_token_lists([r.prompt_token_ids for r in rows])
        self.rebuilds += 1
        return arrays

    def _appended(self, rows: list) -> dict[str, np.ndarray]:
        """(row, column, token) of every token a row gained since the last step."""
        where, tokens = [], []
        for i, (ids, p, n) in enumerate(zip(self._lists, self._prompt_lens, self._lens)):
            new = ids[p + n:]
            where += [(i, n + j) for j in range(len(new))]
            tokens += new
            self._lens[i] = n + len(new)
        return {"new_at": np.array(where, dtype=np.int64).reshape(-1, 2).T.copy(),  # [2, new]: rows, columns
                "new_ids": np.array(tokens, dtype=np.int64)}

    # ------------------------------------------------------------------ device side
    def device_tensors(self, uploaded: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Takes this module's arrays out of ``uploaded``; the step's penalty history tensors."""
        mine = {k[len(_PREFIX):]: uploaded.pop(k) for k in [k for k in uploaded if k.startswith(_PREFIX)]}
        if self._rebuilding:
            # cloned: the upload is one buffer shared by the step's other inputs, freed after the step
            self._output_ids = mine["output_ids"].clone()
            self._prompt = {k: mine[k].clone() for k in ("prompt_ids", "prompt_mask") if k in mine}
        else:
            self._append(mine["new_at"], mine["new_ids"])
        ids = self._output_ids
        mask = torch.arange(ids.shape[1], device=ids.device)[None, :] < mine["lens"][:, None]  # [rows, capacity]
        return dict(output_ids=ids, output_mask=mask, **self._prompt)

    def _append(self, at: torch.Tensor, tokens: torch.Tensor) -> None:
        capacity = _capacity(max(self._lens, default=0))
        if capacity > self._output_ids.shape[1]:  # grown on the device: the history stays there
            grown = self._output_ids.new_zeros(self._output_ids.shape[0], capacity)  # [rows, capacity]
            grown[:, : self._output_ids.shape[1]] = self._output_ids
            self._output_ids = grown
        self._output_ids[at[0], at[1]] = tokens


def _capacity(length: int) -> int:
    """Columns for ``length`` output tokens: a power of two (at least 16), so growth is rare."""
    return max(16, 1 << max(0, length - 1).bit_length())


def pad_token_lists(lists: list[list[int]], width: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded ids ``[rows, width]`` (zeros past each list; ``width`` by default the longest
    list's, at least 1) and their validity mask ``[rows, width]``."""
    lens = np.array([len(x) for x in lists], dtype=np.int64)
    width = max(1, int(lens.max(initial=0))) if width is None else width
    ids = np.zeros((len(lists), width), dtype=np.int64)
    for i, x in enumerate(lists):
        ids[i, : len(x)] = x
    return ids, np.arange(width)[None, :] < lens[:, None]

"""Vectorized sampler: one pass over ``[num_rows, vocab]`` logits with per-row parameters.

Order: raw log-probs (reported, as vLLM's default) -> the structured-output grammar's bitmask
(constrained rows only) -> allowed_token_ids and logit_bias -> bad_words -> min_tokens masking -> penalties ->
greedy rows take argmax; random rows apply temperature, top-k, top-p, min-p and draw with the
exponential-race trick ``argmax(p / q), q ~ Exp(1)``, where seeded rows draw ``q`` from their
own generator so their tokens do not depend on the rest of the batch.

A row whose rules leave no token (every logit -inf: a grammar step the other constraints exclude,
``allowed_token_ids`` all in ``bad_words``, ...) samples ``NO_TOKEN`` instead of an argmax over
-inf (which is token 0); ``distributions`` gives it all-zero probabilities. The engine ends that
sequence (``Scheduler.update``) without appending anything.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.contracts.device_to_host import to_host
from pagedllm.contracts.host_to_device import to_device
from pagedllm.layers.ops import check_layer_ops
from pagedllm.layers.penalty_history import PenaltyHistory
from pagedllm.layers.sampling_inputs import SamplingInputs, prepare_inputs
from pagedllm.native import bindings
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output import GrammarState, StructuredOutputManager
from pagedllm.structured_output.manager import apply_token_bitmask

NO_TOKEN = -1  # a row's sampled id when its constraints allow no token at all


@dataclass
class SamplingRow:
    """One row to sample: a sequence's parameters, history and generator."""

    params: SamplingParams
    token_ids: list[int]  # prompt + output, the sequence's own list (not copied per step)
    num_prompt_tokens: int
    generator: torch.Generator | None
    banned_token_ids: tuple[int, ...] = ()  # eos/stop ids masked until min_tokens is reached
    grammar: GrammarState | None = None  # structured_outputs: only tokens it allows may be sampled

    # the slices are taken only by the penalties, the one place that needs the history
    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float]  # raw logprob of each sampled token
    top_logprobs: list[dict[int, float]] | None  # per row: top-k token -> logprob (k = params.logprobs)


class Sampler:
    """Samples one token per row. ``ops="triton"`` (layers/ops.py) filters top-k/top-p/min-p with
    the Triton kernel (no sort); otherwise with the sorting torch code below.
    ``structured_output`` fills the grammar bitmasks.

    A step makes one host->device copy (``prepare``: the rows' inputs and the caller's own arrays)
    and one device->host copy: ``sample`` leaves every result on the device so the caller can
    fetch it with its own results in one ``to_host`` (``contracts/device_to_host.py``), and
    ``finish`` turns the fetched arrays into a ``SamplerOutput``. Nothing in between reads a
    device value on the host. Speculative verify's ``distributions`` makes the same one upload;
    its ``chosen_logprobs`` one more each way, for the tokens rejection sampling picked from them.
    """

    def __init__(self, ops: str = "native", structured_output: StructuredOutputManager | None = None,
                 persistent_penalties: bool = True):
        """``persistent_penalties``: keep the penalties' token histories on the device between
        steps and upload only new tokens (the engine's sampler, whose rows persist); False
        uploads every history whole, for callers whose rows are new lists each call (speculative
        verify and draft rows), where a kept history would be rebuilt every time."""
        self.ops = check_layer_ops(ops)
        self.structured_output = structured_output
        self.penalty_history = PenaltyHistory() if persistent_penalties else None

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """``sample``, fetched and finished: one device->host transfer."""
        return self.finish(to_host(self.sample(logits, rows)), rows)

    @torch.inference_mode()
    def prepare(self, logits: torch.Tensor, rows: list[SamplingRow],
                extra: dict[str, np.ndarray] | None = None) -> SamplingInputs:
        """The step's one host->device copy: the rows' sampling inputs, plus the caller's ``extra``
        host arrays (their device tensors are in ``.tensors`` under the same names). Call once
        per step (it advances seeded rows' generators and the kept penalty histories)."""
        return self._inputs(logits, rows, extra=extra)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, rows: list[SamplingRow],
               inputs: SamplingInputs | None = None) -> dict[str, torch.Tensor]:
        """Device tensors: ``sampled_ids [rows]`` and, when some row asks, ``sampled_logprobs
        [rows]`` and ``top_logprob_ids`` / ``top_logprob_values [rows, max k]``. ``inputs``:
        ``prepare``'s for these rows (None: prepared here)."""
        logits = logits.float()  # [num_rows, vocab]
        inputs = inputs if inputs is not None else self._inputs(logits, rows)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if inputs.flags.need_logprobs else None
        logits = _process(logits, inputs, self._vocab_size())
        empty = _empty_rows(logits, inputs)
        tokens = self._choose(logits, inputs)
        if empty is not None:
            tokens = tokens.masked_fill(empty, NO_TOKEN)
        out = dict(sampled_ids=tokens)
        if raw_logprobs is not None:  # an empty row's logprob is a placeholder: nothing is appended
            out["sampled_logprobs"] = raw_logprobs.gather(1, tokens.clamp_min(0)[:, None]).squeeze(1)
            out.update(_top_logprob_tensors(raw_logprobs, inputs.flags.max_top_logprobs))
        return out

    @staticmethod
    def finish(host: dict[str, np.ndarray], rows: list[SamplingRow]) -> SamplerOutput:
        """The ``SamplerOutput`` of ``sample``'s tensors once they are on the host."""
        tokens = host["sampled_ids"].tolist()
        if "sampled_logprobs" not in host:
            return SamplerOutput(tokens, [0.0] * len(rows), None)
        return SamplerOutput(tokens, host["sampled_logprobs"].tolist(), _top_logprobs_from(host, rows))

    @torch.inference_mode()
    def distributions(self, logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(probs, raw_logprobs)``, both ``[num_rows, vocab]``: the normalised distribution
        ``__call__`` draws each row's token from (a greedy row: one-hot at its argmax; a row that
        allows no token: all zeros) and the raw log-probs it reports. Speculative decoding
        verifies drafts against these."""
        logits = logits.float()
        inputs = self._inputs(logits, rows, noise=False)  # the caller draws from ``probs`` itself
        raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = _process(logits, inputs, self._vocab_size())
        probs = torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[1]).float()  # [rows, vocab]
        if not inputs.flags.all_greedy:
            weights = _random_probs(logits, inputs)
            probs = torch.where(inputs.tensors["greedy"][:, None], probs, weights / weights.sum(dim=-1, keepdim=True))
        empty = _empty_rows(logits, inputs)
        if empty is not None:  # not one-hot at 0 (argmax of -inf), not NaN (0 / 0)
            probs = probs.masked_fill(empty[:, None], 0.0)
        return probs, raw_logprobs

    @staticmethod
    def chosen_logprobs(raw_logprobs: torch.Tensor, index: list[int], tokens: list[int],
                        rows: list[SamplingRow]) -> tuple[list[float], list[dict[int, float]] | None]:
        """For the rows ``index`` of ``raw_logprobs`` (``rows`` their SamplingRows): the raw logprob
        of ``tokens[j]`` at row ``index[j]``, and per row its ``params.logprobs`` most likely
        tokens -> raw logprob (None if no row asks), in one host->device and one device->host
        transfer."""
        pairs = np.array([index, tokens], dtype=np.int64).reshape(2, -1)  # [2, len(index)]: rows, tokens
        pairs[1] = pairs[1].clip(min=0)  # NO_TOKEN: a placeholder logprob, never appended
        pairs = to_device(dict(pairs=pairs), raw_logprobs.device)["pairs"]
        picked = raw_logprobs[pairs[0]]  # [len(index), vocab]
        chosen = picked.gather(1, pairs[1][:, None]).squeeze(1)  # [len(index)]
        k = max((r.params.logprobs or 0 for r in rows), default=0)
        host = to_host({"chosen": chosen, **_top_logprob_tensors(picked, k)})
        return host["chosen"].tolist(), _top_logprobs_from(host, rows)

    def _inputs(self, logits: torch.Tensor, rows: list[SamplingRow], noise: bool = True,
                extra: dict[str, np.ndarray] | None = None) -> SamplingInputs:
        return prepare_inputs(rows, logits.shape[1], logits.device, self._bitmask(rows), noise, self.penalty_history,
                              extra)

    def _bitmask(self, rows: list[SamplingRow]) -> np.ndarray | None:
        grammars = [r.grammar for r in rows]
        if all(g is None for g in grammars):
            return None
        if self.structured_output is None:
            raise ValueError("rows carry grammars but this Sampler has no StructuredOutputManager")
        return self.structured_output.fill_bitmask(grammars)

    def _vocab_size(self) -> int | None:
        return self.structured_output.vocab_size if self.structured_output is not None else None

    def _choose(self, logits: torch.Tensor, inputs: SamplingInputs) -> torch.Tensor:
        tokens = row_argmax(logits)
        if inputs.flags.all_greedy:
            return tokens
        sampled = _sample_random(logits, inputs) if self.ops == "native" else _sample_random_triton(logits, inputs)
        return torch.where(inputs.tensors["greedy"], tokens, sampled)


def _empty_rows(logits: torch.Tensor, inputs: SamplingInputs) -> torch.Tensor | None:
    """``[rows]`` bool: the rows whose every logit is -inf after the rules; None when no rule that
    masks (grammar, allowed ids, bad words / banned ids) is on. Stays on the device (no sync)."""
    f = inputs.flags
    if not (f.grammar or f.allowed or f.masked):
        return None
    return torch.isneginf(logits).all(dim=-1)


def _process(logits: torch.Tensor, inputs: SamplingInputs, grammar_vocab: int | None) -> torch.Tensor:
    """Every logit rule before the draw (grammar, allowed ids and bias, bad words and banned ids,
    penalties), each only when some row uses it."""
    f, t = inputs.flags, inputs.tensors
    if f.grammar:
        apply_token_bitmask(logits, t["bitmask"], grammar_vocab)
    if f.allowed:
        logits = _apply_allowed(logits, t["allowed_rows"], t["allowed_pairs"])
    if f.bias:
        logits.index_put_((t["bias_pairs"][0], t["bias_pairs"][1]), t["bias_values"], accumulate=True)
    if f.masked:  # one indexed write for the batch, not one per masked token
        logits[t["masked_pairs"][0], t["masked_pairs"][1]] = float("-inf")
    if f.penalties:
        logits = _apply_penalties(logits, t, f.repetition)
    return logits


def _apply_allowed(logits: torch.Tensor, allowed_rows: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    """Masks every token outside a row's ``allowed_token_ids`` (rows without them: untouched)."""
    blocked = allowed_rows[:, None].expand_as(logits).clone()  # [rows, vocab]
    blocked[pairs[0], pairs[1]] = False
    return logits.masked_fill(blocked, float("-inf"))


def _counts(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(logits).scatter_add_(1, ids, mask.float())  # [rows, vocab]


def _apply_penalties(logits: torch.Tensor, t: dict[str, torch.Tensor], repetition: bool) -> torch.Tensor:
    counts = _counts(logits, t["output_ids"], t["output_mask"])
    if repetition:
        rep = t["repetition"][:, None]
        seen = _counts(logits, t["prompt_ids"], t["prompt_mask"]) + counts > 0
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalised, logits)
    logits = logits - t["frequency"][:, None] * counts
    return logits - t["presence"][:, None] * (counts > 0).float()


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """``[rows]`` int64: each row's first maximum (NaN wins). CPU float32: the C library's one pass
    (torch's CPU max/argmax with an index dispatch to a scalar loop: 1 x 8192 took ~50 us, most of
    a greedy decode step's sampling, and 64 x 8192 ~1.6 ms); elsewhere ``max(dim).indices`` (the
    same index as argmax, faster than it on CPU and CUDA float32)."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.stride(-1) == 1 \
            and x.shape[1] > 0 and bindings.is_available():
        return bindings.library().argmax_rows(x)
    return x.max(dim=-1).indices


def _sample_random(logits: torch.Tensor, inputs: SamplingInputs) -> torch.Tensor:
    probs = _random_probs(logits, inputs)
    return row_argmax(probs / _exponential_noise(probs, inputs))


def _random_probs(logits: torch.Tensor, inputs: SamplingInputs) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p: each row's weights to draw from (not normalised after min-p)."""
    t = inputs.tensors
    logits = logits / t["temperature"][:, None]
    if inputs.flags.top_k_top_p:
        logits = _top_k_top_p(logits, t["top_k"], t["top_p"])
    probs = torch.softmax(logits, dim=-1)
    if inputs.flags.min_p:
        keep = probs >= t["min_p"][:, None] * probs.amax(dim=-1, keepdim=True)
        probs = probs * keep
    return probs


def _sample_random_triton(logits: torch.Tensor, inputs: SamplingInputs) -> torch.Tensor:
    """``_sample_random`` with the top-k/top-p/min-p filter in one kernel (no sort)."""
    from pagedllm.layers.triton_ops.sampling import top_k_top_p_min_p_
    t = inputs.tensors
    logits = (logits / t["temperature"][:, None]).contiguous()
    if inputs.flags.top_k_top_p or inputs.flags.min_p:
        top_k = t["top_k"].to(torch.int32)  # >= vocab: off, like 0
        top_k_top_p_min_p_(logits, top_k, t["top_p"], t["min_p"])
    probs = torch.softmax(logits, dim=-1)
    return (probs / _exponential_noise(probs, inputs)).argmax(dim=-1)


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    dev, vocab = logits.device, logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=dev)[None, :]
    drop = ranks >= top_k[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    drop |= (probs.cumsum(dim=-1) - probs) > top_p[:, None]  # the top token always stays
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _exponential_noise(probs: torch.Tensor, inputs: SamplingInputs) -> torch.Tensor:
    q = torch.empty_like(probs).exponential_()
    if inputs.flags.seeded:  # drawn on the host from each row's own generator (sampling_inputs)
        q.index_copy_(0, inputs.tensors["seeded_rows"], inputs.tensors["seeded_noise"])
    return q


def _top_logprob_tensors(raw: torch.Tensor, k: int) -> dict[str, torch.Tensor]:
    if k == 0:
        return {}
    values, ids = raw.topk(k, dim=-1)  # [rows, k]
    return dict(top_logprob_ids=ids, top_logprob_values=values)


def _top_logprobs_from(host: dict[str, np.ndarray], rows: list[SamplingRow]) -> list[dict[int, float]] | None:
    """Per row, its first ``params.logprobs`` top entries (None when no row asked)."""
    if "top_logprob_ids" not in host:
        return None
    ids, values = host["top_logprob_ids"].tolist(), host["top_logprob_values"].tolist()
    return [dict(zip(ids[i][:k], values[i][:k])) for i, k in enumerate(r.params.logprobs or 0 for r in rows)]

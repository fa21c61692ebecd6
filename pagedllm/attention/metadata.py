"""Explicit attention metadata for one flat batch (docs/design.md, core idea 2).

The batch holds ``num_tokens`` query tokens from ``num_reqs`` requests, laid end to end::

    tokens:  | req0 (q0 tokens) | req1 (q1 tokens) | ... |
    query_start_loc = [0, q0, q0+q1, ...]                      (num_reqs + 1)

Request ``r`` has ``seq_lens[r]`` tokens of context *after* this step, its new tokens being the
last ``q_r`` of them, so query token ``i`` of request ``r`` sits at position
``seq_lens[r] - q_r + i`` and attends causally to context positions ``0 .. that position``::

    context of req r:  [ already cached ............ | new (q_r) ]
                       0                 seq_len - q_r        seq_len

Context position ``p`` of request ``r`` lives in physical block ``block_tables[r, p // B]`` at
offset ``p % B`` (``B`` = block size); a new token's K/V is written to
``slot_mapping[t] = block_id * B + offset``.

Bidirectional image spans (Gemma 3): ``attend_ends[t]`` (None: plain causal) is the context
position query token ``t`` sees up to, exclusive: ``position + 1`` for a causal token, the end of
its image's placeholder run for an image token, which so attends to every token of its image in
both directions (transformers' ``token_type_ids`` block mask, OR'ed with the causal one; a
sliding window still bounds it from below). The scheduler never splits such a run across chunks,
so the run's later tokens are always in the same step::

    tokens      t  t  [i  i  i]  t        (i: one image's run, positions 2..4)
    attend_ends 1  2   5  5  5   6
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.contracts.host_to_device import to_device


@dataclass(frozen=True)
class AttentionMetadata:
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32, context length including this step's tokens
    block_tables: torch.Tensor  # [num_reqs, max_blocks_per_req] int32, -1 / garbage past the end
    slot_mapping: torch.Tensor  # [num_tokens] int64
    max_query_len: int
    max_seq_len: int
    block_size: int
    attend_ends: torch.Tensor | None = None  # [num_tokens] int32: bidirectional image spans, see above

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    @property
    def query_lens(self) -> torch.Tensor:
        return self.query_start_loc[1:] - self.query_start_loc[:-1]

    def request_spans(self) -> list[tuple[int, int, int, int]]:
        """``(request, first token, end token, seq_len)`` of every request with new tokens
        (host-side loop bounds for the per-request torch backends)."""
        qsl, seq_lens = self.query_start_loc.tolist(), self.seq_lens.tolist()
        return [(r, qsl[r], qsl[r + 1], n) for r, n in enumerate(seq_lens) if qsl[r + 1] > qsl[r]]

    @classmethod
    def build(
        cls,
        query_lens: np.ndarray,
        seq_lens: np.ndarray,
        block_tables: np.ndarray,
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Builds metadata from host arrays: computes query_start_loc and slot_mapping."""
        host = cls.host_arrays(query_lens, seq_lens, block_tables, block_size)
        return cls.from_tensors(to_device(host, device), host, block_size)

    @staticmethod
    def host_arrays(query_lens, seq_lens, block_tables, block_size: int) -> dict[str, np.ndarray]:
        """The metadata's arrays on the host, named like the fields (for one batched transfer)."""
        query_lens = np.asarray(query_lens, dtype=np.int64)
        seq_lens = np.asarray(seq_lens, dtype=np.int64)
        block_tables = np.asarray(block_tables, dtype=np.int32)
        qsl = np.zeros(len(query_lens) + 1, dtype=np.int64)
        np.cumsum(query_lens, out=qsl[1:])
        positions = positions_from_lens(query_lens, seq_lens)
        req_idx = np.repeat(np.arange(len(query_lens)), query_lens)
        block_ids = block_tables[req_idx, positions // block_size].astype(np.int64)
        return dict(query_start_loc=qsl.astype(np.int32), seq_lens=seq_lens.astype(np.int32),
                    block_tables=block_tables, slot_mapping=block_ids * block_size + positions % block_size,
                    positions=positions)

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor], host: dict[str, np.ndarray],
                     block_size: int) -> AttentionMetadata:
        """Metadata over the device tensors of ``host`` (its ``host_arrays``; extra keys are
        ignored). The maxima come from the host copies: no device synchronisation."""
        q_lens, seq_lens = np.diff(host["query_start_loc"]), host["seq_lens"]
        return cls(
            query_start_loc=t["query_start_loc"], seq_lens=t["seq_lens"], block_tables=t["block_tables"],
            slot_mapping=t["slot_mapping"], block_size=block_size,
            max_query_len=int(q_lens.max()) if len(q_lens) else 0,
            max_seq_len=int(seq_lens.max()) if len(seq_lens) else 0, attend_ends=t.get("attend_ends"),
        )

    def visible(self, start: int, end: int, seq_len: int, window: int | None = None,
                chunk: int | None = None) -> torch.Tensor:
        """``[end - start, seq_len]`` bool: which context positions the request's query tokens
        ``[start, end)`` (its last ``end - start`` positions) see, for the torch backends."""
        q_len = end - start
        q_pos = torch.arange(seq_len - q_len, seq_len, device=self.slot_mapping.device)
        k_pos = torch.arange(seq_len, device=q_pos.device)[None, :]
        hi = q_pos + 1 if self.attend_ends is None else self.attend_ends[start:end].to(q_pos.device)
        mask = k_pos < hi[:, None]  # [q_len, seq_len]
        if window:
            mask &= k_pos > q_pos[:, None] - window
        if chunk:
            mask &= k_pos >= (q_pos // chunk * chunk)[:, None]
        return mask


def positions_from_lens(query_lens: np.ndarray, seq_lens: np.ndarray) -> np.ndarray:
    """Position of every query token: ``seq_len - query_len + i`` for i in range(query_len)."""
    query_lens = np.asarray(query_lens, dtype=np.int64)
    starts = np.asarray(seq_lens, dtype=np.int64) - query_lens
    qsl = np.concatenate([[0], np.cumsum(query_lens)])
    offsets = np.arange(int(qsl[-1]), dtype=np.int64) - np.repeat(qsl[:-1], query_lens)
    return np.repeat(starts, query_lens) + offsets

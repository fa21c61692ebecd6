"""Batched LoRA over a mixed batch: each token carries an adapter slot (-1: the base model).

Every LoRA-enabled linear layer holds a :class:`LoRASlots`: ``a [slots, R, in]`` and
``b [slots, out, R]`` for ``max_loras`` adapters, where ``R = num_sub * max_lora_rank`` (a fused
projection such as qkv stacks its sub-projections' ranks, and its B is block-diagonal over them)
and the adapter's scale is folded into ``b``. A layer adds ``(x @ a[s].T) @ b[s].T`` to the
output rows of the tokens of slot ``s`` (Punica's shrink, then expand).

The step's token -> slot mapping (:class:`LoRABatch`) is one object shared by every layer and
set by the model runner before each forward (as vLLM's punica wrapper): threading it through
every module's forward would change every model family's signature for one feature.
"""
from __future__ import annotations

import numpy as np
import torch

from pagedllm.native import bindings


class LoRABatch:
    """The step's tokens grouped by adapter slot: ``perm`` (the LoRA tokens' rows, ordered by slot)
    and ``segments`` (slot, start, end) into it. Base-model tokens are in no segment, so they pay
    nothing; a batch without LoRA tokens skips the op altogether."""

    def __init__(self):
        self.perm: torch.Tensor | None = None  # [num_lora_tokens] int64, on the device
        self.segments: list[tuple[int, int, int]] = []
        self.whole: bool = False  # one slot covers every token, in order: no gather / scatter

    def set(self, token_slots: np.ndarray, device: torch.device) -> None:
        """``token_slots``: one slot per token of the step's flat batch (-1: base)."""
        rows = np.flatnonzero(token_slots >= 0)
        if rows.size == 0:
            self.perm, self.segments, self.whole = None, [], False
            return
        order = rows[np.argsort(token_slots[rows], kind="stable")]
        slots = token_slots[order]
        bounds = np.flatnonzero(np.diff(slots)) + 1
        starts = np.concatenate([[0], bounds])
        ends = np.concatenate([bounds, [order.size]])
        self.segments = [(int(slots[s]), int(s), int(e)) for s, e in zip(starts, ends)]
        self.whole = len(self.segments) == 1 and order.size == token_slots.size
        self.perm = None if self.whole else torch.from_numpy(order).to(device, non_blocking=True)

    def clear(self) -> None:
        self.perm, self.segments, self.whole = None, [], False

    @property
    def active(self) -> bool:
        return bool(self.segments)


def lora_shrink_expand(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                       batch: LoRABatch) -> torch.Tensor:
    """``y[rows of slot s] += (x[rows] @ a[s].T) @ b[s].T`` in place (``y`` is the base layer's fresh
    output), one shrink and one expand per adapter present in the batch (grouped by slot), in
    ``a``'s dtype; torch ops (the C library's GEMM for float32 on the CPU).

    ``x [tokens, in]``, ``y [tokens, out]``, ``a [slots, R, in]``, ``b [slots, out, R]``."""
    if not batch.active:
        return y
    xs = x if batch.whole else x.index_select(0, batch.perm)  # [lora tokens, in]
    xs = xs.to(a.dtype)
    delta = torch.empty(xs.shape[0], b.shape[1], dtype=a.dtype, device=x.device)  # [lora tokens, out]
    for slot, start, end in batch.segments:
        _matmul_t(_matmul_t(xs[start:end], a[slot]), b[slot], delta[start:end])  # [n, R], then [n, out]
    delta = delta.to(y.dtype)
    if batch.whole:
        _serial(lambda s: y[s].add_(delta[s]), y)
    else:
        _serial(lambda s: y.index_add_(0, batch.perm[s], delta[s]), delta)
    return y  # the base layer's fresh output, added to in place


# torch runs an elementwise op on fewer elements than this in the calling thread (at::internal::GRAIN_SIZE)
_SERIAL_ELEMENTS = 32768


def _serial(op, rows: torch.Tensor) -> None:
    """Applies ``op`` to slices of rows small enough that torch runs each in this thread: on the
    CPU a parallel torch op between the C kernels wakes torch's OpenMP team (see ``_matmul_t``)."""
    step = rows.shape[0] if rows.device.type != "cpu" else max(1, _SERIAL_ELEMENTS // max(1, rows.shape[1]))
    for i in range(0, rows.shape[0], step):
        op(slice(i, i + step))


def _matmul_t(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T``. float32 on the CPU through the C library's small-batch GEMM, a slice of rows
    at a time: its threads are those of the layers' other C kernels, while a torch GEMM between them
    wakes a second OpenMP team (torch bundles its own libgomp) that spins against the first."""
    if out is None:
        out = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
    if x.device.type != "cpu" or x.dtype != torch.float32 or w.dtype != torch.float32 or not bindings.is_available():
        return torch.matmul(x, w.T, out=out)
    lib, x = bindings.library(), x.contiguous()
    step, threads = lib.max_decode_tokens, torch.get_num_threads()
    for i in range(0, x.shape[0], step):
        lib.linear(x[i:i + step], w, None, None, out[i:i + step], threads)
    return out


class LoRASlots:
    """One linear layer's adapter slots (see the module docstring); written by lora/model.py."""

    def __init__(self, num_slots: int, rank: int, in_features: int, out_features: int, dtype: torch.dtype,
                 device: torch.device, batch: LoRABatch):
        self.a = torch.zeros(num_slots, rank, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(num_slots, out_features, rank, dtype=dtype, device=device)
        self.batch = batch

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return lora_shrink_expand(x, y, self.a, self.b, self.batch)

    @property
    def nbytes(self) -> int:
        return self.a.numel() * self.a.element_size() + self.b.numel() * self.b.element_size()

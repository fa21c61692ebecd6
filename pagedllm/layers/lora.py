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
    and ``segments`` (slot, start, end) into it, also as device tensors for the kernels
    (``seg_slot [G]``, ``seg_start [G + 1]``). Base-model tokens are in no segment, so they pay
    nothing; a batch without LoRA tokens skips the op altogether."""

    def __init__(self):
        self.clear()

    def set(self, token_slots: np.ndarray, device: torch.device) -> None:
        """``token_slots``: one slot per token of the step's flat batch (-1: base)."""
        rows = np.flatnonzero(token_slots >= 0)
        if rows.size == 0:
            self.clear()
            return
        order = rows[np.argsort(token_slots[rows], kind="stable")]
        slots = token_slots[order]
        bounds = np.flatnonzero(np.diff(slots)) + 1
        starts = np.concatenate([[0], bounds, [order.size]]).astype(np.int64)
        self.segments = [(int(slots[s]), int(s), int(e)) for s, e in zip(starts[:-1], starts[1:])]
        self.whole = len(self.segments) == 1 and order.size == token_slots.size
        self.max_segment = int(np.diff(starts).max())
        self.perm = torch.from_numpy(order.astype(np.int64)).to(device, non_blocking=True)
        self.seg_slot = torch.from_numpy(slots[starts[:-1]].astype(np.int64)).to(device, non_blocking=True)
        self.seg_start = torch.from_numpy(starts).to(device, non_blocking=True)

    def clear(self) -> None:
        self.perm: torch.Tensor | None = None  # [num_lora_tokens] int64, on the device
        self.seg_slot: torch.Tensor | None = None  # [segments] int64
        self.seg_start: torch.Tensor | None = None  # [segments + 1] int64: token offsets into perm
        self.segments: list[tuple[int, int, int]] = []
        self.whole = False  # one slot covers every token, in order: token i is row i
        self.max_segment = 0

    @property
    def active(self) -> bool:
        return bool(self.segments)


def lora_shrink_expand(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                       batch: LoRABatch) -> torch.Tensor:
    """``y[rows of slot s] += (x[rows] @ a[s].T) @ b[s].T`` in place (``y`` is the base layer's fresh
    output), one call per projection for every adapter in the batch: the C kernel
    (``native/csrc/lora_sgmv.c``) for float32 on the CPU, the Triton kernels
    (``triton_ops/lora.py``) on CUDA, else the torch reference.

    ``x [tokens, in]``, ``y [tokens, out]``, ``a [slots, R, in]``, ``b [slots, out, R]``."""
    if not batch.active:
        return y
    if x.device.type == "cpu" and x.dtype == y.dtype == a.dtype == b.dtype == torch.float32 \
            and y.is_contiguous() and bindings.is_available():
        bindings.library().lora_sgmv(x.contiguous(), y, a, b, None if batch.whole else batch.perm, batch.seg_slot,
                                     batch.seg_start, torch.get_num_threads())
        return y
    if x.is_cuda and x.stride(1) == 1 and y.stride(1) == 1:
        from pagedllm.layers.triton_ops.lora import lora_sgmv
        return lora_sgmv(x, y, a, b, batch.perm, batch.seg_slot, batch.seg_start, batch.max_segment)
    return lora_shrink_expand_ref(x, y, a, b, batch)


def lora_shrink_expand_ref(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                           batch: LoRABatch) -> torch.Tensor:
    """The reference the kernels are tested against: per segment, the shrink ``t = x[rows] @ a[s].T``
    and the expand ``y[rows] += t @ b[s].T``, in ``a``'s dtype."""
    for slot, start, end in batch.segments:
        rows = batch.perm[start:end]
        t = x.index_select(0, rows).to(a.dtype) @ a[slot].T  # [n, R]
        y.index_add_(0, rows, (t @ b[slot].T).to(y.dtype))  # [n, out]
    return y


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

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
    nothing; a batch without LoRA tokens skips the op altogether.

    Two modes. Eager (``set``): the segments are the step's own, and the device tensors are made
    from them when a kernel first reads them (a step replayed by a CUDA graph never makes them).
    Graph-safe (``use_graph``, for a captured decode step): the kernels read fixed-size device
    buffers that the caller refills in place before each replay (``slot_groups``: every slot is a
    segment, empty or not, and ``perm`` lists every row of the padded batch), and nothing a launch
    depends on (grid, branches) changes with the mapping. ``num_slots`` (``max_loras``) sizes those
    buffers."""

    def __init__(self, num_slots: int | None = None):
        self.num_slots = num_slots
        self.token_slots = np.empty(0, dtype=np.int64)  # the step's slot per token (host), as given to ``set``
        self.clear()

    def set(self, token_slots: np.ndarray, device: torch.device) -> None:
        """``token_slots``: one slot per token of the step's flat batch (-1: base)."""
        self.clear()
        self.token_slots = token_slots
        rows = np.flatnonzero(token_slots >= 0)
        if rows.size == 0:
            return
        order = rows[np.argsort(token_slots[rows], kind="stable")]
        slots = token_slots[order]
        bounds = np.flatnonzero(np.diff(slots)) + 1
        starts = np.concatenate([[0], bounds, [order.size]]).astype(np.int64)
        self.segments = [(int(slots[s]), int(s), int(e)) for s, e in zip(starts[:-1], starts[1:])]
        self.whole = len(self.segments) == 1 and order.size == token_slots.size
        self.max_segment = int(np.diff(starts).max())
        self._host = (order.astype(np.int64), slots[starts[:-1]].astype(np.int64), starts)
        self._device = device

    def use_graph(self, perm: torch.Tensor, seg_slot: torch.Tensor, seg_start: torch.Tensor) -> None:
        """Graph-safe mode over persistent device buffers (layout of ``slot_groups``): ``perm [rows]``
        every row of the padded batch, ``seg_slot [G]``, ``seg_start [G + 1]``. The kernels' grids
        cover ``rows`` tokens per segment, so one capture serves every mapping of that many rows."""
        self.clear()
        self.graph = True
        self.max_segment = perm.shape[0]
        self._tensors = (perm, seg_slot, seg_start)

    def clear(self) -> None:
        self.segments: list[tuple[int, int, int]] = []  # eager mode only
        self.whole = False  # one slot covers every token, in order: token i is row i
        self.max_segment = 0  # the most tokens a segment may hold (the Triton grids' token axis)
        self.graph = False
        self._host: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # perm, seg_slot, seg_start
        self._device: torch.device | None = None
        self._tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def _device_tensors(self) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        if self._tensors is None and self._host is not None:
            self._tensors = tuple(torch.from_numpy(a).to(self._device, non_blocking=True) for a in self._host)
        return self._tensors or (None, None, None)

    @property
    def perm(self) -> torch.Tensor | None:
        """``[lora tokens]`` int64 on the device (graph-safe: ``[rows]``, the base rows last)."""
        return self._device_tensors()[0]

    @property
    def seg_slot(self) -> torch.Tensor | None:
        """``[segments]`` int64: each segment's slot."""
        return self._device_tensors()[1]

    @property
    def seg_start(self) -> torch.Tensor | None:
        """``[segments + 1]`` int64: token offsets into ``perm``."""
        return self._device_tensors()[2]

    @property
    def active(self) -> bool:
        """Whether the op runs: a graph-safe batch always does (its mapping is read on the device)."""
        return self.graph or bool(self.segments)


def slot_groups(token_slots: np.ndarray, num_slots: int) -> tuple[np.ndarray, np.ndarray]:
    """A step's mapping as the graph-safe buffers hold it: ``perm [rows]`` every row, those of slot
    0, then slot 1, ..., then the base rows (-1: base model, or a padding row), and ``seg_start
    [num_slots + 1]``: slot ``s``'s rows are ``perm[seg_start[s]:seg_start[s + 1]]`` (empty for an
    unused slot). With ``seg_slot = arange(num_slots)`` it is a ``LoRABatch`` segment layout."""
    key = np.where(token_slots < 0, num_slots, token_slots)  # base rows sort after every slot
    perm = np.argsort(key, kind="stable").astype(np.int64)
    counts = np.bincount(key, minlength=num_slots + 1)[:num_slots]
    return perm, np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)


def lora_shrink_expand(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                       batch: LoRABatch) -> torch.Tensor:
    """``y[rows of slot s] += (x[rows] @ a[s].T) @ b[s].T`` in place (``y`` is the base layer's fresh
    output), one call per projection for every adapter in the batch: the C kernel
    (``native/csrc/lora_sgmv.c``) for float32 on the CPU, the Triton kernels
    (``triton_ops/lora.py``) on CUDA, else the torch reference. A graph-safe batch takes the same
    kernels (the C one reads the buffers from host memory; the Triton grids are fixed by their
    sizes) and the reference's device-only form, so none reads the mapping on the host.

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
    and the expand ``y[rows] += t @ b[s].T``, in ``a``'s dtype. A graph-safe batch: the same per
    slot over every row, kept on the rows of that slot (``row_slots``), with no host read."""
    if batch.graph:
        owner = row_slots(batch, x.shape[0])[:, None]  # [tokens, 1]
        xa = x.to(a.dtype)
        for slot in range(a.shape[0]):
            delta = ((xa @ a[slot].T) @ b[slot].T).to(y.dtype)  # [tokens, out]
            y.copy_(torch.where(owner == slot, y + delta, y))
        return y
    for slot, start, end in batch.segments:
        rows = batch.perm[start:end]
        t = x.index_select(0, rows).to(a.dtype) @ a[slot].T  # [n, R]
        y.index_add_(0, rows, (t @ b[slot].T).to(y.dtype))  # [n, out]
    return y


def row_slots(batch: LoRABatch, num_rows: int) -> torch.Tensor:
    """Each row's slot (-1: in no segment) from the batch's device tensors, computed on the device."""
    perm, seg_slot, seg_start = batch.perm, batch.seg_slot, batch.seg_start
    g = seg_slot.shape[0]
    # [len(perm)]: the segment holding each grouped position (g: past the last segment's end)
    seg = torch.searchsorted(seg_start[1:], torch.arange(perm.shape[0], device=perm.device), right=True)
    slot = torch.where(seg < g, seg_slot[seg.clamp(max=g - 1)], -1)
    return torch.full((num_rows,), -1, dtype=torch.int64, device=perm.device).scatter_(0, perm, slot)


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

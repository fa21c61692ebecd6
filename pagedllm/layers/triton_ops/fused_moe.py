"""Mixture-of-experts on the device: the experts of one layer as two grouped GEMMs, no host sync.

The token/expert pairs ("slots", ``s = token * top_k + j``) are sorted by expert on the device and
each expert's run is padded to a whole number of ``BLOCK_M`` rows (like vLLM's
``moe_align_block_size``), so every row block belongs to one expert:

    ids (top-2)   t0: e3 e0 | t1: e3 e1 | t2: e0 e3            slots 0..5
    sorted_slots  [1 5 - -] [3 - - -] [0 2 4 -]  (BLOCK_M = 4, '-' = the pad value, num slots)
    block_expert  e0        e1        e3         then unused blocks up to the static bound

All sizes are upper bounds fixed by the number of tokens (``max_blocks = cdiv(slots, BLOCK_M) +
min(experts, slots)``: each active expert pads at most one block), so a step can be captured in
a CUDA graph; the real block count stays on the device (``num_padded``) and the programs past it
return at once. One kernel, launched twice, reads its block's expert from ``block_expert``, its
rows through ``sorted_slots`` and multiplies them by that expert's matrix:

    gate_up  [slots, 2 * inter] = x[slot // top_k] @ w13[e]^T
    down     [slots, hidden]    = act(gate_up)[slot] @ w2[e]^T * routing_weight[slot]

and the ``top_k`` weighted rows of each token are summed (a view and a sum, no scatter).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit
def _moe_gemm_kernel(a_ptr, w_ptr, c_ptr, weight_ptr, slots_ptr, block_expert_ptr, num_padded_ptr, N, K,
                     num_slots, a_stride, w_expert_stride, w_stride, c_stride, SLOTS_PER_ROW: tl.constexpr,
                     MUL_WEIGHT: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):  # past the last expert's blocks (the static grid's tail)
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    slots = tl.load(slots_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M], pads = num_slots
    slot_ok = slots < num_slots
    rows = (slots // SLOTS_PER_ROW).to(tl.int64)  # the A row each slot reads: its token, or itself
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    a_ptrs = a_ptr + rows[:, None] * a_stride + rk[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + expert * w_expert_stride + rn[:, None].to(tl.int64) * w_stride + rk[None, :]  # [BLOCK_N, BLOCK_K]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = rk[None, :] < K - k0
        a = tl.load(a_ptrs, mask=slot_ok[:, None] & k_ok, other=0.0)
        w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok, other=0.0)
        acc = tl.dot(a, tl.trans(w), acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if MUL_WEIGHT:  # the routing weight, in float32 before the one rounding to the output dtype
        acc *= tl.load(weight_ptr + slots, mask=slot_ok, other=0.0)[:, None]
    c_ptrs = c_ptr + slots[:, None].to(tl.int64) * c_stride + rn[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=slot_ok[:, None] & n_ok[None, :])


@dataclass(frozen=True)
class ExpertBlocks:
    """The slots sorted by expert in ``block_m``-row blocks (module docstring). ``sorted_slots
    [max_blocks * block_m]`` int32 (pads hold ``num_slots``), ``block_expert [max_blocks]`` int32,
    ``num_padded [1]`` int32: rows in use, a multiple of ``block_m``."""

    sorted_slots: torch.Tensor
    block_expert: torch.Tensor
    num_padded: torch.Tensor
    num_slots: int
    block_m: int

    @property
    def max_blocks(self) -> int:
        return self.block_expert.shape[0]


def max_blocks(num_slots: int, num_experts: int, block_m: int) -> int:
    """The most blocks ``num_slots`` slots can need: whole blocks plus one partial block per active expert."""
    return triton.cdiv(num_slots, block_m) + min(num_experts, num_slots)


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """ids: [tokens, top_k] expert ids -> their slots sorted by expert, each expert's run padded
    to whole blocks. Torch ops only, none of which reads a value on the host: the output sizes
    depend on the shapes alone."""
    flat = ids.flatten().long()  # [slots], slot s = token s // top_k
    slots, device = flat.numel(), ids.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m  # [experts]
    padded_end = padded.cumsum(0)
    first = counts.cumsum(0) - counts  # each expert's first position among the sorted slots
    order = torch.argsort(flat, stable=True)  # [slots] slot ids grouped by expert
    expert_of = flat[order]
    dest = padded_end[expert_of] - padded[expert_of] + torch.arange(slots, device=device) - first[expert_of]
    blocks = max_blocks(slots, num_experts, block_m)
    sorted_slots = torch.full((blocks * block_m,), slots, dtype=torch.int32, device=device)
    sorted_slots.scatter_(0, dest, order.int())
    block_start = torch.arange(blocks, device=device) * block_m
    # the expert whose padded run holds each block's first row; blocks past the end are never run
    block_expert = torch.searchsorted(padded_end, block_start, right=True).clamp_(max=num_experts - 1).int()
    return ExpertBlocks(sorted_slots, block_expert, padded_end[-1:].int(), slots, block_m)


DECODE_ROWS_PER_EXPERT = 16  # up to this many slots per expert on average: the decode tiles


def tiles(num_slots: int, num_experts: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps). At decode each expert holds a few rows and the
    layer reads every active expert's weights once: 16-row blocks (``tl.dot``'s smallest) waste
    the least padding; prefill gets the square-ish GEMM tiles of grouped_gemm. Not tuned on a GPU."""
    if num_slots <= DECODE_ROWS_PER_EXPERT * num_experts:
        return 16, 64, 64, 4
    return 64, 128, 64, 8


def moe_gemm(a: torch.Tensor, w: torch.Tensor, blocks: ExpertBlocks, slots_per_row: int,
             routing_weights: torch.Tensor | None, tile: tuple[int, int, int, int]) -> torch.Tensor:
    """``[slots, N]``: row s is ``a[s // slots_per_row] @ w[expert of s]^T``, times
    ``routing_weights[s]`` (float32, flat) when given. a: [rows, K] with unit inner stride, w:
    [experts, N, K] contiguous."""
    _, n, k = w.shape
    assert a.shape[1] == k and a.stride(1) == 1 and w.is_contiguous() and w.dtype == a.dtype
    c = torch.empty(blocks.num_slots, n, dtype=a.dtype, device=a.device)
    block_m, block_n, block_k, num_warps = tile
    assert block_m == blocks.block_m
    weights = routing_weights if routing_weights is not None else blocks.num_padded  # (unread)
    grid = (blocks.max_blocks, triton.cdiv(n, block_n))
    _moe_gemm_kernel[grid](
        a, w, c, weights, blocks.sorted_slots, blocks.block_expert, blocks.num_padded, n, k, blocks.num_slots,
        a.stride(0), w.stride(0), w.stride(1), c.stride(0), SLOTS_PER_ROW=slots_per_row,
        MUL_WEIGHT=routing_weights is not None, DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps)
    return c


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, routing_weights: torch.Tensor,
                  ids: torch.Tensor, act_and_mul) -> torch.Tensor:
    """x: [tokens, hidden], w13: [experts, 2 * inter, hidden], w2: [experts, hidden, inter],
    routing_weights / ids: [tokens, top_k] (float32 / int) -> ``[tokens, hidden]``, the sum of
    each token's top-k experts' outputs weighted by its routing weights. ``act_and_mul``:
    ``[rows, 2 * inter] -> [rows, inter]``."""
    tokens, top_k = ids.shape
    if tokens == 0:
        return torch.zeros_like(x)
    experts = w13.shape[0]
    x = x if x.stride(1) == 1 else x.contiguous()  # the kernel steps along K with unit stride
    tile = tiles(tokens * top_k, experts)
    blocks = align_by_expert(ids, experts, tile[0])
    gate_up = moe_gemm(x, w13, blocks, top_k, None, tile)  # [slots, 2 * inter]
    h = act_and_mul(gate_up)  # [slots, inter]
    out = moe_gemm(h, w2, blocks, 1, routing_weights.flatten().float(), tile)  # [slots, hidden], weighted
    return out.view(tokens, top_k, -1).sum(dim=1)  # [tokens, hidden]


def fused_experts_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, routing_weights: torch.Tensor,
                      ids: torch.Tensor, act_and_mul) -> torch.Tensor:
    """The reference: every token's experts one by one, in float64."""
    y = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = act_and_mul((w13[e].double() @ x[t].double())[None])[0]  # [inter]
            y[t] += float(routing_weights[t, j]) * (w2[e].double() @ h)
    return y.to(x.dtype)

"""Batched LoRA over a mixed batch (Punica's SGMV), the GPU path of ``layers/lora.py``:
``y[rows] += (x[rows] @ a[s].T) @ b[s].T`` for the tokens of each adapter slot ``s``.

The tokens arrive grouped by slot (``LoRABatch``: ``perm`` the rows, segment ``g`` the tokens
``seg_start[g] .. seg_start[g + 1] - 1`` of slot ``seg_slot[g]``); base-model tokens are in no
segment. Two kernels, named as in the torch reference ``lora_shrink_expand_ref``:

- shrink: program (segment, block of its tokens, block of ranks) writes ``t = x[rows] @ a[s].T``
  (float32, ``[lora tokens, R]``);
- expand: program (segment, block of its tokens, block of output columns) adds ``t @ b[s].T`` to
  those rows of ``y`` (a row is in one segment: no atomics).

Both grids are (segments, ``cdiv(max_segment, BLOCK_M)``, column blocks), with ``max_segment`` a
host-side bound on a segment's tokens; a program past its segment's end returns at once (an empty
segment's all do). Eagerly the segments are the step's own and ``max_segment`` the longest one; a
CUDA graph captures the graph-safe layout (``LoRABatch.use_graph``: one segment per slot, empty or
not, ``max_segment`` = the graph's rows), so its grids are fixed while the mapping it reads from
``perm``/``seg_start`` changes in place between replays.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # tokens per program (tl.dot needs >= 16)


@triton.jit
def _past_segment_end(seg_start_ptr, BLOCK_M: tl.constexpr):
    """Whether this program's block of tokens starts past its segment's end (nothing to do)."""
    g = tl.program_id(0)
    return tl.program_id(1) * BLOCK_M >= tl.load(seg_start_ptr + g + 1) - tl.load(seg_start_ptr + g)


@triton.jit
def _segment_tile(perm_ptr, seg_slot_ptr, seg_start_ptr, BLOCK_M: tl.constexpr):
    """This program's block of its segment's tokens: their positions in the grouped order, which of
    them are in the segment (past a short segment's end: none), the segment's slot and the tokens'
    rows in ``x`` / ``y``."""
    g = tl.program_id(0)
    start, end = tl.load(seg_start_ptr + g), tl.load(seg_start_ptr + g + 1)
    tokens = start + tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    live = tokens < end
    slot = tl.load(seg_slot_ptr + g).to(tl.int64)
    rows = tl.load(perm_ptr + tokens, mask=live, other=0).to(tl.int64)
    return tokens, live, slot, rows


@triton.jit
def _tile_times_slot_t(lhs_ptr, lhs_rows, lhs_stride, live, w_ptr, slot, num_cols, K, DOT_PRECISION: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``lhs[lhs_rows, :K] @ w[slot][cols, :K].T`` (``w [slots, num_cols, K]`` contiguous) in float32
    ``[BLOCK_M, BLOCK_N]``, for this program's block of columns ``cols`` (grid axis 2), rows not
    ``live`` and columns past ``num_cols`` masked: the GEMM of both shrink and expand."""
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        lhs = tl.load(lhs_ptr + lhs_rows[:, None] * lhs_stride + (k0 + rk)[None, :],
                      mask=live[:, None] & (k0 + rk[None, :] < K), other=0.0)  # [BLOCK_M, BLOCK_K]
        w = tl.load(w_ptr + slot * num_cols * K + cols[None, :].to(tl.int64) * K + (k0 + rk)[:, None],
                    mask=(cols[None, :] < num_cols) & (k0 + rk[:, None] < K), other=0.0)  # [BLOCK_K, BLOCK_N]: w[s].T
        acc = tl.dot(lhs.to(w.dtype), w, acc, input_precision=DOT_PRECISION)
    return acc, cols


@triton.jit
def _lora_shrink_kernel(x_ptr, a_ptr, t_ptr, perm_ptr, seg_slot_ptr, seg_start_ptr, K, R, x_stride,
                        DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    if _past_segment_end(seg_start_ptr, BLOCK_M):
        return
    tokens, live, slot, rows = _segment_tile(perm_ptr, seg_slot_ptr, seg_start_ptr, BLOCK_M)
    acc, rr = _tile_times_slot_t(x_ptr, rows, x_stride, live, a_ptr, slot, R, K, DOT_PRECISION, BLOCK_M, BLOCK_R,
                                 BLOCK_K)
    tl.store(t_ptr + tokens[:, None].to(tl.int64) * R + rr[None, :], acc, mask=live[:, None] & (rr[None, :] < R))


@triton.jit
def _lora_expand_kernel(t_ptr, b_ptr, y_ptr, perm_ptr, seg_slot_ptr, seg_start_ptr, N, R, y_stride,
                        DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_R: tl.constexpr):
    if _past_segment_end(seg_start_ptr, BLOCK_M):
        return
    tokens, live, slot, rows = _segment_tile(perm_ptr, seg_slot_ptr, seg_start_ptr, BLOCK_M)
    # t is [lora tokens, R] float32, its rows the tokens' positions in the grouped order
    acc, rn = _tile_times_slot_t(t_ptr, tokens.to(tl.int64), R, live, b_ptr, slot, N, R, DOT_PRECISION, BLOCK_M,
                                 BLOCK_N, BLOCK_R)
    mask = live[:, None] & (rn[None, :] < N)
    y_ptrs = y_ptr + rows[:, None] * y_stride + rn[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + acc).to(y_ptr.dtype.element_ty), mask=mask)


def lora_sgmv(x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, perm: torch.Tensor,
              seg_slot: torch.Tensor, seg_start: torch.Tensor, max_segment: int) -> torch.Tensor:
    """``y[perm[i]] += (x[perm[i]] @ a[s].T) @ b[s].T`` per segment, in place; ``x [T, in]`` and
    ``y [T, out]`` with unit inner stride, ``a [slots, R, in]`` and ``b [slots, out, R]`` contiguous,
    ``perm``, ``seg_slot [G]``, ``seg_start [G + 1]`` int64 on the device; ``max_segment``: the most
    tokens one segment may hold (the grids' token axis; under a CUDA graph, the graph's rows).
    Reads nothing on the host: capturable."""
    (num_segs,), (_, r, k), n = seg_slot.shape, a.shape, b.shape[1]
    assert x.stride(1) == 1 and y.stride(1) == 1 and a.is_contiguous() and b.is_contiguous()
    if num_segs == 0 or max_segment == 0:
        return y
    t = torch.empty(perm.shape[0], r, dtype=torch.float32, device=x.device)  # [lora tokens, R]
    precision = "ieee" if a.dtype == torch.float32 else "tf32"
    token_blocks = triton.cdiv(max_segment, BLOCK_M)
    block_r = max(16, min(64, triton.next_power_of_2(r)))
    _lora_shrink_kernel[(num_segs, token_blocks, triton.cdiv(r, block_r))](
        x, a, t, perm, seg_slot, seg_start, k, r, x.stride(0), DOT_PRECISION=precision, BLOCK_M=BLOCK_M,
        BLOCK_R=block_r, BLOCK_K=64, num_warps=4)
    _lora_expand_kernel[(num_segs, token_blocks, triton.cdiv(n, 64))](
        t, b, y, perm, seg_slot, seg_start, n, r, y.stride(0), DOT_PRECISION=precision, BLOCK_M=BLOCK_M,
        BLOCK_N=64, BLOCK_R=block_r, num_warps=4)
    return y

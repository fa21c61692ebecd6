"""Top-k, top-p and min-p filtering of a batch of logits, with per-row parameters as tensors.

The torch sampler sorts every row. This kernel instead finds each row's two thresholds by
bisection over the order-preserving integer image of the float32 logits (``_order_key``), one
pass over the row per step, 33 steps each (the key range is 2^32)::

    t_k = the k-th largest key                          (top-k: keep key >= t_k)
    t_p = min x such that mass(key > x) <= top_p * Z_k  (top-p: keep key >= t_p)

where ``mass`` sums softmax numerators ``exp(l - max)`` of the tokens that survive top-k and
``Z_k`` is their total: a token survives top-p when the probability of all tokens above it is
at most ``top_p``, exactly the torch sampler's ``cumsum - p <= top_p`` rule (the top token
always stays). min-p keeps ``p >= min_p * p_max``, i.e. ``exp(l - max) >= min_p``. Dropped
logits become ``-inf`` in place. Rows differ from the sorting reference only for tied logits
(the sort keeps ties in some order, the threshold keeps all of them).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024
_KEY_STEPS = 33  # bisection over an int32 key range: 2^32 + 1 candidates


@triton.jit
def _order_key(x):
    """float32 -> int64 with the same order (negative floats have their magnitude bits flipped)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)


@triton.jit
def _row_max(row_ptr, vocab, BLOCK: tl.constexpr):
    m = tl.full((), float("-inf"), tl.float32)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        m = tl.maximum(m, tl.max(tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf")), axis=0))
    return m


@triton.jit
def _count_at_least(row_ptr, vocab, threshold, BLOCK: tl.constexpr):
    count = tl.full((), 0, tl.int32)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        key = _order_key(tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf")))
        count += tl.sum(((key >= threshold) & (cols < vocab)).to(tl.int32), axis=0)
    return count


@triton.jit
def _mass_above(row_ptr, vocab, row_max, threshold, BLOCK: tl.constexpr):
    """Sum of exp(l - row_max) over the tokens whose key is > threshold."""
    mass = tl.full((), 0.0, tl.float32)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        logits = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf"))
        mass += tl.sum(tl.where(_order_key(logits) > threshold, tl.exp(logits - row_max), 0.0), axis=0)
    return mass


@triton.jit
def _top_k_top_p_min_p_kernel(logits_ptr, top_k_ptr, top_p_ptr, min_p_ptr, stride, vocab, BLOCK: tl.constexpr,
                              KEY_STEPS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride
    top_k = tl.load(top_k_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    min_p = tl.load(min_p_ptr + row)
    row_max = _row_max(row_ptr, vocab, BLOCK)
    # top-k: lo always has >= k keys at or above it, hi never does
    lo = tl.full((), -2147483648, tl.int64)
    if (top_k > 0) & (top_k < vocab):
        hi = tl.full((), 2147483648, tl.int64)
        for _ in range(KEY_STEPS):
            mid = (lo + hi) >> 1
            ok = _count_at_least(row_ptr, vocab, mid, BLOCK) >= top_k
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid)
    t_k = lo
    # top-p among the top-k survivors: lo is never enough mass-wise, hi always is
    t_p = t_k
    if top_p < 1.0:
        budget = top_p * _mass_above(row_ptr, vocab, row_max, t_k - 1, BLOCK)
        lo = t_k - 1
        hi = tl.full((), 2147483647, tl.int64)
        for _ in range(KEY_STEPS):
            mid = (lo + hi) >> 1
            ok = _mass_above(row_ptr, vocab, row_max, mid, BLOCK) <= budget
            hi = tl.where(ok, mid, hi)
            lo = tl.where(ok, lo, mid)
        t_p = hi
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        logits = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf"))
        keep = (_order_key(logits) >= t_p) & (tl.exp(logits - row_max) >= min_p)
        tl.store(row_ptr + cols, tl.where(keep, logits, float("-inf")), mask=cols < vocab)


def top_k_top_p_min_p_(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> None:
    """Filters float32 ``logits [rows, vocab]`` in place. Per row: ``top_k`` int32 (<= 0 or
    >= vocab: off), ``top_p`` float32 (>= 1: off), ``min_p`` float32 (0: off); all on the
    logits' device, so no value is read back to the host."""
    rows, vocab = logits.shape
    assert logits.dtype == torch.float32 and logits.stride(1) == 1
    if rows == 0:
        return
    block = min(BLOCK, triton.next_power_of_2(vocab))
    _top_k_top_p_min_p_kernel[(rows,)](logits, top_k, top_p, min_p, logits.stride(0), vocab, BLOCK=block,
                                       KEY_STEPS=_KEY_STEPS, num_warps=8 if block >= 1024 else 4)


def top_k_top_p_min_p_ref(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                          min_p: torch.Tensor) -> torch.Tensor:
    """The sorting reference (the torch sampler's rules), returning a filtered copy."""
    vocab = logits.shape[1]
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab).long()
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    drop = torch.arange(vocab, device=logits.device)[None, :] >= k[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    drop |= (probs.cumsum(dim=-1) - probs) > top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    out = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    probs = torch.softmax(out, dim=-1)
    return out.masked_fill(probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True), float("-inf"))

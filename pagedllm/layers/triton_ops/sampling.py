"""Top-k, top-p and min-p filtering of a batch of logits, with per-row parameters as tensors.

The torch sampler sorts every row. Here each row's two thresholds come from its ``CANDIDATES``
largest logits (``torch.topk``, sorted), in the order-preserving integer image of the float32
logits (``_order_key``)::

    t_k = the k-th largest key                          (top-k: keep key >= t_k)
    t_p = min x such that mass(key > x) <= top_p * Z_k  (top-p: keep key >= t_p)

where ``mass`` sums softmax numerators ``exp(l - max)`` of the tokens that survive top-k and
``Z_k`` is their total: a token survives top-p when the probability of all tokens above it is
at most ``top_p``, exactly the torch sampler's ``cumsum - p <= top_p`` rule (the top token
always stays). min-p keeps ``p >= min_p * p_max``, i.e. ``exp(l - max) >= min_p``. Dropped
logits become ``-inf`` in place. Rows differ from the sorting reference only for tied logits
(the sort keeps ties in some order, the threshold keeps all of them).

Passes over a row's vocabulary (``passes`` counts them when asked): the candidates settle both
thresholds whenever every token they depend on is a candidate, which is the case unless top-k
asks for ``CANDIDATES`` tokens or more (the last candidate may tie tokens past it) or the top-p
nucleus is wider than the candidates. Then
the kernel makes one pass (``Z_k`` over the whole row, only for top-p without top-k) plus the
pass that writes the row: at most 2, after ``torch.topk``'s own. A row whose thresholds lie
past the candidates (a nucleus of more than ``CANDIDATES`` tokens in a flat distribution) falls
back, in the same launch and on that row alone, to bisection over the key range (33 steps, a
pass each, per threshold), exact as well. No value is read back to the host.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024
CANDIDATES = 1024  # the largest logits per row the thresholds are looked for in (one tile)
_KEY_STEPS = 33  # bisection over an int32 key range: 2^32 + 1 candidates


@triton.jit
def _order_key(x):
    """float32 -> int64 with the same order (negative floats have their magnitude bits flipped)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)


@triton.jit
def _count_at_least(row_ptr, vocab, threshold, BLOCK: tl.constexpr):
    count = tl.zeros([BLOCK], tl.int32)  # reduced once per pass, not once per block
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        key = _order_key(tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf")))
        count += ((key >= threshold) & (cols < vocab)).to(tl.int32)
    return tl.sum(count, axis=0)


@triton.jit
def _mass_above(row_ptr, vocab, row_max, threshold, BLOCK: tl.constexpr):
    """Sum of exp(l - row_max) over the tokens whose key is > threshold."""
    mass = tl.zeros([BLOCK], tl.float32)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        logits = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf"))
        mass += tl.where(_order_key(logits) > threshold, tl.exp(logits - row_max), 0.0)
    return tl.sum(mass, axis=0)


@triton.jit
def _bisect_top_k(row_ptr, vocab, top_k, BLOCK: tl.constexpr, KEY_STEPS: tl.constexpr):
    """The k-th largest key: lo always has >= k keys at or above it, hi never does."""
    lo = tl.full((), -2147483648, tl.int64)
    hi = tl.full((), 2147483648, tl.int64)
    for _ in range(KEY_STEPS):
        mid = (lo + hi) >> 1
        ok = _count_at_least(row_ptr, vocab, mid, BLOCK) >= top_k
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid)
    return lo


@triton.jit
def _bisect_top_p(row_ptr, vocab, row_max, t_k, budget, BLOCK: tl.constexpr, KEY_STEPS: tl.constexpr):
    """min x >= t_k with mass(key > x) <= budget: lo is never enough mass-wise, hi always is."""
    lo = t_k - 1
    hi = tl.full((), 2147483647, tl.int64)
    for _ in range(KEY_STEPS):
        mid = (lo + hi) >> 1
        ok = _mass_above(row_ptr, vocab, row_max, mid, BLOCK) <= budget
        hi = tl.where(ok, mid, hi)
        lo = tl.where(ok, lo, mid)
    return hi


@triton.jit
def _top_k_top_p_min_p_kernel(logits_ptr, cand_ptr, top_k_ptr, top_p_ptr, min_p_ptr, passes_ptr, stride,
                              cand_stride, vocab, num_cand, BLOCK: tl.constexpr, CAND_BLOCK: tl.constexpr,
                              KEY_STEPS: tl.constexpr, COUNT_PASSES: tl.constexpr):
    """One program per row; ``cand_ptr`` holds the row's ``num_cand`` largest logits, descending."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride
    top_k = tl.load(top_k_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    min_p = tl.load(min_p_ptr + row)
    c = tl.arange(0, CAND_BLOCK)
    cand = tl.load(cand_ptr + row * cand_stride + c, mask=c < num_cand, other=float("-inf"))
    key = tl.where(c < num_cand, _order_key(cand), -2147483649)  # [CAND_BLOCK], descending
    row_max = tl.max(cand, axis=0)
    last_key = tl.sum(tl.where(c == num_cand - 1, key, 0), axis=0)
    all_cand = num_cand == vocab  # every token is a candidate: nothing lies past them
    passes = tl.full((), 0, tl.int32)
    # top-k: t_k is a candidate's key, and every token at or above it one, unless ties of the
    # last candidate may continue past it
    k_on = (top_k > 0) & (top_k < vocab)
    t_k = tl.full((), -2147483648, tl.int64)
    k_key = tl.sum(tl.where(c == top_k - 1, key, 0), axis=0)
    k_fits = (top_k <= num_cand) & (all_cand | (k_key > last_key))
    if k_on:
        if k_fits:
            t_k = k_key
        else:
            t_k = _bisect_top_k(row_ptr, vocab, top_k, BLOCK, KEY_STEPS)
            passes += KEY_STEPS
    # every token with key >= t_k is a candidate: with top-k from the candidates, or all of them
    within = (k_on & k_fits) | all_cand
    t_p = t_k
    if top_p < 1.0:
        weight = tl.where(key >= t_k, tl.exp(cand - row_max), 0.0)  # [CAND_BLOCK]
        if within:
            z_k = tl.sum(weight, axis=0)
        else:
            z_k = _mass_above(row_ptr, vocab, row_max, t_k - 1, BLOCK)
            passes += 1
        budget = top_p * z_k
        # mass above candidate j: the exclusive prefix sum (for a run of ties, its first member's
        # is the true one and the smallest, which is all the minimum below needs)
        above = tl.cumsum(weight, axis=0) - weight
        ok = (above <= budget) & (key >= t_k)
        t_p = tl.min(tl.where(ok, key, 2147483647), axis=0)
        # past the candidates only if the nucleus may continue there: all of the candidates'
        # mass is within the budget and tokens below them are eligible
        if (within == 0) & (tl.sum(weight, axis=0) <= budget):
            t_p = _bisect_top_p(row_ptr, vocab, row_max, t_k, budget, BLOCK, KEY_STEPS)
            passes += KEY_STEPS
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        logits = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf"))
        keep = (_order_key(logits) >= t_p) & (tl.exp(logits - row_max) >= min_p)
        tl.store(row_ptr + cols, tl.where(keep, logits, float("-inf")), mask=cols < vocab)
    if COUNT_PASSES:
        tl.store(passes_ptr + row, passes + 1)


def top_k_top_p_min_p_(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                       passes: torch.Tensor | None = None) -> None:
    """Filters float32 ``logits [rows, vocab]`` in place. Per row: ``top_k`` int32 (<= 0 or
    >= vocab: off), ``top_p`` float32 (>= 1: off), ``min_p`` float32 (0: off); all on the
    logits' device, so no value is read back to the host. ``passes`` (int32 ``[rows]``, optional)
    receives the number of passes the kernel made over each row (module doc)."""
    rows, vocab = logits.shape
    assert logits.dtype == torch.float32 and logits.stride(1) == 1
    if rows == 0:
        return
    num_cand = min(CANDIDATES, vocab)
    cand = logits.topk(num_cand, dim=-1, sorted=True).values  # [rows, num_cand], descending
    block = min(BLOCK, triton.next_power_of_2(vocab))
    _top_k_top_p_min_p_kernel[(rows,)](
        logits, cand, top_k, top_p, min_p, top_k if passes is None else passes, logits.stride(0), cand.stride(0),
        vocab, num_cand, BLOCK=block, CAND_BLOCK=triton.next_power_of_2(num_cand), KEY_STEPS=_KEY_STEPS,
        COUNT_PASSES=passes is not None, num_warps=8 if block >= 1024 else 4)


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

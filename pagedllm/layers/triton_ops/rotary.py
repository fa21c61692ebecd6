"""Rotary embedding, GPT-NeoX "rotate half" layout, applied in place from the cos/sin cache.

For each token at position ``p`` and each head, with ``x1, x2`` the two halves of the head::

    x1' = x1 * cos[p] - x2 * sin[p]
    x2' = x2 * cos[p] + x1 * sin[p]

Every RoPE scaling type the engine supports lives in the precomputed cache (``RotaryEmbedding``),
so this one kernel serves all of them. Arithmetic in float32, stored in the tensor's dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotary_neox_kernel(x_ptr, positions_ptr, cos_ptr, sin_ptr, token_stride, head_stride, num_heads, half,
                        cache_stride, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
    d = tl.arange(0, BLOCK_D)[None, :]  # [1, BLOCK_D]
    cos = tl.load(cos_ptr + pos * cache_stride + d, mask=d < half, other=0.0)  # [1, BLOCK_D]
    sin = tl.load(sin_ptr + pos * cache_stride + d, mask=d < half, other=0.0)
    mask = (heads < num_heads) & (d < half)
    first = x_ptr + token * token_stride + heads * head_stride + d  # [BLOCK_H, BLOCK_D] pointers
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + half, mask=mask, other=0.0).to(tl.float32)
    tl.store(first, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(first + half, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


def rotary_neox_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotates x ([tokens, heads, head_dim] view, unit inner stride) in place; cos/sin:
    [max_position, head_dim // 2] float32, positions: [tokens] integer."""
    tokens, heads, head_dim = x.shape
    assert x.stride(2) == 1 and cos.stride() == sin.stride() and cos.stride(1) == 1
    if tokens == 0:
        return
    half = head_dim // 2
    _rotary_neox_kernel[(tokens,)](
        x, positions, cos, sin, x.stride(0), x.stride(1), heads, half, cos.stride(0),
        BLOCK_H=triton.next_power_of_2(heads), BLOCK_D=triton.next_power_of_2(half), num_warps=4)


def rotary_neox_ref(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The torch reference (a rotated copy, in float32 arithmetic)."""
    c = cos[positions].unsqueeze(1)  # [tokens, 1, head_dim // 2]
    s = sin[positions].unsqueeze(1)
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)

"""Weight-only int8 GEMM: ``y = x @ (q * scale[:, None])^T + bias``.

``q [out, in]`` int8 with one float32 ``scale`` per output channel (``layers/quantization.py``).
Each program computes a ``BLOCK_M x BLOCK_N`` tile of ``y``; the int8 weight tile is widened to
the activation dtype in registers right after its load, the dot products accumulate in float32,
and the channel scale (and bias) is applied once to the finished tile, so the weight is read as
int8 (a quarter of float32's bytes, half of bf16's) and never dequantized in memory.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _int8_gemm_kernel(x_ptr, q_ptr, scale_ptr, bias_ptr, y_ptr, M, N, K, x_stride, q_stride, y_stride,
                      HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rm[:, None].to(tl.int64) * x_stride + rk[None, :]  # [BLOCK_M, BLOCK_K]
    q_ptrs = q_ptr + rn[None, :].to(tl.int64) * q_stride + rk[:, None]  # [BLOCK_K, BLOCK_N]: q transposed
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptrs, mask=(rm[:, None] < M) & (rk[None, :] + k0 < K), other=0.0)
        q = tl.load(q_ptrs, mask=(rn[None, :] < N) & (rk[:, None] + k0 < K), other=0)
        acc = tl.dot(x, q.to(x.dtype), acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        q_ptrs += BLOCK_K
    acc *= tl.load(scale_ptr + rn, mask=rn < N, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + rm[:, None].to(tl.int64) * y_stride + rn[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def _tiles(m: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): decode batches are weight-bandwidth bound, so small M tiles
    with narrow N tiles spread the weight over many programs; prefill gets square-ish tiles."""
    if m <= 16:
        return 16, 32, 128
    if m <= 64:
        return triton.next_power_of_2(m), 64, 64
    return 64, 128, 64


def int8_gemm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x: [M, K] (float32/float16/bfloat16, unit inner stride), q: [N, K] int8 contiguous,
    scale: [N] float32, bias: [N] or None -> [M, N] in x's dtype."""
    m, k = x.shape
    n = q.shape[0]
    assert q.shape[1] == k and q.is_contiguous() and x.stride(1) == 1
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    block_m, block_n, block_k = _tiles(m)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int8_gemm_kernel[grid](x, q, scale, bias if bias is not None else scale, y, m, n, k, x.stride(0), q.stride(0),
                            y.stride(0), HAS_BIAS=bias is not None,
                            DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
    return y


def int8_gemm_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The reference: dequantize the whole weight, one float32 GEMM."""
    y = x.float() @ (q.float() * scale[:, None]).T
    return (y if bias is None else y + bias.float()).to(x.dtype)

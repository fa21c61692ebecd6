"""MXFP4 GEMM: ``y = x @ W^T + bias`` with W as gpt-oss ships it (``layers/quantization/mxfp4.py``):
``blocks [N, K / 32, 16]`` uint8 holding two e2m1 codes per byte (element 2j low nibble, 2j + 1
high) and ``scales [N, K / 32]`` e8m0. Each program computes a ``BLOCK_M x BLOCK_N`` tile of
``y``; the weight tile is read as bytes and decoded in registers (code -> sign, exponent,
mantissa; times the group's power of two) right before the dot, so the weight is read at half a
byte per element and never dequantized in memory. The reference is ``mxfp4.dequantize`` +
``F.linear``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

GROUP = 32


@triton.jit
def _e2m1(code):
    """An e2m1 code (0..15, int32) as float32: 0 0.5 1 1.5 2 3 4 6 and the negatives (bit 3)."""
    exp = (code >> 1) & 3
    man = (code & 1).to(tl.float32)
    mag = tl.where(exp == 0, man * 0.5, (1.0 + man * 0.5) * tl.exp2((exp - 1).to(tl.float32)))
    return tl.where((code & 8) != 0, -mag, mag)


@triton.jit
def decode_tile(blocks_ptr, scales_ptr, rows, k, N, K):
    """``W[rows, k]`` transposed, ``[BLOCK_K, BLOCK_N]`` float32, decoded from MXFP4 in registers:
    element k of row n is nibble k % 2 of byte k // 2, scaled by 2^(scale - 127) of group k // 32.
    ``rows`` int64 ``[BLOCK_N]``, ``k`` ``[BLOCK_K]``; outside ``N`` x ``K`` reads 0."""
    mask = (k < K)[:, None] & (rows < N)[None, :]
    byte = tl.load(blocks_ptr + rows[None, :] * (K // 2) + (k // 2)[:, None], mask=mask, other=0).to(tl.int32)
    code = (byte >> ((k % 2) * 4)[:, None]) & 15
    scale = tl.load(scales_ptr + rows[None, :] * (K // 32) + (k // 32)[:, None], mask=mask, other=127).to(tl.int32)
    return _e2m1(code) * tl.exp2((scale - 127).to(tl.float32))


@triton.jit
def _mxfp4_gemm_kernel(x_ptr, blocks_ptr, scales_ptr, bias_ptr, y_ptr, M, N, K, x_stride, y_stride,
                       HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk  # [BLOCK_K]
        k_ok = k < K
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * x_stride + k[None, :],
                    mask=(rm[:, None] < M) & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        w = decode_tile(blocks_ptr, scales_ptr, rn.to(tl.int64), k, N, K)  # [BLOCK_K, BLOCK_N]
        acc = tl.dot(x, w.to(x.dtype), acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + rm[:, None].to(tl.int64) * y_stride + rn[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(rm[:, None] < M) & n_ok[None, :])


def tiles(m: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): small M tiles for decode (weight-bound), square-ish for prefill."""
    return (16, 32, 64) if m <= 16 else (64, 64, 64)


def mxfp4_matmul(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor,
                 bias: torch.Tensor | None) -> torch.Tensor:
    """x ``[M, K]`` (float32 / float16 / bfloat16), blocks ``[N, K / 32, 16]`` and scales
    ``[N, K / 32]`` uint8 contiguous, bias ``[N]`` or None -> ``[M, N]`` in x's dtype."""
    m, k = x.shape
    n = blocks.shape[0]
    if blocks.shape[1] * GROUP != k or not (blocks.is_contiguous() and scales.is_contiguous()):
        raise ValueError(f"MXFP4 weight blocks {tuple(blocks.shape)} do not fit x {tuple(x.shape)} (or are strided)")
    x = x if x.stride(1) == 1 else x.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    block_m, block_n, block_k = tiles(m)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _mxfp4_gemm_kernel[grid](x, blocks, scales, bias if bias is not None else x, y, m, n, k, x.stride(0), y.stride(0),
                             HAS_BIAS=bias is not None, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                             BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
    return y

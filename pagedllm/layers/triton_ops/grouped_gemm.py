"""Weight-only 4/8-bit group-wise GEMM: ``y = x @ W^T + bias`` with the weight read as its codes.

The runtime layout of ``layers/quantization/grouped.py`` (GPTQ, AWQ, compressed-tensors, own int4):

    q      uint8 [N, K / 2] (4 bits: column 2j in the low nibble of byte j) or [N, K] (8 bits)
    scale  float32 [N, G]   szero  float32 [N, G]       (G = K / group; channel-wise: G = 1)

    W[n, k] = code[n, k] * scale[n, k // group] - szero[n, k // group]

Each program computes a ``BLOCK_M x BLOCK_N`` tile of ``y``. Per K tile it loads the packed bytes
``[BLOCK_N, BLOCK_K / 2]`` along the rows as they are stored, splits the nibbles and interleaves
them back into column order in registers (``tl.interleave``: low nibble = even column), applies
the group's scale and scaled zero, and feeds the widened tile to ``tl.dot`` with float32
accumulation. Where the K tile lies inside one group (``ONE_GROUP``: the tile divides the group,
or the layer is channel-wise) the scales are one ``[BLOCK_N]`` vector per tile; where the tile
holds several whole groups each column gathers its own. Act-order layers are handled outside:
their columns were sorted by group at load, and the caller gathers the activations with
``act_perm`` (``grouped.grouped_linear``), so the kernel always sees contiguous groups.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _grouped_gemm_kernel(x_ptr, q_ptr, scale_ptr, szero_ptr, bias_ptr, y_ptr, M, N, K, G, group,
                         x_stride, q_stride, y_stride, BITS: tl.constexpr, ONE_GROUP: tl.constexpr,
                         HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    PER_BYTE: tl.constexpr = 8 // BITS  # codes per byte: 2 (4 bits) or 1
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    rb = tl.arange(0, BLOCK_K // PER_BYTE)  # the tile's bytes along K
    n_ok = rn < N
    x_ptrs = x_ptr + rm[:, None].to(tl.int64) * x_stride + rk[None, :]  # [BLOCK_M, BLOCK_K]
    q_ptrs = q_ptr + rn[:, None].to(tl.int64) * q_stride + rb[None, :]  # [BLOCK_N, BLOCK_K / PER_BYTE]
    s_row = rn.to(tl.int64) * G  # each output row's first group
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptrs, mask=(rm[:, None] < M) & (rk[None, :] + k0 < K), other=0.0)
        b = tl.load(q_ptrs, mask=n_ok[:, None] & (rb[None, :] + k0 // PER_BYTE < K // PER_BYTE), other=0)
        if BITS == 4:
            codes = tl.interleave(b & 15, b >> 4)  # [BLOCK_N, BLOCK_K]: column 2j low nibble, 2j + 1 high
        else:
            codes = b
        if ONE_GROUP:  # the whole tile in group k0 // group
            s_ptrs = s_row + k0 // group  # [BLOCK_N]
            s = tl.load(scale_ptr + s_ptrs, mask=n_ok, other=0.0)[:, None]
            z = tl.load(szero_ptr + s_ptrs, mask=n_ok, other=0.0)[:, None]
        else:  # whole groups inside the tile: each column its own
            g = tl.minimum((k0 + rk) // group, G - 1)  # (clamped: masked tail columns)
            s_ptrs = s_row[:, None] + g[None, :]  # [BLOCK_N, BLOCK_K]
            s = tl.load(scale_ptr + s_ptrs, mask=n_ok[:, None], other=0.0)
            z = tl.load(szero_ptr + s_ptrs, mask=n_ok[:, None], other=0.0)
        w = (codes.to(tl.float32) * s - z).to(x.dtype)  # [BLOCK_N, BLOCK_K]
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        q_ptrs += BLOCK_K // PER_BYTE
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + rm[:, None].to(tl.int64) * y_stride + rn[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=(rm[:, None] < M) & n_ok[None, :])


DECODE_MAX_M = 16  # up to this many rows: the decode tiles


def tiles(m: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps). Decode batches read every weight once and are
    bandwidth bound: one 16-row M tile (``tl.dot``'s smallest) and narrow N tiles (int8_gemm's
    decode tile) spread the weight over many programs; prefill gets the usual square-ish GEMM
    tiles. Not tuned on a GPU yet."""
    if m <= DECODE_MAX_M:
        return 16, 32, 128, 4
    return 64, 128, 64, 8


def one_group_per_tile(group: int, k: int, block_k: int) -> bool:
    """Whether every K tile lies in one group: the tile divides the group, or one group spans K."""
    return group >= k or group % block_k == 0


def grouped_gemm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, szero: torch.Tensor,
                 bias: torch.Tensor | None, group: int, bits: int) -> torch.Tensor:
    """x: [M, K] (float32/float16/bfloat16, unit inner stride), q: the packed codes (module
    docstring), scale / szero: [N, K / group] float32, bias: [N] or None -> [M, N] in x's dtype."""
    m, k = x.shape
    n, groups = scale.shape
    assert bits in (4, 8) and q.shape == (n, k * bits // 8) and q.is_contiguous() and x.stride(1) == 1
    assert groups * group == k and scale.is_contiguous() and szero.is_contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    block_m, block_n, block_k, num_warps = tiles(m)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        x, q, scale, szero, bias if bias is not None else scale, y, m, n, k, groups, group,
        x.stride(0), q.stride(0), y.stride(0), BITS=bits, ONE_GROUP=one_group_per_tile(group, k, block_k),
        HAS_BIAS=bias is not None, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps)
    return y

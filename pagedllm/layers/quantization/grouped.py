"""The runtime layout of every group-wise 4/8-bit format (own int4, GPTQ, AWQ, compressed-tensors).

Each checkpoint format unpacks its tensors at load into the same logical form:

    codes  [out, in]  unsigned integer codes (0..15 or 0..255)
    scale  [out, G]   the step of each group (G = in / group)
    zero   [out, G]   the zero point of each group, in code units
    g_idx  [in]       the group of each input column (act-order / desc_act), or None

    W[o, i] = (codes[o, i] - zero[o, g_idx[i]]) * scale[o, g_idx[i]]

and :func:`install` turns that into what the kernels read (``native/csrc/quant_linear.c``):
``weight`` uint8 with two codes per byte for 4 bits (column 2j in the low nibble of byte j),
``weight_scale`` and ``weight_szero = zero * scale`` (float32 ``[out, G]``), so a weight is
one FMA away from its code. Act-order checkpoints number groups by a permutation of the input
columns; we sort the columns by group once here (groups become contiguous) and gather the
activations with ``act_perm`` per call, as exllama does.
"""
from __future__ import annotations

import torch

from pagedllm.layers.ops import triton_available
from pagedllm.layers.quantization.base import native_f32, scratch_buffer

# up to this many rows (by bits) the C kernel (codes widened in registers), beyond them
# dequantize + MKL: the crossover measured on the ~200M benchmark model's projections (AVX-512,
# 2 threads, benchmarks/RESULTS.md "4-bit, 8-bit and FP8 weights"); capped at run time by the
# library's own limit, NativeLibrary.max_decode_tokens. The one-call decoder takes no more
# tokens than this either (models/cpu_decode.py): it has no MKL path.
C_MAX_ROWS = {4: 32, 8: 24}
BITS = (4, 8)


def check_group(group: int, in_features: int, what: str) -> None:
    """Group sizes the kernels take: a multiple of 8 that divides the layer's input size."""
    if group <= 0 or group % 8 or in_features % group:
        raise ValueError(f"{what}={group} is not supported for a layer with {in_features} inputs (per rank): the "
                         "group size must be a multiple of 8 that divides the input size")


def act_order_permutation(g_idx: torch.Tensor, groups: int) -> torch.Tensor | None:
    """The column order that makes groups contiguous (None when they already are); refuses a
    ``g_idx`` whose groups are not all the same size."""
    in_features = g_idx.shape[0]
    group = in_features // groups
    plain = torch.arange(in_features) // group
    if torch.equal(g_idx.long(), plain):
        return None
    perm = torch.argsort(g_idx.long(), stable=True)
    if not torch.equal(g_idx.long()[perm], plain):
        raise ValueError(f"g_idx does not assign {group} input columns to each of its {groups} groups (per rank); "
                         "such act-order layouts are not supported")
    return perm


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``[out, in]`` codes -> the kernels' bytes: ``[out, in / 2]`` nibble pairs for 4 bits."""
    codes = codes.to(torch.uint8)
    if bits == 8:
        return codes.contiguous()
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()  # [out, in / 2]


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of :func:`pack_codes`: ``[out, in]`` codes as int32."""
    if bits == 8:
        return packed.to(torch.int32)
    pairs = torch.stack([packed & 15, packed >> 4], dim=-1)  # [out, in / 2, 2]
    return pairs.reshape(packed.shape[0], -1).to(torch.int32)


def install(layer: torch.nn.Module, codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
            g_idx: torch.Tensor | None, bits: int, what: str = "group_size") -> None:
    """Sets the runtime tensors of ``layer`` from the logical form (module docstring)."""
    out_features, in_features = codes.shape
    groups = scale.shape[1]
    if in_features % groups:
        raise ValueError(f"{what}: {groups} groups do not split {in_features} input columns evenly")
    check_group(in_features // groups, in_features, what)
    perm = None if g_idx is None else act_order_permutation(g_idx, groups)
    if perm is not None:
        codes = codes[:, perm]
    device = codes.device
    scale = scale.float().contiguous()
    layer.weight = torch.nn.Parameter(pack_codes(codes, bits), requires_grad=False)
    layer.register_buffer("weight_scale", scale, persistent=False)
    layer.register_buffer("weight_szero", (zero.float() * scale).contiguous(), persistent=False)
    layer.register_buffer("act_perm", None if perm is None else perm.to(device), persistent=False)
    layer.quant_bits, layer.quant_group = bits, in_features // groups


def dequantize(q: torch.Tensor, scale: torch.Tensor, szero: torch.Tensor, group: int, bits: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight ``[out, in]`` of the runtime layout, in torch (any device)."""
    codes = unpack_codes(q, bits).to(dtype)  # [out, in]
    s = scale.to(dtype).repeat_interleave(group, dim=1)
    z = szero.to(dtype).repeat_interleave(group, dim=1)
    return codes * s - z


def grouped_linear(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``x @ W^T + bias`` for a layer in the runtime layout (what ``LinearBase.forward`` calls)."""
    if layer.act_perm is not None:
        x = x.index_select(-1, layer.act_perm)
    return grouped_matmul(x, layer.weight, layer.weight_scale, layer.weight_szero, layer.bias,
                          layer.quant_group, layer.quant_bits)


def grouped_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, szero: torch.Tensor,
                   bias: torch.Tensor | None, group: int, bits: int) -> torch.Tensor:
    """The C kernel for small float32 CPU batches, else the weight widened (in C into a reused
    buffer on the CPU, in torch elsewhere) for one GEMM; on CUDA the Triton GEMM, which widens
    the codes in registers (``layers/triton_ops/grouped_gemm.py``)."""
    if x.device.type == "cuda" and triton_available():
        return _triton_matmul(x, q, scale, szero, bias, group, bits)
    native = native_f32(x)
    if native is None:
        return torch.nn.functional.linear(x, dequantize(q, scale, szero, group, bits, x.dtype), bias)
    lead, in_features = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, in_features).contiguous()  # [tokens, in]
    if 0 < x2.shape[0] <= min(C_MAX_ROWS[bits], native.max_decode_tokens):
        y = torch.empty(x2.shape[0], q.shape[0], dtype=torch.float32)
        b = None if bias is None else bias.float().contiguous()
        native.grouped_linear(x2, q, scale, szero, b, group, bits, y, torch.get_num_threads())
    else:
        w = scratch_buffer(q.shape[0] * in_features).view(q.shape[0], in_features)  # [out, in]
        native.dequantize_grouped(q, scale, szero, w, group, bits, torch.get_num_threads())
        y = torch.nn.functional.linear(x2, w, bias)
    return y.view(*lead, q.shape[0])


def _triton_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, szero: torch.Tensor,
                   bias: torch.Tensor | None, group: int, bits: int) -> torch.Tensor:
    from pagedllm.layers.triton_ops.grouped_gemm import grouped_gemm
    rows = x.reshape(-1, x.shape[-1])  # [tokens, in]
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    return grouped_gemm(rows, q, scale, szero, bias, group, bits).view(*x.shape[:-1], q.shape[0])  # [..., out]

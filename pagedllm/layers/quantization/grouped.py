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

On the CPU (with the C library) :func:`install` also keeps a second copy of the same numbers in
the panel layout of ``native/csrc/quant_gemm.c`` (:func:`pack_panels`), which the GEMM for
batches past ``SMALL_MAX_ROWS`` reads: per panel of ``QG_PANEL`` (32) output rows, the codes of
the 32 rows at input k are one run of 16 bytes (4 bits: row j in the low nibble of byte j,
row 16 + j in its high nibble) or 32 bytes (8 bits), then input k + 1, and so on:

    panel_codes  uint8   [P, in, 16] (4 bits) or [P, in, 32] (8 bits), P = ceil(out / 32)
    panel_scale  float32 [P, G, 32]   panel_scale[p, g, j] = weight_scale[32 p + j, g]
    panel_szero  float32 [P, G, 32]   the same for weight_szero

(the last panel's rows past ``out`` are zeros). The batch-1 kernels and the one-call decoder
read the row-major ``weight``; the GEMM needs whole columns of 32 rows at each input, which
the row-major bytes do not give without a transpose per call. The copy costs as much memory
again as the codes, scales and zeros (+106 MB on the ~200M benchmark model; float32 keeps a
oneDNN-packed second copy of its 755 MB the same way, ``cpu_ops.pack_model``).
"""
from __future__ import annotations

import torch

from pagedllm.layers import cpu_ops
from pagedllm.layers.linear import QUANTIZED_FORWARD
from pagedllm.layers.ops import triton_available
from pagedllm.layers.quantization.base import native_f32, scratch_buffer
from pagedllm.native import bindings

# Routing by row count (by bits), measured on the ~200M benchmark model's 64 projections
# (AVX-512, 2 threads, benchmarks/RESULTS.md "4-bit, 8-bit and FP8 weights"):
# up to SMALL_MAX_ROWS the small-batch kernel (quant_linear.c: codes widened in registers per
# pair / triple of tokens), up to GEMM_MAX_ROWS the panel GEMM (quant_gemm.c: each code widened
# once per call), beyond them (prefill chunks) dequantize + one GEMM (cpu_ops.unpacked_linear).
SMALL_MAX_ROWS = {4: 2, 8: 3}


def gemm_max_rows(mkl_tuned: bool) -> dict[int, int]:
    """The panel GEMM's row limit per bits: 384 where it was measured against MKL on the Xeon
    (``cpu_ops.MKL_TUNED``); elsewhere unbounded for 4 bits, where on AMD Zen 5 it ties
    dequantize + oneDNN at 512 rows and beats it 1.10-1.20x at 1024-2048 (a 4-bit code widens to
    a float32 weight for a fraction of the widened buffer's write and read), and 384 for 8 bits,
    where the widened GEMM stays 3-6% ahead at 1024-2048 (benchmarks/RESULTS.md)."""
    return {4: 384, 8: 384} if mkl_tuned else {4: 1 << 62, 8: 384}


GEMM_MAX_ROWS = gemm_max_rows(cpu_ops.MKL_TUNED)
# The most tokens the one-call decoder takes with these weights when they have no panel copy
# (models/cpu_decode.py; capped by NativeLibrary.max_decode_tokens): it runs the small-batch
# kernel with no Python between layers, which beat the module path's panel GEMM up to here
# (int4 on the 200M model, decode step ms, decoder / module path: 4 tokens 27.6 / 30.0, 6: 38.2
# / 39.5, 8: 50.5 / 46.1). With the panel copies (every CPU layer keeps them) the decoder runs
# the panel GEMM itself past SMALL_MAX_ROWS, as the module path does, and takes up to
# cpu_ops.PANEL_MAX_ROWS tokens (200M int4, decoder / module path: 4 tokens 13.30 / 19.09 ms,
# 16: 33.04 / 40.41, 64: 104.76 / 114.34; benchmarks/RESULTS.md).
C_MAX_ROWS = {4: 6, 8: 6}
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


def pack_panels(codes: torch.Tensor, scale: torch.Tensor, szero: torch.Tensor, bits: int,
                panel: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[out, in]`` codes and ``[out, G]`` scales / scaled zeros -> the panel layout (module
    docstring): ``[P, in, panel / 2 or panel]`` uint8 codes, ``[P, G, panel]`` float32 twice."""
    out_features, in_features = codes.shape
    pad = -out_features % panel
    c = torch.nn.functional.pad(codes.to(torch.uint8), (0, 0, 0, pad))  # [P * panel, in]
    c = c.view(-1, panel, in_features).transpose(1, 2)  # [P, in, panel]
    if bits == 4:
        c = c[..., : panel // 2] | (c[..., panel // 2:] << 4)  # [P, in, panel / 2]

    def by_panel(t: torch.Tensor) -> torch.Tensor:
        t = torch.nn.functional.pad(t.float(), (0, 0, 0, pad))  # [P * panel, G]
        return t.view(-1, panel, t.shape[1]).transpose(1, 2).contiguous()  # [P, G, panel]
    return c.contiguous(), by_panel(scale), by_panel(szero)


def panel_copy_bytes(out_features: int, in_features: int, group: int, bits: int) -> int:
    """Bytes of the panel-layout copy :func:`install` keeps of an ``[out, in]`` layer on the CPU
    (0 without the C library, which then keeps none). :func:`pack_panels` itself runs on meta
    tensors (no data), so the size comes from the layout code, the last panel's padding included."""
    if not bindings.is_available():
        return 0
    codes = torch.empty(out_features, in_features, dtype=torch.uint8, device="meta")
    scale = torch.empty(out_features, in_features // group, device="meta")  # [out, G]
    panels = pack_panels(codes, scale, scale, bits, bindings.library().qg_panel)
    return sum(t.numel() * t.element_size() for t in panels)


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
    panels = (None,) * 3
    if device.type == "cpu" and bindings.is_available():
        panels = pack_panels(codes, scale, layer.weight_szero, bits, bindings.library().qg_panel)
    for name, t in zip(("panel_codes", "panel_scale", "panel_szero"), panels):
        layer.register_buffer(name, t, persistent=False)


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
    panels = None if layer.panel_codes is None else (layer.panel_codes, layer.panel_scale, layer.panel_szero)
    return grouped_matmul(x, layer.weight, layer.weight_scale, layer.weight_szero, layer.bias,
                          layer.quant_group, layer.quant_bits, panels)


def grouped_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, szero: torch.Tensor,
                   bias: torch.Tensor | None, group: int, bits: int,
                   panels: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """On float32 CPU batches: the small-batch C kernel up to ``SMALL_MAX_ROWS`` rows, the panel GEMM
    (``panels``: :func:`pack_panels` of the same weight) up to ``GEMM_MAX_ROWS``, else the weight
    widened in C into a reused buffer for one GEMM (``cpu_ops.unpacked_linear``). Elsewhere the weight widened in torch;
    on CUDA the Triton GEMM, which widens the codes in registers
    (``layers/triton_ops/grouped_gemm.py``)."""
    if x.device.type == "cuda" and triton_available():
        return _triton_matmul(x, q, scale, szero, bias, group, bits)
    native = native_f32(x)
    if native is None:
        return torch.nn.functional.linear(x, dequantize(q, scale, szero, group, bits, x.dtype), bias)
    lead, in_features = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, in_features).contiguous()  # [tokens, in]
    rows, b = x2.shape[0], None if bias is None else bias.float().contiguous()
    if 0 < rows <= SMALL_MAX_ROWS[bits]:
        y = torch.empty(rows, q.shape[0], dtype=torch.float32)
        native.grouped_linear(x2, q, scale, szero, b, group, bits, y, torch.get_num_threads())
    elif panels is not None and 0 < rows <= GEMM_MAX_ROWS[bits]:
        y = torch.empty(rows, q.shape[0], dtype=torch.float32)
        native.grouped_gemm(x2, *panels, b, group, bits, y, torch.get_num_threads())
    else:
        w = scratch_buffer(q.shape[0] * in_features).view(q.shape[0], in_features)  # [out, in]
        native.dequantize_grouped(q, scale, szero, w, group, bits, torch.get_num_threads())
        y = cpu_ops.unpacked_linear(x2, w, bias)
    return y.view(*lead, q.shape[0])


def _triton_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, szero: torch.Tensor,
                   bias: torch.Tensor | None, group: int, bits: int) -> torch.Tensor:
    from pagedllm.layers.triton_ops.grouped_gemm import grouped_gemm
    rows = x.reshape(-1, x.shape[-1])  # [tokens, in]
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    return grouped_gemm(rows, q, scale, szero, bias, group, bits).view(*x.shape[:-1], q.shape[0])  # [..., out]


QUANTIZED_FORWARD[torch.uint8] = grouped_linear

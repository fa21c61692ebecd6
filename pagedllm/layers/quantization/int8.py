"""Weight-only int8 quantization of the linear projections (``quantization="int8"``).

Each projection weight ``W [out, in]`` becomes ``q = round(W / s)`` in int8 with one float32
scale per output row, ``s = max|W[row]| / 127`` (symmetric, per channel), computed from the
checkpoint's weights at load time, after tensor-parallel sharding: each rank scales its own
rows, so row-parallel layers (o_proj, down_proj) get one scale per row per rank, over that rank's
slice of the inputs. Activations, norms, embeddings, the LM head and the KV cache stay in the model dtype
(an int8 LM head too was measured with benchmarks/throughput.py --quantization int8 and lost:
single 224 -> 208, mixed32 837 -> 715, batch64 952 -> 632 output tok/s; its matrix-vector product
is 1.9x faster for one row, but beyond a few rows this int8 kernel loses to the oneDNN-packed
float32 GEMM).

Why: decoding small batches streams every weight once per step, so on a CPU it runs at memory
bandwidth; int8 weights are a quarter of float32's bytes. The one-call C decoder and
``ld_linear`` run them on ``quant_linear.c``'s VNNI path where the CPU has AVX512-VNNI and the
input size is a multiple of 64 (integer dot products against activation levels, the whole row
one group), else widen int8 to float32 in registers (8 lanes per load) and apply the row scale
to each finished dot product. Larger batches (prefill chunks) dequantize the layer's weight for one
MKL GEMM, where the arithmetic dwarfs the conversion. On CUDA the Triton GEMM
(``layers/triton_ops/int8_gemm.py``) does the same widening in registers for every batch size
(when triton is installed); elsewhere the weight is dequantized per call: correct, no speed-up.
"""
from __future__ import annotations

import torch

from pagedllm.layers import cpu_ops
from pagedllm.layers.linear import QUANTIZED_FORWARD
from pagedllm.layers.ops import triton_available
from pagedllm.layers.quantization.base import QuantMethod, native_f32, scratch_buffer
from pagedllm.native import bindings

# up to this many rows the C kernel (weights widened in registers) beats dequantize + MKL
# (capped at run time by the library's own limit, NativeLibrary.max_decode_tokens)
C_MAX_ROWS = 48


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [out, in] int8, scale [out] float32)`` with ``weight ~= q * scale[:, None]``."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row stays zero
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


class Int8Method(QuantMethod):
    name = "int8"

    def process_weights(self, layer: torch.nn.Module) -> None:
        """Replaces the float weight by int8 codes plus ``weight_scale`` (per row)."""
        q, scale = quantize_int8(layer.weight)
        layer.weight = torch.nn.Parameter(q, requires_grad=False)
        layer.register_buffer("weight_scale", scale.to(layer.weight.device), persistent=False)


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ (q * scale)^T + bias``: the C kernel for small float32 CPU batches, else the weight
    widened (in C, into a reused buffer, on the CPU) for one GEMM."""
    if x.device.type == "cuda" and triton_available():
        return _triton_linear(x, q, scale, bias)
    native = native_f32(x)
    if native is not None and x.dim() == 2 and x.shape[0] <= min(C_MAX_ROWS, native.max_decode_tokens):
        return _c_linear(native, x.contiguous(), q, scale, bias)
    if native is not None:
        return cpu_ops.unpacked_linear(x, _dequantize_c(native, q, scale), bias)
    w = q.to(x.dtype) * scale.to(x.dtype)[:, None]  # [out, in]
    return torch.nn.functional.linear(x, w, bias)


def _dequantize_c(native: bindings.NativeLibrary, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 weight, in a buffer that the next call overwrites (used at once by the GEMM)."""
    w = scratch_buffer(q.numel()).view(q.shape)  # [out, in]
    native.dequantize_int8(q, scale, w, torch.get_num_threads())
    return w


def _triton_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    from pagedllm.layers.triton_ops.int8_gemm import int8_gemm
    rows = x.reshape(-1, x.shape[-1])  # [tokens, in]
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    return int8_gemm(rows, q, scale, bias).view(*x.shape[:-1], q.shape[0])  # [..., out]


def _c_linear(native: bindings.NativeLibrary, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
    rows, out_features = x.shape[0], q.shape[0]
    y = torch.empty(rows, out_features, dtype=torch.float32)
    if rows == 0:
        return y
    b = None if bias is None else bias.float().contiguous()
    native.linear(x, q, scale, b, y, torch.get_num_threads())
    return y


def _int8_forward(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return int8_linear(x, layer.weight, layer.weight_scale, layer.bias)


QUANTIZED_FORWARD[torch.int8] = _int8_forward

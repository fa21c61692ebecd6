"""Writes tests/models/fixtures/quant_layers.safetensors: single layers quantized, packed and
dequantized by the real tools, so the tests check our unpacking against code nobody here wrote
(and, for FP8, compressed-tensors' fake quantization of a layer's input activations).

Run in a separate venv (never the shared interpreter), made as:
    python -m venv /work/wt/quant-venv --system-site-packages
    /work/wt/quant-venv/bin/pip install compressed-tensors==0.20.1
    /work/wt/quant-venv/bin/pip install --no-deps autoawq==0.2.9 accelerate==1.15.0
    /work/wt/quant-venv/bin/python scripts/make_quant_fixtures.py
Tools used (recorded in the file's metadata): compressed-tensors' PackedQuantizationCompressor /
NaiveQuantizationCompressor / FloatQuantizationCompressor (compress and decompress), its
calculate_qparams / compute_dynamic_scales_and_zp / fake_quantize (FP8 activations) and
AutoAWQ's WQLinear_GEMM.from_linear (packing) with awq.utils.packing_utils.dequantize_gemm (its
own dequantization). GPTQ has no tool here: gptqmodel does not install (its build needs CUDA),
so GPTQ is tested against its spec.
"""
from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import torch
from safetensors.torch import save_file

OUT = Path(__file__).resolve().parents[1] / "tests" / "models" / "fixtures" / "quant_layers.safetensors"


def ct_layer(prefix: str, weight: torch.Tensor, bits: int, strategy: str, group: int | None, symmetric: bool,
             packed: bool) -> dict[str, torch.Tensor]:
    from compressed_tensors.compressors.naive_quantized.base import NaiveQuantizationCompressor
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy=strategy, group_size=group)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    out_features, in_features = weight.shape
    g = group or in_features
    w = weight.reshape(out_features, in_features // g, g)  # [out, G, group]
    scale, zero = calculate_qparams(w.amin(-1), w.amax(-1), args)
    state = {"weight": weight, "weight_scale": scale, "weight_zero_point": zero}
    compressor = PackedQuantizationCompressor if packed else NaiveQuantizationCompressor
    compressed = compressor.compress(state, scheme)
    reference = compressor.decompress(dict(compressed), scheme)["weight"]
    return {**{f"{prefix}.{k}": v.contiguous() for k, v in compressed.items()},
            f"{prefix}.dequantized": reference.float().contiguous()}


def ct_fp8_layer(prefix: str, weight: torch.Tensor, x: torch.Tensor, strategy: str, act: str,
                 block: tuple[int, int] = (16, 16)) -> dict[str, torch.Tensor]:
    """An FP8 (float-quantized) layer: compressed-tensors' weight scales (calculate_qparams),
    compression and decompression, and its fake quantization of the activations ``x``
    ([1, tokens, in], as a model's Linear sees them) with the scheme's input_activations."""
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, compute_dynamic_scales_and_zp
    w_args = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy=strategy,
                              block_structure=list(block) if strategy == "block" else None)
    a_args = {"static": QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="tensor", dynamic=False),
              "token": QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="token", dynamic=True),
              "group": QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="group", dynamic=True,
                                        group_size=block[1])}[act]
    scheme = QuantizationScheme(targets=["Linear"], weights=w_args, input_activations=a_args)
    out_features, in_features = weight.shape
    if strategy == "block":
        wb = weight.reshape(out_features // block[0], block[0], in_features // block[1], block[1])
        lo, hi = wb.amin(dim=(1, 3)), wb.amax(dim=(1, 3))  # [out / bn, in / bk]
    elif strategy == "channel":
        lo, hi = weight.amin(1, keepdim=True), weight.amax(1, keepdim=True)  # [out, 1]
    else:
        lo, hi = weight.amin().reshape(1), weight.amax().reshape(1)
    scale, zero = calculate_qparams(lo, hi, w_args)
    compressed = FloatQuantizationCompressor.compress({"weight": weight, "weight_scale": scale,
                                                      "weight_zero_point": zero}, scheme)
    reference = FloatQuantizationCompressor.decompress(dict(compressed), scheme)["weight"]
    if act == "static":
        a_scale, a_zero = calculate_qparams(x.amin().reshape(1), x.amax().reshape(1), a_args)
        compressed["input_scale"] = a_scale
    else:
        a_scale, a_zero = compute_dynamic_scales_and_zp(x, a_args, torch.nn.Linear(1, 1))
    x_quantized = fake_quantize(x, a_scale, a_zero, a_args)
    return {**{f"{prefix}.{k}": v.contiguous() for k, v in compressed.items()},
            f"{prefix}.dequantized": reference.float().contiguous(), f"{prefix}.x": x[0].contiguous(),
            f"{prefix}.x_quantized": x_quantized[0].float().contiguous()}


def _import_awq_gemm():
    """AutoAWQ's GEMM module without the package __init__ (which imports datasets, models...)."""
    root = Path(importlib.util.find_spec("awq").origin).parent
    for name in ("awq", "awq.modules", "awq.modules.linear", "awq.utils"):
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(root / Path(*name.split(".")[1:]))]
        sys.modules[name] = pkg
    from awq.modules.linear.gemm import WQLinear_GEMM
    from awq.utils.packing_utils import dequantize_gemm
    return WQLinear_GEMM, dequantize_gemm


def awq_layer(prefix: str, weight: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    WQLinear_GEMM, dequantize_gemm = _import_awq_gemm()
    out_features, in_features = weight.shape
    w = weight.reshape(out_features, in_features // group, group)  # [out, G, group]
    lo, hi = w.amin(-1), w.amax(-1)
    scales = ((hi - lo).clamp(min=1e-5) / 15).half()  # AutoAWQ's pseudo_quantize_tensor (zero_point=True)
    zeros = (-torch.round(lo / scales.float())).clamp(0, 15)
    linear = torch.nn.Linear(in_features, out_features, bias=False)
    linear.weight.data.copy_(weight)
    q = WQLinear_GEMM.from_linear(linear, 4, group, scales=scales.t().contiguous(), zeros=zeros.t().contiguous())
    reference = dequantize_gemm(q.qweight, q.qzeros, q.scales, 4, group)  # [in, out]
    return {f"{prefix}.qweight": q.qweight, f"{prefix}.qzeros": q.qzeros, f"{prefix}.scales": q.scales,
            f"{prefix}.dequantized": reference.t().float().contiguous()}


def main() -> None:
    g = torch.Generator().manual_seed(0)
    w = lambda o, i: torch.randn(o, i, generator=g) * 0.05  # noqa: E731
    tensors = {
        **ct_layer("ct_w4_group32_asym_packed", w(40, 96), 4, "group", 32, False, True),
        **ct_layer("ct_w4_group64_sym_packed", w(24, 128), 4, "group", 64, True, True),
        **ct_layer("ct_w8_channel_sym_packed", w(24, 72), 8, "channel", None, True, True),
        **ct_layer("ct_w8_channel_asym_packed", w(16, 40), 8, "channel", None, False, True),
        **ct_layer("ct_w4_group32_asym_naive", w(16, 64), 4, "group", 32, False, False),
        **awq_layer("awq_group32", w(64, 96), 32),
        **ct_fp8_layer("ct_fp8_tensor_static", w(24, 48), torch.randn(1, 5, 48, generator=g), "tensor", "static"),
        **ct_fp8_layer("ct_fp8_channel_token", w(40, 72), torch.randn(1, 6, 72, generator=g), "channel", "token"),
        **ct_fp8_layer("ct_fp8_block16_group", w(48, 64), torch.randn(1, 7, 64, generator=g), "block", "group"),
    }
    import compressed_tensors
    meta = {"compressed_tensors": compressed_tensors.__version__, "autoawq": importlib.metadata.version("autoawq"),
            "torch": torch.__version__, "made_by": "scripts/make_quant_fixtures.py"}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(OUT), metadata=meta)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes): {sorted(tensors)}")


if __name__ == "__main__":
    import importlib.metadata
    main()

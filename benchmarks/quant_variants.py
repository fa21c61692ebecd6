"""Pre-quantized copies of a float checkpoint, for benchmarks that compare formats in one run.

``throughput.py --quantization none,int4,gptq-w4g128`` loads each name's model side by side:
``none`` and the engine's own methods (``int8``, ``int4``: quantized at load) run the checkpoint
as it is; a name of :data:`VARIANTS` runs a copy written here once (next to the benchmark's
cached models) in that format, which the engine then loads as it loads a downloaded one:

    gptq-w4g128   GPTQ v1 4-bit, group 128, symmetric, no act order (AutoGPTQ / gptqmodel layout)
    ct-w4a16      compressed-tensors ``pack-quantized`` W4A16, group 128, symmetric (llm-compressor's)
    ct-w8a16      compressed-tensors ``pack-quantized`` W8A16, group 128, symmetric
    fp8-w8a16     compressed-tensors ``float-quantized`` FP8 e4m3 weights, per-channel scales, float
                  activations (llm-compressor's FP8 W8A16 scheme)
    fp8-b128      ``quant_method: fp8`` with ``weight_block_size: [128, 128]`` and dynamic activations
                  (e4m3 per token and 128 inputs), as DeepSeek / Qwen FP8 checkpoints ship

The codes (and fp8 values) are round-to-nearest from the float weights (not the GPTQ algorithm: for speed the
layout is what counts, and greedy outputs are compared against the float model only as a hint).
The packing is the formats' published layout, as tests/models/test_quantized_checkpoints.py
writes its checkpoints with these same packers (pinned there against the tools' packing and transformers).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from common import CACHE_DIR  # noqa: F401  (also puts this checkout's pagedllm first on sys.path)
from safetensors.torch import load_file, save_file

from pagedllm.layers import quantization
from pagedllm.layers.quantization.base import pack_int32

GROUP = 128
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
VARIANTS = ("gptq-w4g128", "ct-w4a16", "ct-w8a16", "fp8-w8a16", "fp8-b128")
CHOICES = ("none", *quantization.METHODS, *VARIANTS)


def parse_quantizations(text: str) -> list[str]:
    """``"none,int8,int4"`` -> ``["none", "int8", "int4"]``; refuses unknown, repeated or no names."""
    names = [n.strip() for n in text.split(",")]
    unknown = [n for n in names if n not in CHOICES]
    problem = ("no method" if not text.strip() else f"{unknown} not allowed" if unknown else
               "a method named twice" if len(set(names)) != len(names) else None)
    if problem:
        raise ValueError(f"--quantization={text!r}: {problem}; give one or a comma list (each once) of {CHOICES}")
    return names


def engine_quantization(name: str) -> str | None:
    """The ``quantization=`` the engine gets for ``name``: None for ``none`` and for a variant
    (the copy's config.json says its format)."""
    return None if name == "none" or name in VARIANTS else name


def variant_dir(model_dir: Path, name: str) -> Path:
    """Where ``name``'s model lives: ``model_dir`` itself, or its written copy for a variant."""
    return CACHE_DIR / f"{model_dir.name}-{name}" if name in VARIANTS else model_dir


# --- the formats' published layouts (tests/models/test_quantized_checkpoints.py writes its
# checkpoints with these too, and pins them against the tools and transformers) ------------

def quantize_groups(w: torch.Tensor, bits: int, group: int, sym: bool):
    """(codes [out, in], scale [out, G] (float16-exact), zero [out, G]) over contiguous groups."""
    out_features, in_features = w.shape
    g = in_features if group == -1 else group
    wg = w.reshape(out_features, in_features // g, g)  # [out, G, group]
    maxq = 2**bits - 1
    if sym:
        scale = wg.abs().amax(-1) / (2 ** (bits - 1) - 1)
        zero = torch.full_like(scale, 2 ** (bits - 1))
    else:
        lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
        scale = (hi - lo) / maxq
    scale = scale.clamp(min=1e-6).half().float()  # GPTQ and AWQ store float16 scales
    if not sym:
        zero = torch.round(-lo / scale).clamp(1, maxq)  # >= 1: GPTQ v1 stores zero - 1
    codes = torch.clamp(torch.round(wg / scale[..., None]) + zero[..., None], 0, maxq)
    return codes.reshape(out_features, in_features).long(), scale, zero


def gptq_tensors(codes, scale, zero, g_idx, bits, v2):
    return {"qweight": pack_int32(codes.t(), bits, dim=0), "qzeros": pack_int32((zero - (0 if v2 else 1)).t().long(),
            bits, dim=1), "scales": scale.t().half().contiguous(), "g_idx": g_idx}


def ct_packed_tensors(codes, scale, zero, g_idx, bits, sym):
    t = {"weight_packed": pack_int32(codes, bits, dim=1), "weight_scale": scale,
         "weight_shape": torch.tensor(list(codes.shape))}
    if not sym:
        t["weight_zero_point"] = pack_int32(zero.long(), bits, dim=0)
    return t


def gptq_config(bits, group, sym, act_order, fmt):
    return {"quant_method": "gptq", "bits": bits, "group_size": group, "sym": sym, "desc_act": act_order,
            "checkpoint_format": fmt}


def ct_config(bits, group, sym, fmt):
    weights = {"num_bits": bits, "type": "int", "symmetric": sym, "dynamic": False,
               "strategy": "channel" if group == -1 else "group", "group_size": None if group == -1 else group}
    return {"quant_method": "compressed-tensors", "format": fmt, "ignore": ["lm_head"], "config_groups": {
        "group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None, "format": fmt}}}


def quantize_fp8(w: torch.Tensor, block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 weight [out, in], scale, the scale spread over the weight [out, in] or [out, 1]):
    per-channel scales [out, 1] (``block`` None) or one per ``block`` = (rows, inputs) tile
    [ceil(out / rows), in / inputs]; scale = amax / 448 (e4m3's max), as llm-compressor and
    transformers' FineGrainedFP8 compute it."""
    out_features, in_features = w.shape
    if block is None:
        scale = (w.abs().amax(dim=1, keepdim=True) / 448).clamp(min=1e-12)  # [out, 1]
        full = scale
    else:
        bn, bk = block
        tiles = -(-out_features // bn)
        padded = torch.cat([w, w.new_zeros(tiles * bn - out_features, in_features)])  # [tiles * bn, in]
        amax = padded.reshape(tiles, bn, in_features // bk, bk).abs().amax(dim=(1, 3))  # [tiles, in / bk]
        scale = (amax / 448).clamp(min=1e-12)
        full = scale.repeat_interleave(bn, 0)[:out_features].repeat_interleave(bk, 1)  # [out, in]
    return (w / full).clamp(-448, 448).to(torch.float8_e4m3fn), scale, full


def dequantize(name: str, w: torch.Tensor) -> torch.Tensor:
    """The float weight that ``name``'s copy of ``w`` stands for (what transformers computes with)."""
    if name.startswith("fp8"):
        q, _, full = quantize_fp8(w.float(), FP8_BLOCK if name == "fp8-b128" else None)
        return q.float() * full
    bits = 8 if name == "ct-w8a16" else 4
    codes, scale, zero = quantize_groups(w.float(), bits, GROUP, sym=True)
    grouped = (codes - zero.repeat_interleave(GROUP, 1)).float().view(w.shape[0], -1, GROUP)  # [out, G, GROUP]
    return (grouped * scale[..., None]).view(w.shape)


def _gptq_w4g128(w: torch.Tensor) -> dict[str, torch.Tensor]:
    codes, scale, zero = quantize_groups(w.float(), 4, GROUP, sym=True)
    return gptq_tensors(codes, scale, zero, (torch.arange(w.shape[1]) // GROUP).int(), 4, v2=False)


def _ct_packed(bits: int):
    def write(w: torch.Tensor) -> dict[str, torch.Tensor]:
        codes, scale, zero = quantize_groups(w.float(), bits, GROUP, sym=True)
        return ct_packed_tensors(codes, scale, zero, None, bits, sym=True)
    return write


def _fp8_w8a16(w: torch.Tensor) -> dict[str, torch.Tensor]:
    q, scale, _ = quantize_fp8(w.float(), None)
    return {"weight": q, "weight_scale": scale}


def _fp8_b128(w: torch.Tensor) -> dict[str, torch.Tensor]:
    q, scale, _ = quantize_fp8(w.float(), FP8_BLOCK)
    return {"weight": q, "weight_scale_inv": scale}


FP8_BLOCK = (128, 128)
FP8_W8A16_CONFIG = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
                    "config_groups": {"group_0": {"targets": ["Linear"], "format": "float-quantized",
                                                  "input_activations": None,
                                                  "weights": {"num_bits": 8, "type": "float", "symmetric": True,
                                                              "dynamic": False, "strategy": "channel"}}}}
WRITERS = {"gptq-w4g128": (_gptq_w4g128, gptq_config(4, GROUP, True, False, "gptq")),
           "ct-w4a16": (_ct_packed(4), ct_config(4, GROUP, True, "pack-quantized")),
           "ct-w8a16": (_ct_packed(8), ct_config(8, GROUP, True, "pack-quantized")),
           "fp8-w8a16": (_fp8_w8a16, FP8_W8A16_CONFIG),
           "fp8-b128": (_fp8_b128, {"quant_method": "fp8", "activation_scheme": "dynamic",
                                    "weight_block_size": list(FP8_BLOCK)})}


def ensure_variant(model_dir: Path, name: str) -> Path:
    """The model of ``name``: ``model_dir``, or its variant copy, written once (reused after)."""
    dst = variant_dir(model_dir, name)
    if name not in VARIANTS or (dst / "config.json").exists():
        return dst
    writer, qcfg = WRITERS[name]
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    state = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(str(f)))
    for n in [n for n in state if n.endswith(".weight") and n.rsplit(".", 2)[-2] in PROJECTIONS]:
        w = state.pop(n)
        state.update({f"{n[:-len('.weight')]}.{k}": v.contiguous() for k, v in writer(w).items()})
    for f in model_dir.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and not f.name.endswith(".index.json"):
            shutil.copy(f, tmp / f.name)
    save_file(state, str(tmp / "model.safetensors"))
    config = json.loads((tmp / "config.json").read_text())
    (tmp / "config.json").write_text(json.dumps({**config, "quantization_config": qcfg}, indent=2))
    os.replace(tmp, dst)
    print(f"wrote the {name} copy of {model_dir.name} to {dst}")
    return dst

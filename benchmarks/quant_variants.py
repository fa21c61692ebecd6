"""Pre-quantized copies of a float checkpoint, for benchmarks that compare formats in one run.

``throughput.py --quantization none,int4,gptq-w4g128`` loads each name's model side by side:
``none`` and the engine's own methods (``int8``, ``int4``: quantized at load) run the checkpoint
as it is; a name of :data:`VARIANTS` runs a copy written here once (next to the benchmark's
cached models) in that format, which the engine then loads as it loads a downloaded one:

    gptq-w4g128   GPTQ v1 4-bit, group 128, symmetric, no act order (AutoGPTQ / gptqmodel layout)
    ct-w4a16      compressed-tensors ``pack-quantized`` W4A16, group 128, symmetric (llm-compressor's)

The codes are round-to-nearest from the float weights (not the GPTQ algorithm: for speed the
layout is what counts, and greedy outputs are compared against the float model only as a hint).
The packing is the formats' published layout, as tests/models/test_quantized_checkpoints.py
writes it (those tests pin it against the tools' own packing and against transformers).
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
GPTQ_CONFIG = {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "sym": True, "desc_act": False,
               "checkpoint_format": "gptq"}
CT_WEIGHTS = {"num_bits": 4, "type": "int", "symmetric": True, "dynamic": False, "strategy": "group",
              "group_size": GROUP}
CT_CONFIG = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
             "config_groups": {"group_0": {"targets": ["Linear"], "weights": CT_WEIGHTS, "input_activations": None,
                                           "format": "pack-quantized"}}}
VARIANTS = ("gptq-w4g128", "ct-w4a16")
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


def quantize_sym4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes in [0, 15] (zero 8) [out, in] and float16-exact scales [out, in / GROUP], round to nearest."""
    out_f, in_f = w.shape
    wg = w.float().reshape(out_f, in_f // GROUP, GROUP)  # [out, groups, GROUP]
    scale = (wg.abs().amax(-1) / 7).clamp(min=1e-6).half().float()  # GPTQ stores float16 scales
    codes = torch.clamp(torch.round(wg / scale[..., None]) + 8, 0, 15)
    return codes.reshape(out_f, in_f).long(), scale


def gptq_tensors(w: torch.Tensor) -> dict[str, torch.Tensor]:
    codes, scale = quantize_sym4(w)
    zeros = torch.full(scale.shape, 8 - 1, dtype=torch.long)  # v1 stores zero - 1
    return {"qweight": pack_int32(codes.t(), 4, dim=0), "qzeros": pack_int32(zeros.t(), 4, dim=1),
            "scales": scale.t().half().contiguous(), "g_idx": (torch.arange(w.shape[1]) // GROUP).int()}


def ct_tensors(w: torch.Tensor) -> dict[str, torch.Tensor]:
    codes, scale = quantize_sym4(w)
    return {"weight_packed": pack_int32(codes, 4, dim=1), "weight_scale": scale,
            "weight_shape": torch.tensor(list(codes.shape))}


WRITERS = {"gptq-w4g128": (gptq_tensors, GPTQ_CONFIG), "ct-w4a16": (ct_tensors, CT_CONFIG)}


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

"""PEFT LoRA checkpoints: ``adapter_config.json`` + ``adapter_model.safetensors`` (never a pickle).

A PEFT tensor is named ``base_model.model.<module>.lora_A.weight`` (``[r, in]``) or
``...lora_B.weight`` (``[out, r]``); the adapter adds ``scale * x @ A.T @ B.T`` to the module's
output, ``scale = lora_alpha / r`` (rsLoRA: ``lora_alpha / sqrt(r)``). What pagedllm cannot
compute exactly is refused with a ValueError naming the adapter and the field or module:
DoRA, trained biases, per-module rank / alpha patterns, ``modules_to_save`` (whole copies of
embeddings or the LM head) and embedding adapters.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch
from safetensors import safe_open

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# the projections an adapter may target (Hugging Face names), as they sit in a decoder layer
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_TENSOR_NAME = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[\w-]+)?\.weight$")
_LAYER_MODULE = re.compile(r"^model\.layers\.(?P<layer>\d+)\.(?:self_attn|mlp)\.(?P<proj>\w+)$")


@dataclass(frozen=True)
class AdapterConfig:
    """What the engine needs from ``adapter_config.json``."""

    rank: int
    scale: float  # lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora


@dataclass(frozen=True)
class LoRAWeights:
    """An adapter's tensors by module name (``model.layers.3.self_attn.q_proj``): ``(A [r, in], B [out, r])``."""

    config: AdapterConfig
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]


def read_adapter_config(path: str) -> AdapterConfig:
    """Parses and checks ``adapter_config.json`` (ValueError naming the field for what is refused)."""
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(file):
        raise ValueError(f"lora_path={path!r} is not a PEFT adapter: no {CONFIG_FILE} there")
    try:
        cfg = json.loads(open(file, encoding="utf-8").read())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"lora_path={path!r}: {CONFIG_FILE} is unreadable ({e})") from None
    peft_type = cfg.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"lora_path={path!r}: peft_type={peft_type!r} is not supported (only LORA)")
    refused = {"use_dora": "DoRA adapters", "modules_to_save": "modules_to_save (whole copies of embeddings or "
               "the LM head, e.g. for an extended vocabulary)", "rank_pattern": "per-module ranks",
               "alpha_pattern": "per-module alphas", "layers_to_transform": "adapters on some layers only",
               "fan_in_fan_out": "fan_in_fan_out (Conv1D weights)", "lora_bias": "trained biases on lora_B",
               "trainable_token_indices": "trained embedding rows", "target_parameters": "adapters on raw "
               "parameters (MoE experts)", "layer_replication": "replicated layers",
               "alora_invocation_tokens": "activated LoRA (aLoRA)"}
    for key, what in refused.items():
        if cfg.get(key):
            raise ValueError(f"lora_path={path!r}: {key}={cfg[key]!r} is not supported: {what}")
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"lora_path={path!r}: bias={cfg['bias']!r} is not supported (only 'none': trained "
                         "biases change the base model)")
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"lora_path={path!r}: r={rank!r} must be an integer >= 1")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise ValueError(f"lora_path={path!r}: lora_alpha={alpha!r} must be a number")
    scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    return AdapterConfig(rank, float(scale))


def tensor_names(path: str) -> dict[str, tuple[str, str]]:
    """Every tensor of the adapter file: name -> (module, "A" or "B"); refuses embedding adapters
    and anything else that is not a LoRA factor."""
    file = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(file):
        raise ValueError(f"lora_path={path!r}: no {WEIGHTS_FILE} there (pickled adapter_model.bin is never loaded)")
    out = {}
    with safe_open(file, framework="pt") as f:
        for name in f.keys():
            if "lora_embedding" in name:
                raise ValueError(f"lora_path={path!r}: {name} is an embedding adapter, which is not supported")
            m = _TENSOR_NAME.match(name)
            if m is None:
                raise ValueError(f"lora_path={path!r}: tensor {name} is not a LoRA factor (lora_A / lora_B); "
                                 "modules_to_save copies are not supported")
            out[name] = (m["module"], m["ab"])
    return out


def target_of(path: str, module: str) -> tuple[int, str]:
    """``model.layers.3.self_attn.q_proj`` -> (3, "q_proj"); other modules are refused by name."""
    m = _LAYER_MODULE.match(module)
    if m is None or m["proj"] not in TARGET_MODULES:
        raise ValueError(f"lora_path={path!r}: module {module} is not supported as a LoRA target (supported: "
                         f"{', '.join(TARGET_MODULES)} of the decoder layers)")
    return int(m["layer"]), m["proj"]


def check_shapes(path: str, shapes: dict[str, tuple[int, int]], num_layers: int, max_rank: int) -> AdapterConfig:
    """Checks an adapter against the base model without reading its tensors' data: its rank is
    at most ``max_rank``, each module is a supported target of an existing layer, and each
    factor's shape fits it (``shapes``: projection -> (in_features, out_features) of the whole,
    unsharded model); ValueError naming the module otherwise."""
    config = read_adapter_config(path)
    if config.rank > max_rank:
        raise ValueError(f"lora_path={path!r}: rank r={config.rank} exceeds max_lora_rank={max_rank}; start the "
                         "engine with a larger max_lora_rank")
    names = tensor_names(path)
    seen: dict[str, set[str]] = {}
    with safe_open(os.path.join(path, WEIGHTS_FILE), framework="pt") as f:
        for name, (module, ab) in names.items():
            layer, proj = target_of(path, module)
            if layer >= num_layers or proj not in shapes:
                raise ValueError(f"lora_path={path!r}: module {module} does not exist in the base model")
            fan_in, fan_out = shapes[proj]
            want = (config.rank, fan_in) if ab == "A" else (fan_out, config.rank)
            got = tuple(f.get_slice(name).get_shape())
            if got != want:
                raise ValueError(f"lora_path={path!r}: {name} has shape {list(got)}, but module {module} of the base "
                                 f"model needs {list(want)} (an adapter for another base model?)")
            seen.setdefault(module, set()).add(ab)
    for module, parts in seen.items():
        if parts != {"A", "B"}:
            raise ValueError(f"lora_path={path!r}: module {module} has lora_{''.join(parts)} only; both lora_A and "
                             "lora_B are needed")
    if not seen:
        raise ValueError(f"lora_path={path!r}: the adapter holds no LoRA tensors")
    return config


def load_weights(path: str) -> LoRAWeights:
    """The adapter's factors as float32 CPU tensors (already checked by ``check_shapes``)."""
    config = read_adapter_config(path)
    factors: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(os.path.join(path, WEIGHTS_FILE), framework="pt") as f:
        for name, (module, ab) in tensor_names(path).items():
            factors.setdefault(module, {})[ab] = f.get_tensor(name).float()
    return LoRAWeights(config, {m: (t["A"], t["B"]) for m, t in factors.items()})


def module_shapes(hf_config) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each target projection of a dense decoder layer, from its
    config (MoE layers have no single gate/up/down projection: only attention is targetable)."""
    hidden, heads = hf_config.hidden_size, hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    kv = getattr(hf_config, "num_key_value_heads", None) or heads
    shapes = {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv * head_dim),
              "v_proj": (hidden, kv * head_dim), "o_proj": (heads * head_dim, hidden)}
    experts = any(getattr(hf_config, k, 0) for k in ("num_experts", "num_local_experts", "n_routed_experts"))
    if not experts:
        inter = hf_config.intermediate_size
        shapes.update(gate_proj=(hidden, inter), up_proj=(hidden, inter), down_proj=(inter, hidden))
    return shapes

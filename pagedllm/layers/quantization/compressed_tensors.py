"""compressed-tensors checkpoints (``quant_method: compressed-tensors``, as llm-compressor
writes them): weight-only integer schemes (W4A16, W8A16), ``pack-quantized`` or
``naive-quantized``, ``group`` or ``channel`` strategy, symmetric or not.

Per linear layer (compressed_tensors/compressors/pack_quantized/helpers.py, ``pack_to_int32``):

    weight_packed      int32 [out, in / (32 / bits)]  signed codes + 2^(bits-1), packed along
                                                      the input dimension, lowest bits first
    weight_scale       float [out, G]                 G = in / group_size (channel: 1)
    weight_zero_point  [out / (32 / bits), G] int32   asymmetric only: signed zero points,
                                                      packed the same way along dimension 0
    weight_g_idx       int32 [in]                     act-order "group" only
    weight_shape       int64 [2]                      the unpacked [out, in]

    W[o, i] = (code[o, i] - zero[o, g]) * scale[o, g]

``naive-quantized`` stores the signed codes unpacked as int8 ``weight`` (and int8 zero points).
Signed codes and zero points are moved to unsigned by adding 2^(bits-1) to both, which leaves
W unchanged. ``float-quantized`` (FP8 weights, FP8 or float activations) is read by ``fp8.py``;
integer activation quantization and sparsity are refused.

``kv_cache_scheme`` (llm-compressor's FP8 KV cache): static symmetric float8, per tensor or per
attention head,

    {"num_bits": 8, "type": "float", "strategy": "tensor" | "attn_head", "symmetric": true, "dynamic": false, ...}

with one scale per attention layer (per KV head of it with ``attn_head``) for its keys and one for
its values, ``k = fp8(k / k_scale)`` (after rotary) as the FP8 KV cache of
``attention/kv_quant.py`` stores them. compressed-tensors registers them on the attention module
(``initialize_attn_qparams``: ``self_attn.k_scale`` / ``v_scale``, shape ``[1]``, or
``[num_key_value_heads, 1, 1]`` per head); older releases quantized the outputs of ``k_proj`` / ``v_proj``
(``self_attn.k_proj.output_scale``), which ``kv_quant.checkpoint_scale_name`` renames as vLLM's
``get_cache_scale`` does. A checkpoint with a ``kv_cache_scheme`` and no ``config_groups`` has
float weights (:meth:`CompressedTensorsMethod.kv_cache_only`). As in vLLM the scales take
effect with ``kv_cache_dtype="fp8"``; the default "auto" keeps the model's dtype for the cache
and leaves them unused. Any other KV scheme (integer, other widths, per-token or per-channel,
asymmetric, dynamic) is refused.
"""
from __future__ import annotations

import torch

from pagedllm.layers.quantization.base import unpack_int32
from pagedllm.layers.quantization.checkpoint import CheckpointMethod, CheckpointTensor
from pagedllm.layers.quantization.config import require, require_choice
from pagedllm.layers.quantization.fp8 import Fp8Method

FORMATS = ("pack-quantized", "naive-quantized", "float-quantized")
STRATEGIES = ("group", "channel")
# modules outside pagedllm's quantized projections that a checkpoint may leave unquantized
IGNORABLE = ("lm_head",)
# the kv_cache_schemes read (module docstring), each field's allowed values; a missing field takes
# compressed-tensors' QuantizationArgs default (a missing strategy without groups resolves to
# "tensor" there)
KV_CACHE_SCHEME = {"num_bits": (8,), "type": ("float",), "strategy": ("tensor", "attn_head"), "symmetric": (True,),
                   "dynamic": (False,), "group_size": (None,)}
KV_CACHE_DEFAULTS = {"num_bits": 8, "type": "int", "strategy": "tensor", "symmetric": True, "dynamic": False,
                     "group_size": None}


def check_kv_cache_scheme(scheme: dict | None) -> None:
    """Refuses a ``kv_cache_scheme`` other than static symmetric FP8 per tensor or per attention
    head, naming the field."""
    if scheme is None:
        return
    require(isinstance(scheme, dict), "kv_cache_scheme", scheme, "null or an FP8 per-tensor / per-head scheme")
    for field, allowed in KV_CACHE_SCHEME.items():
        value = scheme.get(field, KV_CACHE_DEFAULTS[field])
        require(value in allowed, f"kv_cache_scheme.{field}", value,
                f"one of {allowed!r} (only static symmetric FP8 KV caches, per tensor or per attention head)")


class CompressedTensorsMethod(CheckpointMethod):
    name = "compressed-tensors"

    def __init__(self, bits: int, group_size: int, act_order: bool, packed: bool):
        super().__init__(bits, group_size, act_order)
        self.packed = packed

    @classmethod
    def from_config(cls, cfg: dict) -> CompressedTensorsMethod | Fp8Method:
        groups = cfg.get("config_groups") or {}
        require(len(groups) == 1, "config_groups", list(groups), "exactly one scheme")
        scheme = next(iter(groups.values()))
        fmt = scheme.get("format") or cfg.get("format")
        require(fmt in FORMATS, "format", fmt, f"one of {FORMATS}")
        check_kv_cache_scheme(cfg.get("kv_cache_scheme"))
        require(not cfg.get("sparsity_config"), "sparsity_config", cfg.get("sparsity_config"), "empty")
        ignored = [m for m in cfg.get("ignore") or [] if m not in IGNORABLE]
        require(not ignored, "ignore", ignored, f"only {IGNORABLE} (every projection quantized)")
        require("Linear" in scheme.get("targets", []), "targets", scheme.get("targets"), "['Linear']")
        if fmt == "float-quantized":
            return Fp8Method.from_compressed_tensors(scheme)
        require(scheme.get("input_activations") is None, "input_activations", scheme.get("input_activations"),
                "null (weight-only integer schemes: W4A16, W8A16)")
        return cls._from_weights(scheme.get("weights") or {}, packed=fmt == "pack-quantized")

    @staticmethod
    def kv_cache_only(cfg: dict) -> bool:
        """Whether only the KV cache is quantized (a ``kv_cache_scheme``, no ``config_groups``): the
        weights are float, and the attention layers read the K/V scales."""
        if cfg.get("config_groups") or cfg.get("kv_cache_scheme") is None:
            return False
        check_kv_cache_scheme(cfg["kv_cache_scheme"])
        require(not cfg.get("sparsity_config"), "sparsity_config", cfg.get("sparsity_config"), "empty")
        return True

    @classmethod
    def _from_weights(cls, w: dict, packed: bool) -> CompressedTensorsMethod:
        require(w.get("type") == "int", "weights.type", w.get("type"), "'int'")
        bits = require_choice(w, "num_bits", (4, 8))
        strategy = w.get("strategy")
        require(strategy in STRATEGIES, "weights.strategy", strategy, f"one of {STRATEGIES}")
        require(not w.get("dynamic", False), "weights.dynamic", w.get("dynamic"), "false")
        group = w.get("group_size") if strategy == "group" else -1
        require(isinstance(group, int) and (group > 0 or strategy == "channel"), "weights.group_size", group,
                "a positive multiple of 8")
        return cls(bits, group, act_order=w.get("actorder") == "group", packed=packed)

    def checkpoint_tensors(self) -> tuple[CheckpointTensor, ...]:
        return (CheckpointTensor("weight_packed" if self.packed else "weight", "codes"),
                CheckpointTensor("weight_scale", "scale"),
                CheckpointTensor("weight_zero_point", "zero", optional=True),
                CheckpointTensor("weight_g_idx", "g_idx", optional=True),
                *([CheckpointTensor("weight_shape", "shape")] if self.packed else []))

    def convert(self, kind: str, tensor: torch.Tensor) -> torch.Tensor:
        offset = 2 ** (self.bits - 1)
        if kind == "codes":
            return unpack_int32(tensor, self.bits, dim=1) if self.packed else tensor.to(torch.int32) + offset
        if kind == "zero":
            zero = unpack_int32(tensor, self.bits, dim=0) if self.packed else tensor.to(torch.int32) + offset
            return zero.float()  # [out, G]
        if kind == "scale":
            return tensor.float()
        return tensor.to(torch.int64 if kind == "shape" else torch.int32)

"""Weight-only quantization of the linear projections: one file per format, one interface
(``base.QuantMethod``: create the checkpoint's weights, load them, process them into a runtime
layout whose kernel ``LinearBase.forward`` calls).

Made at load from float weights (``--quantization``):
    int8                per-row symmetric int8 (int8.py)
    int4                group-wise (128) symmetric int4 (int4.py)
Read from a pre-quantized checkpoint (detected from ``quantization_config`` in config.json;
``--quantization`` may name it, and refuses a checkpoint of another kind):
    gptq                GPTQ 4/8-bit, v1 and v2, act order (gptq.py)
    awq                 AWQ 4-bit GEMM layout (awq.py)
    compressed-tensors  W4A16 / W8A16 pack- or naive-quantized (compressed_tensors.py), and
                        float-quantized FP8 W8A8 / W8A16 (fp8.py)
    fp8                 FP8 e4m3 weights, per-tensor or block-wise scales, static or dynamic
                        FP8 activations (fp8.py)
    mxfp4               gpt-oss's MXFP4 experts (the projections stay float; mxfp4.py)

On CUDA the group-wise 4/8-bit layout runs the Triton dequant-in-GEMM
(``layers/triton_ops/grouped_gemm.py``), int8 its own Triton GEMM, FP8 ``torch._scaled_mm``.
"""
from __future__ import annotations

import torch

from pagedllm.layers.fused_moe import FusedMoE
from pagedllm.layers.linear import LinearBase
from pagedllm.layers.quantization.awq import AWQMethod
from pagedllm.layers.quantization.base import QuantMethod
from pagedllm.layers.quantization.checkpoint import CheckpointMethod
from pagedllm.layers.quantization.compressed_tensors import CompressedTensorsMethod
from pagedllm.layers.quantization.fp8 import Fp8Method, fp8_linear
from pagedllm.layers.quantization.gptq import GPTQMethod
from pagedllm.layers.quantization.grouped import grouped_linear
from pagedllm.layers.quantization.int4 import Int4Method
from pagedllm.layers.quantization.int8 import C_MAX_ROWS, Int8Method, int8_linear, quantize_int8
from pagedllm.layers.quantization.mxfp4 import Mxfp4Method

__all__ = ["C_MAX_ROWS", "METHODS", "check_method", "checkpoint_method", "create_weights", "fp8_linear",
           "grouped_linear",
           "int8_linear", "keeps_cpu_panels", "process_weights", "projection_layout", "quantize_int8", "quantize_model",
           "refuse_moe",
           "resolve_method"]

LOAD_TIME_METHODS = ("int8", "int4")
CHECKPOINT_METHODS = {"gptq": GPTQMethod, "awq": AWQMethod, "compressed-tensors": CompressedTensorsMethod,
                      "fp8": Fp8Method, "mxfp4": Mxfp4Method}
METHODS = (*LOAD_TIME_METHODS, *CHECKPOINT_METHODS)


def check_method(method: str | None) -> str | None:
    if method is not None and method not in METHODS:
        raise ValueError(f"quantization={method!r} is not supported; use None or one of {METHODS}")
    return method


def _quant_config(hf_config) -> dict | None:
    """``quantization_config`` of a transformers config object or a parsed config.json dict."""
    if isinstance(hf_config, dict):
        cfg = hf_config.get("quantization_config")
    else:
        cfg = getattr(hf_config, "quantization_config", None)
    if cfg is not None and not isinstance(cfg, dict):
        cfg = cfg.to_dict()
    return cfg or None


def checkpoint_method_name(hf_config) -> str | None:
    """The checkpoint's ``quantization_config.quant_method`` (normalized), None if its weights are
    not quantized (none of it is, or only its KV cache: the attention layers read those scales);
    refuses methods that are not supported."""
    cfg = _quant_config(hf_config)
    if cfg is None:
        return None
    name = str(cfg.get("quant_method", "")).lower().replace("_", "-")
    if name not in CHECKPOINT_METHODS:
        raise ValueError(f"quantization_config.quant_method={cfg.get('quant_method')!r} is not supported; "
                         f"allowed: {tuple(CHECKPOINT_METHODS)}")
    if name == "compressed-tensors" and CompressedTensorsMethod.kv_cache_only(cfg):
        return None
    return name


def resolve_method(requested: str | None, hf_config) -> str | None:
    """The quantization the engine runs: the checkpoint's own, or ``requested``. Refuses a
    request the checkpoint contradicts (a checkpoint format it is not, or int8/int4 on
    already-quantized weights)."""
    check_method(requested)
    found = checkpoint_method_name(hf_config)
    if found is not None and requested not in (None, found):
        raise ValueError(f"quantization={requested!r}, but the checkpoint is quantized with {found!r} "
                         "(quantization_config in config.json); pass quantization=None or the checkpoint's method")
    if found is None and requested in CHECKPOINT_METHODS:
        raise ValueError(f"quantization={requested!r} needs a checkpoint quantized that way; this one has no "
                         f"quantization_config (quantize at load with one of {LOAD_TIME_METHODS})")
    return requested or found


def checkpoint_method(hf_config) -> QuantMethod | None:
    """The checkpoint's format with its settings validated, or None for float checkpoints."""
    name = checkpoint_method_name(hf_config)
    return None if name is None else CHECKPOINT_METHODS[name].from_config(_quant_config(hf_config))


def projection_layout(method: str | None, hf_config) -> tuple[int, int, int] | None:
    """``(bits, group size, float bytes per group)`` of the projections with ``method`` (resolved:
    :func:`resolve_method`); group -1: one group per output row. None: float weights. For memory
    estimates (``pagedllm plan``): int8 keeps a scale per row, the group-wise layout a scale and
    a scaled zero per group, fp8 a scale per group."""
    if method in (None, "mxfp4"):  # mxfp4: only the experts are quantized, the projections are float
        return None
    if method == "int8":
        return 8, -1, 4
    if method == "int4":
        return 4, Int4Method.group_size, 8
    fmt = checkpoint_method(hf_config)
    return fmt.bits, fmt.group_size, getattr(fmt, "scale_bytes_per_group", 8)


def keeps_cpu_panels(method: str | None, hf_config) -> bool:
    """Whether ``method`` (resolved: :func:`resolve_method`) installs the group-wise 4/8-bit layout
    (``grouped.install``), which on the CPU also keeps a panel copy of each projection."""
    if method in (None, "int8", "mxfp4"):
        return False
    return method == "int4" or isinstance(checkpoint_method(hf_config), CheckpointMethod)


def _linear_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(m, LinearBase)]


def create_weights(model: torch.nn.Module, method: QuantMethod) -> None:
    """Gives every projection the parameters ``method``'s checkpoint holds (before loading)."""
    for layer in _linear_layers(model):
        method.create_weights(layer)


def process_weights(model: torch.nn.Module, method: QuantMethod) -> int:
    """Converts every projection to ``method``'s runtime layout; returns how many."""
    layers = _linear_layers(model)
    for layer in layers:
        method.process_weights(layer)
        layer.packed_weight = None
    return len(layers)


def refuse_moe(method: str, model_name: str) -> None:
    """Load-time ``int8`` / ``int4`` quantize linear projections only; a mixture-of-experts model's
    experts would stay float, so the engine (and ``pagedllm plan``) refuse rather than half-apply it."""
    raise ValueError(f"quantization={method!r} covers linear projections only, not the experts of a "
                     f"mixture-of-experts model ({model_name}); leave quantization unset")


def quantize_model(model: torch.nn.Module, method: str | None) -> int:
    """Quantizes every projection (not embeddings or the LM head) at load with ``int8`` or
    ``int4``; returns how many. Checkpoint formats were converted while loading: 0."""
    if check_method(method) not in LOAD_TIME_METHODS:
        return 0
    if any(isinstance(m, FusedMoE) for m in model.modules()):  # refused, not half-applied
        refuse_moe(method, type(model).__name__)
    return process_weights(model, Int8Method() if method == "int8" else Int4Method())

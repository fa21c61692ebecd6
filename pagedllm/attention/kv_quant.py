"""FP8 KV cache (``kv_cache_dtype="fp8"`` / ``"fp8_e4m3"`` / ``"fp8_e5m2"``): per-tensor scales.

Each attention layer keeps one float32 scale for its keys and one for its values (vLLM's
``k_scale`` / ``v_scale``): the cache stores ``round_fp8(k / k_scale)`` and
``round_fp8(v / v_scale)``, saturated at the format's largest finite value. The scales reach
every backend the same way, folded into the tensors the backend already takes:

    softmax(q . k^T * scale) v  =  softmax((q * k_scale) . (k / k_scale)^T * scale) (v / v_scale) * v_scale

so a backend only stores the (already divided) K/V in fp8 (``to_cache_dtype``) and widens them
when it reads (the C kernel in registers, the torch and Triton kernels with a cast). The scales
are tensors, read by pointer, so CUDA graphs captured before they change stay right.

Where the scales come from: the checkpoint (``model.layers.N.self_attn.k_scale`` / ``v_scale``,
as vLLM, AutoFP8 and llm-compressor write them; older llm-compressor releases wrote
``self_attn.k_proj.output_scale`` / ``v_proj.output_scale``, renamed by
:func:`checkpoint_scale_name`), else 1.0, or, with ``calculate_kv_scales``,
from the first real batch as vLLM does: ``k_scale = max|k| / 200``, ``v_scale = max|v| / 100``
(vLLM's K_SCALE_CONSTANT / V_SCALE_CONSTANT), per layer and rank, once. The profiling forward and
CUDA-graph capture run on dummy tokens and do not count (``calibration_paused``).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

K_SCALE_CONSTANT, V_SCALE_CONSTANT = 200.0, 100.0


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in the cache's dtype; fp8 saturates at the largest finite value (a plain cast
    would turn an out-of-range value into NaN for e4m3 or inf for e5m2)."""
    if not is_fp8(dtype):
        return x.to(dtype)
    limit = torch.finfo(dtype).max
    return x.clamp(-limit, limit).to(dtype)


def add_scales(attn: nn.Module) -> None:
    """Gives an attention layer its ``k_scale`` / ``v_scale`` (1.0 unless the checkpoint has them)."""
    for name in ("k_scale", "v_scale"):
        param = nn.Parameter(torch.ones((), dtype=torch.float32), requires_grad=False)
        param.weight_loader = _load_scale
        param.optional_in_checkpoint = True
        attn.register_parameter(name, param)
    attn.calibrate_kv_scales = False


# older llm-compressor's names for the K/V scales -> the attention layer's (vLLM's get_cache_scale)
_LEGACY_SCALE_NAMES = {".self_attn.k_proj.output_scale": ".self_attn.k_scale",
                       ".self_attn.v_proj.output_scale": ".self_attn.v_scale"}


def checkpoint_scale_name(name: str) -> str:
    """The attention layer's name for a checkpoint's K/V scale tensor (other names unchanged)."""
    for legacy, current in _LEGACY_SCALE_NAMES.items():
        if name.endswith(legacy):
            return name[: -len(legacy)] + current
    return name


def _load_scale(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    if loaded.numel() != 1:
        raise ValueError(f"checkpoint KV scale of shape {tuple(loaded.shape)}: only per-tensor (one element) k_scale "
                         "/ v_scale are supported")
    param.data.copy_(loaded.reshape(()))


def scale_inputs(attn: nn.Module, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q * k_scale, k / k_scale, v / v_scale)`` for an fp8 cache (module docstring); the
    first real batch sets the scales when ``calibrate_kv_scales`` is on."""
    if attn.calibrate_kv_scales and k.shape[0] > 0:
        _calibrate(attn, k, v)
    k_scale, v_scale = attn.k_scale.to(q.dtype), attn.v_scale.to(q.dtype)
    return q * k_scale, k / k_scale, v / v_scale


def scale_output(attn: nn.Module, out: torch.Tensor) -> torch.Tensor:
    return out * attn.v_scale.to(out.dtype)


def _calibrate(attn: nn.Module, k: torch.Tensor, v: torch.Tensor) -> None:
    eps = torch.finfo(torch.float32).tiny  # an all-zero batch must not give a zero scale
    attn.k_scale.copy_((k.abs().amax().float() / K_SCALE_CONSTANT).clamp_min(eps))
    attn.v_scale.copy_((v.abs().amax().float() / V_SCALE_CONSTANT).clamp_min(eps))
    attn.calibrate_kv_scales = False


def _attention_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if hasattr(m, "calibrate_kv_scales")]


def start_calibration(model: nn.Module) -> None:
    """Every attention layer sets its scales from the next real batch it sees (calculate_kv_scales)."""
    for attn in _attention_layers(model):
        attn.calibrate_kv_scales = True


@contextlib.contextmanager
def calibration_paused(model: nn.Module) -> Iterator[None]:
    """Forwards on dummy tokens (profiling, graph capture) inside leave the scales alone."""
    layers = _attention_layers(model)
    pending = [attn.calibrate_kv_scales for attn in layers]
    for attn in layers:
        attn.calibrate_kv_scales = False
    try:
        yield
    finally:
        for attn, flag in zip(layers, pending):
            attn.calibrate_kv_scales = flag

"""FP8 KV cache (``kv_cache_dtype="fp8"`` / ``"fp8_e4m3"`` / ``"fp8_e5m2"``): per-tensor or
per-head scales.

Each attention layer keeps one float32 scale for its keys and one for its values (vLLM's
``k_scale`` / ``v_scale``), or one per KV head when the checkpoint has them per head
(llm-compressor's ``attn_head`` strategy; vLLM's ``k/v_scale = [num_kv_heads]``): the cache stores
``round_fp8(k / k_scale)`` and ``round_fp8(v / v_scale)``, saturated at the format's largest
finite value. The scales reach every backend the same way, folded into the tensors the backend
already takes (per head: query head h takes the scales of its KV head, h // group):

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
import functools
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


def add_scales(attn: nn.Module, kv_heads: range, total_kv_heads: int) -> None:
    """Gives an attention layer its ``k_scale`` / ``v_scale`` (1.0 unless the checkpoint has them):
    0-d, or ``[len(kv_heads)]`` when the checkpoint has one per head (this rank's ``kv_heads`` of
    the model's ``total_kv_heads``)."""
    for name in ("k_scale", "v_scale"):
        param = nn.Parameter(torch.ones((), dtype=torch.float32), requires_grad=False)
        param.weight_loader = functools.partial(_load_scale, kv_heads=kv_heads, total=total_kv_heads)
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


def _load_scale(param: nn.Parameter, loaded: torch.Tensor, shard_id=None, *, kv_heads: range, total: int) -> None:
    if loaded.numel() == 1:
        param.data.copy_(loaded.reshape(()))
    elif loaded.numel() == total:  # per KV head ([heads] or compressed-tensors' [heads, 1, 1]): this rank's
        param.data = loaded.reshape(total)[kv_heads.start:kv_heads.stop].to(param.device, torch.float32).clone()
    else:
        raise ValueError(f"checkpoint KV scale of shape {tuple(loaded.shape)}: k_scale / v_scale must have one "
                         f"element (per tensor) or num_key_value_heads={total} (per head)")


def scale_inputs(attn: nn.Module, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q * k_scale, k / k_scale, v / v_scale)`` for an fp8 cache (module docstring); the
    first real batch sets the scales when ``calibrate_kv_scales`` is on."""
    if attn.calibrate_kv_scales and k.shape[0] > 0:
        _calibrate(attn, k, v)
    k_scale, v_scale = attn.k_scale.to(q.dtype), attn.v_scale.to(q.dtype)
    if k_scale.dim():  # per KV head [kv_heads] against q [tokens, heads, dim], k/v [tokens, kv_heads, dim]
        return q * _per_query_head(attn, k_scale), k / k_scale[:, None], v / v_scale[:, None]
    return q * k_scale, k / k_scale, v / v_scale


def scale_output(attn: nn.Module, out: torch.Tensor) -> torch.Tensor:
    """``out * v_scale`` (``out``: the backend's ``[tokens, heads, head_dim]``)."""
    v_scale = attn.v_scale.to(out.dtype)
    if v_scale.dim():
        return out.view(out.shape[0], attn.num_heads, -1) * _per_query_head(attn, v_scale)
    return out * v_scale


def _per_query_head(attn: nn.Module, per_kv_head: torch.Tensor) -> torch.Tensor:
    """``[heads, 1]``: query head h takes its KV head's scale (heads of a GQA group are adjacent)."""
    return per_kv_head.repeat_interleave(attn.num_heads // attn.num_kv_heads)[:, None]


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

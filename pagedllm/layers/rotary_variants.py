"""RoPE beyond the Llama default: per-layer-type parameters (Gemma 3 local/global), partial
rotary (``partial_rotary_factor``) and LongRoPE (Phi-3 ``longrope`` / ``su``).

LongRoPE has two frequency sets: ``short_factor`` for sequences within
``original_max_position_embeddings`` and ``long_factor`` beyond. transformers picks one per
forward call from that call's largest position, so its KV cache can hold keys rotated either
way. A paged cache must rotate all of a sequence's keys alike, so the engine picks once, from
``max_model_len`` (as vLLM does): long factors when the engine may run past the original
length, short otherwise. Both agree with transformers whenever every forward of a sequence is
on the same side of ``original_max_position_embeddings`` as ``max_model_len``.
"""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers.rotary import RotaryEmbedding, rope_parameters

SCALED_ROPE_TYPES = ("linear", "dynamic", "llama3", "yarn", "longrope")


def layer_rope_parameters(hf_config, layer_type: str | None = None) -> dict:
    """The RoPE settings of one layer type (transformers 5 nests them per type for Gemma 3)."""
    params = rope_parameters(hf_config)
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
        params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    if params["rope_type"] == "su":  # the early name of longrope in Phi-3 checkpoints
        params["rope_type"] = "longrope"
    return params


def rotary_dim(hf_config, head_dim: int, params: dict) -> int:
    factor = params.get("partial_rotary_factor") or getattr(hf_config, "partial_rotary_factor", None) or 1.0
    return int(head_dim * factor)


def inv_freq_for(hf_config, head_dim: int, max_position: int, layer_type: str | None = None):
    """(inverse frequencies over the rotary dims, cos/sin scaling) as transformers computes them."""
    params = layer_rope_parameters(hf_config, layer_type)
    rope_type, dim = params["rope_type"], rotary_dim(hf_config, head_dim, params)
    if rope_type == "default":
        base = float(params["rope_theta"])
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), 1.0
    if rope_type not in SCALED_ROPE_TYPES:
        raise ValueError(f"rope_scaling type {rope_type!r} is not supported; use default or one of "
                         f"{SCALED_ROPE_TYPES}")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    kwargs = {"layer_type": layer_type} if layer_type is not None else {}
    original = params.get("original_max_position_embeddings")
    if rope_type == "longrope" and original and max_position > original:
        kwargs["seq_len"] = original + 1  # the long factors (see the module docstring)
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"), **kwargs)
    return inv_freq.float(), float(scaling)


def make_rotary(hf_config, head_dim: int, max_position: int, ops: str = "native",
                layer_type: str | None = None) -> nn.Module:
    """A RotaryEmbedding for the layer type, wrapped to rotate only part of each head if configured;
    ``ops``: the rotary kernel ("native" | "triton", layers/ops.py)."""
    inv_freq, scaling = inv_freq_for(hf_config, head_dim, max_position, layer_type)
    dim = 2 * inv_freq.numel()
    rotary = RotaryEmbedding(dim, max_position, inv_freq, scaling, ops)
    return rotary if dim == head_dim else PartialRotaryEmbedding(rotary, dim)


class PartialRotaryEmbedding(nn.Module):
    """Rotates the first ``rotary_dim`` channels of each head; the rest pass through unchanged."""

    def __init__(self, rotary: RotaryEmbedding, rotary_dim: int):
        super().__init__()
        self.rotary, self.rotary_dim = rotary, rotary_dim

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [num_tokens, num_heads, head_dim], k: [num_tokens, num_kv_heads, head_dim]; rotated in place."""
        q_rot, k_rot = q[..., : self.rotary_dim], k[..., : self.rotary_dim]  # views
        new_q, new_k = self.rotary(positions, q_rot, k_rot)
        if new_q.data_ptr() != q_rot.data_ptr():  # the torch path returns new tensors
            q_rot.copy_(new_q)
            k_rot.copy_(new_k)
        return q, k

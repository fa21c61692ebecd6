"""RoPE beyond the Llama default: per-layer-type parameters (Gemma 3 local/global), partial
rotary (``partial_rotary_factor``) and LongRoPE (Phi-3 ``longrope`` / ``su``).

LongRoPE has two frequency sets: ``short_factor`` for sequences within
``original_max_position_embeddings`` (L) and ``long_factor`` beyond. The engine picks per
request, and a sequence's K/V never mixes the two:

* a request of at most L tokens (prompt + output so far) rotates with the short factors; one of
  more than L with the long factors, from its first prefill chunk on;
* when a request grows past L while decoding, the scheduler recomputes its K/V with the long
  factors, as a recompute preemption does (engine/scheduler.py), and its prefix-cache hashes
  key on the factor set (kv_cache_manager.py), so it never hits a short-factor block.

That is what transformers' Phi-3 ``generate`` computes: each forward rotates with the factors
of its largest position, and ``prepare_inputs_for_generation`` drops the cache (recomputing the
whole sequence) on the step where the input first exceeds L tokens, so its cache never mixes
factors either. Recent vLLM picks one set per engine from ``max_model_len`` (the long factors
for every request when ``max_model_len`` > L, with a warning that short sequences degrade);
earlier releases switched per batch (``long_prompt_offset``: long for every token of a batch with
any position past L), so a cache could mix factors. pagedllm picked per engine too before; per
request it matches transformers on short and long requests alike, at the cost of one recompute
of a request's L tokens when it crosses L.

The rotary table then holds both sets (``make_rotary``): rows ``[0, L)`` the short factors at
positions ``0 .. L - 1``, rows ``L + p`` the long factors at position p. The runner passes a
long-factor request's positions offset by L (``long_rope_offset``), vLLM's ``long_prompt_offset``
per request, so the rotary kernels (C, Triton, torch) need no flag of their own.
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


def long_rope_offset(hf_config, max_position: int, layer_type: str | None = None) -> int | None:
    """LongRoPE's switch point L (``original_max_position_embeddings``) when sequences may pass it
    (``max_position`` > L): requests of more than L tokens use the long factors, and their positions
    are offset by L into the rotary table (module docstring); None otherwise."""
    params = layer_rope_parameters(hf_config, layer_type)
    original = params.get("original_max_position_embeddings") or getattr(
        hf_config, "original_max_position_embeddings", None)
    if params["rope_type"] != "longrope" or not original or max_position <= original:
        return None
    return int(original)


def inv_freq_for(hf_config, head_dim: int, max_position: int, layer_type: str | None = None,
                 long_factors: bool = False):
    """(inverse frequencies over the rotary dims, cos/sin scaling) as transformers computes them;
    LongRoPE's long factors with ``long_factors``, else its short ones."""
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
    original = params.get("original_max_position_embeddings") or getattr(
        hf_config, "original_max_position_embeddings", None)
    if rope_type == "longrope" and long_factors:
        kwargs["seq_len"] = original + 1  # past the original length: the long factors
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"), **kwargs)
    return inv_freq.float(), float(scaling)


def make_rotary(hf_config, head_dim: int, max_position: int, ops: str = "native",
                layer_type: str | None = None) -> nn.Module:
    """A RotaryEmbedding for the layer type, wrapped to rotate only part of each head if configured;
    ``ops``: the rotary kernel ("native" | "triton", layers/ops.py)."""
    inv_freq, scaling = inv_freq_for(hf_config, head_dim, max_position, layer_type)
    dim = 2 * inv_freq.numel()
    rotary = RotaryEmbedding(dim, max_position, inv_freq, scaling, ops)
    offset = long_rope_offset(hf_config, max_position, layer_type)
    if offset is not None:  # both factor sets in one table (module docstring)
        long_freq, _ = inv_freq_for(hf_config, head_dim, max_position, layer_type, long_factors=True)
        long = RotaryEmbedding(dim, max_position, long_freq, scaling, ops)
        # [L + max_position, dim / 2]: the short factors' first L rows, then the long factors' table
        rotary.cos = torch.cat([rotary.cos[:offset], long.cos])
        rotary.sin = torch.cat([rotary.sin[:offset], long.sin])
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

"""Rotary position embeddings (GPT-NeoX "rotate half" layout, as in HF Llama).

cos/sin are precomputed once for every position up to ``max_position`` and gathered by the
batch's positions, so nothing is re-materialised per step beyond the gather.
"""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers import cpu_ops
from pagedllm.layers.ops import check_layer_ops


def rope_parameters(hf_config) -> dict:
    """The config's RoPE settings in one dict (transformers 5 ``rope_parameters`` or 4.x fields)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", None) or 10000.0)
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    return params


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, inv_freq: torch.Tensor, scaling: float = 1.0,
                 ops: str = "native"):
        super().__init__()
        self.ops = check_layer_ops(ops)  # layers/ops.py
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)  # [max_position, head_dim // 2]
        self.register_buffer("cos", freqs.cos() * scaling, persistent=False)
        self.register_buffer("sin", freqs.sin() * scaling, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [num_tokens, num_heads, head_dim], k: [num_tokens, num_kv_heads, head_dim]."""
        if self.ops == "triton":
            from pagedllm.layers.triton_ops.rotary import rotary_neox_
            rotary_neox_(q, positions, self.cos, self.sin)  # in place, like the C op
            rotary_neox_(k, positions, self.cos, self.sin)
            return q, k
        if q.stride(-1) == 1 and k.stride(-1) == 1 and cpu_ops.usable(q, k, self.cos):
            positions = positions.to(torch.int64).contiguous()
            cpu_ops.rotary_neox_(q, positions, self.cos, self.sin)  # in place, no gathers
            cpu_ops.rotary_neox_(k, positions, self.cos, self.sin)
            return q, k
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)  # [num_tokens, 1, head_dim // 2]
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        rotate = _rotate_functional if torch.compiler.is_compiling() else _rotate
        return rotate(q, cos, sin), rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates both halves into one preallocated output (no concatenation)."""
    x1, x2 = x.chunk(2, dim=-1)
    out = torch.empty_like(x)
    o1, o2 = out.chunk(2, dim=-1)
    torch.mul(x1, cos, out=o1).sub_(x2 * sin)
    torch.mul(x2, cos, out=o2).add_(x1 * sin)
    return out


def _rotate_functional(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Same math without ``out=`` views, which torch.compile handles badly (aliasing); inductor
    fuses this into one kernel anyway."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

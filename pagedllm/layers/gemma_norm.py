"""Gemma's RMSNorm: scales by ``1 + weight`` (weights stored as offsets from one), in float32.

Torch ops under either ``ops`` (layers/ops.py): the Triton norm kernel scales by ``weight``."""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers.ops import check_layer_ops


class GemmaRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, ops: str = "native"):
        super().__init__()
        self.eps = eps
        self.ops = check_layer_ops(ops)  # accepted like RMSNorm's; the math is torch either way
        self.weight = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Plain norm, or (when ``residual`` is given) ``residual += x`` then norm; returns both."""
        if residual is not None:
            residual.add_(x)  # in place: the residual stream is owned by the decoder loop
            x = residual
        xf = x.float()  # transformers normalises and scales in float32, then casts back
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight.float())
        return out.to(x.dtype) if residual is None else (out.to(x.dtype), residual)

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Plain norm, or (when ``residual`` is given) ``residual += x`` then norm; returns both."""
        if residual is not None:
            residual.add_(x)  # in place: the residual stream is owned by the decoder loop
            x = residual
        orig_dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * xf.to(orig_dtype)
        return out if residual is None else (out, residual)

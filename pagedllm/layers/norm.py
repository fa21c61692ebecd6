from __future__ import annotations

import torch
import torch.nn.functional as F
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
        if x.dtype == torch.float32:
            out = F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one fused kernel
        else:  # half precision: normalise in float32 like the reference implementation
            xf = x.float()
            out = self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return out if residual is None else (out, residual)

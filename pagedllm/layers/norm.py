from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers import cpu_ops
from pagedllm.layers.ops import check_layer_ops


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, ops: str = "native"):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.ops = check_layer_ops(ops)  # layers/ops.py

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Plain norm, or (when ``residual`` is given) ``residual += x`` then norm; returns both."""
        if self.ops == "triton":
            return self._triton(x, residual)
        if self._fused_ok(x, residual):  # one C call instead of ~6 torch ops
            out = cpu_ops.add_rms_norm(x, residual, self.weight, self.eps)
            return out if residual is None else (out, residual)
        if residual is not None:
            residual.add_(x)  # in place: the residual stream is owned by the decoder loop
            x = residual
        if x.dtype == torch.float32:
            out = F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one fused kernel
        else:  # half precision: normalise in float32 like the reference implementation
            xf = x.float()
            out = self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return out if residual is None else (out, residual)

    def _fused_ok(self, x: torch.Tensor, residual: torch.Tensor | None) -> bool:
        if x.dim() != 2 or x.stride(-1) != 1 or (residual is not None and not residual.is_contiguous()):
            return False
        return cpu_ops.usable(x, self.weight) and (residual is None or residual.dtype == torch.float32)

    def _triton(self, x: torch.Tensor, residual: torch.Tensor | None):
        from pagedllm.layers.triton_ops.norm import add_rms_norm
        dim = x.shape[-1]
        if residual is None:  # also q/k norms over [tokens, heads, head_dim] views
            return add_rms_norm(x.reshape(-1, dim), None, self.weight, self.eps).view(x.shape)
        out = add_rms_norm(x, residual, self.weight, self.eps)  # [rows, dim]; residual updated in place
        return out, residual

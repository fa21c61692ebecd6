import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers import cpu_ops
from pagedllm.layers.ops import check_layer_ops


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for a fused ``[..., 2 * d]`` gate_up output."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


class SiluAndMul(nn.Module):
    """``silu_and_mul`` as a layer, so the model picks its implementation when it is built."""

    def __init__(self, ops: str = "native"):
        super().__init__()
        self.ops = check_layer_ops(ops)  # layers/ops.py

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops == "triton" and x.dim() == 2 and x.stride(-1) == 1:
            from pagedllm.layers.triton_ops.activation import silu_and_mul as triton_silu_and_mul
            return triton_silu_and_mul(x)
        if x.dim() == 2 and x.is_contiguous() and x.shape[-1] % 2 == 0 and cpu_ops.usable(x):
            return cpu_ops.silu_and_mul(x)  # one pass over the [rows, 2d] output (C, vectorised)
        return silu_and_mul(x)

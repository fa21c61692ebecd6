import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for a fused ``[..., 2 * d]`` gate_up output."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)

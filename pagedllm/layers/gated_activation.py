"""Gated activations ``act(gate) * up`` over a fused ``[..., 2 * d]`` gate_up output, by config name."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedllm.layers.activation import silu_and_mul


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``gelu(gate, approximate="tanh") * up`` (GeGLU, Gemma's ``gelu_pytorch_tanh``)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh").mul_(up)


def gelu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``gelu(gate) * up`` with the exact (erf) GELU."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate).mul_(up)


# transformers' ACT2FN names -> the fused gate/up function that computes the same thing
GATED_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": silu_and_mul, "swish": silu_and_mul,
    "gelu_pytorch_tanh": gelu_tanh_and_mul, "gelu_new": gelu_tanh_and_mul,
    "gelu": gelu_and_mul,
}


def gated_activation(name: str, field: str = "hidden_act") -> Callable[[torch.Tensor], torch.Tensor]:
    """The gate/up function for the config's activation; ValueError naming ``field`` if unknown."""
    if name not in GATED_ACTIVATIONS:
        raise ValueError(f"{field}={name!r} is not supported; supported: {sorted(GATED_ACTIVATIONS)}")
    return GATED_ACTIVATIONS[name]

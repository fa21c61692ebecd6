"""Gated activations ``act(gate) * up`` over a fused ``[..., 2 * d]`` gate_up output, by config name.

SwiGLU is the ``SiluAndMul`` layer, which has a Triton kernel (``ops="triton"``); the GELU
variants have none and run as torch ops under either ``ops`` (same result, no fusion)."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedllm.layers.activation import SiluAndMul, silu_and_mul
from pagedllm.layers.ops import check_layer_ops


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


def gated_activation(name: str, field: str = "hidden_act",
                     ops: str = "native") -> Callable[[torch.Tensor], torch.Tensor]:
    """The gate/up function for the config's activation, built for ``ops`` (layers/ops.py);
    ValueError naming ``field`` if unknown."""
    check_layer_ops(ops)
    if name not in GATED_ACTIVATIONS:
        raise ValueError(f"{field}={name!r} is not supported; supported: {sorted(GATED_ACTIVATIONS)}")
    fn = GATED_ACTIVATIONS[name]
    return SiluAndMul(ops) if fn is silu_and_mul else fn

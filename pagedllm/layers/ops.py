"""Which implementation the layers' fused ops use, chosen once, when the model is built.

``fused_ops`` (an engine argument):

- ``"auto"``: Triton kernels on CUDA (when triton is installed), the built-in paths elsewhere
- ``"native"``: the built-in paths everywhere: fused C ops for float32 CPU tensors, torch ops
  otherwise (the A/B baseline for the kernels)
- ``"triton"``: the Triton kernels (``layers/triton_ops``) on every device; on the CPU only
  under the Triton interpreter (``TRITON_INTERPRET=1``), which is how the tests prove them

It resolves to ``"native"`` or ``"triton"``, which the model hands to each layer it builds
(RMSNorm, RotaryEmbedding, SiluAndMul) and the engine to its Sampler. The int8 projections use
the Triton GEMM on CUDA whatever the choice (``layers/quantization.py``).
"""
from __future__ import annotations

import functools
import importlib.util

import torch

FUSED_OPS = ("auto", "native", "triton")
LAYER_OPS = ("native", "triton")  # what a layer is built with


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def resolve_fused_ops(name: str, device: torch.device) -> str:
    """``"native"`` or ``"triton"`` for a model on ``device``; ValueError when not possible."""
    if name not in FUSED_OPS:
        raise ValueError(f"fused_ops={name!r} is not supported; use one of {FUSED_OPS}")
    if name == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "native"
    if name == "triton" and not triton_available():
        raise ValueError("fused_ops='triton' needs the triton package (pip install triton)")
    if name == "triton" and device.type != "cuda" and not _interpreting():
        raise ValueError(f"fused_ops='triton' on device={device.type!r} runs only under the Triton interpreter "
                         "(TRITON_INTERPRET=1, set before triton is imported); use 'auto' or 'native'")
    return name


def check_layer_ops(ops: str) -> str:
    if ops not in LAYER_OPS:
        raise ValueError(f"ops={ops!r} is not supported; use one of {LAYER_OPS}")
    return ops


def _interpreting() -> bool:
    from triton import knobs  # triton's own (lazy) reading of TRITON_INTERPRET
    return bool(knobs.runtime.interpret)

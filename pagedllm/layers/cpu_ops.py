"""Fused float32 CPU ops (C, in the CPU library of ``pagedllm/native``) with torch fallbacks.

Used by RMSNorm and the rotary embedding when the tensors are float32 on the CPU and the
kernel library is available; everything else takes the plain torch path.
"""
from __future__ import annotations

import torch

from pagedllm import envs
from pagedllm.native import bindings


def usable(*tensors: torch.Tensor) -> bool:
    """The C op applies: float32 CPU tensors, library built, and not inside torch.compile
    (inductor fuses the plain torch version into its own kernels)."""
    if torch.compiler.is_compiling():
        return False
    # PAGEDLLM_FUSED_CPU_OPS=0: escape hatch (and A/B switch for benchmarks) to plain torch ops
    on_cpu = all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)
    return envs.PAGEDLLM_FUSED_CPU_OPS and on_cpu and bindings.is_available()


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``residual += x`` (if given) then RMSNorm of the result; x: [rows, dim], unit inner stride."""
    rows, dim = x.shape
    out = torch.empty(rows, dim, dtype=torch.float32)
    bindings.library().add_rms_norm(x, residual, weight, out, eps, torch.get_num_threads())
    return out


def rotary_neox_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotates x ([tokens, heads, head_dim] view, unit inner stride) in place."""
    bindings.library().rotary_neox_(x, positions, cos, sin, torch.get_num_threads())


# oneDNN's prepacked float32 GEMM beats MKL's by 1.3-4x for 4..512 rows on this kind of CPU
# (decode batches), MKL stays ahead for 1-2 rows and for big prefill chunks: measured per shape
# in benchmarks/RESULTS.md. Packing keeps a second copy of each weight.
PACKED_MIN_ROWS, PACKED_MAX_ROWS = 4, 512


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """A oneDNN-packed copy of a float32 CPU weight [out, in], or None where not applicable."""
    if not (envs.PAGEDLLM_PACKED_LINEAR and weight.device.type == "cpu" and weight.dtype == torch.float32):
        return None
    if not torch.backends.mkldnn.is_available():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 64)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None):
    """F.linear, through the packed weight when the row count is in the range where it wins."""
    # under torch.compile inductor picks (and prepacks) the GEMM itself
    if packed is not None and x.dim() == 2 and PACKED_MIN_ROWS <= x.shape[0] <= PACKED_MAX_ROWS \
            and not torch.compiler.is_compiling():
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return torch.nn.functional.linear(x, weight, bias)


def pack_model(model: torch.nn.Module, ram_bytes: int | None = None) -> int:
    """Attaches packed weights to every linear-like module (``packed_weight``) and packs the
    modules that hold several (``pack_weights()``, FusedMoE); returns how many weights were packed.

    Skipped when the second copy would take more than a quarter of the available RAM.
    """
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.dim() >= 2)  # + stacked experts
    if ram_bytes is not None and weight_bytes > ram_bytes // 4:
        return 0
    count = 0
    for module in model.modules():
        if hasattr(module, "packed_weight"):
            module.packed_weight = pack_weight(module.weight)
            count += module.packed_weight is not None
        elif hasattr(module, "pack_weights"):  # several weights per module (FusedMoE's experts)
            count += module.pack_weights()
    return count

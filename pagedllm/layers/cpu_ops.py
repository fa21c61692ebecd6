"""Fused float32 CPU ops (C, built with the attention kernel) with torch fallbacks.

Used by RMSNorm and the rotary embedding when the tensors are float32 on the CPU and the
kernel library is available; everything else takes the plain torch path.
"""
from __future__ import annotations

import os

import torch

# escape hatch (and A/B switch for benchmarks): PAGEDLLM_FUSED_CPU_OPS=0 uses plain torch ops
ENABLED = os.environ.get("PAGEDLLM_FUSED_CPU_OPS", "1") != "0"


def _lib():
    from pagedllm.attention.cpu import load_library
    return load_library()


def usable(*tensors: torch.Tensor) -> bool:
    return ENABLED and all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors) and _lib() is not None


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``residual += x`` (if given) then RMSNorm of the result; x: [rows, dim], unit inner stride."""
    rows, dim = x.shape
    out = torch.empty(rows, dim, dtype=torch.float32)
    res_ptr = residual.data_ptr() if residual is not None else None
    rc = _lib().pl_add_rms_norm(x.data_ptr(), res_ptr, weight.data_ptr(), out.data_ptr(), rows, dim,
                                x.stride(0), eps, torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"pl_add_rms_norm failed ({rc})")
    return out


def rotary_neox_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotates x ([tokens, heads, head_dim] view, unit inner stride) in place."""
    tokens, heads, head_dim = x.shape
    rc = _lib().pl_rotary_neox(x.data_ptr(), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), tokens,
                               heads, head_dim, x.stride(0), x.stride(1), cos.shape[0], torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"pl_rotary_neox failed ({rc}): positions beyond the rotary table?")

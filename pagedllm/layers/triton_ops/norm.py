"""RMSNorm with the residual add fused in, like the C op (``cpu_ops.add_rms_norm``).

``residual += x`` (stored back in place, in the residual's dtype) and then
``weight * (h * rsqrt(mean(h^2) + eps))`` of the sum ``h``, in one pass over each row. The
arithmetic follows transformers' LlamaRMSNorm: the normalised row is rounded to the model
dtype before the weight multiplies it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedllm.layers.triton_ops._util import num_warps_for, row_block


@triton.jit
def _add_rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, x_stride, residual_stride, out_stride, dim, eps,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    h = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual_ptrs = residual_ptr + row * residual_stride + cols
        h = (h + tl.load(residual_ptrs, mask=mask, other=0.0).to(tl.float32)).to(residual_ptr.dtype.element_ty)
        tl.store(residual_ptrs, h, mask=mask)
        h = h.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / dim + eps)
    normed = (h * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (normed * weight).to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``residual += x`` (if given) then RMSNorm; x, residual: [rows, dim] with unit inner stride."""
    rows, dim = x.shape
    assert x.stride(1) == 1 and (residual is None or residual.stride(1) == 1)
    out = torch.empty(rows, dim, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    block = row_block(dim)
    _add_rms_norm_kernel[(rows,)](
        x, residual if residual is not None else x, weight, out, x.stride(0),
        residual.stride(0) if residual is not None else 0, out.stride(0), dim, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=num_warps_for(block))
    return out


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
    """The torch reference (updates ``residual`` in place, like the kernel)."""
    if residual is not None:
        residual.add_(x)
        x = residual
    h = x.float()
    normed = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (normed.float() * weight.float()).to(x.dtype)

"""SiLU-and-mul: ``silu(gate) * up`` for a fused ``[rows, 2 * d]`` gate/up projection output.

Like torch's ``F.silu(gate).mul_(up)``, the activation is rounded to the dtype before the
product (one rounding per torch op), with float32 arithmetic in between.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_stride, out_stride, d, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + d + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [rows, 2 * d] with unit inner stride -> [rows, d]."""
    rows, width = x.shape
    assert x.stride(1) == 1 and width % 2 == 0
    d = width // 2
    out = torch.empty(rows, d, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    block = min(BLOCK, triton.next_power_of_2(d))
    _silu_and_mul_kernel[(rows, triton.cdiv(d, block))](x, out, x.stride(0), out.stride(0), d, BLOCK=block,
                                                        num_warps=4)
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up

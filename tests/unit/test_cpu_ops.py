"""Fused / packed CPU ops against plain torch."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.layers import cpu_ops


@pytest.mark.parametrize("rows", [1, 3, 4, 17, 64, 512, 700])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 40, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    x = torch.randn(rows, 40, generator=g)
    packed = cpu_ops.pack_weight(w)
    torch.testing.assert_close(cpu_ops.linear(x, w, b, packed), F.linear(x, w, b), atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not cpu_ops.usable(torch.zeros(1)), reason="no C compiler")
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_matches_reference(with_residual):
    g = torch.Generator().manual_seed(0)
    x, res, w = torch.randn(9, 37, generator=g), torch.randn(9, 37, generator=g), torch.randn(37, generator=g)
    expected_res = res + x if with_residual else None
    src = expected_res if with_residual else x
    expected = w * (src * torch.rsqrt(src.pow(2).mean(-1, keepdim=True) + 1e-6))
    got_res = res.clone() if with_residual else None
    out = cpu_ops.add_rms_norm(x, got_res, w, 1e-6)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    if with_residual:
        torch.testing.assert_close(got_res, expected_res)


@pytest.mark.skipif(not cpu_ops.usable(torch.zeros(1)), reason="no C compiler")
def test_rotary_matches_reference_and_rejects_bad_positions():
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(5, 3 * 4 * 8, generator=g)
    q = qkv[:, :32].view(5, 4, 8)  # a strided view, as in the model
    pos = torch.tensor([0, 3, 7, 2, 9])
    freqs = torch.outer(torch.arange(16.0), 1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8))
    cos, sin = freqs.cos(), freqs.sin()
    c, s = cos[pos][:, None], sin[pos][:, None]
    x1, x2 = q[..., :4].clone(), q[..., 4:].clone()
    expected = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)
    cpu_ops.rotary_neox_(q, pos, cos, sin)
    torch.testing.assert_close(q, expected, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError):
        cpu_ops.rotary_neox_(q, torch.tensor([0, 1, 2, 3, 99]), cos, sin)

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


PANELS = cpu_ops.panels_apply(torch.zeros(32, 1))  # an AVX-512 build of the library


def test_gemm_routing_per_cpu_vendor():
    """MKL's tuned kernels run only on Intel CPUs: on other x86 CPUs every row count takes the
    packed copies, and the decoder the panel GEMM from one token."""
    assert cpu_ops.gemm_routing("GenuineIntel") == (4, 512, 16)
    lo, hi, decode = cpu_ops.gemm_routing("AuthenticAMD")
    assert (lo, decode) == (1, 1) and hi >= 1 << 40
    assert cpu_ops.gemm_routing("HygonGenuine") == cpu_ops.gemm_routing("AuthenticAMD")
    assert cpu_ops.gemm_routing("") == cpu_ops.gemm_routing("GenuineIntel")  # no vendor_id: not x86


@pytest.mark.parametrize("vendor", ["GenuineIntel", "AuthenticAMD"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 96, 97, 512, 700])
def test_linear_routes_rows_as_the_vendor_table_says(vendor, rows, monkeypatch):
    """Each row count reaches the GEMM gemm_routing gives it, with F.linear's result: the panel
    copy (where the library has it) for 1 to PANEL_MAX_ROWS rows on every vendor, oneDNN's copy
    inside the table's packed range, F.linear (MKL) only outside both."""
    lo, hi, _ = cpu_ops.gemm_routing(vendor)
    monkeypatch.setattr(cpu_ops, "MKL_TUNED", cpu_ops.mkl_tuned(vendor))
    monkeypatch.setattr(cpu_ops, "PACKED_MIN_ROWS", lo)
    monkeypatch.setattr(cpu_ops, "PACKED_MAX_ROWS", hi)
    g = torch.Generator().manual_seed(rows)
    w, b, x = torch.randn(64, 48, generator=g), torch.randn(64, generator=g), torch.randn(rows, 48, generator=g)
    want = F.linear(x, w, b)
    packed = cpu_ops.pack_weight(w, panels=True)
    calls = []
    monkeypatch.setattr(torch.nn.functional, "linear", lambda *a: calls.append(1) or want)
    torch.testing.assert_close(cpu_ops.linear(x, w, b, packed), want, atol=1e-4, rtol=1e-4)
    on_panels = isinstance(packed, cpu_ops.PanelWeight) and rows <= cpu_ops.PANEL_MAX_ROWS
    assert bool(calls) == (packed is None or not (on_panels or lo <= rows <= hi))
    if PANELS:  # the panel copy takes 1-3 rows on Intel too (benchmarks/RESULTS.md)
        assert bool(calls) == (rows > 512 and vendor == "GenuineIntel")


@pytest.mark.skipif(not PANELS, reason="the panel GEMM needs an AVX-512 build of the C library")
@pytest.mark.parametrize("rows", [4, 7, 8, 9, 17, 63, 64, 65, 96, 97, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_panel_linear_matches_f_linear_across_tiles_and_row_blocks(rows, bias):
    """dense_gemm.c: 8-row tiles, 64-row blocks, each thread's panels (here 5); from 97 rows the
    oneDNN copy takes over. K = 200 is no multiple of the 16-float vectors."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(160, 200, generator=g)
    b = torch.randn(160, generator=g) if bias else None
    x = torch.randn(rows, 200, generator=g)
    packed = cpu_ops.pack_weight(w, panels=True)
    assert isinstance(packed, cpu_ops.PanelWeight)
    torch.testing.assert_close(cpu_ops.linear(x, w, b, packed), F.linear(x, w, b), atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not PANELS, reason="the panel GEMM needs an AVX-512 build of the C library")
def test_panel_layout_and_its_refusals():
    w = torch.arange(64 * 3, dtype=torch.float32).reshape(64, 3)
    panels = cpu_ops.pack_panels(w)
    assert panels.shape == (2, 3, 32) and panels[1, 2, 5] == w[37, 2]
    assert not isinstance(cpu_ops.pack_weight(torch.randn(48, 8), panels=True), cpu_ops.PanelWeight)  # 48 % 32
    assert not isinstance(cpu_ops.pack_weight(torch.randn(64, 8)), cpu_ops.PanelWeight)  # not asked (FusedMoE)
    from pagedllm.native import bindings
    with pytest.raises(ValueError, match="dg_gemm"):  # out columns not whole panels
        bindings.library().dense_gemm(torch.randn(4, 8), torch.randn(2, 8, 32), None, torch.empty(4, 48), 1)


@pytest.mark.skipif(not PANELS, reason="the panel GEMM needs an AVX-512 build of the C library")
def test_pack_model_keeps_panels_only_where_both_copies_fit():
    model = torch.nn.Sequential(torch.nn.Linear(16, 64))
    model[0].packed_weight = None
    weight_bytes = 64 * 16 * 4
    assert cpu_ops.pack_model(model, ram_bytes=8 * weight_bytes) == 1
    assert isinstance(model[0].packed_weight, cpu_ops.PanelWeight)
    assert cpu_ops.pack_model(model, ram_bytes=4 * weight_bytes) == 1  # room for one copy: oneDNN's only
    assert isinstance(model[0].packed_weight, torch.Tensor)


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


@pytest.mark.parametrize("rows,inter", [(0, 8), (1, 7), (5, 101), (64, 96)])
def test_silu_and_mul_matches_torch_in_one_c_pass(rows, inter, monkeypatch):
    """SiluAndMul on a contiguous float32 CPU gate_up takes the C pass (vector body and scalar
    tail, both SiLU tails: |gate| up to ~100), a strided one the torch ops; both equal torch's."""
    from pagedllm.layers.activation import SiluAndMul
    g = torch.Generator().manual_seed(rows * 1000 + inter)
    x = torch.randn(rows, 2 * inter, generator=g) * 30
    gate, up = x[:, :inter], x[:, inter:]
    want = F.silu(gate) * up
    calls = []
    c_pass = cpu_ops.silu_and_mul
    monkeypatch.setattr(cpu_ops, "silu_and_mul", lambda t: calls.append(t.shape) or c_pass(t))
    torch.testing.assert_close(SiluAndMul()(x), want, atol=1e-5, rtol=1e-5)
    assert calls == [x.shape]
    if rows > 1:  # (one row of a wider tensor is still contiguous)
        strided = torch.cat([x, x], dim=1)[:, : 2 * inter]  # not contiguous: torch's ops
        torch.testing.assert_close(SiluAndMul()(strided), want, atol=1e-5, rtol=1e-5)
        assert calls == [x.shape]


@pytest.mark.parametrize("mkl_tuned", [True, False])
@pytest.mark.parametrize("rows", [1, 5, 600])
def test_unpacked_linear_takes_onednn_where_mkl_is_untuned(mkl_tuned, rows, monkeypatch):
    """A widened (quantized) weight's GEMM: F.linear (MKL) on Intel, oneDNN elsewhere; same result."""
    monkeypatch.setattr(cpu_ops, "MKL_TUNED", mkl_tuned)
    g = torch.Generator().manual_seed(rows)
    w, b, x = torch.randn(96, 72, generator=g), torch.randn(96, generator=g), torch.randn(rows, 72, generator=g)
    want = F.linear(x, w, b)
    calls = []
    monkeypatch.setattr(torch.nn.functional, "linear", lambda *a: calls.append(1) or want)
    torch.testing.assert_close(cpu_ops.unpacked_linear(x, w, b), want, atol=1e-4, rtol=1e-4)
    assert bool(calls) == (mkl_tuned or not torch.backends.mkldnn.is_available())

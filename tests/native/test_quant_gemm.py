"""The panel GEMM for group-quantized weights (native/csrc/quant_gemm.c) and its layout
(layers/quantization/grouped.py: pack_panels) against dequantize-then-matmul in float64, written
from the definition W[o, i] = (codes[o, i] - zero[o, g(i)]) * scale[o, g(i)], on shapes that hit
every tail: rows not a multiple of the 8-row tile, outputs not a multiple of the 32-column
panel, inputs not a multiple of the 256-input k-block, a group spanning k-blocks."""
from __future__ import annotations

import pytest
import torch

from pagedllm.layers import cpu_ops
from pagedllm.layers.linear import ReplicatedLinear
from pagedllm.layers.quantization import grouped
from pagedllm.native import bindings
from pagedllm.native.bindings import NativeLibrary

pytestmark = pytest.mark.skipif(not cpu_ops.usable(torch.zeros(1)), reason="no C compiler")


def _layout(out_features: int, in_features: int, group: int, bits: int, sym: bool, seed: int):
    """Random codes, scales and zeros (``sym``: the zero at the middle code, as GPTQ sym writes)."""
    g = torch.Generator().manual_seed(seed)
    groups = in_features // group
    codes = torch.randint(0, 2**bits, (out_features, in_features), generator=g)
    scale = torch.rand(out_features, groups, generator=g) * 0.1 + 0.01
    zero = torch.randint(0, 2**bits, (out_features, groups), generator=g).float()
    return codes, scale, torch.full_like(zero, 2 ** (bits - 1)) if sym else zero


def _reference64(codes, scale, zero, group, g_idx=None):
    g_of = torch.arange(codes.shape[1]) // group if g_idx is None else g_idx.long()
    return (codes.double() - zero.double()[:, g_of]) * scale.double()[:, g_of]


def _gemm(lib, x, codes, scale, zero, group, bits, bias=None):
    """``lib``'s qg_gemm on the panel layout of the logical (codes, scale, zero)."""
    panels = grouped.pack_panels(codes, scale, zero * scale, bits, lib.qg_panel)
    y = torch.empty(x.shape[0], codes.shape[0])
    lib.grouped_gemm(x, *panels, bias, group, bits, y, 2)
    return y


def _check(got, x, codes, scale, zero, group, bias=None, g_idx=None):
    want = x.double() @ _reference64(codes, scale, zero, group, g_idx).t()
    if bias is not None:
        want += bias.double()
    torch.testing.assert_close(got.double(), want, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group, in_features", [(32, 96), (64, 320), (128, 384), (384, 384)])
@pytest.mark.parametrize("rows", [1, 7, 33, 45, 261])  # 261: three 128-row passes, the last of 5
def test_gemm_matches_float64_reference(bits, group, in_features, rows):
    out_features = 70  # two full 32-column panels and a 6-column tail
    codes, scale, zero = _layout(out_features, in_features, group, bits, sym=False, seed=rows + group + bits)
    x, bias = torch.randn(rows, in_features), torch.randn(out_features)
    got = _gemm(bindings.library(), x, codes, scale, zero, group, bits, bias)
    _check(got, x, codes, scale, zero, group, bias)


@pytest.mark.parametrize("bits", [4, 8])
def test_symmetric_zeros_and_a_single_short_panel(bits):
    codes, scale, zero = _layout(5, 64, 32, bits, sym=True, seed=bits)
    x = torch.randn(19, 64)
    _check(_gemm(bindings.library(), x, codes, scale, zero, 32, bits), x, codes, scale, zero, 32)


def test_gemm_limits_per_vendor():
    """The Xeon's measured limits where MKL is tuned; elsewhere 4-bit codes stay on the panel GEMM
    at every row count (it beat dequantize + oneDNN at 1024-2048 rows on AMD Zen 5), 8-bit ones
    keep 384."""
    assert grouped.gemm_max_rows(True) == {4: 384, 8: 384}
    off_intel = grouped.gemm_max_rows(False)
    assert off_intel[8] == 384 and off_intel[4] >= 1 << 40
    assert grouped.GEMM_MAX_ROWS == grouped.gemm_max_rows(cpu_ops.MKL_TUNED)


@pytest.mark.parametrize("bits", [4, 8])
def test_layer_routes_rows_between_the_limits_to_the_gemm(bits, monkeypatch):
    """Rows in (SMALL_MAX_ROWS, GEMM_MAX_ROWS] take the panel GEMM, others the small-batch kernel
    or dequantize + GEMM; every route gives the reference's result (at the Xeon's limits, so
    both ends are reachable on any host)."""
    monkeypatch.setattr(grouped, "GEMM_MAX_ROWS", grouped.gemm_max_rows(True))
    codes, scale, zero = _layout(40, 128, 64, bits, sym=False, seed=3)
    layer = ReplicatedLinear(128, 40, bias=False)
    grouped.install(layer, codes, scale, zero, None, bits)
    calls, real = [], NativeLibrary.grouped_gemm

    def spy(self, x, *args):
        calls.append(x.shape[0])
        return real(self, x, *args)
    monkeypatch.setattr(NativeLibrary, "grouped_gemm", spy)
    small, big = grouped.SMALL_MAX_ROWS[bits], grouped.GEMM_MAX_ROWS[bits]
    for rows in (small, small + 1, big, big + 1):
        x = torch.randn(rows, 128)
        _check(layer(x), x, codes, scale, zero, 64)
    assert calls == [small + 1, big]


@pytest.mark.parametrize("bits", [4, 8])
def test_act_order_layer_through_the_gemm(bits):
    """desc_act: groups numbered along a permutation of the input columns; install sorts the
    columns (and the panels follow) and the layer gathers x to match."""
    group, in_features, rows = 32, 128, grouped.SMALL_MAX_ROWS[bits] + 9
    codes, scale, zero = _layout(36, in_features, group, bits, sym=False, seed=11)
    perm = torch.randperm(in_features, generator=torch.Generator().manual_seed(2))
    g_idx = torch.empty(in_features, dtype=torch.int32)
    g_idx[perm] = (torch.arange(in_features) // group).int()
    layer = ReplicatedLinear(in_features, 36, bias=False)
    grouped.install(layer, codes, scale, zero, g_idx, bits)
    assert layer.act_perm is not None and layer.panel_codes is not None
    x = torch.randn(rows, in_features)
    _check(layer(x), x, codes, scale, zero, group, g_idx=g_idx)


def test_panel_layout_is_the_documented_one():
    codes = torch.randint(0, 16, (40, 8))
    scale, szero = torch.rand(40, 2), torch.rand(40, 2)
    qp, sp, zp = grouped.pack_panels(codes, scale, szero, 4, 32)
    assert qp.shape == (2, 8, 16) and sp.shape == zp.shape == (2, 2, 32)
    p, k, j = 1, 5, 3  # rows 35 (low nibble) and 51 (past the 40 rows: zero) at input 5
    assert int(qp[p, k, j]) == int(codes[32 * p + j, k])
    assert int(qp[0, k, j]) == int(codes[j, k]) | int(codes[16 + j, k]) << 4
    assert sp[1, 1, 7] == scale[39, 1] and zp[1, 1, 7] == szero[39, 1]
    assert not sp[1, :, 8:].any() and not zp[1, :, 8:].any()
    q8, _, _ = grouped.pack_panels(codes, scale, szero, 8, 32)
    assert q8.shape == (2, 8, 32) and int(q8[0, k, 20]) == int(codes[20, k])


def test_bad_group_is_refused():
    lib = bindings.library()
    x, y = torch.randn(40, 96), torch.empty(40, 8)
    qp, sp, zp = torch.zeros(1, 96, 16, dtype=torch.uint8), torch.zeros(1, 3, 32), torch.zeros(1, 3, 32)
    with pytest.raises(ValueError, match="qg_gemm: bad dimensions"):
        lib.grouped_gemm(x, qp, sp, zp, None, 40, 4, y, 2)  # 40 does not divide 96


@pytest.mark.parametrize("march", [("-mavx2", "-mfma", "-mf16c"), ()], ids=["avx2", "portable"])
def test_builds_without_avx512_match(march, tmp_path):
    """Without AVX-512 the GEMM takes 2-row tiles of 8-lane (or scalar / SSE) vectors."""
    lib = NativeLibrary.build(cache_dir=tmp_path, cflags=("-O2", *march, "-fopenmp", "-shared", "-fPIC"))
    for bits, group, in_features, rows in ((4, 32, 320, 37), (8, 128, 384, 33), (4, 384, 384, 5)):
        codes, scale, zero = _layout(70, in_features, group, bits, sym=False, seed=bits + rows)
        x, bias = torch.randn(rows, in_features), torch.randn(70)
        _check(_gemm(lib, x, codes, scale, zero, group, bits, bias), x, codes, scale, zero, group, bias)

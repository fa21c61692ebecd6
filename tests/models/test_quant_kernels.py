"""The group-wise 4/8-bit runtime (layers/quantization/grouped.py, native/csrc/quant_linear.c)
against dequantize-then-matmul in float64, and each checkpoint format's unpacking against the
real tools' own dequantization (fixtures written by scripts/make_quant_fixtures.py with
compressed-tensors 0.20.1 and AutoAWQ 0.2.9)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from pagedllm.layers import cpu_ops
from pagedllm.layers.linear import ReplicatedLinear
from pagedllm.layers.quantization import grouped
from pagedllm.layers.quantization.awq import AWQMethod
from pagedllm.layers.quantization.base import pack_int32, unpack_int32
from pagedllm.layers.quantization.compressed_tensors import CompressedTensorsMethod
from pagedllm.layers.quantization.gptq import GPTQMethod
from pagedllm.layers.quantization.int4 import quantize_int4

FIXTURES = Path(__file__).parent / "fixtures" / "quant_layers.safetensors"
needs_c = pytest.mark.skipif(not cpu_ops.usable(torch.zeros(1)), reason="no C compiler")


def _random_layout(out_features: int, in_features: int, group: int, bits: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    groups = in_features // group
    codes = torch.randint(0, 2**bits, (out_features, in_features), generator=g)
    scale = torch.rand(out_features, groups, generator=g) * 0.1 + 0.01
    zero = torch.randint(0, 2**bits, (out_features, groups), generator=g).float()
    return codes, scale, zero


def _reference64(codes, scale, zero, group, g_idx=None):
    """W[o, i] = (codes[o, i] - zero[o, g(i)]) * scale[o, g(i)] in float64, straight from the definition."""
    g_of = torch.arange(codes.shape[1]) // group if g_idx is None else g_idx.long()
    return (codes.double() - zero.double()[:, g_of]) * scale.double()[:, g_of]


def _layer(codes, scale, zero, bits, g_idx=None, bias=None):
    layer = ReplicatedLinear(codes.shape[1], codes.shape[0], bias=bias is not None)
    if bias is not None:
        layer.bias.data.copy_(bias)
    grouped.install(layer, codes, scale, zero, g_idx, bits)
    return layer


@needs_c
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [8, 16, 32, 64, 128])  # 8, 16: groups the 16-lane steps do not fill
# every token tail; past grouped.SMALL_MAX_ROWS (3 for 8 bits, 2 for 4): the panel GEMM (test_quant_gemm.py)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 24, 25, 32, 33, 130])
def test_grouped_linear_matches_float64_reference(bits, group, rows):
    out_features, in_features = 70, 2 * 128  # 70 rows: a 2-row tail in the 4-row work units
    codes, scale, zero = _random_layout(out_features, in_features, group, bits, seed=rows + group + bits)
    bias = torch.randn(out_features)
    x = torch.randn(rows, in_features)
    got = _layer(codes, scale, zero, bits, bias=bias)(x)
    want = x.double() @ _reference64(codes, scale, zero, group).t() + bias.double()
    torch.testing.assert_close(got.double(), want, atol=2e-4, rtol=2e-4)


@needs_c
@pytest.mark.parametrize("group, in_features", [(128, 384), (256, 512)])
def test_small_batch_kernel_every_token_count_matches_float64_reference(group, in_features):
    """The 4-bit kernel on groups of whole 128-column blocks (quant_linear.c's value-table path)
    for every token count the one-call decoder hands it (up to grouped.C_MAX_ROWS), each tail of
    its 3-token passes and of its 4-row work units (70 rows)."""
    from pagedllm.native.bindings import library
    codes, scale, zero = _random_layout(70, in_features, group, 4, seed=group)
    layer = _layer(codes, scale, zero, 4)
    want64 = _reference64(codes, scale, zero, group)
    bias = torch.randn(70)
    for rows in range(1, grouped.C_MAX_ROWS[4] + 1):
        x = torch.randn(rows, in_features)
        got = torch.empty(rows, 70)
        library().grouped_linear(x, layer.weight, layer.weight_scale, layer.weight_szero, bias, group, 4, got, 2)
        torch.testing.assert_close(got.double(), x.double() @ want64.t() + bias.double(), atol=2e-4, rtol=2e-4)


def _level_tolerance(x: torch.Tensor, magnitude: torch.Tensor) -> torch.Tensor:
    """The error quant_linear.c's VNNI path (own int8) allows per token and output row: the activation
    levels' |x - x~| <= max|x| / 127 / 2 / 254^2 per element, float32 rounding of x * 127 / max|x|
    (2^-24 relative, doubled), and of the float sums it forms: ~1e-6 of sum |terms|, with
    ``magnitude [out, in]`` = |code * scale| + |zero * scale| (the two terms it subtracts). The
    float paths are within it too."""
    x64, m64 = x.double(), magnitude.double()
    per_element = x64.abs().amax(dim=1, keepdim=True) * (0.5 / 127 / 254**2) + x64.abs() * 2**-23  # [T, in]
    return per_element @ m64.t() + 1e-6 * (x64.abs() @ m64.t())  # [T, out]


def _assert_within(got: torch.Tensor, want: torch.Tensor, tol: torch.Tensor) -> None:
    err = (got.double() - want).abs()
    ratio = (err / tol).max().item()
    assert bool((err <= tol).all()), f"error {err.max().item():.3g} past the bound (worst ratio {ratio:.3g})"


@needs_c
@pytest.mark.parametrize("bits, group, in_features", [(4, 128, 384), (4, 256, 512), (8, 64, 192), (8, 128, 384),
                                                      (8, 192, 384), (4, 32, 96), (8, 16, 96)])
def test_small_batch_kernel_within_the_activation_level_bound(bits, group, in_features):
    """Every token count the one-call decoder hands the group-wise kernel (each tail of its token
    passes and of its 4-row work units: 70 rows), groups 32-256, against float64 within the bound
    of _level_tolerance (which the float paths meet too); an input with a 1000x outlier and an
    all-zero one (exactly the bias)."""
    from pagedllm.native.bindings import library
    codes, scale, zero = _random_layout(70, in_features, group, bits, seed=group + bits)
    layer = _layer(codes, scale, zero, bits)
    want64 = _reference64(codes, scale, zero, group)
    magnitude = (codes.double().abs() + zero.double().repeat_interleave(group, 1)) * scale.double().repeat_interleave(
        group, 1)
    bias = torch.randn(70)
    for rows in range(1, grouped.C_MAX_ROWS[bits] + 1):
        x = torch.randn(rows, in_features)
        x[0, 5] = 1000.0
        if rows > 1:
            x[-1] = 0.0
        got = torch.empty(rows, 70)
        library().grouped_linear(x, layer.weight, layer.weight_scale, layer.weight_szero, bias, group, bits, got, 2)
        _assert_within(got, x.double() @ want64.t() + bias.double(), _level_tolerance(x, magnitude))
        if rows > 1:
            assert torch.equal(got[-1], bias)


@needs_c
@pytest.mark.parametrize("in_features", [192, 45])  # 192: the VNNI path (whole 64-column steps); 45: the tile
def test_own_int8_small_batch_kernel_within_the_activation_level_bound(in_features):
    """quantization="int8"'s signed codes with one scale per row through ld_linear (the one-call
    decoder's matmul; on an AVX512-VNNI CPU quant_linear.c's VNNI path), every token count up to
    5, 70 rows, against float64 within the levels' bound; an input with a 1000x outlier."""
    from pagedllm.layers.quantization.int8 import quantize_int8
    from pagedllm.native.bindings import library
    g = torch.Generator().manual_seed(in_features)
    q, s = quantize_int8(torch.randn(70, in_features, generator=g))
    want64 = q.double() * s.double()[:, None]  # [out, in]
    magnitude = (q.double().abs() + 128) * s.double()[:, None]  # the VNNI path's codes + 128 and zero point 128
    bias = torch.randn(70, generator=g)
    for rows in range(1, 6):
        x = torch.randn(rows, in_features, generator=g)
        x[0, 3] = -1000.0
        got = torch.empty(rows, 70)
        library().linear(x, q, s, bias, got, 2)
        _assert_within(got, x.double() @ want64.t() + bias.double(), _level_tolerance(x, magnitude))


@pytest.fixture(scope="module")
def avx2_library(tmp_path_factory):
    """The kernels built for AVX2/FMA/F16C without AVX-512 (the 8-lane paths, which a
    -march=native build on an AVX-512 machine does not run)."""
    from pagedllm.native.bindings import NativeLibrary
    if not cpu_ops.usable(torch.zeros(1)):
        pytest.skip("no C compiler")
    flags = ("-O2", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC")
    lib = NativeLibrary.build(cache_dir=tmp_path_factory.mktemp("avx2"), cflags=flags)
    assert lib.has_avx2
    return lib


@pytest.mark.parametrize("bits, group", [(4, 32), (4, 128), (8, 16), (8, 128)])
def test_avx2_build_matches_float64_reference(avx2_library, bits, group):
    out_features, in_features = 70, 256
    codes, scale, zero = _random_layout(out_features, in_features, group, bits, seed=group + bits)
    layer = _layer(codes, scale, zero, bits)
    want64 = _reference64(codes, scale, zero, group)
    g_of = torch.arange(in_features) // group
    magnitude = (codes.double() + zero.double()[:, g_of]) * scale.double()[:, g_of]  # the two terms it subtracts
    gen = torch.Generator().manual_seed(bits * group)
    for rows in (1, 2, 3, 5):
        x = torch.randn(rows, in_features, generator=gen)
        got = torch.empty(rows, out_features)
        avx2_library.grouped_linear(x, layer.weight, layer.weight_scale, layer.weight_szero, None, group, bits, got, 2)
        # float32 sums: a fixed atol failed now and then where an output sits near 0 beside terms of ~30
        _assert_within(got, x.double() @ want64.t(), _level_tolerance(x, magnitude))
    widened = torch.empty(out_features, in_features)
    avx2_library.dequantize_grouped(layer.weight, layer.weight_scale, layer.weight_szero, widened, group, bits, 2)
    torch.testing.assert_close(widened.double(), want64, atol=1e-5, rtol=1e-6)


def test_avx2_build_fp8_matches_float64_reference(avx2_library):
    from pagedllm.layers.quantization import fp8
    w = (torch.randn(9, 40) * 40).to(torch.float8_e4m3fn)
    w.view(torch.uint8)[w.view(torch.uint8) & 0x7F == 0x7F] = 0x7E  # no NaN (refused at load)
    scale = torch.rand(9, 2) + 0.25
    x = torch.randn(3, 40)
    got = torch.empty(3, 9)
    avx2_library.fp8_linear(x, w.view(torch.uint8), scale, None, 20, got, 2)
    want = x.double() @ fp8.dequantize(w, scale, torch.float64).t()
    torch.testing.assert_close(got.double(), want, atol=2e-3, rtol=1e-5)


@needs_c
@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("bits", [4, 8])
def test_act_order_permutation_matches_g_idx_reference(rows, bits):
    """desc_act: groups are numbered along a permutation of the input columns."""
    group, in_features = 32, 128
    codes, scale, zero = _random_layout(24, in_features, group, bits, seed=7)
    perm = torch.randperm(in_features, generator=torch.Generator().manual_seed(1))
    g_idx = torch.empty(in_features, dtype=torch.int32)
    g_idx[perm] = (torch.arange(in_features) // group).int()  # GPTQ: groups in act order
    layer = _layer(codes, scale, zero, bits, g_idx=g_idx)
    assert layer.act_perm is not None
    x = torch.randn(rows, in_features)
    torch.testing.assert_close(layer(x).double(), x.double() @ _reference64(codes, scale, zero, group, g_idx).t(),
                               atol=2e-4, rtol=2e-4)


def test_uneven_g_idx_is_refused():
    codes, scale, zero = _random_layout(8, 64, 32, 4, seed=0)
    g_idx = torch.zeros(64, dtype=torch.int32)  # 64 columns in group 0, none in group 1
    with pytest.raises(ValueError, match="g_idx"):
        _layer(codes, scale, zero, 4, g_idx=g_idx)


@pytest.mark.parametrize("group", [4, 12, 40, 0])  # not a multiple of 8, or not dividing 96
def test_group_sizes_the_kernel_cannot_take_are_refused(group):
    with pytest.raises(ValueError, match=f"group_size={group} is not supported"):
        grouped.check_group(group, 96, "group_size")
    grouped.check_group(48, 96, "group_size")


def test_torch_fallback_matches_float64_reference():
    codes, scale, zero = _random_layout(16, 64, 32, 4, seed=3)
    layer = _layer(codes, scale, zero, 4)
    x = torch.randn(2, 64, dtype=torch.float64)  # not float32: the torch path
    # scale and scale * zero are kept in float32: float32-level differences
    torch.testing.assert_close(layer(x), x @ _reference64(codes, scale, zero, 32).t(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dim", [0, 1])
def test_pack_int32_round_trips(bits, dim):
    codes = torch.randint(0, 2**bits, (16, 24))
    assert torch.equal(unpack_int32(pack_int32(codes, bits, dim), bits, dim), codes.int())
    awq = [0, 4, 1, 5, 2, 6, 3, 7]
    nibbles = codes % 16  # AWQ's interleave is 4-bit only: asserted for both parametrizations
    assert torch.equal(unpack_int32(pack_int32(nibbles, 4, dim, awq), 4, dim, awq), nibbles.int())


def test_int4_quantizer_round_trip():
    w = torch.randn(6, 256) * torch.linspace(0.1, 2, 6)[:, None]
    w[2, 128:] = 0
    codes, scale = quantize_int4(w)
    assert codes.dtype == torch.uint8 and scale.shape == (6, 2)
    assert int(codes.min()) >= 1 and int(codes.max()) <= 15
    deq = (codes.float() - 8) * scale.repeat_interleave(128, dim=1)
    assert torch.all((deq - w).abs() <= scale.repeat_interleave(128, dim=1) / 2 + 1e-6)
    assert torch.equal(codes[2, 128:], torch.full((128,), 8, dtype=torch.uint8))


# --- checkpoint formats against the tools' own dequantization -------------------------------------

def _fixture(prefix: str) -> dict[str, torch.Tensor]:
    with safe_open(str(FIXTURES), framework="pt") as f:
        return {k.split(".", 1)[1]: f.get_tensor(k) for k in f.keys() if k.startswith(prefix + ".")}


def _load_layer(method, tensors: dict[str, torch.Tensor], out_features: int, in_features: int):
    layer = ReplicatedLinear(in_features, out_features, bias=False)
    method.create_weights(layer)
    for name, t in tensors.items():
        if name != "dequantized":
            param = getattr(layer, name)
            param.weight_loader(param, t)
    method.process_weights(layer)
    return layer


def _dequantized(layer) -> torch.Tensor:
    w = grouped.dequantize(layer.weight, layer.weight_scale, layer.weight_szero, layer.quant_group,
                           layer.quant_bits)
    return w if layer.act_perm is None else w[:, torch.argsort(layer.act_perm)]


CT_CASES = {  # fixture prefix: (bits, strategy, group, symmetric, packed)
    "ct_w4_group32_asym_packed": (4, "group", 32, False, True),
    "ct_w4_group64_sym_packed": (4, "group", 64, True, True),
    "ct_w8_channel_sym_packed": (8, "channel", None, True, True),
    "ct_w8_channel_asym_packed": (8, "channel", None, False, True),
    "ct_w4_group32_asym_naive": (4, "group", 32, False, False),
}


@pytest.mark.parametrize("prefix", list(CT_CASES))
def test_compressed_tensors_unpacking_matches_the_library(prefix):
    bits, strategy, group, sym, packed = CT_CASES[prefix]
    t = _fixture(prefix)
    method = CompressedTensorsMethod._from_weights(
        {"type": "int", "num_bits": bits, "strategy": strategy, "group_size": group, "symmetric": sym}, packed)
    out_features, in_features = t["dequantized"].shape
    layer = _load_layer(method, t, out_features, in_features)
    torch.testing.assert_close(_dequantized(layer), t["dequantized"], atol=1e-6, rtol=1e-5)


def test_awq_unpacking_matches_autoawq():
    t = _fixture("awq_group32")
    out_features, in_features = t["dequantized"].shape
    layer = _load_layer(AWQMethod(4, 32), t, out_features, in_features)
    # AutoAWQ dequantizes in float16 (its scales' dtype): equal up to float16 rounding (2^-11
    # relative); a misplaced nibble would be off by a whole step (~3% of a weight here)
    torch.testing.assert_close(_dequantized(layer), t["dequantized"], atol=1e-7, rtol=2**-10)


@pytest.mark.parametrize("v2", [False, True])
@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_unpacking_follows_the_spec(bits, v2):
    """No GPTQ tool installs here (gptqmodel's build needs CUDA): packed by hand as AutoGPTQ's
    QuantLinear.pack does (codes along the input dimension, zeros minus one in v1)."""
    out_features, in_features, group = 32, 64, 32
    codes, scale, zero = _random_layout(out_features, in_features, group, bits, seed=bits)
    zero = zero.clamp(min=1)  # v1 cannot store a zero point of 0 (it stores zero - 1)
    stored_zero = zero - (0 if v2 else 1)
    tensors = {"qweight": pack_int32(codes.t(), bits, dim=0), "qzeros": pack_int32(stored_zero.t().long(), bits, 1),
               "scales": scale.t().half(), "g_idx": (torch.arange(in_features) // group).int()}
    layer = _load_layer(GPTQMethod(bits, group, False, v2), tensors, out_features, in_features)
    want = _reference64(codes, scale.half().float(), zero, group).float()
    torch.testing.assert_close(_dequantized(layer), want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("act_order, in_features, match", [
    (True, 128, "desc_act/act-order checkpoints with tensor_parallel_size=2"),
    (False, 96, "group_size=32 does not divide the 48 inputs of a row-parallel layer's rank slice"),
])
def test_row_parallel_slices_must_hold_whole_groups(act_order, in_features, match):
    from pagedllm.distributed.parallel_state import TensorParallelGroup
    from pagedllm.layers import linear
    rank0_of_two = TensorParallelGroup(0, 2, backend=object())  # sizing only: no collective runs
    layer = linear.RowParallelLinear(in_features, 16, tp=rank0_of_two)  # this rank: half the inputs
    group = 32
    with pytest.raises(ValueError, match=match):
        GPTQMethod(4, group, act_order, v2=False).create_weights(layer)

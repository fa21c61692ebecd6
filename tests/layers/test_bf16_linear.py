"""The bfloat16 weight kernel (native/csrc/bf16_linear.c) and its route in cpu_ops.linear, against
float64 math on the bf16 weights, on shapes that hit every tail: outputs not a multiple of the
4-row unit, inputs not a multiple of the 16- / 8-lane steps, token counts not a multiple of 3."""
from __future__ import annotations

import pytest
import torch

from pagedllm.layers import cpu_ops
from pagedllm.native import bindings
from pagedllm.native.bindings import NativeLibrary

pytestmark = pytest.mark.skipif(not cpu_ops.usable(torch.zeros(1)), reason="no C compiler")

# (tokens, in, out): 16-lane body + 8-lane tail + scalar tail; < 8 inputs; 1..16 tokens
SHAPES = ((1, 1000, 37), (2, 333, 70), (4, 24, 9), (5, 7, 5), (16, 1031, 130))


def _check(lib: NativeLibrary, tokens: int, in_features: int, out_features: int, bias: bool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, in_features, generator=g)
    w = torch.randn(out_features, in_features, generator=g).bfloat16()
    b = torch.randn(out_features, generator=g) if bias else None
    y = torch.full((tokens, out_features), float("nan"))
    lib.bf16_linear(x, w, b, y, 2)
    want = x.double() @ w.double().T + (0 if b is None else b.double())
    # float32 sums of in_features products: error ~ sqrt(in) * eps * |terms|
    torch.testing.assert_close(y.double(), want, atol=1e-5 * in_features**0.5, rtol=1e-5)


@pytest.mark.parametrize("shape", SHAPES)
def test_matches_float64_on_the_bf16_weights(shape):
    _check(bindings.library(), *shape, bias=shape[0] % 2 == 1, seed=sum(shape))


@pytest.mark.parametrize("march", [("-mavx2", "-mfma", "-mf16c"), ()], ids=["avx2", "portable"])
def test_builds_without_avx512_match(march, tmp_path):
    """Without AVX-512 the kernel takes 8-lane steps (or scalar code) for the same sums."""
    lib = NativeLibrary.build(cache_dir=tmp_path, cflags=("-O2", *march, "-fopenmp", "-shared", "-fPIC"))
    for shape in SHAPES:
        _check(lib, *shape, bias=True, seed=sum(shape))


def test_refuses_more_rows_than_the_library_takes():
    lib = bindings.library()
    x, w = torch.zeros(lib.max_decode_tokens + 1, 8), torch.zeros(4, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bf16_linear: bad dimensions"):
        lib.bf16_linear(x, w, None, torch.empty(x.shape[0], 4), 2)


def test_linear_routes_small_bf16_batches_to_the_kernel_in_x_dtype():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 64, generator=g).bfloat16()
    b = torch.randn(40, generator=g).bfloat16()
    x32 = torch.randn(3, 64, generator=g)
    want = x32.double() @ w.double().T + b.double()
    got32 = cpu_ops.linear(x32, w, b, None)  # float32 activations (the one-call decoder's): float32 out
    assert got32.dtype == torch.float32
    torch.testing.assert_close(got32.double(), want, atol=1e-5, rtol=1e-5)
    got16 = cpu_ops.linear(x32.bfloat16(), w, b, None)  # the module path: bf16 in, bf16 out
    assert got16.dtype == torch.bfloat16
    torch.testing.assert_close(got16, torch.nn.functional.linear(x32.bfloat16(), w, b), atol=0.05, rtol=2**-7)
    big = torch.randn(cpu_ops.BF16_C_MAX_ROWS + 1, 64, generator=g)  # past the kernel's rows: oneDNN, in bf16
    assert cpu_ops.linear(big, w, b, None).dtype == torch.bfloat16

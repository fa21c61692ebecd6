"""The one-call decoder's small-batch matmul (llama_decode.c, through ld_linear) against float64:
float32 and int8 (per-row scale) weights, every token count of its register tiles and their
remainders, input lengths with and without a vector tail; in the default build (on an AVX-512
host: the 16-lane tile of 6 tokens) and in builds without AVX-512 (the 8-lane tile of 3) and
without AVX2 (scalar)."""
from __future__ import annotations

import pytest
import torch

from pagedllm.layers import cpu_ops
from pagedllm.native import bindings
from pagedllm.native.bindings import NativeLibrary

pytestmark = pytest.mark.skipif(not cpu_ops.usable(torch.zeros(1)), reason="no C compiler")

OUT = 70  # 17 units of 4 rows and a unit of 2


@pytest.fixture(scope="module", params=["default", "avx2", "portable"])
def library(request, tmp_path_factory):
    if request.param == "default":
        return bindings.library()
    march = ("-mavx2", "-mfma", "-mf16c") if request.param == "avx2" else ()
    return NativeLibrary.build(cache_dir=tmp_path_factory.mktemp(request.param),
                               cflags=("-O2", *march, "-fopenmp", "-shared", "-fPIC"))


@pytest.mark.parametrize("in_features", [64, 45, 16 * 3 + 9, 64 * 2 + 16 + 3])
@pytest.mark.parametrize("int8", [False, True], ids=["f32", "int8"])
def test_every_token_count_matches_float64(library, in_features, int8):
    g = torch.Generator().manual_seed(in_features + int8)
    weight = torch.randn(OUT, in_features, generator=g)
    scale = None
    if int8:
        scale = weight.abs().amax(dim=1) / 127
        weight = torch.round(weight / scale[:, None]).to(torch.int8)
    want_w = weight.double() * (1 if scale is None else scale.double()[:, None])
    bias = torch.randn(OUT, generator=g)
    for rows in [*range(1, 14), library.max_decode_tokens]:
        x = torch.randn(rows, in_features, generator=g)
        got = torch.empty(rows, OUT)
        library.linear(x, weight, scale, bias, got, 2)
        torch.testing.assert_close(got.double(), x.double() @ want_w.t() + bias.double(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("out", [2, 70, 71, 130])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_one_token_rows_split_over_threads_match_float64(library, out, threads):
    """One float32 token: in AVX-512 builds each thread walks the two halves of its rows together
    (matvec_two_streams; an odd row count takes the register tile); every row once, with its bias,
    whatever the thread count (3 threads split 35 row pairs unevenly; 2 rows give one a pair and
    the others nothing)."""
    g = torch.Generator().manual_seed(out * 10 + threads)
    in_features = 64 * 3 + 5  # the 64-wide loop and a tail
    weight, bias = torch.randn(out, in_features, generator=g), torch.randn(out, generator=g)
    x = torch.randn(1, in_features, generator=g)
    got = torch.full((1, out), float("nan"))
    library.linear(x, weight, None, bias, got, threads)
    want = x.double() @ weight.double().t() + bias.double()
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)


def test_refuses_more_tokens_than_its_tiles_hold():
    lib = bindings.library()
    x, w = torch.zeros(lib.max_decode_tokens + 1, 8), torch.zeros(4, 8)
    with pytest.raises(ValueError, match="ld_linear: bad dimensions"):
        lib.linear(x, w, None, None, torch.empty(x.shape[0], 4), 2)

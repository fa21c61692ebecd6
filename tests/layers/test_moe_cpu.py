"""The C MoE kernel (layers/moe_cpu.py, native/csrc/moe_experts.c) against FusedMoE's torch path
and a per-token loop written from the routing definition."""
from __future__ import annotations

import pytest
import torch
from conftest import make_model_dir
from test_fused_moe import _reference

from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.layers import cpu_ops, moe_cpu
from pagedllm.layers.fused_moe import FusedMoE, route
from pagedllm.native import bindings
from pagedllm.native.bindings import NativeLibrary

pytestmark = pytest.mark.skipif(not cpu_ops.usable(torch.zeros(1)), reason="no C compiler")

HIDDEN, INTER = 64, 48  # multiples of the panels (32 hidden, 16 intermediate columns)


def _pair(experts: int, top_k: int, act: str = "silu") -> tuple[FusedMoE, FusedMoE]:
    """(packed for the kernel, torch path) sharing the same random weights."""
    torch.manual_seed(experts * 10 + top_k)
    moe, ref = (FusedMoE(experts, top_k, HIDDEN, INTER, True, act, tp=TensorParallelGroup()) for _ in range(2))
    moe.w13.normal_(std=0.2), moe.w2.normal_(std=0.2)
    ref.w13, ref.w2 = moe.w13, moe.w2
    cpu_ops.pack_model(moe)
    return moe, ref


@pytest.mark.parametrize("num_tokens", [1, 3, 9, 64, 200])
@pytest.mark.parametrize("experts,top_k", [(8, 2), (4, 1), (3, 3)])
def test_kernel_matches_torch_path_and_reference(num_tokens, experts, top_k):
    moe, ref = _pair(experts, top_k)
    assert moe.kernel_weights is not None and ref.kernel_weights is None
    x, logits = torch.randn(num_tokens, HIDDEN) * 3, torch.randn(num_tokens, experts)  # SiLU far into both tails
    got = moe(x, logits)
    # outputs reach ~70 and cancel inside the down projection: float32 rounding alone differs
    # by up to ~2e-5 between summation orders (AMD EPYC's oneDNN vs the kernel: 1.2e-5 at 9 tokens)
    torch.testing.assert_close(got, ref(x, logits), atol=5e-5, rtol=1e-5)
    expected = _reference(x, logits, moe.w13, moe.w2, top_k, True)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_idle_experts_and_no_tokens():
    moe, ref = _pair(8, 2)
    x = torch.randn(5, HIDDEN)
    logits = torch.full((5, 8), -10.0)
    logits[:, 2], logits[:, 5] = 5.0, 4.0  # every token to experts 2 and 5: six get no rows
    torch.testing.assert_close(moe(x, logits), ref(x, logits), atol=1e-5, rtol=1e-5)
    assert moe(x[:0], logits[:0]).shape == (0, HIDDEN)


def test_packed_layout_is_the_documented_one():
    gate_panel, down_panel = bindings.library().moe_panels
    moe, _ = _pair(2, 1)
    w13p, w2p = moe.kernel_weights.w13, moe.kernel_weights.w2
    assert w13p.shape == (2, INTER // gate_panel, HIDDEN, 2 * gate_panel)
    assert w2p.shape == (2, HIDDEN // down_panel, INTER, down_panel)
    e, p, k, c = 1, 2, 7, 3  # gate row p*G + c, up row inter + p*G + c, down row p*D + c, at input k
    assert w13p[e, p, k, c] == moe.w13[e, p * gate_panel + c, k]
    assert w13p[e, p, k, gate_panel + c] == moe.w13[e, INTER + p * gate_panel + c, k]
    assert w2p[e, 1, k, c] == moe.w2[e, down_panel + c, k]


@pytest.mark.parametrize("act,hidden,inter", [("gelu", HIDDEN, INTER), ("silu", 48, INTER), ("silu", HIDDEN, 40)])
def test_uncovered_experts_take_the_torch_path(act, hidden, inter):
    moe = FusedMoE(4, 2, hidden, inter, True, act, tp=TensorParallelGroup())
    assert not moe_cpu.can_pack(moe.w13, moe.w2, act)
    assert cpu_ops.pack_model(moe) == 8 and moe.kernel_weights is None and moe.packed is not None  # oneDNN


def test_expert_id_out_of_range_is_refused():
    moe, _ = _pair(4, 2)
    x, logits = torch.randn(3, HIDDEN), torch.randn(3, 4)
    weights, ids = route(logits, 2, True)
    ids[1, 0] = 4
    with pytest.raises(ValueError, match="moe_experts: metadata out of range"):
        moe_cpu.run_experts(x, weights, ids, moe.kernel_weights)


@pytest.mark.parametrize("march", [(), ("-march=haswell",)], ids=["portable", "avx2"])
def test_builds_without_avx512_match(march, tmp_path):
    """Without AVX-512 the kernel takes 2-row tiles (and plain SSE or scalar code without AVX2)."""
    lib = NativeLibrary.build(cache_dir=tmp_path, cflags=("-O2", *march, "-fopenmp", "-shared", "-fPIC"))
    moe, ref = _pair(8, 2)
    x, logits = torch.randn(37, HIDDEN) * 3, torch.randn(37, 8)
    weights, ids = route(logits, 2, True)
    out = torch.empty_like(x)
    lib.moe_experts(x, ids, weights, moe.kernel_weights.w13, moe.kernel_weights.w2, out, 2)
    torch.testing.assert_close(out, ref(x, logits), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_the_engine_runs_the_families_through_the_kernel(arch, tmp_path):
    """The tiny MoE configs of the family tests (tests/models/test_families.py, greedy equal to
    transformers) are packed for the kernel, so those tests cover it."""
    from pagedllm import LLM
    llm = LLM(make_model_dir(tmp_path, arch), dtype="float32", kv_cache_memory="16MiB")
    layers = [m for m in llm.llm_engine.executor.runner.model.modules() if isinstance(m, FusedMoE)]
    assert layers and all(m.kernel_weights is not None for m in layers)


def _silu_through_kernel(lib: NativeLibrary, g: torch.Tensor) -> torch.Tensor:
    """SiLU of ``g [T, INTER]`` as the kernel computes it: one expert whose gate rows pick x's
    first INTER columns, whose up rows all read the last one (1), and whose down rows copy the
    activations, so out[:, :INTER] = silu(g) * 1 with every dot product exact."""
    moe = FusedMoE(1, 1, HIDDEN, INTER, True, "silu", tp=TensorParallelGroup())
    eye = torch.eye(INTER, HIDDEN)
    moe.w13.copy_(torch.cat([eye, torch.zeros(INTER, HIDDEN).index_fill_(1, torch.tensor([HIDDEN - 1]), 1.0)])[None])
    moe.w2.copy_(torch.eye(HIDDEN, INTER)[None])
    cpu_ops.pack_model(moe)
    x = torch.cat([g, torch.zeros(len(g), HIDDEN - INTER - 1), torch.ones(len(g), 1)], dim=1)
    ids, weights = torch.zeros(len(g), 1, dtype=torch.int64), torch.ones(len(g), 1)
    out = torch.empty_like(x)
    lib.moe_experts(x, ids, weights, moe.kernel_weights.w13, moe.kernel_weights.w2, out, 2)
    return out[:, :INTER]


@pytest.mark.parametrize("march", [None, (), ("-march=haswell",)], ids=["native", "portable", "avx2"])
def test_silu_exp_is_accurate_over_the_whole_float_range(march, tmp_path):
    """The exp behind SiLU (pagedllm_native.h's pn_exp512 / pn_exp256, expf without AVX2) against
    float64, from inputs where exp(-g) overflows (clamped) to where it underflows."""
    lib = bindings.library() if march is None else NativeLibrary.build(
        cache_dir=tmp_path, cflags=("-O2", *march, "-fopenmp", "-shared", "-fPIC"))
    g = torch.cat([torch.linspace(-120, 120, 48 * 40), torch.randn(48 * 40) * 4]).reshape(-1, INTER)
    got = _silu_through_kernel(lib, g).double()
    want = torch.nn.functional.silu(g.double())
    torch.testing.assert_close(got, want, rtol=3e-7, atol=1e-36)  # ~2.5 float32 ulp (measured: 1.1)

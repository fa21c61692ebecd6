"""Every Triton kernel against its torch reference (pagedllm/layers/triton_ops/*).

On CPU tensors under the interpreter: float32 and float16 arithmetic, bfloat16 only where the
kernel merely loads, converts and stores it (the interpreter's bfloat16 arithmetic is wrong,
triton-lang/triton#11584; every kernel here computes in float32); all of it on the device too.
"""
from __future__ import annotations

import pytest
import torch
from concurrent_runs import run_side_by_side
from triton_devices import DEVICES

from pagedllm.layers.quantization import grouped, quantize_int8
from pagedllm.layers.triton_ops import activation, grouped_gemm, int8_gemm, norm, rotary, sampling

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# one rounding of the result in the dtype (plus float32 reduction-order noise)
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm(device, dtype, with_residual):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 48, generator=g).to(dtype).to(device)
    weight = (1 + 0.1 * torch.randn(48, generator=g)).to(dtype).to(device)
    residual = torch.randn(5, 48, generator=g).to(dtype).to(device) if with_residual else None
    ref_residual = residual.clone() if with_residual else None
    out = norm.add_rms_norm(x, residual, weight, 1e-6)
    ref = norm.add_rms_norm_ref(x, ref_residual, weight, 1e-6)
    torch.testing.assert_close(out, ref, **TOL[dtype])
    if with_residual:  # the residual is updated in place with x added (one rounding, same as torch;
        # the interpreter's float32 -> bfloat16 conversion does not round to nearest)
        exact = dict(atol=0, rtol=0) if dtype != torch.bfloat16 or device == "cuda" else TOL[dtype]
        torch.testing.assert_close(residual, ref_residual, **exact)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_on_strided_views(device, dtype):
    g = torch.Generator().manual_seed(1)
    heads, kv_heads, head_dim, tokens = 3, 1, 16, 4
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype).to(device)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)  # strided views, like the model's
    k = qkv[:, heads * head_dim: (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    freqs = torch.outer(torch.arange(32.0), 1.0 / 10000 ** (torch.arange(0, head_dim, 2) / head_dim))
    cos, sin = freqs.cos().to(device), freqs.sin().to(device)  # [max_position, head_dim // 2] float32
    positions = torch.tensor([0, 7, 31, 7]).to(device)
    ref_q, ref_k = rotary.rotary_neox_ref(q, positions, cos, sin), rotary.rotary_neox_ref(k, positions, cos, sin)
    v_before = qkv[:, (heads + kv_heads) * head_dim:].clone()
    rotary.rotary_neox_(q, positions, cos, sin)
    rotary.rotary_neox_(k, positions, cos, sin)
    torch.testing.assert_close(q, ref_q, **TOL[dtype])
    torch.testing.assert_close(k, ref_k, **TOL[dtype])
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], v_before)  # v untouched


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(device, dtype):
    x = torch.randn(3, 2 * 40, generator=torch.Generator().manual_seed(2)).to(dtype).to(device)
    torch.testing.assert_close(activation.silu_and_mul(x), activation.silu_and_mul_ref(x), **TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16))
@pytest.mark.parametrize("rows", [1, 5, 40])
@pytest.mark.parametrize("with_bias", [False, True])
def test_int8_gemm(device, dtype, rows, with_bias):
    g = torch.Generator().manual_seed(rows)
    q, scale = quantize_int8(torch.randn(72, 200, generator=g))  # K=200: a partial last K tile
    x = torch.randn(rows, 200, generator=g).to(dtype)
    bias = torch.randn(72, generator=g).to(dtype) if with_bias else None
    x, q, scale = x.to(device), q.to(device), scale.to(device)
    bias = bias.to(device) if with_bias else None
    out = int8_gemm.int8_gemm(x, q, scale, bias)
    ref = int8_gemm.int8_gemm_ref(x, q, scale, bias)
    assert out.dtype == dtype and out.shape == (rows, 72)
    torch.testing.assert_close(out, ref, **({"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else TOL[dtype]))


# group -> K: each with a partial last K tile under the decode (128) or prefill (64) tile; groups
# 32 and 64 put several groups in one K tile, 128 and channel-wise (-1) one group per tile
GROUPED_K = {32: 160, 64: 192, 128: 384, -1: 200}
GROUPED_N = 72  # a partial last N tile under both tiles (32 and 128 wide)


def _grouped_layout(bits: int, group: int, n: int, k: int, seed: int):
    """Random codes, scales and zero points in the runtime layout: (q, scale, szero, group)."""
    g = torch.Generator().manual_seed(seed)
    group = k if group == -1 else group
    codes = torch.randint(0, 2**bits, (n, k), generator=g)
    scale = torch.rand(n, k // group, generator=g) * 0.02 + 0.002
    zero = torch.randint(0, 2**bits, (n, k // group), generator=g).float()
    return grouped.pack_codes(codes, bits), scale, (zero * scale).contiguous(), group


def _close_to_float64(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """float32: reduction-order noise; float16: the weight widened to float16 before the dot
    (2^-11 relative per weight) and the result rounded once, both relative to the output's size."""
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), ref, atol=1e-5 * ref.abs().max().item(), rtol=1e-5)
    else:
        torch.testing.assert_close(out.double(), ref, atol=2e-3 * ref.abs().max().item(), rtol=2e-3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16))
@pytest.mark.parametrize("rows", [1, 3, 17])  # decode tiles (1, 3) and the prefill tile (17)
@pytest.mark.parametrize("group", list(GROUPED_K), ids=lambda g: "channel" if g == -1 else f"g{g}")
@pytest.mark.parametrize("bits", [4, 8])
def test_grouped_gemm_equals_dequantize_then_matmul_in_float64(device, bits, group, rows, dtype):
    k = GROUPED_K[group]
    q, scale, szero, group = _grouped_layout(bits, group, GROUPED_N, k, seed=bits * 1000 + k + rows)
    g = torch.Generator().manual_seed(rows)
    x, bias = torch.randn(rows, k, generator=g).to(dtype), torch.randn(GROUPED_N, generator=g).to(dtype)
    ref = x.double() @ grouped.dequantize(q, scale, szero, group, bits, torch.float64).T + bias.double()
    out = grouped_gemm.grouped_gemm(*(t.to(device) for t in (x, q, scale, szero, bias)), group, bits)
    assert out.dtype == dtype and out.shape == (rows, GROUPED_N)
    _close_to_float64(out.cpu(), ref, dtype)
    no_bias = grouped_gemm.grouped_gemm(*(t.to(device) for t in (x, q, scale, szero)), None, group, bits)
    _close_to_float64(no_bias.cpu(), ref - bias.double(), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows", [1, 17])
@pytest.mark.parametrize("bits", [4, 8])
def test_grouped_gemm_with_act_order_gathers_the_activations(device, bits, rows):
    """A desc_act layer (g_idx a permutation of the input columns): ``install`` sorts the columns
    by group, the activations are gathered with ``act_perm``; the product equals the checkpoint's
    own W (codes and groups in the original column order) in float64."""
    from pagedllm.layers.linear import ReplicatedLinear
    out_features, in_features, group = 40, 128, 32
    g = torch.Generator().manual_seed(bits + rows)
    codes = torch.randint(0, 2**bits, (out_features, in_features), generator=g)
    scale = torch.rand(out_features, in_features // group, generator=g) * 0.02 + 0.002
    zero = torch.randint(0, 2**bits, scale.shape, generator=g).float()
    g_idx = (torch.randperm(in_features, generator=g) // group).int()  # every group 32 columns, shuffled
    layer = ReplicatedLinear(in_features, out_features, bias=False)
    grouped.install(layer, codes, scale, zero, g_idx, bits)
    assert layer.act_perm is not None
    x = torch.randn(rows, in_features, generator=g)
    want = x.double() @ ((codes.double() - zero.double()[:, g_idx.long()]) * scale.double()[:, g_idx.long()]).T
    if device == "cuda":  # the layer's own forward: grouped_linear takes the Triton GEMM on CUDA
        out = grouped.grouped_linear(layer.cuda(), x.cuda()).cpu()
    else:
        out = grouped_gemm.grouped_gemm(x.index_select(-1, layer.act_perm), layer.weight, layer.weight_scale,
                                        layer.weight_szero, None, layer.quant_group, bits)
    _close_to_float64(out, want, torch.float32)


def _filter_inputs(device, rows=6, vocab=300):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(rows, vocab, generator=g) * 3  # distinct values: no ties at a threshold
    logits[2, :100] = float("-inf")  # e.g. masked by allowed_token_ids
    top_k = torch.tensor([0, 5, 50, 1, 300, 17], dtype=torch.int32)[:rows]
    top_p = torch.tensor([1.0, 1.0, 0.9, 1.0, 0.5, 0.3])[:rows]
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.5, 0.0, 0.05])[:rows]
    return logits.to(device), top_k.to(device), top_p.to(device), min_p.to(device)


@pytest.mark.parametrize("device", DEVICES)
def test_top_k_top_p_min_p_matches_sorting_reference(device):
    logits, top_k, top_p, min_p = _filter_inputs(device)
    ref = sampling.top_k_top_p_min_p_ref(logits, top_k, top_p, min_p)
    sampling.top_k_top_p_min_p_(logits, top_k, top_p, min_p)
    assert torch.equal(torch.isinf(logits), torch.isinf(ref))
    torch.testing.assert_close(logits, ref, atol=0, rtol=0)
    kept = (~torch.isinf(logits)).sum(dim=1).tolist()
    assert kept[0] == 300 and kept[1] == 5 and kept[3] == 1  # off, top-k alone, top-k=1
    assert 0 < kept[4] < 300 and kept[5] <= 17


@pytest.mark.parametrize("device", DEVICES)
def test_top_p_boundary_token_stays(device):
    """Probabilities 0.5, 0.25, 0.125, ...: with top_p=0.6 the second token is kept (only 0.5
    lies above it), the third is not (0.75 > 0.6)."""
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.0625, 0.0625]])).to(device)
    sampling.top_k_top_p_min_p_(logits, torch.zeros(1, dtype=torch.int32, device=device),
                                torch.tensor([0.6], device=device), torch.zeros(1, device=device))
    assert (~torch.isinf(logits)).tolist() == [[True, True, False, False, False]]


@pytest.mark.parametrize("device", DEVICES)
def test_filter_passes_over_the_vocabulary(device, monkeypatch):
    """The thresholds come from the row's largest logits (here 64 of 300, so that small rows
    exercise what 1024 of a 128K vocabulary does): rows they settle make one pass over the
    vocabulary (the write), two for top-p without top-k (its total mass); a top-k past the
    candidates (the 64th ties the last candidate's key: who knows what follows) or a nucleus wider
    than them bisects (33 passes) on that row alone. Every row
    equals the sorting reference."""
    monkeypatch.setattr(sampling, "CANDIDATES", 64)
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(7, 300, generator=g) * 3
    logits[5] = torch.randn(300, generator=g) * 0.05  # flat: a nucleus of ~270 tokens
    top_k = torch.tensor([0, 5, 63, 0, 40, 0, 64], dtype=torch.int32)
    top_p = torch.tensor([1.0, 1.0, 1.0, 0.5, 0.8, 0.9, 1.0])
    min_p = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.1, 0.0, 0.0])
    ref = sampling.top_k_top_p_min_p_ref(logits, top_k, top_p, min_p)
    logits, top_k, top_p, min_p = (t.to(device) for t in (logits, top_k, top_p, min_p))
    passes = torch.zeros(7, dtype=torch.int32, device=device)
    sampling.top_k_top_p_min_p_(logits, top_k, top_p, min_p, passes)
    torch.testing.assert_close(logits.cpu(), ref, atol=0, rtol=0)
    assert passes.tolist() == [1, 1, 1, 2, 1, 2 + sampling._KEY_STEPS, 1 + sampling._KEY_STEPS]
    assert (~torch.isinf(ref[5])).sum() > 64 and (~torch.isinf(ref[6])).sum() == 64


def test_every_kernel_compiles_ahead_of_time_for_sm80_and_sm90(tmp_path):
    """Real compiles (ptxas to cubin) without a GPU, in a process without the interpreter."""
    import os
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=os.getcwd(), TRITON_DEFAULT_FP_FUSION="1")
    script = os.path.join(os.path.dirname(__file__), "aot_compile.py")
    archs = ("80", "90")  # one process per arch, side by side
    envs = [dict(env, TRITON_CACHE_DIR=str(tmp_path / arch)) for arch in archs]
    done = run_side_by_side([[sys.executable, script, arch] for arch in archs], envs, timeout=300)
    assert not done.failures, done.failures
    compiled = done.stdout.split("\n")
    for kernel in ("_add_rms_norm_kernel", "_rotary_neox_kernel", "_silu_and_mul_kernel",
                   "_top_k_top_p_min_p_kernel", "_int8_gemm_kernel", "_grouped_gemm_kernel", "_moe_gemm_kernel",
                   "_mxfp4_gemm_kernel", "_lora_shrink_kernel", "_lora_expand_kernel"):
        for arch in ("sm_80", "sm_90"):
            assert any(line.startswith(arch) and line.endswith(kernel) for line in compiled), (arch, kernel)

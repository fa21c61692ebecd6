"""Weight-only int8 (``quantization="int8"``) against transformers running the same dequantized
weights, and the int8 kernels against plain dequantize + matmul."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import hf_greedy, random_prompts, token_logprobs

from pagedllm import LLM, SamplingParams
from pagedllm.layers import cpu_ops, quantization

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPTS = random_prompts(12, seed=3, lo=2, hi=50)
MAX_NEW = 10


ROW_PARALLEL = ("o_proj", "down_proj")  # input dim split across tensor-parallel ranks


def _fake_quant(w: torch.Tensor) -> torch.Tensor:
    s = w.abs().amax(dim=1, keepdim=True) / 127
    s = torch.where(s > 0, s, torch.ones_like(s))  # an all-zero row stays zero (as quantize_int8)
    return torch.round(w / s).clamp(-127, 127) * s


def _dequantized_reference(hf_model, tp: int = 1):
    """A copy of the transformers model whose projections hold round(W / s) * s, s = max|row| / 127
    (for row-parallel layers under ``tp`` ranks: per rank's slice of the input dimension)."""
    import copy
    model = copy.deepcopy(hf_model)
    with torch.no_grad():
        for name, module in model.named_modules():
            short = name.rsplit(".", 1)[-1]
            if short in PROJECTIONS:
                parts = tp if short in ROW_PARALLEL else 1
                module.weight.copy_(torch.cat([_fake_quant(c) for c in module.weight.chunk(parts, dim=1)], dim=1))
    return model


def test_quantize_int8_round_trip():
    w = torch.randn(37, 29) * torch.linspace(0.1, 3, 37)[:, None]
    w[5] = 0
    q, s = quantization.quantize_int8(w)
    assert q.dtype == torch.int8 and s.shape == (37,) and int(q.abs().max()) == 127
    assert torch.all((q.float() * s[:, None] - w).abs() <= s[:, None] / 2 + 1e-6)
    assert torch.equal(q[5], torch.zeros(29, dtype=torch.int8))


@pytest.mark.skipif(not cpu_ops.usable(torch.zeros(1)), reason="no C compiler")
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 17, 48, 49, 200])  # > 48: widened in C, then one GEMM
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_matches_dequantized_matmul(rows, bias):
    g = torch.Generator().manual_seed(rows)
    q, s = quantization.quantize_int8(torch.randn(70, 45, generator=g))  # odd sizes: every tail
    x = torch.randn(rows, 45, generator=g)
    b = torch.randn(70, generator=g) if bias else None
    got = quantization.int8_linear(x, q, s, b)
    torch.testing.assert_close(got, F.linear(x, q.float() * s[:, None], b), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("engine_kwargs", [{}, dict(max_num_batched_tokens=32)], ids=["default", "chunked32"])
def test_greedy_matches_transformers_on_dequantized_weights(arch, engine_kwargs, model_dirs, hf_models):
    llm = LLM(model_dirs[arch], block_size=8, num_gpu_blocks_override=400, quantization="int8", **engine_kwargs)
    model = llm.llm_engine.executor.runner.model
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.int8
    assert model.model.fused_decoder is not None  # decode steps take the one-call C decoder
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    reference = _dequantized_reference(hf_models[arch])
    want = [hf_greedy(reference, p, MAX_NEW) for p in PROMPTS]
    got = [o.outputs[0].token_ids for o in outs]
    assert got == want
    for prompt, out in list(zip(PROMPTS, outs))[:3]:
        gen = out.outputs[0].token_ids
        got_lp = torch.tensor([lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, gen)])
        torch.testing.assert_close(got_lp, token_logprobs(reference, prompt, gen), atol=1e-4, rtol=0)
    assert llm.get_kv_cache_stats().num_used_blocks == 0


def test_int8_weights_take_a_quarter_of_the_bytes(llama_dir):
    def proj_bytes(llm):
        model = llm.llm_engine.executor.runner.model
        return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n.endswith("proj.weight"))
    fp32 = LLM(llama_dir, num_gpu_blocks_override=64, max_model_len=128)
    int8 = LLM(llama_dir, num_gpu_blocks_override=64, max_model_len=128, quantization="int8")
    assert proj_bytes(int8) * 4 == proj_bytes(fp32)


def test_unknown_method_is_rejected(llama_dir):
    with pytest.raises(ValueError, match="quantization='fp4'"):
        LLM(llama_dir, num_gpu_blocks_override=64, quantization="fp4")


def test_tensor_parallel_ranks_quantize_their_own_shards(llama_dir, hf_models):
    """TP=2: column-parallel rows keep their scales; row-parallel layers get one scale per row
    per rank (over that rank's half of the inputs). Greedy equals transformers on those weights."""
    prompts = PROMPTS[:4]
    llm = LLM(llama_dir, num_gpu_blocks_override=200, tensor_parallel_size=2, num_threads=1, quantization="int8")
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    reference = _dequantized_reference(hf_models["llama"], tp=2)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(reference, p, MAX_NEW) for p in prompts]
    # the tokens alone cannot tell per-shard from per-row scales here; the logprobs can (the
    # single-rank quantization is 4e-3..8e-3 away from this reference on these prompts)
    for prompt, out in zip(prompts, outs):
        gen = out.outputs[0].token_ids
        got = torch.tensor([lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, gen)])
        torch.testing.assert_close(got, token_logprobs(reference, prompt, gen), atol=1e-3, rtol=0)


def test_load_time_quantization_is_refused_for_moe_models(tmp_path):
    """int8/int4 quantize linear projections; a MoE model's experts are not ones, so it is refused
    rather than applied to the attention only."""
    from conftest import make_model_dir

    from pagedllm import LLM
    model_dir = make_model_dir(tmp_path, "mixtral")
    for method in ("int8", "int4"):
        with pytest.raises(ValueError, match=f"quantization='{method}' covers linear projections only"):
            LLM(model_dir, quantization=method, num_gpu_blocks_override=16, max_model_len=64)

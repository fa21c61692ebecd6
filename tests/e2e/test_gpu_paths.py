"""The engine paths the first GPU run must exercise beyond plain greedy decoding, each with CUDA
graphs on (the default) against eager: an fp8 KV cache on the Triton kernels, seeded top-k /
top-p sampling (the Triton filter), and an MoE model (its routing inside the captured graph).
Needs a GPU (marked ``gpu``; benchmarks/gpu_check.sh runs them)."""
from __future__ import annotations

import math

import pytest
import torch
from conftest import hf_greedy, make_model_dir, random_prompts

from pagedllm import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

GREEDY = SamplingParams(temperature=0, max_tokens=8, min_tokens=8, ignore_eos=True, logprobs=0)


def _generate(model_dir: str, prompts, params, **kwargs):
    """(the model runner, each prompt's completion), on CUDA with the engine's defaults (``auto``
    attention: the Triton kernels; CUDA graphs unless ``enforce_eager``)."""
    llm = LLM(model_dir, device="cuda", block_size=16, num_gpu_blocks_override=128, max_model_len=256,
              max_num_seqs=12, **kwargs)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return llm.llm_engine.executor.runner, [o.outputs[0] for o in outs]


def _graphed_and_eager(model_dir: str, prompts, params, **kwargs):
    graphed, g_outs = _generate(model_dir, prompts, params, **kwargs)
    eager, e_outs = _generate(model_dir, prompts, params, enforce_eager=True, **kwargs)
    assert graphed.decode_graphs is not None and graphed.decode_graphs.replays >= 7
    assert eager.decode_graphs is None
    return g_outs, e_outs


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_fp8_kv_cache_graphs_equal_eager(dtype, kv_cache_dtype, tmp_path):
    """In float32 the captured steps and eager agree token for token; in float16 (the tensor-core
    path, where the graph's split count, fixed by max_model_len, rounds differently from eager's)
    the steps replay, every logprob is finite and the first tokens, from the eager prefill, agree."""
    model_dir = make_model_dir(tmp_path, "llama", hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    prompts = random_prompts(5, seed=31, lo=3, hi=40)
    g_outs, e_outs = _graphed_and_eager(model_dir, prompts, GREEDY, dtype=dtype, kv_cache_dtype=kv_cache_dtype)
    for g, e in zip(g_outs, e_outs):
        assert g.token_ids[0] == e.token_ids[0] and math.isfinite(g.cumulative_logprob)
        if dtype == "float32":
            assert g.token_ids == e.token_ids


def test_seeded_top_k_top_p_sampling_graphs_equal_eager(llama_dir):
    """The sampler runs after the graph on the logits it wrote: with per-request seeds the same
    tokens come out of replayed and eager steps."""
    prompts = random_prompts(5, seed=32, lo=3, hi=40)
    params = [SamplingParams(temperature=0.8, top_k=k, top_p=p, min_p=m, seed=40 + i, max_tokens=8, min_tokens=8,
                             ignore_eos=True)
              for i, (k, p, m) in enumerate([(20, 0.9, 0.0), (0, 0.7, 0.0), (5, 1.0, 0.0), (0, 0.95, 0.05),
                                             (50, 0.8, 0.1)])]
    g_outs, e_outs = _graphed_and_eager(llama_dir, prompts, params, dtype="float32")
    assert [g.token_ids for g in g_outs] == [e.token_ids for e in e_outs]
    assert len({tuple(g.token_ids) for g in g_outs}) == len(prompts)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_moe_model_graphs_equal_eager_and_transformers(arch, model_dirs, hf_models):
    """An MoE model's decode steps capture (no host sync in the routing) and replay to the eager
    and transformers greedy tokens."""
    prompts = random_prompts(5, seed=33, lo=3, hi=40)
    g_outs, e_outs = _graphed_and_eager(model_dirs[arch], prompts, GREEDY, dtype="float32")
    for g, e, p in zip(g_outs, e_outs, prompts):
        assert g.token_ids == e.token_ids == hf_greedy(hf_models[arch], p, 8)

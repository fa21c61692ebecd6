"""``kv_cache_dtype``: K/V stored in half precision while the model computes in float32."""
from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy, random_prompts

from pagedllm import LLM, SamplingParams

PROMPTS = random_prompts(6, seed=11, lo=4, hi=40)


def _llm(model_dir, **kw):
    return LLM(model_dir, block_size=8, max_model_len=128, **kw)


@pytest.mark.parametrize("backend", ["auto", "sdpa", "torch"])
@pytest.mark.parametrize("cache_dtype", ["float16", "bfloat16"])
def test_half_cache_tracks_transformers(llama_dir, hf_models, backend, cache_dtype):
    llm = _llm(llama_dir, num_gpu_blocks_override=64, kv_cache_dtype=cache_dtype, attention_backend=backend)
    runner = llm.llm_engine.executor.runner
    assert runner.cache.kv.dtype == getattr(torch, cache_dtype)
    assert next(runner.model.parameters()).dtype == torch.float32
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    model = hf_models["llama"]
    # rounding K/V to 16 bits moves the logits by ~1e-3: the greedy tokens must still match
    # transformers' float32 run, and the chosen tokens' logprobs must stay close to its
    for prompt, out in zip(PROMPTS, outs):
        gen = out.outputs[0].token_ids
        assert gen == hf_greedy(model, prompt, 8)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + gen])).logits[0]
        ref = torch.log_softmax(logits, -1)[len(prompt) - 1:-1].gather(1, torch.tensor(gen)[:, None]).squeeze(1)
        got = torch.tensor([lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, gen)])
        torch.testing.assert_close(got, ref, atol=2e-2 if cache_dtype == "bfloat16" else 3e-3, rtol=0)
    assert llm.get_kv_cache_stats().num_used_blocks == 0


def test_half_cache_holds_twice_the_blocks(llama_dir):
    full = _llm(llama_dir, kv_cache_memory="1MiB")
    half = _llm(llama_dir, kv_cache_memory="1MiB", kv_cache_dtype="float16")
    assert half.get_kv_cache_stats().num_blocks == 2 * full.get_kv_cache_stats().num_blocks


def test_unsupported_cache_dtype(llama_dir):
    with pytest.raises(ValueError, match="kv_cache_dtype='int8'"):
        _llm(llama_dir, num_gpu_blocks_override=64, kv_cache_dtype="int8")

"""``prompt_logprobs`` against transformers' logits over the same prompt."""
from __future__ import annotations

import pytest
import torch
from conftest import random_prompts

from pagedllm import LLM, SamplingParams

PROMPTS = random_prompts(5, seed=31, lo=2, hi=45) + [[7]]  # ... and a one-token prompt
TOP = 3


def _check(out, prompt, hf_model, top=TOP):
    pl = out.prompt_logprobs
    assert len(pl) == len(prompt) and pl[0] is None
    if len(prompt) == 1:
        return
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].float(), -1)  # [len, vocab]
    for p in range(1, len(prompt)):
        entry, row, tok = pl[p], ref[p - 1], prompt[p]
        assert abs(entry[tok].logprob - row[tok].item()) < 1e-4
        assert entry[tok].rank == int((row > row[tok]).sum()) + 1
        top_ids = row.topk(top).indices.tolist()
        assert set(entry) == set(top_ids) | {tok}
        assert [entry[t].rank for t in top_ids] == list(range(1, top + 1))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("budget", [None, 16], ids=["whole", "chunked16"])
def test_prompt_logprobs_match_transformers(arch, budget, model_dirs, hf_models):
    kw = {} if budget is None else dict(max_num_batched_tokens=budget)
    llm = LLM(model_dirs[arch], block_size=8, num_gpu_blocks_override=200, max_model_len=128, **kw)
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=TOP)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for out, prompt in zip(outs, PROMPTS):
        _check(out, prompt, hf_models[arch])
    no_logprobs = llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=2), use_tqdm=False)
    assert no_logprobs[0].prompt_logprobs is None


def test_prefix_cache_does_not_skip_scored_prompts(llama_dir, hf_models):
    llm = LLM(llama_dir, block_size=8, num_gpu_blocks_override=200, max_model_len=128)
    prompt = random_prompts(1, seed=32, lo=40, hi=41)[0]
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=2), use_tqdm=False)  # now cached
    hits = llm.get_kv_cache_stats().prefix_cache_hits
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=2, prompt_logprobs=0),
                       use_tqdm=False)[0]
    assert llm.get_kv_cache_stats().prefix_cache_hits == hits and out.num_cached_tokens == 0
    _check(out, prompt, hf_models["llama"], top=0)
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=2), use_tqdm=False)
    assert llm.get_kv_cache_stats().prefix_cache_hits > hits  # requests without them still hit


def test_n_delta_and_preemption(llama_dir, hf_models):
    llm = LLM(llama_dir, block_size=8, num_gpu_blocks_override=24, max_model_len=128)
    prompts = random_prompts(3, seed=33, lo=40, hi=41)
    params = SamplingParams(temperature=1.0, seed=1, n=2, max_tokens=30, ignore_eos=True, prompt_logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.llm_engine.scheduler.stats.num_preemptions > 0  # recomputed prompts score the same
    for out, prompt in zip(outs, prompts):
        assert len(out.outputs) == 2
        _check(out, prompt, hf_models["llama"], top=1)
    engine = llm.llm_engine
    engine.add_request("d", {"prompt_token_ids": prompts[0]},
                       SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=1, output_kind="delta"))
    carried = []
    while engine.has_unfinished_requests():
        carried += [o.prompt_logprobs is not None for o in engine.step()]
    assert carried == [True, False, False, False]  # once, in the first delta
    assert llm.get_kv_cache_stats().num_used_blocks == 0

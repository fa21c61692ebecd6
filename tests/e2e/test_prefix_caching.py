"""Prefix caching end to end: identical outputs, counted hits, reset."""
from __future__ import annotations

from conftest import random_prompts

from pagedllm import LLM, SamplingParams

SYSTEM = random_prompts(1, seed=30, lo=40, hi=41)[0]  # 40 tokens: 5 full blocks of 8
PROMPTS = [SYSTEM + tail for tail in random_prompts(6, seed=31, lo=1, hi=20)]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _run(llm, prompts=PROMPTS):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_prefix_caching_on_and_off_give_identical_outputs(llama_dir):
    off = LLM(llama_dir, block_size=8, num_gpu_blocks_override=200, enable_prefix_caching=False)
    on = LLM(llama_dir, block_size=8, num_gpu_blocks_override=200)
    expected = _run(off)
    _run(on, PROMPTS[:1])  # warm the cache with the shared system prompt
    assert _run(on) == expected
    stats = on.get_kv_cache_stats()
    assert stats.prefix_cache_hits >= 6 * 40  # every request reused the 5 system-prompt blocks
    assert 0 < stats.prefix_cache_hit_rate < 1
    assert off.get_kv_cache_stats().prefix_cache_hits == 0
    metrics = {m.name: m.value for m in on.get_metrics() if not m.labels}
    assert metrics["pagedllm:prefix_cache_hits"] == stats.prefix_cache_hits
    assert metrics["pagedllm:prefix_cache_queries"] == stats.prefix_cache_queries


def test_cached_blocks_survive_until_reset(llama_dir):
    llm = LLM(llama_dir, block_size=8, num_gpu_blocks_override=200)
    _run(llm, PROMPTS[:1])
    assert llm.get_kv_cache_stats().num_cached_blocks >= 5
    hits = llm.get_kv_cache_stats().prefix_cache_hits
    assert llm.reset_prefix_cache() is True
    assert llm.get_kv_cache_stats().num_cached_blocks == 0
    _run(llm, PROMPTS[:1])
    assert llm.get_kv_cache_stats().prefix_cache_hits == hits  # nothing left to hit


def test_prompt_shorter_than_a_block_never_hits(llama_dir):
    llm = LLM(llama_dir, block_size=16, num_gpu_blocks_override=200)
    short = [SYSTEM[:10]]
    _run(llm, short)
    _run(llm, short)
    assert llm.get_kv_cache_stats().prefix_cache_hits == 0


def test_utilization_and_stats_while_running(llama_dir):
    llm = LLM(llama_dir, block_size=8, num_gpu_blocks_override=200)
    engine = llm.llm_engine
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), {"prompt_token_ids": p}, GREEDY)
    engine.step()
    s = llm.get_kv_cache_stats()
    assert s.num_used_blocks > 0 and s.num_used_blocks + s.num_free_blocks == s.num_blocks
    # shared system-prompt blocks count once: stored tokens <= capacity of used blocks
    assert 0 < s.utilization <= 1
    assert s.num_tokens_stored == sum(len(p) for p in PROMPTS) - 5 * 8 * (len(PROMPTS) - 1)
    while engine.has_unfinished_requests():
        engine.step()
    assert llm.get_kv_cache_stats().num_used_blocks == 0

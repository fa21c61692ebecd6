"""Speculation waits for a request's first output token: a prompt whose last token is left for a
later chunk (the token budget cut it one short) looked like a decoding request, got drafts, and
its ``n`` siblings were never forked (the engine loop died on an IndexError in the server soak)."""
from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
PROMPT = [{"prompt_token_ids": [5, 6, 7, 8] * 4 + [5]}]  # 17 tokens, repeating: the n-gram finds drafts


@pytest.mark.parametrize("n, temperature", [(1, 0.0), (3, 1.0)])
def test_a_prompt_cut_one_short_is_not_speculated(llama_dir, n, temperature):
    params = SamplingParams(n=n, temperature=temperature, seed=3, max_tokens=12, ignore_eos=True)
    plain = LLM(llama_dir, block_size=8, num_gpu_blocks_override=64, max_model_len=128, max_num_batched_tokens=16)
    want = [c.token_ids for c in plain.generate(PROMPT, params, use_tqdm=False)[0].outputs]
    llm = LLM(llama_dir, block_size=8, num_gpu_blocks_override=64, max_model_len=128, max_num_batched_tokens=16,
              speculative_config=NGRAM)
    got = [c.token_ids for c in llm.generate(PROMPT, params, use_tqdm=False)[0].outputs]
    assert len(got) == n and all(len(t) == 12 for t in got)
    if temperature == 0:
        assert got == want
    stats = llm.get_kv_cache_stats()
    assert stats.num_free_blocks == stats.num_blocks

"""Phi-3 LongRoPE per request (layers/rotary_variants.py) against transformers.

A tiny random Phi-3 with original context L = 48 served with max_model_len 256: requests of at
most L tokens rotate with the short factors, longer ones with the long factors, and a request
that grows past L while decoding has its K/V recomputed with the long factors (the scheduler
frees its blocks and re-admits it, as a recompute preemption does).
"""
from __future__ import annotations

import pytest
import torch
from conftest import make_model_dir, random_prompts
from test_families import GREEDY, _assert_logprobs_match, _generate, hf_greedy

from pagedllm import LLM, SamplingParams

ORIGINAL = 48
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.3, 2.0, 3.0], "long_factor": [1.5, 3.0, 5.0, 9.0],
            "original_max_position_embeddings": ORIGINAL, "partial_rotary_factor": 0.5}


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    import transformers as tf
    path = make_model_dir(tmp_path_factory.mktemp("phi3_longrope"), "phi3", rope_scaling=LONGROPE,
                          partial_rotary_factor=0.5, original_max_position_embeddings=ORIGINAL)
    hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, block_size=8, max_num_batched_tokens=32, max_model_len=256, num_gpu_blocks_override=300)
    return hf, llm, path


@pytest.mark.parametrize("lo, hi", [(5, ORIGINAL - GREEDY.max_tokens), (ORIGINAL + 1, 120)], ids=["short", "long"])
def test_short_and_long_requests_match_transformers(phi3, lo, hi):
    """Short requests (within L through their last token) rotate with the short factors, as
    transformers does for them, although max_model_len is past L; long prompts with the long ones
    from their first prefill chunk (32-token chunks: the first ends within L)."""
    hf, llm, _ = phi3
    prompts = random_prompts(6, seed=lo, lo=lo, hi=hi)
    outs = _generate(llm, prompts)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]
    _assert_logprobs_match(hf, prompts, outs)


def test_request_crossing_the_original_context_matches_transformers(phi3):
    """Prompts of 38-47 tokens decode 20 tokens, crossing L = 48 on the way.

    transformers' ``generate`` for Phi-3 (``Phi3ForCausalLM.prepare_inputs_for_generation``):
    while the sequence has at most L tokens each forward rotates with the short factors (its
    largest position is below L) and extends the cache; on the step whose input first has L + 1
    tokens it drops the cache and runs the whole sequence again, which rotates every position with
    the long factors (``longrope_frequency_update``: largest position + 1 > L); later steps extend
    that cache, all long. So the tokens up to the (L + 1)-th come from short-factor attention, the
    rest from long-factor attention over an all-long cache. The engine computes exactly that: short
    factors until the request holds L + 1 tokens, then a recompute of all of them with the long
    factors. Prefix caching is on: the recomputed blocks must not hit the request's own freed
    short-factor blocks (their hashes key on the factor set), and a second run of the same prompts
    hits the long-factor blocks of the first run's recomputation.
    """
    hf, llm, _ = phi3
    prompts = random_prompts(6, seed=7, lo=ORIGINAL - 10, hi=ORIGINAL)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    refs = [hf_greedy(hf, p, 20) for p in prompts]
    before = llm.get_kv_cache_stats().num_preemptions
    for _ in range(2):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        llm.llm_engine.scheduler.kv.check_integrity()
        assert [o.outputs[0].token_ids for o in outs] == refs
    assert llm.get_kv_cache_stats().num_preemptions == before  # the switch is not counted as a preemption


def test_the_factor_sets_differ_on_these_prompts(phi3):
    """The checks above can fail: transformers' short and long factors give different greedy
    continuations for some of the short prompts (so picking one set per engine, from max_model_len,
    would not match)."""
    hf, _, _ = phi3
    prompts = random_prompts(6, seed=5, lo=5, hi=ORIGINAL - GREEDY.max_tokens)
    short = [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    long_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](hf.config, torch.device("cpu"), seq_len=ORIGINAL + 1)
    rotary = hf.model.rotary_emb
    saved = rotary.original_inv_freq.clone()
    try:
        rotary.original_inv_freq.copy_(long_freq)  # transformers' "short" set replaced by the long one
        long = [hf_greedy(hf, p, GREEDY.max_tokens) for p in prompts]
    finally:
        rotary.original_inv_freq.copy_(saved)
    assert short != long


def test_self_drafting_across_the_original_context(phi3):
    """Speculative decoding with the model as its own draft, on requests that cross L: the target
    verifies no short-factor draft past L (its K/V would need the long factors), and the draft
    model switches to the long factors too, so the draft agrees with the target on every token it
    proposes, and the output is transformers' greedy one."""
    hf, _, path = phi3
    prompts = random_prompts(4, seed=8, lo=ORIGINAL - 10, hi=ORIGINAL)
    llm = LLM(path, block_size=8, max_model_len=256, num_gpu_blocks_override=300,
              speculative_config={"model": path, "num_speculative_tokens": 3})
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 20) for p in prompts]
    metrics = {m.name: m.value for m in llm.get_metrics() if not m.labels}
    drafted = metrics["pagedllm:spec_decode_num_draft_tokens"]
    assert drafted > 0 and metrics["pagedllm:spec_decode_num_accepted_tokens"] == drafted

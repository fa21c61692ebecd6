"""Constraints that leave a sequence no token: it ends with finish_reason "constraint" (or "stop"
when its grammar has matched a whole string), never with a token they forbid; the rest of the
batch is unaffected and every KV block is freed. Refused up front where the first step shows it.

Tokens of the test tokenizer: "a" = 67 and "aa" = [67, 67], so allowed_token_ids=[67] with the bad
word "aa" allows one "a" and then nothing; EOS = 2.
"""
from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams, StructuredOutputsParams

A, EOS = 67, 2
PROMPT = [{"prompt_token_ids": [5, 6, 7, 8, 9]}]


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, block_size=8, num_gpu_blocks_override=64, max_model_len=128)


def _assert_all_blocks_free(llm):
    stats = llm.get_kv_cache_stats()
    assert stats.num_free_blocks == stats.num_blocks
    llm.llm_engine.scheduler.kv.check_integrity()


def _one_a(temperature: float, **fields) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=1, max_tokens=6, allowed_token_ids=[A], bad_words=["aa"],
                          **fields)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_sequence_left_without_a_token_ends_and_its_neighbours_run_on(llm, temperature):
    free = SamplingParams(temperature=temperature, seed=2, max_tokens=6, ignore_eos=True)
    alone = llm.generate(PROMPT, free, use_tqdm=False)[0].outputs[0].token_ids
    outs = llm.generate(PROMPT * 2, [_one_a(temperature, n=2), free], use_tqdm=False)
    for c in outs[0].outputs:
        assert (c.token_ids, c.finish_reason, c.text) == ([A], "constraint", "a")
    assert outs[1].outputs[0].token_ids == alone and outs[1].outputs[0].finish_reason == "length"
    _assert_all_blocks_free(llm)


def test_grammar_and_allowed_ids_that_exclude_each_other(llm):
    """The grammar wants "yes", only "a" is allowed: no token at all. A grammar matched in full whose
    stop token is not allowed ends with "stop"."""
    so = StructuredOutputsParams
    none = SamplingParams(temperature=0, max_tokens=4, allowed_token_ids=[A], structured_outputs=so(choice=["yes"]))
    whole = SamplingParams(temperature=1, max_tokens=4, allowed_token_ids=[A], structured_outputs=so(choice=["a"]))
    outs = llm.generate(PROMPT * 2, [none, whole], use_tqdm=False)
    assert (outs[0].outputs[0].token_ids, outs[0].outputs[0].finish_reason) == ([], "constraint")
    assert (outs[1].outputs[0].token_ids, outs[1].outputs[0].finish_reason) == ([A], "stop")
    _assert_all_blocks_free(llm)


def test_min_tokens_never_lets_a_masked_eos_through(llm):
    """allowed {a, EOS}, bad word "aa", min_tokens 3: after one "a" both are masked."""
    params = SamplingParams(temperature=1, seed=0, max_tokens=6, min_tokens=3, allowed_token_ids=[A, EOS],
                            bad_words=["aa"])
    c = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    assert (c.token_ids, c.finish_reason) == ([A], "constraint")
    assert llm.llm_engine.counters.request_success["constraint"] > 0


@pytest.mark.parametrize("fields", [dict(allowed_token_ids=[A], bad_words=["a"]),
                                    dict(allowed_token_ids=[EOS], min_tokens=2),
                                    dict(allowed_token_ids=[9], stop_token_ids=[9], min_tokens=1)])
def test_allowed_ids_masked_at_the_first_step_are_refused(llm, fields):
    with pytest.raises(ValueError, match="allowed_token_ids=.* leaves no token to sample"):
        llm.generate(PROMPT, SamplingParams(max_tokens=4, **fields), use_tqdm=False)


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("method", ["ngram", "self-draft"])
def test_speculative_verification_never_accepts_a_forbidden_token(llama_dir, method, temperature):
    """The prompt repeats "a" (the n-gram proposes more); the draft model's rows have no min_tokens
    mask, so it proposes EOS where the target's row is empty: both are rejected."""
    spec = NGRAM if method == "ngram" else {"model": llama_dir, "num_speculative_tokens": 3}
    llm = LLM(llama_dir, block_size=8, num_gpu_blocks_override=64, max_model_len=128, speculative_config=spec)
    params = SamplingParams(temperature=temperature, seed=0, max_tokens=8, min_tokens=4,
                            allowed_token_ids=[A, EOS], bad_words=["aa"])
    c = llm.generate([{"prompt_token_ids": [A, 5, A, 5, A]}], params, use_tqdm=False)[0].outputs[0]
    assert (c.token_ids, c.finish_reason) == ([A], "constraint")
    drafts = {m.name: m.value for m in llm.get_metrics()}.get("pagedllm:spec_decode_num_draft_tokens", 0)
    assert drafts > 0
    _assert_all_blocks_free(llm)

"""Per-request options of the offline API: ``priority`` (scheduling_policy="priority") and the
prompt dict's ``cache_salt``, end to end through ``LLM.generate``."""
from __future__ import annotations

import pytest
from conftest import random_prompts

from pagedllm import LLM, SamplingParams
from pagedllm.sampling_params import BeamSearchParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = random_prompts(4, seed=41, lo=5, hi=12)


def test_priority_orders_admission_and_leaves_outputs_alone(llama_dir):
    fcfs = LLM(llama_dir, block_size=8, num_gpu_blocks_override=64)
    by_priority = LLM(llama_dir, block_size=8, num_gpu_blocks_override=64, max_num_seqs=1,
                      scheduling_policy="priority")
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    outs = by_priority.generate(prompts, GREEDY, use_tqdm=False, priority=[3, 0, 2, 1])
    first = {o.request_id: o.metrics.first_scheduled_time for o in outs}
    order = sorted(range(4), key=lambda k: first[outs[k].request_id])
    assert order == [1, 3, 2, 0]  # one sequence at a time: strictly by priority
    expected = fcfs.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]
    assert by_priority.get_kv_cache_stats().num_used_blocks == 0


def test_priority_is_refused_where_it_cannot_apply(llama_dir):
    fcfs = LLM(llama_dir, block_size=8, num_gpu_blocks_override=64)
    with pytest.raises(ValueError, match=r"priority=1 needs scheduling_policy='priority'"):
        fcfs.generate([PROMPTS[0], PROMPTS[1]], GREEDY, use_tqdm=False, priority=[0, 1])
    assert not fcfs.llm_engine.has_unfinished_requests()  # the first prompt, accepted, was withdrawn
    with pytest.raises(ValueError, match="priority has 1 values for 2 prompts"):
        fcfs.generate([PROMPTS[0], PROMPTS[1]], GREEDY, use_tqdm=False, priority=[0])
    by_priority = LLM(llama_dir, block_size=8, num_gpu_blocks_override=64, scheduling_policy="priority")
    with pytest.raises(ValueError, match=r"priority='high' is invalid"):
        by_priority.generate([PROMPTS[0]], GREEDY, use_tqdm=False, priority=["high"])
    with pytest.raises(ValueError, match="scheduling_policy='lifo' must be one of"):
        LLM(llama_dir, scheduling_policy="lifo")


def test_cache_salt_separates_prefix_cache_hits(llama_dir):
    llm = LLM(llama_dir, block_size=8, num_gpu_blocks_override=64)
    prompt = random_prompts(1, seed=42, lo=33, hi=34)[0]  # 4 full blocks of 8

    def cached(**salt) -> int:
        out = llm.generate([{"prompt_token_ids": prompt, **salt}], GREEDY, use_tqdm=False)[0]
        return out.num_cached_tokens

    assert cached(cache_salt="alice") == 0
    assert cached(cache_salt="alice") == 32  # same salt: the prompt's full blocks are shared
    assert cached(cache_salt="bob") == 0  # another salt: nothing shared
    assert cached() == 0  # unsalted: nothing shared with the salted ones either
    assert cached() == 32
    engine = llm.llm_engine  # a salt given twice, differently: refused, neither is dropped
    with pytest.raises(ValueError, match="cache_salt='bob' differs from the prompt's cache_salt='alice'"):
        engine.add_request("x", {"prompt_token_ids": prompt, "cache_salt": "alice"}, GREEDY, cache_salt="bob")
    engine.add_request("y", {"prompt_token_ids": prompt, "cache_salt": "alice"}, GREEDY, cache_salt="alice")
    while engine.has_unfinished_requests():
        outs = [o for o in engine.step() if o.finished]
    assert outs[0].num_cached_tokens == 32  # the same salt both ways: alice's blocks
    assert llm.get_kv_cache_stats().num_used_blocks == 0


@pytest.mark.parametrize("prompt, message", [
    ({"prompt_token_ids": [5, 6], "cache_salt": ""}, "cache_salt='' is invalid"),
    ({"prompt_token_ids": [5, 6], "cache_salt": 7}, "cache_salt=7 is invalid"),
    ({"prompt_token_ids": [5, 6], "multi_modal_data": {}}, r"prompt has keys \['multi_modal_data'\]"),
])
def test_bad_prompt_dicts_are_refused_by_name(llama_dir, prompt, message):
    llm = LLM(llama_dir, block_size=8, num_gpu_blocks_override=64)
    with pytest.raises(ValueError, match=message):
        llm.generate([prompt], GREEDY, use_tqdm=False)
    assert llm.generate([{"prompt_token_ids": [5, 6]}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_beam_search_without_max_tokens_runs_to_max_model_len(llama_dir):
    llm = LLM(llama_dir, block_size=8, num_gpu_blocks_override=64, max_model_len=24)
    out = llm.beam_search([{"prompt_token_ids": PROMPTS[0]}],
                          BeamSearchParams(beam_width=2, max_tokens=None, ignore_eos=True))[0]
    assert [len(s.output_token_ids) for s in out.sequences] == [24 - len(PROMPTS[0])] * 2
    assert llm.get_kv_cache_stats().num_used_blocks == 0
    with pytest.raises(ValueError, match="max_tokens=0 is invalid"):
        BeamSearchParams(beam_width=2, max_tokens=0)

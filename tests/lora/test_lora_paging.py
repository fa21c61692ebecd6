"""Adapter weights paged like the KV cache, end to end: more adapters than device slots (and than
host-memory entries) in flight, preemption with adapters, prefix caching that never shares K/V
between adapters. The reference is an engine with a slot for every adapter (whose outputs equal
transformers + PEFT: test_lora_offline.py)."""
from __future__ import annotations

import pytest
from adapters import make_adapter
from conftest import make_model_dir, random_prompts

from pagedllm import LLM, LoRARequest, SamplingParams

pytest.importorskip("peft")
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
TARGETS = (["q_proj", "v_proj"], ["o_proj", "down_proj"], ["k_proj", "gate_proj"], ["up_proj"], ["q_proj", "o_proj"])


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base = make_model_dir(tmp_path_factory.mktemp("base"), "llama")
    loras = [LoRARequest(f"a{i}", i + 1, make_adapter(base, tmp_path_factory.mktemp(f"a{i}"), 4 + 4 * (i % 2), 8,
                                                     targets, seed=10 + i))
             for i, targets in enumerate(TARGETS)]
    prompts = [{"prompt_token_ids": p} for p in random_prompts(12, seed=5, lo=20, hi=40)]
    choice = [loras[i % 5] if i % 6 != 5 else None for i in range(len(prompts))]
    with LLM(base, enable_lora=True, max_loras=5, block_size=8) as roomy:
        reference = _tokens(roomy.generate(prompts, PARAMS, lora_request=choice, use_tqdm=False))
    return base, loras, prompts, choice, reference


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _slots_all_free(llm) -> None:
    pool = llm.llm_engine.scheduler.lora_slots
    pool.check_invariants()
    assert sum(pool.refs) == 0 and pool.num_free_slots == pool.num_slots


def test_more_adapters_than_slots_in_flight(setup):
    base, loras, prompts, choice, reference = setup
    with LLM(base, enable_lora=True, max_loras=2, max_cpu_loras=3, block_size=8, max_num_seqs=6) as llm:
        assert _tokens(llm.generate(prompts, PARAMS, lora_request=choice, use_tqdm=False)) == reference
        stats = llm.llm_engine.scheduler.lora_slots.stats
        assert stats.evictions >= len(loras) - 2 and stats.loads >= len(loras)  # 5 adapters through 2 slots
        _slots_all_free(llm)
        assert len(llm.llm_engine.executor.runner.lora.host) <= 3  # the host-memory LRU is bounded
        metrics = {m.name: m for m in llm.get_metrics()}
        assert metrics["pagedllm:lora_evictions"].value == stats.evictions
        assert metrics["pagedllm:lora_requests_info"].labels == {"running_lora_adapters": "",
                                                                 "waiting_lora_adapters": "", "max_lora": "2"}


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_with_adapters_keeps_outputs(setup, mode):
    base, loras, prompts, choice, reference = setup
    with LLM(base, enable_lora=True, max_loras=3, block_size=8, num_gpu_blocks_override=20, max_model_len=64,
             preemption_mode=mode, watermark=0.0, swap_space=0.01) as llm:
        assert _tokens(llm.generate(prompts, PARAMS, lora_request=choice, use_tqdm=False)) == reference
        assert llm.get_kv_cache_stats().preemptions_by_mode[mode] > 0
        _slots_all_free(llm)


def test_prefix_cache_never_shares_blocks_between_adapters(setup):
    base, loras, prompts, choice, reference = setup
    prompt = prompts[0]  # 20+ tokens: at least two full blocks of 8
    with LLM(base, enable_lora=True, max_loras=2, block_size=8, enable_prefix_caching=True) as llm:
        def run(lora):
            out = llm.generate([prompt], PARAMS, lora_request=lora, use_tqdm=False)[0]
            return out.num_cached_tokens, out.outputs[0].token_ids
        first = run(loras[0])
        other, again, base_run = run(loras[1]), run(loras[0]), run(None)
        assert first[0] == 0 and other[0] == 0 and base_run[0] == 0  # nothing shared across adapters
        assert again[0] >= 16 and again[1] == first[1] == reference[0]  # the same adapter does hit
        assert other[1] != first[1]

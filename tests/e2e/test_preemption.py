"""Preemption (recompute and swap) under a cache too small for all requests leaves outputs unchanged."""
from __future__ import annotations

import pytest
from conftest import random_prompts

from pagedllm import LLM, SamplingParams

PROMPTS = random_prompts(12, seed=3, lo=20, hi=40)


def _outputs(llm, params=None):
    params = params or SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def reference(llama_dir):
    roomy = LLM(llama_dir, block_size=8, num_gpu_blocks_override=400)
    seeded_n = SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=24, ignore_eos=True)
    return _outputs(roomy), _outputs(roomy, seeded_n)


def _tight(llama_dir, mode, **kw):
    return LLM(llama_dir, block_size=8, num_gpu_blocks_override=24, max_model_len=128, preemption_mode=mode,
               watermark=0.0, **kw)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_outputs(llama_dir, reference, mode):
    tight = _tight(llama_dir, mode, swap_space=0.01)
    assert _outputs(tight) == reference[0]
    stats = tight.get_kv_cache_stats()
    assert stats.num_preemptions > 0 and stats.preemptions_by_mode[mode] > 0
    metrics = {m.name: m.value for m in tight.get_metrics() if not m.labels}
    assert metrics["pagedllm:num_preemptions"] == stats.num_preemptions
    assert stats.num_free_blocks == 24 and stats.num_cpu_free_blocks == stats.num_cpu_blocks
    tight.llm_engine.scheduler.kv.check_integrity()
    if mode == "swap":
        assert stats.num_cpu_blocks > 0


def test_swap_falls_back_to_recompute_when_cpu_pool_is_small(llama_dir, reference):
    tight = _tight(llama_dir, "swap", swap_space=2 * 4096 / 1024**3)  # room for two blocks only
    assert tight.get_kv_cache_stats().num_cpu_blocks == 2
    assert _outputs(tight) == reference[0]
    assert tight.get_kv_cache_stats().preemptions_by_mode["recompute"] > 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_parallel_sampling_survives_preemption(llama_dir, reference, mode):
    tight = _tight(llama_dir, mode, swap_space=0.01)
    seeded_n = SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=24, ignore_eos=True)
    assert _outputs(tight, seeded_n) == reference[1]
    assert tight.get_kv_cache_stats().num_preemptions > 0


def test_runner_forgets_the_block_table_rows_of_finished_requests(llama_dir):
    """Released tables reach the runner even through a step that has nothing else to run."""
    from pagedllm import LLM, SamplingParams
    llm = LLM(llama_dir, num_gpu_blocks_override=64, max_model_len=128)
    llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=3), use_tqdm=False)
    runner = llm.llm_engine.executor.runner
    assert len(runner.block_table.rows) == 2  # finished in the last step: released by the next one
    llm.llm_engine.step()  # idle: no tokens, only the release
    assert not runner.block_table.rows and llm.get_kv_cache_stats().num_used_blocks == 0

"""Preemption under a cache too small for all requests leaves outputs unchanged."""
from __future__ import annotations

from conftest import random_prompts
from pagedllm import LLM, SamplingParams


def _outputs(llm, prompts):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_recompute_preemption_keeps_outputs(llama_dir):
    prompts = random_prompts(12, seed=3, lo=20, hi=40)
    roomy = LLM(llama_dir, block_size=8, num_gpu_blocks_override=400)
    tight = LLM(llama_dir, block_size=8, num_gpu_blocks_override=24, max_model_len=128, preemption_mode="recompute",
                watermark=0.0)
    assert _outputs(tight, prompts) == _outputs(roomy, prompts)
    metrics = {m.name: m.value for m in tight.get_metrics() if not m.labels}
    assert metrics["pagedllm:num_preemptions"] > 0
    assert tight.get_kv_cache_stats().num_free_blocks == 24
    tight.llm_engine.scheduler.kv.check_integrity()

"""LoRA under tensor parallelism on CPU (gloo): A/B sharded as vLLM (column-parallel layers keep A
whole and take their rows of B, row-parallel ones take their columns of A; the layer's all-reduce
sums the shards), two ranks give one rank's greedy output for a mixed batch."""
from __future__ import annotations

import pytest
from adapters import ADAPTERS, make_adapter
from conftest import make_model_dir, random_prompts

from pagedllm import LLM, LoRARequest, SamplingParams

pytest.importorskip("peft")


def test_tp2_with_adapters_matches_tp1(tmp_path_factory):
    base = make_model_dir(tmp_path_factory.mktemp("tp-base"), "qwen2")
    loras = [LoRARequest(f"a{i}", i + 1, make_adapter(base, tmp_path_factory.mktemp(f"tp{i}"), *spec, seed=30 + i))
             for i, spec in enumerate(ADAPTERS)]
    prompts = [{"prompt_token_ids": p} for p in random_prompts(6, seed=42, lo=5, hi=30)]
    choice = [loras[0], loras[1], None, loras[2], loras[1], None]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    with LLM(base, enable_lora=True, max_loras=3, num_gpu_blocks_override=200) as single:
        want = single.generate(prompts, params, lora_request=choice, use_tqdm=False)
    with LLM(base, enable_lora=True, max_loras=2, num_gpu_blocks_override=200, tensor_parallel_size=2,
             num_threads=1) as tp:
        got = tp.generate(prompts, params, lora_request=choice, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for a, b in zip(got, want):
        assert abs(a.outputs[0].cumulative_logprob - b.outputs[0].cumulative_logprob) < 1e-3

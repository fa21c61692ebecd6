"""Tensor parallelism on CPU (gloo): two ranks give the same greedy output as one."""
from __future__ import annotations

import re

from conftest import random_prompts

from pagedllm import LLM, SamplingParams, StructuredOutputsParams


def test_tp2_matches_tp1(llama_dir):
    prompts = [{"prompt_token_ids": p} for p in random_prompts(6, seed=40)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)
    single = LLM(llama_dir, num_gpu_blocks_override=200).generate(prompts, params, use_tqdm=False)
    tp = LLM(llama_dir, num_gpu_blocks_override=200, tensor_parallel_size=2, num_threads=1)
    try:
        sharded = tp.generate(prompts, params, use_tqdm=False)
        # each rank holds half the KV heads: 2 KV heads -> 1 per rank
        assert tp.llm_engine.executor.runner.num_kv_heads == 1
        # structured outputs: the grammar masks rank 0's sampler rows (workers only run the model)
        regex = StructuredOutputsParams(regex="[a-c]{3}-[0-9]{2}")
        for out in tp.generate(prompts[:3], SamplingParams(seed=1, max_tokens=20, structured_outputs=regex),
                               use_tqdm=False):
            assert re.fullmatch("[a-c]{3}-[0-9]{2}", out.outputs[0].text), out.outputs[0].text
    finally:
        tp.llm_engine.shutdown()
    assert [o.outputs[0].token_ids for o in sharded] == [o.outputs[0].token_ids for o in single]
    for a, b in zip(sharded, single):
        assert abs(a.outputs[0].cumulative_logprob - b.outputs[0].cumulative_logprob) < 1e-3


def test_tp2_embeddings_match_tp1(llama_dir):
    """runner="pooling" under tensor parallelism: rank 0 hands back the hidden rows (the residual
    stream is whole on every rank), so the vectors equal one rank's."""
    prompts = [{"prompt_token_ids": p} for p in random_prompts(3, seed=41)]
    single = LLM(llama_dir, runner="pooling", num_gpu_blocks_override=200).embed(prompts, use_tqdm=False)
    tp = LLM(llama_dir, runner="pooling", num_gpu_blocks_override=200, tensor_parallel_size=2, num_threads=1)
    try:
        sharded = tp.embed(prompts, use_tqdm=False)
    finally:
        tp.llm_engine.shutdown()
    for a, b in zip(sharded, single):
        assert max(abs(x - y) for x, y in zip(a.outputs.embedding, b.outputs.embedding)) < 1e-5

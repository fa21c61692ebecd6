"""``compile_model=True``: torch.compile'd decoder layers still match transformers greedy."""
from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy, random_prompts

from pagedllm import LLM, SamplingParams
from pagedllm.models import cpu_decode


def test_compiled_layers_match_transformers(llama_dir, hf_models, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_FUSED_DECODE", "0")  # decode steps through the layers too
    llm = LLM(llama_dir, num_gpu_blocks_override=64, max_model_len=128, compile_model=True)
    layers = llm.llm_engine.executor.runner.model.model.layers
    assert all(type(layer).__name__ == "OptimizedModule" for layer in layers)
    prompts = random_prompts(3, seed=5, lo=5, hi=40)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf_models["llama"], p, 6) for p in prompts]


def test_enforce_eager_wins(llama_dir):
    llm = LLM(llama_dir, num_gpu_blocks_override=64, max_model_len=128, compile_model=True, enforce_eager=True)
    assert not llm.llm_engine.config.compile_model
    assert not any(type(m).__name__ == "OptimizedModule" for m in llm.llm_engine.executor.runner.model.model.layers)

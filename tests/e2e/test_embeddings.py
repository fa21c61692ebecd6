"""runner="pooling": LLM.embed's vectors are the final-normed hidden state of each prompt's last
token, as Hugging Face transformers computes it (its base model's last_hidden_state), L2-normalized
unless asked otherwise; chunked prefill, prefix-cache hits and a batch of prompts change nothing."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import ARCHS, random_prompts

from pagedllm import LLM, PoolingParams, SamplingParams

PROMPTS = random_prompts(3, seed=51, lo=4, hi=30)


def reference(hf, prompt: list[int], normalize: bool = True) -> torch.Tensor:
    with torch.no_grad():
        last = hf.base_model(torch.tensor([prompt])).last_hidden_state[0, -1]  # [hidden]
    return torch.nn.functional.normalize(last, dim=0) if normalize else last


def embed(llm: LLM, prompts, params=None) -> list[torch.Tensor]:
    outs = llm.embed([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [torch.tensor(o.outputs.embedding) for o in outs]


@pytest.mark.parametrize("arch", ARCHS)
def test_embeddings_match_transformers(model_dirs, hf_models, arch):
    llm = LLM(model_dirs[arch], runner="pooling", block_size=8, num_gpu_blocks_override=64)
    for got, prompt in zip(embed(llm, PROMPTS), PROMPTS):
        torch.testing.assert_close(got, reference(hf_models[arch], prompt), atol=2e-5, rtol=1e-4)
    assert llm.get_kv_cache_stats().num_used_blocks == 0


def test_chunked_prefill_prefix_hits_and_normalization(llama_dir, hf_models):
    hf = hf_models["llama"]
    long = random_prompts(1, seed=52, lo=45, hi=46)[0]
    llm = LLM(llama_dir, runner="pooling", block_size=8, num_gpu_blocks_override=64, max_num_batched_tokens=16)
    first, again = embed(llm, [long]), embed(llm, [long])  # 3 chunks; then 40 tokens from the prefix cache
    assert llm.get_kv_cache_stats().prefix_cache_hits >= 40
    for got in first + again:
        torch.testing.assert_close(got, reference(hf, long), atol=2e-5, rtol=1e-4)
    raw = embed(llm, [long], PoolingParams(normalize=False))[0]
    torch.testing.assert_close(raw, reference(hf, long, normalize=False), atol=1e-4, rtol=1e-4)
    assert abs(raw.norm().item() - 1.0) > 0.01  # not normalized
    unnormalized = LLM(llama_dir, runner="pooling", pooler_config={"normalize": False}, block_size=8,
                       num_gpu_blocks_override=64)
    torch.testing.assert_close(embed(unnormalized, [long])[0], raw, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(embed(unnormalized, [long], PoolingParams(normalize=True))[0], first[0],
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["MEAN", "CLS"])
def test_mean_and_cls_pooling_over_chunks_and_hits(llama_dir, hf_models, kind):
    """Every prompt position counts: chunked prefill sums chunk by chunk (two prompts share a
    step), and prefix-cache hits are skipped (a second identical prompt is recomputed)."""
    with torch.no_grad():
        def want(prompt):
            states = hf_models["llama"].base_model(torch.tensor([prompt])).last_hidden_state[0]  # [len, hidden]
            return torch.nn.functional.normalize(states.mean(0) if kind == "MEAN" else states[0], dim=0)
    prompts = random_prompts(3, seed=53, lo=40, hi=46)
    llm = LLM(llama_dir, runner="pooling", pooler_config={"pooling_type": kind}, block_size=8,
              num_gpu_blocks_override=32, max_num_batched_tokens=16, max_model_len=64)
    for got, prompt in zip(embed(llm, prompts + prompts[:1]), prompts + prompts[:1]):
        torch.testing.assert_close(got, want(prompt), atol=2e-5, rtol=1e-4)
    stats = llm.get_kv_cache_stats()
    assert stats.prefix_cache_hits == 0 and stats.num_used_blocks == 0


def test_runner_mismatches_and_bad_options_are_refused(llama_dir):
    pooling = LLM(llama_dir, runner="pooling", block_size=8, num_gpu_blocks_override=64)
    with pytest.raises(ValueError, match="runner='pooling': a generation request needs"):
        pooling.generate([PROMPTS[0]], SamplingParams(max_tokens=2), use_tqdm=False)
    generate = LLM(llama_dir, block_size=8, num_gpu_blocks_override=64)
    with pytest.raises(ValueError, match="runner='generate': an embedding request needs"):
        generate.embed([PROMPTS[0]], use_tqdm=False)
    with pytest.raises(ValueError, match="dimensions=8 is not supported"):
        PoolingParams(dimensions=8)
    with pytest.raises(ValueError, match="pooling_type='STEP' is not supported"):
        LLM(llama_dir, runner="pooling", pooler_config={"pooling_type": "STEP"})
    with pytest.raises(ValueError, match=r"pooler_config has unknown field\(s\) \['softmax'\]"):
        LLM(llama_dir, runner="pooling", pooler_config='{"softmax": true}')
    with pytest.raises(ValueError, match="pooler_config applies to runner='pooling' only"):
        LLM(llama_dir, pooler_config={"normalize": False})
    with pytest.raises(ValueError, match="cannot be combined with speculative_config"):
        LLM(llama_dir, runner="pooling", speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert not pooling.llm_engine.has_unfinished_requests() and not generate.llm_engine.has_unfinished_requests()
    truncated = pooling.embed([{"prompt_token_ids": PROMPTS[1]}], PoolingParams(truncate_prompt_tokens=3),
                              use_tqdm=False)[0]
    assert truncated.prompt_token_ids == PROMPTS[1][-3:]


def test_a_bare_decoder_checkpoint_serves_embeddings(tmp_path, model_dirs, hf_models):
    """An embedding model shipped as ``LlamaModel`` (no ``model.`` prefix, no LM head, like
    e5-mistral's ``MistralModel``) loads under runner="pooling" and pools like transformers."""
    hf_models["llama"].base_model.save_pretrained(tmp_path, safe_serialization=True)
    for f in Path(model_dirs["llama"]).glob("*token*"):  # the tokenizer's files
        shutil.copy(f, tmp_path / f.name)
    llm = LLM(str(tmp_path), runner="pooling", block_size=8, num_gpu_blocks_override=64)
    for got, prompt in zip(embed(llm, PROMPTS), PROMPTS):
        torch.testing.assert_close(got, reference(hf_models["llama"], prompt), atol=2e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="LlamaModel is a bare decoder: it serves embeddings with runner='pooling'"):
        LLM(str(tmp_path))

"""Greedy outputs and logprobs against Hugging Face transformers on the same weights."""
from __future__ import annotations

import pytest
import torch
from conftest import ARCHS, hf_greedy, random_prompts

from pagedllm import LLM, SamplingParams

MAX_NEW = 12
# mixed lengths: shorter than one block, several blocks long, and in between
PROMPTS = random_prompts(14, seed=1, lo=2, hi=70) + [[5, 6], list(range(3, 100))]


@pytest.fixture(scope="module")
def references(hf_models):
    return {a: [hf_greedy(hf_models[a], p, MAX_NEW) for p in PROMPTS] for a in ARCHS}


def _run(model_dir, **kwargs):
    llm = LLM(model_dir, num_gpu_blocks_override=600, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    llm.llm_engine.scheduler.kv.check_integrity()
    assert llm.get_kv_cache_stats().num_free_blocks == 600
    return outs


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("engine_kwargs", [
    dict(block_size=8), dict(block_size=16), dict(block_size=16, max_num_batched_tokens=32)],
    ids=["bs8", "bs16", "bs16-chunked32"])
def test_greedy_matches_transformers(arch, engine_kwargs, model_dirs, references):
    outs = _run(model_dirs[arch], **engine_kwargs)
    got = [o.outputs[0].token_ids for o in outs]
    mismatches = [i for i, (g, r) in enumerate(zip(got, references[arch])) if g != r]
    assert not mismatches, f"{arch}: {len(mismatches)}/{len(PROMPTS)} prompts differ: {mismatches}"


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_logprobs_match_transformers(arch, model_dirs, hf_models):
    outs = _run(model_dirs[arch], block_size=8)
    model = hf_models[arch]
    for prompt, out in zip(PROMPTS[:6], outs[:6]):
        gen = out.outputs[0].token_ids
        with torch.no_grad():
            logits = model(torch.tensor([prompt + gen])).logits[0].float()
        ref = torch.log_softmax(logits, -1)[len(prompt) - 1:-1].gather(1, torch.tensor(gen)[:, None]).squeeze(1)
        got = torch.tensor([lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, gen)])
        assert torch.allclose(got, ref, atol=1e-4), (got - ref).abs().max()
        assert abs(out.outputs[0].cumulative_logprob - ref.sum().item()) < 1e-3

"""Beam search equals transformers' generate(num_beams=W) token for token, all W beams."""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from conftest import random_prompts

from pagedllm import LLM, BeamSearchParams, SamplingParams

W, MAX_NEW = 4, 10
PROMPTS = random_prompts(4, seed=5)


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, block_size=8, num_gpu_blocks_override=300)


@pytest.fixture(scope="module")
def frequent_token(llm):
    """A token greedy decoding emits often: used as EOS so beams really finish early."""
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)
    return Counter(t for o in outs for t in o.outputs[0].token_ids).most_common(1)[0][0]


def _hf_beams(model, prompt, eos, **kw):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), num_beams=W, num_return_sequences=W, do_sample=False,
                             max_new_tokens=MAX_NEW, eos_token_id=eos, pad_token_id=0, **kw)
    beams = [s[len(prompt):].tolist() for s in out]
    return [b[: b.index(eos) + 1] if eos in b else b for b in beams]  # drop padding after EOS


@pytest.mark.parametrize("early_stopping", [False, True, "never"])
@pytest.mark.parametrize("length_penalty", [1.0, 0.5])
@pytest.mark.parametrize("with_eos", [False, True], ids=["no-eos", "frequent-eos"])
def test_beam_search_matches_transformers(llm, hf_models, frequent_token, early_stopping, length_penalty, with_eos):
    engine = llm.llm_engine
    eos = frequent_token if with_eos else 2
    saved = engine.eos_token_ids
    engine.eos_token_ids = frozenset({eos})
    try:
        params = BeamSearchParams(beam_width=W, max_tokens=MAX_NEW, length_penalty=length_penalty,
                                  early_stopping=early_stopping)
        outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    finally:
        engine.eos_token_ids = saved
    for prompt, out in zip(PROMPTS, outs):
        ref = _hf_beams(hf_models["llama"], prompt, eos, length_penalty=length_penalty, early_stopping=early_stopping)
        assert [s.output_token_ids for s in out.sequences] == ref
    if with_eos:
        assert any(s.finish_reason == "stop" for o in outs for s in o.sequences)
    assert llm.get_kv_cache_stats().num_used_blocks == 0
    engine.scheduler.kv.check_integrity()


def test_beams_share_blocks(llm):
    """Beam width 4 holds far fewer blocks at peak than 4 independent sequences would."""
    engine = llm.llm_engine
    prompt = random_prompts(1, seed=21, lo=40, hi=41)[0]
    engine.counters.peak_used_blocks = 0
    llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=W, max_tokens=MAX_NEW))
    independent = W * -(-(len(prompt) + MAX_NEW) // 8)
    assert engine.counters.peak_used_blocks < 0.6 * independent


def test_beam_search_beside_running_requests(llm):
    """Beam search runs in the engine's ordinary steps: requests already in flight keep going,
    the beams equal those of a search on an idle engine, and the others' tokens are untouched."""
    engine = llm.llm_engine
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:2]]
    params = BeamSearchParams(beam_width=W, max_tokens=MAX_NEW)
    alone = llm.beam_search(prompts, params)
    others = [{"prompt_token_ids": p} for p in random_prompts(3, seed=9)]
    greedy = SamplingParams(temperature=0, max_tokens=3 * MAX_NEW, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in llm.generate(others, greedy, use_tqdm=False)]
    for i, prompt in enumerate(others):
        engine.add_request(f"other-{i}", prompt, greedy)
    finals = {o.request_id: o for _ in range(2) for o in engine.step() if o.finished}
    beside = llm.beam_search(prompts, params)
    assert engine.has_unfinished_requests()  # the others were running all along
    while engine.has_unfinished_requests():
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
    for a, b in zip(alone, beside):
        assert [s.output_token_ids for s in a.sequences] == [s.output_token_ids for s in b.sequences]
        assert [s.score for s in a.sequences] == pytest.approx([s.score for s in b.sequences], abs=1e-4)
    assert [finals[f"other-{i}"].outputs[0].token_ids for i in range(3)] == expected
    assert llm.get_kv_cache_stats().num_used_blocks == 0
    engine.scheduler.kv.check_integrity()

"""Sampling parameters end to end: seeds, n, stops, lengths, penalties, logprobs."""
from __future__ import annotations

import random

import pytest
import torch
from conftest import random_prompts

from pagedllm import LLM, SamplingParams
from pagedllm.engine.request import make_generator
from pagedllm.sampling_params import SEED_MAX, SEED_MIN


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, block_size=8, num_gpu_blocks_override=800)


def _gen(llm, prompts, params):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def test_seeded_sampling_is_independent_of_batch(llm):
    prompt = random_prompts(1, seed=7)[0]
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone = _gen(llm, [prompt], seeded)[0].outputs[0].token_ids
    others = random_prompts(16, seed=8)
    batch = _gen(llm, others + [prompt], [SamplingParams(temperature=1.0, max_tokens=16)] * 16 + [seeded])
    assert batch[-1].outputs[0].token_ids == alone
    different_seed = SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=16, ignore_eos=True)
    assert _gen(llm, [prompt], different_seed)[0].outputs[0].token_ids != alone


def test_distinct_seeds_sample_distinct_tokens(llm):
    """torch's CPU manual_seed keeps 32 bits: -1, 2**32 - 1 and 2**63 - 1 used to sample alike."""
    prompt = random_prompts(1, seed=15)[0]
    seeds = [-1, 2**32 - 1, SEED_MAX, SEED_MIN, 0, 2**32]
    outs = [_gen(llm, [prompt], SamplingParams(temperature=1.0, seed=s, max_tokens=12, ignore_eos=True))[0]
            for s in seeds]
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == len(seeds)
    # sibling 1 of seed 5 used to draw what sibling 0 of seed 6 draws (seed + index)
    five = _gen(llm, [prompt], SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True))[0]
    six = _gen(llm, [prompt], SamplingParams(temperature=1.0, seed=6, max_tokens=12, ignore_eos=True))[0]
    assert five.outputs[1].token_ids != six.outputs[0].token_ids


def test_generator_state_is_the_mersenne_twister_of_seed_and_index():
    """Pins the CPU generator state layout make_generator writes: torch draws CPython's stream."""
    for seed, index in [(-1, 0), (SEED_MAX, 3), (7, 1)]:
        ref = random.Random((index << 64) | (seed % 2**64))
        words = [ref.getrandbits(32) for _ in range(8)]
        # random_(0, 2**32) takes the low word of each 64-bit draw (two 32-bit draws, high first)
        got = torch.empty(4, dtype=torch.int64).random_(0, 2**32, generator=make_generator(seed, index))
        assert got.tolist() == words[1::2]


def test_n_sequences_share_the_prompt_and_are_reproducible(llm):
    prompt = random_prompts(1, seed=9, lo=30, hi=31)[0]
    params = SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=10, ignore_eos=True)
    first = _gen(llm, [prompt], params)[0]
    again = _gen(llm, [prompt], params)[0]
    assert [o.index for o in first.outputs] == [0, 1, 2, 3]
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in again.outputs]
    assert len({tuple(o.token_ids) for o in first.outputs}) > 1
    assert llm.get_kv_cache_stats().num_used_blocks == 0


def test_best_of_returns_n_best_by_cumulative_logprob(llm):
    prompt = random_prompts(1, seed=10)[0]
    out = _gen(llm, [prompt], SamplingParams(n=2, best_of=5, temperature=1.0, seed=3, max_tokens=8,
                                             ignore_eos=True, logprobs=0))[0]
    assert len(out.outputs) == 2
    assert out.outputs[0].cumulative_logprob >= out.outputs[1].cumulative_logprob


def test_max_tokens_and_min_tokens(llm):
    prompt = random_prompts(1, seed=11)[0]
    greedy = _gen(llm, [prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].outputs[0]
    assert len(greedy.token_ids) == 20 and greedy.finish_reason == "length"
    stop_tok = greedy.token_ids[2]
    stopped = _gen(llm, [prompt], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_tok]))[0]
    out = stopped.outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    assert out.token_ids == greedy.token_ids[: greedy.token_ids.index(stop_tok) + 1]
    held = _gen(llm, [prompt], SamplingParams(temperature=0, max_tokens=20, min_tokens=10,
                                              stop_token_ids=[stop_tok]))[0].outputs[0]
    assert len(held.token_ids) >= 10 and stop_tok not in held.token_ids[:10]


def test_stop_strings_cut_the_text(llm):
    tok = llm.get_tokenizer()
    prompt = tok.encode("the quick brown fox")
    full = _gen(llm, [prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].outputs[0]
    assert full.text == tok.decode(full.token_ids)
    stop = full.text[5:8]
    assert stop.strip(), "need a non-blank stop string"
    cut = _gen(llm, [prompt], SamplingParams(temperature=0, max_tokens=24, stop=[stop]))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full.text[: full.text.index(stop)]
    kept = _gen(llm, [prompt], SamplingParams(temperature=0, max_tokens=24, stop=[stop],
                                              include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == full.text[: full.text.index(stop) + len(stop)]


def test_penalties_change_greedy_output(llm):
    prompt = random_prompts(1, seed=12)[0]
    base = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    plain = _gen(llm, [prompt], base)[0].outputs[0].token_ids
    for kw in (dict(repetition_penalty=2.0), dict(frequency_penalty=2.0), dict(presence_penalty=2.0)):
        p = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, **kw)
        penalised = _gen(llm, [prompt], p)[0].outputs[0].token_ids
        assert penalised != plain, kw
        if "frequency_penalty" in kw or "presence_penalty" in kw:
            assert max(penalised.count(t) for t in set(penalised)) <= max(plain.count(t) for t in set(plain))


def test_top_k_one_and_tiny_top_p_equal_greedy(llm):
    prompt = random_prompts(1, seed=13)[0]
    greedy = _gen(llm, [prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    for kw in (dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)):
        p = SamplingParams(temperature=1.5, max_tokens=12, ignore_eos=True, **kw)
        assert _gen(llm, [prompt], p)[0].outputs[0].token_ids == greedy.outputs[0].token_ids, kw


def test_logprobs_top_k(llm):
    prompt = random_prompts(1, seed=14)[0]
    out = _gen(llm, [prompt], SamplingParams(temperature=0, max_tokens=5, logprobs=3, ignore_eos=True))[0]
    for entry, tok in zip(out.outputs[0].logprobs, out.outputs[0].token_ids):
        assert tok in entry and entry[tok].rank == 1  # greedy picks the top token
        assert 3 <= len(entry) <= 4
        assert sorted(e.rank for e in entry.values()) == list(range(1, len(entry) + 1))


def test_text_prompts_and_input_order(llm):
    prompts = ["hello world", "the lazy dog", "paged attention"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    assert [o.prompt_token_ids for o in outs] == [llm.get_tokenizer().encode(p) for p in prompts]


def test_logit_bias_and_allowed_tokens_match_transformers_processors(llm, hf_models):
    """Greedy with a bias (and with an allow-list) equals transformers' generate with its own
    SequenceBiasLogitsProcessor (and prefix_allowed_tokens_fn) on the same weights."""
    import torch
    prompts = random_prompts(3, seed=21, lo=5, hi=30)
    model = hf_models["llama"]
    # pushes each prompt's greedy tokens down and others up by about the logits' spread (~1)
    bias = {354: -1.5, 407: -1.5, 123: -1.5, 490: 0.6, 287: 0.6, 210: -0.5}
    allowed = [5, 17, 42, 99, 300, 411]
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref_bias = model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0,
                                      sequence_bias={(t,): b for t, b in bias.items()})[0, len(prompt):].tolist()
            ref_allowed = model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0,
                                         prefix_allowed_tokens_fn=lambda *_: allowed)[0, len(prompt):].tolist()
        got_bias = _gen(llm, [prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                      logit_bias=bias))[0].outputs[0].token_ids
        got_allowed = _gen(llm, [prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                         allowed_token_ids=allowed))[0].outputs[0].token_ids
        plain = _gen(llm, [prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0]
        assert got_bias == ref_bias and got_allowed == ref_allowed
        assert got_bias != plain.token_ids and set(got_allowed) <= set(allowed)


def test_logit_bias_dominates_sampling_per_row(llm):
    """A +100 bias forces its token even when sampling; other rows of the batch are untouched."""
    prompts = random_prompts(3, seed=22)
    forced = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=3, logit_bias={"77": 100})
    free = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=3)
    outs = _gen(llm, prompts, [forced, free, SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=3,
                                                            allowed_token_ids=[8, 9])])
    assert outs[0].outputs[0].token_ids == [77] * 6
    assert outs[1].outputs[0].token_ids == _gen(llm, [prompts[1]], free)[0].outputs[0].token_ids
    assert set(outs[2].outputs[0].token_ids) <= {8, 9}


def test_stop_string_earliest_in_the_text_wins_over_list_order(llm):
    """Two stop strings arriving in the same decoded token: the text ends at the one that occurs
    first in it, so neither is in the output (it used to end at the first one listed)."""
    tok = llm.get_tokenizer()
    prompt = tok.encode("the quick brown fox")
    full = _gen(llm, [prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].outputs[0]
    texts = [tok.decode(full.token_ids[:i]) for i in range(len(full.token_ids) + 1)]

    def piece(i: int) -> str:  # the characters token i adds ("" when it only completes or starts one)
        return texts[i + 1][len(texts[i]):] if texts[i + 1].startswith(texts[i]) else ""
    # a token that decodes to two distinct characters neither of which was generated before it
    at = next(i for i in range(len(full.token_ids))
              if "\ufffd" not in piece(i) and len(set(piece(i)) - set(texts[i])) >= 2)
    before = texts[at]
    early = next(c for c in piece(at) if c not in before)
    late = next(c for c in reversed(piece(at)) if c not in before and c != early)
    out = _gen(llm, [prompt], SamplingParams(temperature=0, max_tokens=24, stop=[late, early]))[0].outputs[0]
    assert out.text == before and out.stop_reason == early and out.finish_reason == "stop"
    kept = _gen(llm, [prompt], SamplingParams(temperature=0, max_tokens=24, stop=[late, early],
                                              include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == before + early

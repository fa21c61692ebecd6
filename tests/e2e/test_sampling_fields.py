"""vLLM sampling fields that change what is generated: top_k=0, bad_words, truncate_prompt_tokens,
logprobs=-1 / max_logprobs, skip_special_tokens and the model's generation_config defaults."""
from __future__ import annotations

import shutil

import pytest

from pagedllm import LLM, SamplingParams

PROMPT = {"prompt_token_ids": [5, 17, 33, 80, 120, 7, 9, 250, 11]}


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, block_size=8, num_gpu_blocks_override=64, max_model_len=128)


def tokens(llm, params: SamplingParams, prompt=PROMPT) -> list[int]:
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids


def contains(seq: list[int], part: list[int]) -> bool:
    return any(seq[i:i + len(part)] == part for i in range(len(seq) - len(part) + 1))


def test_top_k_zero_means_off(llm):
    params = dict(temperature=1.0, seed=9, max_tokens=12, ignore_eos=True)
    assert tokens(llm, SamplingParams(top_k=0, **params)) == tokens(llm, SamplingParams(top_k=-1, **params))
    assert SamplingParams(top_k=0).top_k == -1


def test_bad_words_are_never_generated(llm):
    """The bias makes "the", " the" and "qu" "ick" ("quick") the likely tokens: the reference says
    them; with bad_words the one-token words never appear and "ick" never follows "qu"."""
    tok = llm.get_tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("the", "Ġthe", "qu", "ick")}
    params = dict(temperature=1.0, seed=4, max_tokens=80, ignore_eos=True, logit_bias={i: 30 for i in ids.values()})
    ref = tokens(llm, SamplingParams(**params))
    assert ids["the"] in ref and ids["Ġthe"] in ref and contains(ref, [ids["qu"], ids["ick"]])
    out = tokens(llm, SamplingParams(bad_words=["the", "quick"], **params))
    assert ids["the"] not in out and ids["Ġthe"] not in out, out
    assert not contains(out, [ids["qu"], ids["ick"]]) and ids["qu"] in out, out


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    params = dict(temperature=0, max_tokens=6, ignore_eos=True)
    out = llm.generate([PROMPT], SamplingParams(truncate_prompt_tokens=4, **params), use_tqdm=False)[0]
    assert out.prompt_token_ids == PROMPT["prompt_token_ids"][-4:]
    assert out.outputs[0].token_ids == tokens(llm, SamplingParams(**params),
                                              {"prompt_token_ids": PROMPT["prompt_token_ids"][-4:]})
    whole = llm.generate([PROMPT], SamplingParams(truncate_prompt_tokens=-1, **params), use_tqdm=False)[0]
    assert whole.prompt_token_ids == PROMPT["prompt_token_ids"]  # -1: max_model_len - 1, no cut here


def test_logprobs_minus_one_and_max_logprobs(llama_dir, llm):
    with pytest.raises(ValueError, match="max_logprobs"):
        llm.generate([PROMPT], SamplingParams(logprobs=21, max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="max_logprobs"):
        llm.generate([PROMPT], SamplingParams(logprobs=-1, max_tokens=2), use_tqdm=False)
    unbounded = LLM(llama_dir, block_size=8, num_gpu_blocks_override=64, max_model_len=128, max_logprobs=-1)
    out = unbounded.generate([PROMPT], SamplingParams(logprobs=-1, prompt_logprobs=-1, max_tokens=2),
                             use_tqdm=False)[0]
    vocab = unbounded.llm_engine.model_config.vocab_size
    assert [len(entry) for entry in out.outputs[0].logprobs] == [vocab, vocab]
    assert len(out.prompt_logprobs[1]) == vocab
    assert abs(sum(2.718281828 ** lp.logprob for lp in out.outputs[0].logprobs[0].values()) - 1) < 1e-3


def test_skip_special_tokens_is_applied(llm):
    """Only <s> (special) and one word may be sampled: the text shows <s> unless it is skipped."""
    tok = llm.get_tokenizer()
    word = tok.convert_tokens_to_ids("the")
    params = dict(temperature=1.0, seed=2, max_tokens=12, ignore_eos=True, allowed_token_ids=[1, word])
    kept = llm.generate([PROMPT], SamplingParams(skip_special_tokens=False, **params), use_tqdm=False)[0].outputs[0]
    skipped = llm.generate([PROMPT], SamplingParams(**params), use_tqdm=False)[0].outputs[0]
    assert kept.token_ids == skipped.token_ids and 1 in kept.token_ids and word in kept.token_ids
    assert "<s>" in kept.text and "<s>" not in skipped.text and "the" in skipped.text


def test_generation_config_sampling_defaults(llama_dir, tmp_path):
    model = shutil.copytree(llama_dir, tmp_path / "model")
    (model / "generation_config.json").write_text('{"max_new_tokens": 5, "temperature": 0.0, "top_k": 3}')
    auto = LLM(str(model), block_size=8, num_gpu_blocks_override=64, max_model_len=128)
    defaults = auto.get_default_sampling_params()
    assert (defaults.max_tokens, defaults.temperature, defaults.top_k) == (5, 0.0, 3)
    out = auto.generate([PROMPT], use_tqdm=False)[0].outputs[0]  # no params: the file's defaults
    assert len(out.token_ids) <= 5
    vllm = LLM(str(model), block_size=8, num_gpu_blocks_override=64, max_model_len=128, generation_config="vllm")
    assert vllm.get_default_sampling_params() == SamplingParams()

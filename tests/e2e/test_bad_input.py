"""Invalid input raises ValueError naming the parameter; the engine keeps serving."""
from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, block_size=8, num_gpu_blocks_override=200, max_model_len=256)


@pytest.mark.parametrize("kwargs, name", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(top_k=1.5), "top_k"), (dict(max_tokens=0), "max_tokens"),
    (dict(n=0), "n"), (dict(min_p=2), "min_p"), (dict(best_of=1, n=2), "best_of"),
    (dict(logprobs=-2), "logprobs"), (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(presence_penalty=5), "presence_penalty"), (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    (dict(logit_bias={5: 150}), r"logit_bias\[5\]"), (dict(logit_bias={"x": 1}), "logit_bias"),
    (dict(logit_bias=[1]), "logit_bias"), (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[3, -1]), "allowed_token_ids"),
    (dict(seed=2**70), "seed"), (dict(seed=2**63), "seed"), (dict(seed=-(2**63) - 1), "seed"),
    (dict(seed=True), "seed"), (dict(seed=1.5), "seed"),
    (dict(spaces_between_special_tokens=False), "spaces_between_special_tokens"),
    (dict(extra_args={"custom": 1}), "extra_args"),
    (dict(bad_words=[""]), "bad_words"), (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
    (dict(structured_outputs={"regex": "a", "choice": ["a"]}), "structured_outputs"),
    (dict(structured_outputs={"json": {"type": "object"}}, min_tokens=1), "min_tokens"),
])
def test_invalid_sampling_params(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def _still_serves(llm):
    out = llm.generate(["hello world"], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3
    assert llm.get_kv_cache_stats().num_used_blocks == 0
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("prompt, match", [
    ("", "prompt"),
    ({"prompt_token_ids": []}, "prompt_token_ids"),
    ({"prompt_token_ids": [1, 99999]}, "prompt_token_ids"),
    ({"prompt_token_ids": [1, -3]}, "prompt_token_ids"),
    ({"prompt_token_ids": [5] * 300}, "max_model_len"),
    ({"prompt_token_ids": [5] * 200}, "max_model_len"),  # 200 + max_tokens 100 > 256
])
def test_invalid_prompts_leave_engine_serving(llm, prompt, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}, prompt], SamplingParams(max_tokens=100), use_tqdm=False)
    _still_serves(llm)


def test_request_beyond_max_model_len_is_rejected(llama_dir):
    # start-up guarantees one max_model_len sequence fits the cache, so max_model_len is the binding limit
    llm = LLM(llama_dir, block_size=8, num_gpu_blocks_override=70, max_model_len=512)
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate([{"prompt_token_ids": [5] * 100}], SamplingParams(max_tokens=500), use_tqdm=False)
    with pytest.raises(ValueError, match="n/best_of"):
        llm.generate(["hello"], SamplingParams(n=300, max_tokens=5), use_tqdm=False)
    _still_serves(llm)


def test_unknown_keyword_and_missing_model(llama_dir, tmp_path):
    with pytest.raises(TypeError, match="no_such_option"):
        LLM(llama_dir, no_such_option=1)
    with pytest.raises(ValueError, match="model"):
        LLM(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="block_size"):
        LLM(llama_dir, block_size=12)


def test_unsupported_architecture_lists_supported(tmp_path):
    import json
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        LLM(str(tmp_path))


def test_kv_cache_too_small_for_max_model_len(llama_dir):
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(llama_dir, block_size=8, num_gpu_blocks_override=10, max_model_len=512)


def test_stop_token_ids_outside_vocabulary(llm):
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate(["hello"], SamplingParams(stop_token_ids=[10**6], min_tokens=2, max_tokens=4), use_tqdm=False)
    _still_serves(llm)


def test_negative_swap_space(llama_dir):
    with pytest.raises(ValueError, match="swap_space"):
        LLM(llama_dir, swap_space="-1", num_gpu_blocks_override=64, max_model_len=256)


@pytest.mark.parametrize("kwargs, name", [(dict(logit_bias={99999: 1.0}), "logit_bias"),
                                          (dict(allowed_token_ids=[4, 99999]), "allowed_token_ids")])
def test_token_ids_outside_vocabulary_in_bias_and_allowed(llm, kwargs, name):
    with pytest.raises(ValueError, match=f"{name} contains \\[99999\\]"):
        llm.generate(["hello"], SamplingParams(max_tokens=2, **kwargs), use_tqdm=False)
    _still_serves(llm)

"""Model-config variants against transformers: RoPE scaling types and tied embeddings."""
from __future__ import annotations

import pytest

from conftest import hf_greedy, make_model_dir, random_prompts
from pagedllm import LLM, SamplingParams

VARIANTS = {
    "rope-linear": dict(rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "rope-llama3": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 128}),
    "rope-dynamic": dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
    "rope-theta": dict(rope_theta=500000.0),
    "tied": dict(tie_word_embeddings=True),
    "mha": dict(num_key_value_heads=4),
    "mqa": dict(num_key_value_heads=1),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variant_greedy_matches_transformers(name, tmp_path):
    import transformers as tf
    d = make_model_dir(tmp_path, "llama", **VARIANTS[name])
    hf = tf.AutoModelForCausalLM.from_pretrained(d).eval()
    prompts = random_prompts(4, seed=2, lo=5, hi=90)
    llm = LLM(d, block_size=16, num_gpu_blocks_override=200)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 8) for p in prompts]


def test_sliding_window_models_are_served_up_to_the_window(tmp_path, caplog):
    """No sliding-window attention kernel: within the window it equals full attention, so the
    engine caps max_model_len there (and refuses a larger explicit one); greedy still matches
    transformers, whose model applies the window."""
    import torch
    import transformers as tf
    path = make_model_dir(tmp_path / "mistral-sw", "mistral", sliding_window=48)
    llm = LLM(path, num_gpu_blocks_override=64, block_size=8)
    assert llm.llm_engine.model_config.max_model_len == 48 and "sliding-window" in caplog.text
    with pytest.raises(ValueError, match="max_model_len=64 exceeds the model's sliding_window=48"):
        LLM(path, num_gpu_blocks_override=64, max_model_len=64)
    hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = list(range(5, 40))
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=13, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 13)  # 48 tokens: all inside the window
    qwen = make_model_dir(tmp_path / "qwen2", "qwen2", sliding_window=48)  # use_sliding_window is False
    assert LLM(qwen, num_gpu_blocks_override=64).llm_engine.model_config.max_model_len == 512

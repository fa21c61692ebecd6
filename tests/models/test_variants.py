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

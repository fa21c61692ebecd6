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


@pytest.mark.parametrize("arch, overrides", [
    ("mistral", dict(sliding_window=16)),  # every layer slides
    ("qwen2", dict(use_sliding_window=True, sliding_window=16, max_window_layers=1)),  # layer 1 slides
], ids=["mistral", "qwen2-mixed-layers"])
@pytest.mark.parametrize("budget", [None, 8], ids=["whole", "chunked8"])
def test_sliding_window_attention_matches_transformers(tmp_path, arch, overrides, budget):
    """Prompts and generations run well past the window: every layer that slides must see only
    its last 16 positions, exactly as transformers' model does."""
    import torch
    import transformers as tf
    path = make_model_dir(tmp_path / arch, arch, **overrides)
    hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    kw = {} if budget is None else dict(max_num_batched_tokens=budget)
    llm = LLM(path, num_gpu_blocks_override=300, block_size=8, **kw)
    assert llm.llm_engine.model_config.max_model_len == 512  # not capped at the window
    windows = [layer.self_attn.sliding_window for layer in llm.llm_engine.executor.runner.model.model.layers]
    assert windows == ([16, 16] if arch == "mistral" else [None, 16])
    prompts = random_prompts(4, seed=12, lo=20, hi=50) + [[9, 8, 7]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 24) for p in prompts]


def test_unsupported_activation_is_refused(tmp_path):
    path = make_model_dir(tmp_path / "gelu", "llama", hidden_act="gelu")
    with pytest.raises(ValueError, match="hidden_act='gelu'"):
        LLM(path, num_gpu_blocks_override=64)

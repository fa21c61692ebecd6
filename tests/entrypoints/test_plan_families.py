"""``pagedllm plan`` on the MoE and sliding-window families: total parameters for memory,
active (top-k) parameters for FLOPs, and what the engine allocates for sliding-window layers."""
from __future__ import annotations

import pytest
import torch

from pagedllm.entrypoints.plan import count_params, format_plan, model_shape, plan_kv

GiB = 2**30
# mistralai/Mixtral-8x7B-v0.1 config.json (the fields that matter)
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "vocab_size": 32000, "num_local_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 32768,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "sliding_window": None,
}
# Qwen/Qwen3-30B-A3B, with two dense layers added to exercise mlp_only_layers
QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936, "num_experts": 128, "num_experts_per_tok": 8,
    "decoder_sparse_step": 1, "mlp_only_layers": [0, 1], "max_position_embeddings": 40960,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}


def _transformers_count(config: dict) -> int:
    import transformers as tf
    kwargs = {k: v for k, v in config.items() if k not in ("architectures", "model_type", "torch_dtype")}
    cfg = tf.AutoConfig.for_model(config["model_type"], **kwargs)
    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in model.parameters())


def test_mixtral_total_params_match_transformers_and_active_are_top2():
    shape = model_shape(MIXTRAL_8X7B)
    assert count_params(shape) == 46_702_792_704  # what transformers counts for Mixtral-8x7B
    expert = 3 * 4096 * 14336
    assert count_params(shape) - count_params(shape, active=True) == 32 * 6 * expert  # 6 of 8 experts idle


def test_qwen3_moe_dense_layers_counted_as_dense():
    shape = model_shape(QWEN3_MOE)
    assert shape.num_moe_layers == 46
    ref = _transformers_count(QWEN3_MOE)
    norms = 48 * 2 * 128  # per-head q/k norms, which the estimate leaves out
    assert count_params(shape) == ref - norms
    plan = plan_kv(QWEN3_MOE, gpu_memory=80 * GiB)
    assert plan.num_params == count_params(shape) and plan.active_params == count_params(shape, active=True)
    assert plan.weights_bytes == 2 * plan.num_params  # memory: every expert
    assert "active parameters per token" in format_plan(plan)


@pytest.mark.parametrize("extra, sliding", [
    (dict(layer_types=["sliding_attention"] * 5 + ["full_attention"]), 5),
    (dict(sliding_window_pattern=3), 4),
    (dict(use_sliding_window=False), 0),
])
def test_sliding_window_layers_are_noted_and_planned_as_allocated(extra, sliding):
    config = {"model_type": "gemma3_text", "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 1,
              "head_dim": 64, "num_hidden_layers": 6, "intermediate_size": 512, "vocab_size": 1000,
              "max_position_embeddings": 4096, "sliding_window": 512, **extra}
    plan = plan_kv(config, gpu_memory=GiB, max_model_len=4096, block_size=16)
    assert plan.shape.num_sliding_layers == sliding
    assert plan.kv_bytes_per_block == 2 * 6 * 1 * 64 * 16 * 2  # every layer, as the engine allocates
    assert any("sliding window" in n for n in plan.notes) == bool(sliding)

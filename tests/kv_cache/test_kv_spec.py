"""The per-layer KV spec (kv_cache/spec.py) is what sizing, the pool and ``pagedllm plan`` read."""
from __future__ import annotations

import pytest
import torch

from pagedllm.entrypoints.plan import count_params, model_shape, plan_kv
from pagedllm.kv_cache.planning import kv_bytes
from pagedllm.kv_cache.spec import KVCacheSpec, kv_spec_for
from pagedllm.worker.cache_engine import CacheEngine

# deepseek-ai/DeepSeek-V2-Lite config.json (the fields that matter)
DEEPSEEK_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 2048,
    "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16,
    "num_key_value_heads": 16, "vocab_size": 102400, "n_routed_experts": 64, "n_shared_experts": 2,
    "num_experts_per_tok": 6, "first_k_dense_replace": 1, "q_lora_rank": None, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "max_position_embeddings": 163840,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}


def test_specs_bytes_and_pool_shapes():
    full, latent = KVCacheSpec.full(8, 128), KVCacheSpec.mla(512, 64)
    assert full.elements_per_token() == 2 * 8 * 128 and latent.elements_per_token() == 576
    assert kv_bytes(27, latent, torch.bfloat16, 16) == 27 * 576 * 2 * 16
    assert latent.pool_shape(2, 10, 16) == (2, 1, 10, 1, 16, 576)
    assert full.pool_shape(2, 10, 16) == (2, 2, 10, 8, 16, 128)
    with pytest.raises(ValueError, match="kind='sliding'"):
        KVCacheSpec("sliding", 1, 1)


def test_spec_from_config_object_and_dict():
    class Cfg:
        kv_lora_rank, qk_rope_head_dim = 32, 8
    assert kv_spec_for(Cfg(), 4, 16) == KVCacheSpec.mla(32, 8)  # whatever the rank's KV heads
    assert kv_spec_for(DEEPSEEK_V2_LITE, 16, 192) == KVCacheSpec.mla(512, 64)
    assert kv_spec_for({"num_key_value_heads": 2}, 2, 64) == KVCacheSpec.full(2, 64)


def test_cache_engine_allocates_by_spec_and_moves_blocks():
    eng = CacheEngine(KVCacheSpec.mla(6, 2), num_layers=3, num_blocks=5, block_size=4, dtype=torch.float32,
                      device=torch.device("cpu"), num_cpu_blocks=2)
    assert eng.kv.shape == (3, 1, 5, 1, 4, 8) and eng.cpu_kv.shape == (3, 1, 2, 1, 4, 8)
    assert all(len(c) == 1 and c[0].shape == (5, 1, 4, 8) for c in eng.layer_caches)
    eng.kv[:, :, 1] = torch.randn(3, 1, 1, 4, 8)
    eng.copy_blocks([(1, 3)])
    eng.swap_out([(1, 0)])
    eng.swap_in([(0, 4)])
    assert torch.equal(eng.kv[:, :, 3], eng.kv[:, :, 1]) and torch.equal(eng.kv[:, :, 4], eng.kv[:, :, 1])


def test_plan_deepseek_v2_lite_latent_bytes_and_params():
    plan = plan_kv(DEEPSEEK_V2_LITE, gpu_memory=80 * 2**30, max_model_len=4096)
    assert plan.kv_bytes_per_token == 27 * (512 + 64) * 2  # one bf16 latent per layer
    assert plan.kv_bytes_per_block == 16 * plan.kv_bytes_per_token
    per_head = 27 * 2 * 16 * 192 * 2  # the same model with K/V per head (V at 192, as it pads)
    assert per_head / plan.kv_bytes_per_token > 5
    shape = model_shape(DEEPSEEK_V2_LITE)
    assert shape.num_moe_layers == 26  # first_k_dense_replace=1
    # transformers counts 15.7 B; the estimate leaves out the kv_a / q_a norms like other norms
    import transformers as tf
    kwargs = {k: v for k, v in DEEPSEEK_V2_LITE.items() if k not in ("architectures", "model_type", "torch_dtype")}
    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(tf.DeepseekV2Config(**kwargs))
    ref = sum(p.numel() for p in model.parameters())
    assert count_params(shape) == ref - 27 * 512

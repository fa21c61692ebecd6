"""DeepSeek V2 / V3 (models/deepseek.py) against transformers on tiny random checkpoints.

The configs (conftest.FAMILY_CONFIGS): V2-Lite-shaped (direct q_proj, softmax grouped routing,
two shared experts) and V3-shaped (q_lora_rank, sigmoid routing with a random
e_score_correction_bias, YaRN with mscale); both with a dense first layer and 4 expert groups
of which 2 are kept. Checked: greedy tokens and logprobs at block sizes 8 (chunked prefill,
prefix hits) and 16, preemption by recompute and by swap, tensor parallelism over 2 ranks, 2
pipeline stages, the CPU KV tier, an fp8 latent, and that the pool holds one latent per token
and layer.
"""
from __future__ import annotations

import logging

import pytest
import torch
from conftest import make_model_dir, token_logprobs
from test_families import GREEDY, PROMPTS, SHARED, _assert_logprobs_match, _generate, hf_greedy

from pagedllm import LLM
from pagedllm.kv_cache.spec import KVCacheSpec

ARCHS = ["deepseek_v2", "deepseek_v3"]
RANK, ROPE = 32, 8  # conftest's kv_lora_rank and qk_rope_head_dim


def _checkpoint(path, arch: str) -> str:
    """The tiny checkpoint; V3's router bias made random so it moves the expert choice (transformers
    initialises it to zeros), and an MTP layer's weights appended as V3 checkpoints ship them."""
    import transformers as tf
    from safetensors.torch import load_file, save_file
    make_model_dir(path, arch, num_key_value_heads=4)  # MLA: as many KV heads as heads
    if arch == "deepseek_v3":
        hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        for layer in hf.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(8, generator=torch.Generator().manual_seed(1)))
        hf.save_pretrained(path)
        tensors = load_file(f"{path}/model.safetensors")
        tensors["model.layers.2.eh_proj.weight"] = torch.zeros(64, 128)  # layer 2 = num_hidden_layers: MTP
        save_file(tensors, f"{path}/model.safetensors", metadata={"format": "pt"})
    return str(path)


@pytest.fixture(scope="module", params=ARCHS)
def deepseek(request, tmp_path_factory):
    import transformers as tf
    path = _checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, hf, [hf_greedy(hf, p, GREEDY.max_tokens) for p in PROMPTS]


def test_chunked_prefill_with_prefix_hits_matches_transformers(deepseek, caplog):
    path, hf, refs = deepseek
    with caplog.at_level(logging.INFO, logger="pagedllm.models.deepseek"):
        llm = LLM(path, block_size=8, max_num_batched_tokens=32, num_gpu_blocks_override=400)
    if "v3" in path:
        assert "multi-token-prediction layer weights (model.layers.2.*" in caplog.text
    _generate(llm, [SHARED + [7]])  # caches the shared prefix's blocks
    outs = _generate(llm, PROMPTS)
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert llm.get_kv_cache_stats().prefix_cache_hits >= 8 * len(SHARED)
    _assert_logprobs_match(hf, PROMPTS[:6], outs[:6])


@pytest.mark.parametrize("backend, name", [("auto", "mla-cpu"), ("torch", "mla-torch")])
def test_block_size_16_and_a_latent_pool(deepseek, backend, name):
    """``auto``: decode steps on the C kernel (attention/mla.py); ``torch``: all of it in torch."""
    path, _, refs = deepseek
    llm = LLM(path, block_size=16, num_gpu_blocks_override=400, attention_backend=backend)
    outs = _generate(llm, PROMPTS)
    assert [o.outputs[0].token_ids for o in outs] == refs
    runner = llm.llm_engine.executor.runner
    assert runner.backend.name == name
    assert runner.kv_spec == KVCacheSpec.mla(RANK, ROPE)
    assert runner.cache.kv.shape == (2, 1, 400, 1, 16, RANK + ROPE)  # no K/V per head anywhere
    assert runner.block_bytes() == 2 * 16 * (RANK + ROPE) * 4


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_outputs(deepseek, mode):
    path, _, refs = deepseek
    tight = LLM(path, block_size=8, num_gpu_blocks_override=24, max_model_len=128, preemption_mode=mode,
                watermark=0.0, swap_space=0.01)
    outs = _generate(tight, PROMPTS)
    assert [o.outputs[0].token_ids for o in outs] == refs
    stats = tight.get_kv_cache_stats()
    assert stats.preemptions_by_mode[mode] > 0


def test_attention_backends_without_mla_are_refused(deepseek):
    path, _, _ = deepseek
    with pytest.raises(ValueError, match="attention_backend='sdpa' does not implement multi-head latent attention"):
        LLM(path, attention_backend="sdpa", num_gpu_blocks_override=50)


def test_tensor_parallel_matches_transformers(deepseek):
    """Two ranks: each holds half the heads (q, kv_b, o) and half of every expert; both hold the
    whole latent, so the pool is the same size on each."""
    path, hf, refs = deepseek
    llm = LLM(path, tensor_parallel_size=2, num_threads=1, block_size=8, num_gpu_blocks_override=200)
    try:
        outs = _generate(llm, PROMPTS[:6])
    finally:
        llm.llm_engine.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == refs[:6]
    _assert_logprobs_match(hf, PROMPTS[:6], outs)


def test_pipeline_parallel_matches_transformers(deepseek):
    """Two stages: the dense first layer and the MoE layer on different processes, each with its
    own layers' latent pool."""
    path, _, refs = deepseek
    llm = LLM(path, pipeline_parallel_size=2, num_threads=1, block_size=8, num_gpu_blocks_override=200)
    try:
        outs = _generate(llm, PROMPTS[:4])
    finally:
        llm.llm_engine.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == refs[:4]


def test_cpu_kv_tier_round_trips_latent_blocks(deepseek):
    """Prefix blocks evicted from a small device pool come back from the CPU tier: the tier's
    slots are latent blocks (kv_cache/offload/worker_store.py reads the pool's shape)."""
    path, _, refs = deepseek
    block_bytes = 2 * 8 * (RANK + ROPE) * 4  # layers x tokens x latent x float32
    llm = LLM(path, block_size=8, max_model_len=128, num_gpu_blocks_override=18,
              kv_offload_cpu_gb=64.5 * block_bytes / 2**30)
    assert [o.outputs[0].token_ids for o in _generate(llm, [PROMPTS[1]])] == [refs[1]]
    fillers = [list(range(100 + i, 200 + i)) for i in range(2)]  # each takes most of the pool
    for filler in fillers:
        _generate(llm, [filler])
    assert [o.outputs[0].token_ids for o in _generate(llm, [PROMPTS[3]])] == [refs[3]]
    cpu = llm.get_kv_cache_stats().offload["cpu"]
    assert cpu["hits"] >= len(SHARED) // 8 and cpu["bytes_loaded"] == cpu["hits"] * block_bytes


def test_fp8_latent_cache(deepseek):
    """fp8 latents (unscaled, attention/mla.py): a quarter of the float32 block, and logprobs near
    transformers' float32 ones (fp8 e4m3 keeps 3 mantissa bits); calibrated scales are refused."""
    path, hf, _ = deepseek
    llm = LLM(path, kv_cache_dtype="fp8", block_size=8, num_gpu_blocks_override=200)
    runner = llm.llm_engine.executor.runner
    assert runner.cache.kv.dtype == torch.float8_e4m3fn and runner.block_bytes() == 2 * 8 * (RANK + ROPE)
    for prompt, out in zip(PROMPTS[:8], _generate(llm, PROMPTS[:8])):
        gen = out.outputs[0].token_ids
        got = torch.tensor([lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, gen)])
        # measured at most 0.018 on both configs; float32 latents agree to 2e-4
        torch.testing.assert_close(got, token_logprobs(hf, prompt, gen), atol=0.06, rtol=0)
    with pytest.raises(ValueError, match="calculate_kv_scales=True is not supported with multi-head latent"):
        LLM(path, kv_cache_dtype="fp8", calculate_kv_scales=True, num_gpu_blocks_override=50)


@pytest.mark.parametrize("arch", ARCHS)
def test_grouped_routing_matches_transformers_routers(arch):
    """GroupedTopK (layers/moe_routing.py) against transformers' router on 512 tokens, 32 experts in
    8 groups of which 3 are kept; V3 with a random correction bias."""
    import transformers as tf
    from conftest import _config

    from pagedllm.layers.moe_routing import GroupedTopK
    from pagedllm.models import deepseek
    cfg = _config(arch, num_key_value_heads=4, n_routed_experts=32, n_group=8, topk_group=3, num_experts_per_tok=4)
    module = tf.models.deepseek_v3.modeling_deepseek_v3 if arch == "deepseek_v3" else \
        tf.models.deepseek_v2.modeling_deepseek_v2
    router = (module.DeepseekV3TopkRouter if arch == "deepseek_v3" else module.DeepseekV2TopkRouter)(cfg)
    g = torch.Generator().manual_seed(0)
    torch.nn.init.normal_(router.weight, generator=g)
    bias = None
    if arch == "deepseek_v3":
        bias = torch.randn(32, generator=g) * 0.1
        router.e_score_correction_bias.copy_(bias)
    x = torch.randn(512, cfg.hidden_size, generator=g)
    _, ref_w, ref_ids = router(x)
    model_cls = deepseek.DeepseekV3ForCausalLM if arch == "deepseek_v3" else deepseek.DeepseekV2ForCausalLM
    routing: GroupedTopK = model_cls.routing(cfg)
    w, ids = routing(x @ router.weight.T, bias)
    order, ref_order = ids.argsort(-1), ref_ids.argsort(-1)
    assert torch.equal(ids.gather(1, order), ref_ids.gather(1, ref_order))
    torch.testing.assert_close(w.gather(1, order), ref_w.gather(1, ref_order))

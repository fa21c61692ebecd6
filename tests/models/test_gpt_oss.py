"""GPT-OSS against transformers on a tiny random model built at test time: attention sinks,
alternating sliding (window 16, crossed by the prompts) and full layers, biased router and
experts with the clamped SwiGLU (limit lowered so the clamps bind), YaRN RoPE; float experts
and MXFP4 experts (packed here with the format's rules; the reference is transformers on the
weights dequantized by transformers' own ``convert_moe_packed_tensors``)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import _tokenizer, random_prompts
from mxfp4_reference import pack_mxfp4

from pagedllm import LLM, SamplingParams
from pagedllm.layers.quantization import mxfp4

MAX_NEW = 8
SHARED = random_prompts(1, seed=60, lo=24, hi=25)[0]  # 3 full blocks of 8, reused by half the prompts
PROMPTS = random_prompts(7, seed=61, lo=2, hi=50) + [list(range(3, 60))]  # up to ~80 tokens: windows crossed
PROMPTS = [SHARED + p if i % 2 else p for i, p in enumerate(PROMPTS)]
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "rope_theta": 10000.0,
        "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}


def gpt_oss_config():
    import transformers as tf
    return tf.GptOssConfig(
        vocab_size=512, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6, sliding_window=16,
        num_local_experts=8, num_experts_per_tok=2, swiglu_limit=0.3, rope_parameters=YARN, bos_token_id=1,
        eos_token_id=2, pad_token_id=0, tie_word_embeddings=False, attn_implementation="eager")


def make_gpt_oss(path: Path):
    """A random transformers GPT-OSS saved to ``path``; every bias, sink and norm non-trivial."""
    import transformers as tf
    cfg = gpt_oss_config()
    cfg.initializer_range = 0.05
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.copy_(torch.randn_like(p) * 1.5)
            elif "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.05 * torch.randn_like(p))
    model.save_pretrained(path, safe_serialization=True)
    _tokenizer().save_pretrained(path)
    return model.eval()


def hf_greedy(model, prompt: list[int]) -> list[int]:
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def make_mxfp4_checkpoint(float_dir: Path, path: Path, hf):
    """``float_dir``'s checkpoint with the experts packed as gpt-oss ships them; ``hf`` gets the
    dequantized experts (transformers' own dequantizer), so it is the reference for the packed model."""
    from safetensors.torch import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    shutil.copytree(float_dir, path)
    tensors = {k: v.contiguous() for k, v in hf.state_dict().items()}
    for name in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = pack_mxfp4(tensors.pop(name).transpose(1, 2))  # checkpoint blocks are [E, out, in]
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        dequantized = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out] as HF holds it
        with torch.no_grad():
            hf.get_parameter(name).copy_(dequantized)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (path / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    """(float dir, its transformers model and greedy references, MXFP4 dir, its reference and refs)."""
    base = tmp_path_factory.mktemp("gpt_oss")
    hf = make_gpt_oss(base / "float")
    refs = [hf_greedy(hf, p) for p in PROMPTS]
    import transformers as tf
    hf_q = tf.AutoModelForCausalLM.from_pretrained(base / "float", dtype=torch.float32,
                                                   attn_implementation="eager").eval()
    make_mxfp4_checkpoint(base / "float", base / "mxfp4", hf_q)
    return base / "float", hf, refs, base / "mxfp4", hf_q, [hf_greedy(hf_q, p) for p in PROMPTS]


def _generate(llm, prompts):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    llm.llm_engine.scheduler.kv.check_integrity()
    return outs


def _check(hf, refs, outs, logprob_rows: int = 4, prompts=PROMPTS):
    assert [o.outputs[0].token_ids for o in outs] == refs
    for prompt, out in list(zip(prompts, outs))[:logprob_rows]:
        gen = out.outputs[0].token_ids
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + gen])).logits[0].float()  # [len, vocab]
        ref = torch.log_softmax(logits, -1)[len(prompt) - 1:-1].gather(1, torch.tensor(gen)[:, None]).squeeze(1)
        got = torch.tensor([lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, gen)])
        assert torch.allclose(got, ref, atol=2e-4), (got - ref).abs().max()


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "mxfp4"])
def test_block_size_8_chunked_prefill_prefix_hits(gpt_oss, quantized):
    float_dir, hf, refs, q_dir, hf_q, q_refs = gpt_oss
    path, hf, refs = (q_dir, hf_q, q_refs) if quantized else (float_dir, hf, refs)
    llm = LLM(str(path), block_size=8, max_num_batched_tokens=32, num_gpu_blocks_override=300)
    _generate(llm, [SHARED + [7]])  # caches the shared prefix's blocks
    outs = _generate(llm, PROMPTS)
    _check(hf, refs, outs)
    assert llm.get_kv_cache_stats().prefix_cache_hits >= len(PROMPTS) // 2 * len(SHARED)


@pytest.mark.parametrize("backend", ["cpu", "sdpa", "torch"])
def test_block_size_16_every_cpu_backend(gpt_oss, backend):
    float_dir, hf, refs, *_ = gpt_oss
    llm = LLM(str(float_dir), block_size=16, num_gpu_blocks_override=300, attention_backend=backend)
    _check(hf, refs, _generate(llm, PROMPTS), logprob_rows=2)


def test_preemption(gpt_oss):
    """A pool too small for every request at once: requests are preempted and recomputed."""
    float_dir, hf, refs, *_ = gpt_oss
    llm = LLM(str(float_dir), block_size=8, num_gpu_blocks_override=24, max_num_seqs=8, max_model_len=128)
    outs = _generate(llm, PROMPTS)
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert llm.get_kv_cache_stats().num_preemptions > 0


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "mxfp4"])
def test_tensor_parallel_2(gpt_oss, quantized):
    """Two ranks: each holds half the heads (and their sinks) and half of every expert."""
    float_dir, hf, refs, q_dir, hf_q, q_refs = gpt_oss
    path, hf, refs = (q_dir, hf_q, q_refs) if quantized else (float_dir, hf, refs)
    llm = LLM(str(path), tensor_parallel_size=2, num_threads=1, block_size=8, num_gpu_blocks_override=200)
    try:
        outs = _generate(llm, PROMPTS[:4])
    finally:
        llm.llm_engine.shutdown()
    _check(hf, refs[:4], outs, logprob_rows=2, prompts=PROMPTS[:4])


def test_mxfp4_kernel_matches_transformers_dequantize():
    """The C kernel (and the torch dequantizer) against transformers' dequantization of packed weights."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    torch.manual_seed(0)
    w = torch.randn(3, 40, 96) * torch.logspace(-3, 2, 96)  # [E, out, in], groups of very different ranges
    blocks, scales = pack_mxfp4(w)
    ref = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2)  # [E, out, in]
    assert torch.equal(mxfp4.dequantize(blocks, scales), ref)
    assert (ref - w).abs().max() <= w.abs().max() * 0.25  # it is a quantization of w, not noise
    x, bias = torch.randn(21, 96), torch.randn(40)
    out = mxfp4.mxfp4_linear(x, blocks[1].contiguous(), scales[1].contiguous(), bias)
    torch.testing.assert_close(out.double(), x.double() @ ref[1].double().T + bias.double(), atol=1e-4, rtol=1e-5)


def test_pipeline_parallel_2(gpt_oss):
    """Two stages of one layer each (a sliding one, then a full one): each stage's sinks, experts
    and KV pool are its layer's."""
    float_dir, hf, refs, *_ = gpt_oss
    with LLM(str(float_dir), pipeline_parallel_size=2, num_threads=1, block_size=8,
             num_gpu_blocks_override=200) as llm:
        outs = _generate(llm, PROMPTS[:4])
    assert [o.outputs[0].token_ids for o in outs] == refs[:4]


# openai/gpt-oss-20b config.json (the fields that matter); its safetensors hold 13.76 GB
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 2880, "intermediate_size": 2880,
    "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
    "vocab_size": 201088, "num_local_experts": 32, "num_experts_per_tok": 4, "sliding_window": 128,
    "max_position_embeddings": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "quantization_config": {"quant_method": "mxfp4"},
}


def test_plan_counts_mxfp4_experts_at_four_and_a_quarter_bits():
    from pagedllm.entrypoints.plan import plan_kv
    plan = plan_kv(GPT_OSS_20B, gpu_memory=80 * 10**9, device="cuda", max_model_len=8192)
    assert plan.quantization == "mxfp4"
    assert 13.0e9 < plan.weights_bytes < 14.5e9  # the experts in bf16 would be ~38 GB more
    float_plan = plan_kv({k: v for k, v in GPT_OSS_20B.items() if k != "quantization_config"},
                         gpu_memory=80 * 10**9, device="cuda", max_model_len=8192)
    assert float_plan.weights_bytes > 40e9

"""Every family past Llama against transformers on the same tiny random weights.

One body for all: 16 prompts of mixed lengths submitted together, at block size 8 with
chunked prefill forced small (32-token steps) after a warm-up that makes the prefix cache hit,
and at block size 16 with the default budget; greedy tokens equal, logprobs within tolerance.
The configs (conftest.FAMILY_CONFIGS) exercise what each family changes.
"""
from __future__ import annotations

import pytest
import torch
from conftest import make_model_dir, random_prompts

from pagedllm import LLM, SamplingParams

FAMILIES = ["olmo2", "granite", "phi3", "mixtral", "qwen2_moe", "qwen3_moe", "gemma3", "gemma2"]
MAX_NEW = 8
SHARED = random_prompts(1, seed=50, lo=24, hi=25)[0]  # 3 full blocks of 8, reused by half the prompts
PROMPTS = random_prompts(15, seed=51, lo=2, hi=60) + [list(range(3, 90))]
PROMPTS = [SHARED + p if i % 2 else p for i, p in enumerate(PROMPTS)]
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy generate with EOS switched off (conftest's helper forces
    min_new_tokens, which masks EOS, while the engine with ignore_eos may pick it)."""
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    assert out.shape[1] == len(prompt) + max_new_tokens
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(model dir, transformers model, greedy references) for one family."""
    import transformers as tf
    path = make_model_dir(tmp_path_factory.mktemp(request.param), request.param)
    # Gemma 2's attention cap is applied by transformers' eager attention only: 5.17 still
    # defaults it to SDPA, which drops the cap silently (5.24 picks eager itself)
    eager = {"attn_implementation": "eager"} if request.param == "gemma2" else {}
    hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **eager).eval()
    return path, hf, [hf_greedy(hf, p, MAX_NEW) for p in PROMPTS]


def _generate(llm, prompts):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    llm.llm_engine.scheduler.kv.check_integrity()
    return outs


def _assert_logprobs_match(hf, prompts, outs):
    for prompt, out in zip(prompts, outs):
        gen = out.outputs[0].token_ids
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + gen])).logits[0].float()  # [len, vocab]
        ref = torch.log_softmax(logits, -1)[len(prompt) - 1:-1].gather(1, torch.tensor(gen)[:, None]).squeeze(1)
        got = torch.tensor([lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, gen)])
        assert torch.allclose(got, ref, atol=2e-4), (got - ref).abs().max()


def test_chunked_prefill_with_prefix_hits_matches_transformers(family):
    path, hf, refs = family
    llm = LLM(path, block_size=8, max_num_batched_tokens=32, num_gpu_blocks_override=400)
    _generate(llm, [SHARED + [7]])  # caches the shared prefix's blocks
    outs = _generate(llm, PROMPTS)
    got = [o.outputs[0].token_ids for o in outs]
    assert [i for i, (g, r) in enumerate(zip(got, refs)) if g != r] == []
    assert llm.get_kv_cache_stats().prefix_cache_hits >= 8 * len(SHARED)
    _assert_logprobs_match(hf, PROMPTS[:6], outs[:6])


def test_block_size_16_matches_transformers(family):
    path, _, refs = family
    outs = _generate(LLM(path, block_size=16, num_gpu_blocks_override=400), PROMPTS)
    got = [o.outputs[0].token_ids for o in outs]
    assert [i for i, (g, r) in enumerate(zip(got, refs)) if g != r] == []


LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.3, 2.0, 3.0], "long_factor": [1.5, 3.0, 5.0, 9.0],
            "original_max_position_embeddings": 64, "partial_rotary_factor": 0.5}


@pytest.mark.parametrize("max_model_len, lo, hi", [(256, 70, 120), (64, 10, 50)], ids=["long", "short"])
def test_phi3_longrope_partial_rotary_matches_transformers(tmp_path, max_model_len, lo, hi):
    """Past original_max_position_embeddings (64) transformers rotates with the long factors,
    within it with the short ones; so does the engine, per request (rotary_variants.py;
    test_phi3_longrope.py covers short requests under a long max_model_len and the switch)."""
    import transformers as tf
    path = make_model_dir(tmp_path, "phi3", rope_scaling=LONGROPE, partial_rotary_factor=0.5,
                          original_max_position_embeddings=64)
    hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = random_prompts(4, seed=3, lo=lo, hi=hi)
    llm = LLM(path, block_size=8, max_num_batched_tokens=32, max_model_len=max_model_len, num_gpu_blocks_override=300)
    outs = _generate(llm, prompts)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, MAX_NEW) for p in prompts]


def test_unknown_rope_type_is_refused():
    """transformers validates rope types per config class; one it knows and we do not is refused."""
    from types import SimpleNamespace

    from pagedllm.layers.rotary_variants import make_rotary
    cfg = SimpleNamespace(rope_parameters={"rope_type": "proportional", "rope_theta": 1e4}, hidden_size=64,
                          num_attention_heads=4)
    with pytest.raises(ValueError, match="rope_scaling type 'proportional' is not supported"):
        make_rotary(cfg, 16, 128)


@pytest.mark.parametrize("arch", ["olmo2", "qwen2_moe"])
def test_tensor_parallel_2_matches_transformers(tmp_path, arch):
    """Two ranks: OLMo 2's q/k norms span both ranks' heads; every expert (and the shared one)
    is split over its intermediate dimension."""
    import transformers as tf
    path = make_model_dir(tmp_path, arch)
    hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = PROMPTS[:6]
    llm = LLM(path, tensor_parallel_size=2, num_threads=1, block_size=8, num_gpu_blocks_override=200)
    try:
        outs = _generate(llm, prompts)
    finally:
        llm.llm_engine.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    _assert_logprobs_match(hf, prompts, outs)


def test_gemma3_local_layers_slide_and_logits_are_capped(tmp_path):
    """Gemma 3's config (conftest) slides layer 0 over 16 positions (prompts run to 89 tokens)
    and caps final logits at 0.5, so the parity tests above cover both binding."""
    path = make_model_dir(tmp_path, "gemma3")
    llm = LLM(path, block_size=8, num_gpu_blocks_override=64)
    model = llm.llm_engine.executor.runner.model
    assert [layer.self_attn.sliding_window for layer in model.model.layers] == [16, None]
    out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=1, logprobs=5), use_tqdm=False)
    top = max(lp.logprob for lp in out[0].outputs[0].logprobs[0].values())
    assert top < -5.0  # log(1 / vocab) ~ -6.2: a cap of 0.5 leaves the distribution almost flat


@pytest.mark.parametrize("arch, field, value", [("gemma3", "attn_logit_softcapping", 50.0),
                                               ("gemma3", "use_bidirectional_attention", True),
                                               ("gemma2", "use_bidirectional_attention", True),
                                               ("gemma2", "attn_logit_softcapping", -1.0)])
def test_gemma_unsupported_fields_are_refused(tmp_path, arch, field, value):
    path = make_model_dir(tmp_path, arch, **{field: value})
    with pytest.raises(ValueError, match=field):
        LLM(path, num_gpu_blocks_override=64)


def test_gemma2_caps_bind_and_windows_slide(tmp_path):
    """The parity tests above cover Gemma 2's soft caps only if they change the result: without
    the attention cap transformers' logits move by far more than the parity tolerance, and the
    final cap sits below the largest raw logit. Layer 0 slides over 16 positions (prompts run to 89)."""
    import transformers as tf
    path = make_model_dir(tmp_path, "gemma2")
    hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    ids = torch.tensor([PROMPTS[-1]])
    with torch.no_grad():
        capped, raw = hf(ids).logits, hf.lm_head(hf.model(ids).last_hidden_state)
        for layer in hf.model.layers:
            layer.self_attn.attn_logit_softcapping = None
        uncapped = hf(ids).logits
    assert (capped - uncapped).abs().max() > 0.05
    assert raw.abs().max() > 1.2 * capped.abs().max()
    llm = LLM(path, block_size=8, num_gpu_blocks_override=64)
    assert [layer.self_attn.sliding_window for layer in llm.llm_engine.executor.runner.model.model.layers] == [16, None]


def test_soft_capped_model_gets_a_backend_that_caps(tmp_path, caplog):
    """On CPU, auto takes SDPA (the C kernel has no soft cap) and says so; naming the C kernel is refused."""
    path = make_model_dir(tmp_path, "gemma2")
    with caplog.at_level("INFO", logger="pagedllm.attention.selector"):
        llm = LLM(path, block_size=8, num_gpu_blocks_override=64)
    assert llm.llm_engine.executor.runner.backend.name == "sdpa"
    assert "soft-caps attention logits" in caplog.text
    with pytest.raises(ValueError, match="logits_soft_cap=0.1 is not supported by attention_backend='cpu'"):
        LLM(path, attention_backend="cpu", block_size=8, num_gpu_blocks_override=64)


def test_embeddings_match_transformers(family):
    """runner="pooling" on each family: the prompt's last final-normed hidden state, as
    transformers' base model computes it (its last_hidden_state), L2-normalized."""
    path, hf, _ = family
    llm = LLM(path, runner="pooling", block_size=8, max_num_batched_tokens=32, num_gpu_blocks_override=64)
    prompts = PROMPTS[:4]
    outs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            last = hf.base_model(torch.tensor([prompt])).last_hidden_state[0, -1]  # [hidden]
        torch.testing.assert_close(torch.tensor(out.outputs.embedding), torch.nn.functional.normalize(last, dim=0),
                                   atol=5e-5, rtol=1e-4)
    assert llm.get_kv_cache_stats().num_used_blocks == 0

"""bfloat16 models on the CPU: the one-call decoder's bf16 path (models/cpu_decode.py) and
greedy decoding against transformers.

The oracle is transformers in float32 on the bf16-rounded weights: what the decoder computes
(float32 activations on bf16 weights) up to the K/V it stores rounded to bfloat16. The prefill
steps of these runs (past cpu_ops.BF16_C_MAX_ROWS tokens) take the module path, whose activations
are bfloat16, so greedy tokens may part from the oracle where two logits nearly tie: the first
divergence of each sequence is allowed only where the oracle's own logit gap between its token
and ours is below NEAR_TIE (asserted, not skipped).
"""
from __future__ import annotations

import pytest
import torch
from conftest import _tokenizer, first_divergence_is_a_near_tie, hf_greedy, make_model_dir, random_prompts
from test_cpu_decode import BLOCK, decoder_step

from pagedllm import LLM, SamplingParams
from pagedllm.layers import cpu_ops

pytestmark = pytest.mark.skipif(not cpu_ops.usable(torch.zeros(1)), reason="no C compiler")

# logits of these tiny models are O(1); bf16 activations (8 significant bits) in a prefill move
# them by up to ~1e-2, so a gap below this is a tie bf16 cannot resolve
NEAR_TIE = 0.05


@pytest.fixture(scope="module")
def rounded(tmp_path_factory):
    """Per architecture: a checkpoint whose float32 weights are bf16 values, and transformers'
    float32 model on it (the oracle)."""
    import transformers as tf
    out = {}
    for arch in ("llama", "qwen2", "qwen3"):
        path = make_model_dir(tmp_path_factory.mktemp(f"bf16-{arch}"), arch, std=0.1)
        model = tf.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.bfloat16().float())
        model.save_pretrained(path, safe_serialization=True)
        _tokenizer().save_pretrained(path)
        out[arch] = (path, model)
    return out


def _llm(path: str, **kwargs) -> LLM:
    return LLM(path, num_gpu_blocks_override=64, block_size=BLOCK, max_model_len=256, **kwargs)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_tracks_float32_transformers_on_the_bf16_weights(arch, rounded):
    path, oracle = rounded[arch]
    # steps of at most the decoder's tokens: the prompts' chunks run through the one-call decoder too
    llm = _llm(path, dtype="bfloat16", max_num_batched_tokens=cpu_ops.BF16_C_MAX_ROWS)
    model = llm.llm_engine.executor.runner.model
    assert model.model.fused_decoder is not None and next(model.parameters()).dtype == torch.bfloat16
    prompts = random_prompts(4, seed=1, lo=17, hi=40)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    prompts.append(prompts[0][:16] + prompts[1][:5])  # then a prefix-cache hit on prompt 0's first two blocks
    outs += llm.generate([{"prompt_token_ids": prompts[-1]}], params, use_tqdm=False)
    assert llm.get_kv_cache_stats().prefix_cache_hits >= 16
    assert llm.llm_engine.executor.runner.cache.kv.dtype == torch.bfloat16
    matched = [first_divergence_is_a_near_tie(oracle, p, o.outputs[0].token_ids, hf_greedy(oracle, p, 12), NEAR_TIE)
               for p, o in zip(prompts, outs)]
    assert sum(d == 12 for d in matched) >= 3, matched  # near ties are rare: most sequences match all the way


def test_module_path_prefill_tracks_the_oracle_too(rounded):
    """Default batching: the prompts run through the module path (bf16 activations), decode steps
    through the decoder."""
    path, oracle = rounded["llama"]
    llm = _llm(path, dtype="bfloat16")
    prompts = random_prompts(3, seed=2, lo=30, hi=60)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, o in zip(prompts, outs):
        first_divergence_is_a_near_tie(oracle, p, o.outputs[0].token_ids, hf_greedy(oracle, p, 10), NEAR_TIE)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_decoder_computes_float32_math_on_the_bf16_weights(arch, rounded):
    """The bf16 model's decoder against the float32 module path on the same (rounded) weights
    with a bf16 KV cache: the same math, so close to float32 rounding, caches included."""
    path, _ = rounded[arch]
    runners = [_llm(path, dtype=d, kv_cache_dtype="bfloat16").llm_engine.executor.runner
               for d in ("bfloat16", "float32")]
    assert all(r.model.model.fused_decoder is not None for r in runners)
    g = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(3, 500, (n,), generator=g).tolist()  # noqa: E731
    # steps the decoder takes (<= BF16_C_MAX_ROWS tokens): histories of 16 and 6 tokens, then a ragged
    # batch: a decode into a new block, a chunk crossing a block, a fresh prompt
    steps = [[(rand(5), 0, [5, 17, 2]), (rand(3), 0, [30, 8])], [(rand(4), 5, [5, 17, 2]), (rand(3), 3, [30, 8])],
             [(rand(7), 9, [5, 17, 2])], [(rand(1), 16, [5, 17, 2]), (rand(4), 6, [30, 8]), (rand(3), 0, [39])]]
    assert max(sum(len(ids) for ids, _, _ in s) for s in steps) <= cpu_ops.BF16_C_MAX_ROWS
    for r in runners:  # unwritten slots hold garbage: zero them to compare whole caches
        for k, v in r.cache.layer_caches:
            k.zero_(), v.zero_()
    outs = [[decoder_step(r.model, r.cache.layer_caches, fused, s) for s in steps]
            for r, fused in zip(runners, (True, False))]
    got, want = outs[0][-1], outs[1][-1]
    assert got.dtype == want.dtype == torch.float32 and got.shape == (8, runners[0].model.config.hidden_size)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for (k16, v16), (k32, v32) in zip(runners[0].cache.layer_caches, runners[1].cache.layer_caches):
        for a, b in ((k16, k32), (v16, v32)):  # rounded alike (nearest even), but where the float32 sums straddle
            assert a.dtype == b.dtype == torch.bfloat16 and a.count_nonzero() > 0  # a rounding boundary: one step
            assert (a != b).float().mean() < 0.01
            torch.testing.assert_close(a.float(), b.float(), atol=1e-6, rtol=2**-7)

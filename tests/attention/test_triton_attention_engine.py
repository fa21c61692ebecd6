"""The engine with attention_backend="triton" (Triton's interpreter on CPU), alone and with the
Triton fused ops, against transformers: greedy tokens through chunked prefill, decode steps and
a prefix-cache hit."""
from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy, make_model_dir, random_prompts

from pagedllm import LLM, SamplingParams

pytest.importorskip("pagedllm.attention.triton.backend")

MAX_NEW = 4
SHARED = random_prompts(1, seed=7, lo=20, hi=21)[0]  # 20 tokens: 2 full blocks of 8 and a partial one
FIRST = [SHARED, [5, 6, 7]]
LATER = [SHARED[:16] + [9, 10, 11, 12]]  # reuses SHARED's 2 full blocks from the cache


# gemma2: attention soft cap (binding, conftest) and a 16-token sliding window on layer 0
@pytest.mark.parametrize(("arch", "fused_ops"), [("llama", "native"), ("qwen2", "native"), ("llama", "triton"),
                                                 ("gemma2", "triton")])
def test_greedy_matches_transformers_with_chunks_decodes_and_a_prefix_hit(arch, fused_ops, tmp_path, monkeypatch):
    """fused_ops="triton" is the whole GPU path: Triton attention, norm, rotary, SiLU and sampler."""
    import transformers as tf

    from pagedllm.attention.triton.backend import TritonAttentionBackend
    calls = []  # (max_query_len, max_seq_len) of every attention call
    forward = TritonAttentionBackend.forward
    def spy(self, query, key, value, key_cache, value_cache, meta, *args, **kwargs):
        calls.append((meta.max_query_len, meta.max_seq_len))
        return forward(self, query, key, value, key_cache, value_cache, meta, *args, **kwargs)
    monkeypatch.setattr(TritonAttentionBackend, "forward", spy)

    # head_dim 64 (the kernels' smallest), a GQA group of 2
    model_dir = make_model_dir(tmp_path, arch, hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                               head_dim=64)
    # Gemma 2's attention cap is applied by transformers' eager attention only: 5.17 (the H200
    # device's) still defaults it to SDPA, which drops the cap silently (5.24 picks eager itself)
    eager = {"attn_implementation": "eager"} if arch == "gemma2" else {}
    hf = tf.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32, **eager).eval()
    llm = LLM(model_dir, attention_backend="triton", fused_ops=fused_ops, block_size=8, num_gpu_blocks_override=32,
              max_num_batched_tokens=16, max_model_len=64)  # 16-token chunks: SHARED is prefilled in two
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in FIRST], params,
                                                         use_tqdm=False)]  # fmt: skip
    later = llm.generate([{"prompt_token_ids": p} for p in LATER], params, use_tqdm=False)
    got.append(later[0].outputs[0].token_ids)
    assert llm.get_kv_cache_stats().prefix_cache_hits >= 16
    assert (16, 16) in calls and (4, 20) in calls  # SHARED's second chunk saw its first as cached context
    assert (1, 23) in calls  # a decode step
    assert got == [hf_greedy(hf, p, MAX_NEW) for p in FIRST + LATER]


def test_unsupported_head_dim_fails_at_startup(tmp_path):
    model_dir = make_model_dir(tmp_path, "llama")  # head_dim 16
    with pytest.raises(ValueError, match="head_dim=16 is not supported by attention_backend='triton'"):
        LLM(model_dir, attention_backend="triton", block_size=8, max_num_batched_tokens=16, max_model_len=64)

"""CUDA-graph replay of decode steps equals eager execution (needs a GPU; marked ``gpu``), with
the test's graph-safe attention backend (tests/graph_safe_backend.py) and with the Triton one."""
from __future__ import annotations

import math

import pytest
import torch
from conftest import hf_greedy, make_model_dir, random_prompts
from graph_safe_backend import GraphSafeDecodeBackend

from pagedllm import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _run(model_dir, prompts, monkeypatch, **kwargs):
    monkeypatch.setattr("pagedllm.worker.model_runner.get_attention_backend",
                        lambda name, device: GraphSafeDecodeBackend())
    llm = LLM(model_dir, device="cuda", dtype="float32", block_size=8, num_gpu_blocks_override=128, max_model_len=128,
              max_num_seqs=12, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=8, ignore_eos=True, logprobs=0)  # as hf_greedy
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return llm, outs


def test_graph_replay_equals_eager_and_transformers(llama_dir, hf_models, monkeypatch):
    prompts = random_prompts(5, seed=21, lo=3, hi=40)  # 5 sequences: padded to the size-8 graph
    graphed, g_outs = _run(llama_dir, prompts, monkeypatch)
    eager, e_outs = _run(llama_dir, prompts, monkeypatch, enforce_eager=True)
    graphs = graphed.llm_engine.executor.runner.decode_graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4, 8, 16] and graphs.replays >= 7
    assert eager.llm_engine.executor.runner.decode_graphs is None
    for g, e, p in zip(g_outs, e_outs, prompts):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids == hf_greedy(hf_models["llama"], p, 8)
        assert abs(g.outputs[0].cumulative_logprob - e.outputs[0].cumulative_logprob) < 1e-3
    graphed.llm_engine.scheduler.kv.check_integrity()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_triton_attention_graphs_equal_eager(dtype, tmp_path):
    """The shipped GPU path (Triton attention and fused ops, chosen by ``auto``) captured: in
    float32, graph replay, eager and transformers agree token for token; in bfloat16 (where the
    graph's split count, fixed by max_model_len, rounds differently from eager's) the steps replay
    and the first tokens, from the eager prefill, agree."""
    import transformers as tf

    from pagedllm.attention.triton.backend import TritonAttentionBackend
    model_dir = make_model_dir(tmp_path, "llama", hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    prompts = random_prompts(5, seed=22, lo=3, hi=40)
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=8, ignore_eos=True, logprobs=0)

    def run(**kwargs):
        llm = LLM(model_dir, device="cuda", dtype=dtype, block_size=16, num_gpu_blocks_override=128,
                  max_model_len=512, max_num_seqs=12, **kwargs)  # fmt: skip
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return llm.llm_engine.executor.runner, [o.outputs[0] for o in outs]

    graphed, g_outs = run()
    eager, e_outs = run(enforce_eager=True)
    assert isinstance(graphed.backend, TritonAttentionBackend) and graphed.decode_graphs.replays >= 7
    assert eager.decode_graphs is None
    for g, e in zip(g_outs, e_outs):
        assert g.token_ids[0] == e.token_ids[0] and math.isfinite(g.cumulative_logprob)
    if dtype == "float32":
        hf = tf.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
        for g, e, p in zip(g_outs, e_outs, prompts):
            assert g.token_ids == e.token_ids == hf_greedy(hf, p, 8)

"""CUDA-graph replay of decode steps equals eager execution (needs a GPU; marked ``gpu``).

No attention backend in this tree is graph-safe yet (the torch ones loop over requests on the
host), so the test brings one: decode steps vectorised over the padded block tables, no host
synchronisation; prefill steps take the reference path (they never run in a graph).
"""
from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy, random_prompts

from pagedllm import LLM, SamplingParams
from pagedllm.attention.backend import write_kv
from pagedllm.attention.torch_ref import TorchReferenceBackend

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


class GraphSafeDecodeBackend(TorchReferenceBackend):
    name = "graph-safe-test"
    supports_cuda_graphs = True

    def forward(self, query, key, value, key_cache, value_cache, meta, scale, sliding_window=None):
        if meta.max_query_len > 1 or sliding_window:  # host ints: fixed at capture time
            return super().forward(query, key, value, key_cache, value_cache, meta, scale, sliding_window)
        write_kv(key, value, key_cache, value_cache, meta.slot_mapping)
        n, heads, head_dim = query.shape
        kv_heads = key_cache.shape[1]
        tables = meta.block_tables.long()  # [n, max_blocks]
        # [n, max_blocks, kv_heads, bs, dim] -> [n, kv_heads, max_blocks * bs, dim] -> per query head
        k = key_cache[tables].transpose(1, 2).reshape(n, kv_heads, -1, head_dim).float()
        v = value_cache[tables].transpose(1, 2).reshape(n, kv_heads, -1, head_dim).float()
        k, v = k.repeat_interleave(heads // kv_heads, dim=1), v.repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("nhd,nhtd->nht", query.float() * scale, k)
        t = torch.arange(scores.shape[-1], device=query.device)
        scores = scores.masked_fill(t[None, None, :] >= meta.seq_lens[:, None, None], float("-inf"))
        return torch.einsum("nht,nhtd->nhd", scores.softmax(dim=-1), v).to(query.dtype)


def _run(model_dir, prompts, monkeypatch, **kwargs):
    monkeypatch.setattr("pagedllm.worker.model_runner.get_attention_backend",
                        lambda name, device: GraphSafeDecodeBackend())
    llm = LLM(model_dir, device="cuda", dtype="float32", block_size=8, num_gpu_blocks_override=128, max_model_len=128,
              max_num_seqs=12, **kwargs)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
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

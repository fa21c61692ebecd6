"""Test stand-ins for CUDA graphs: an attention backend they can capture, and a
``DecodeGraphs`` that replays eagerly (so the runner's graph path runs on the CPU).

The torch backends loop over requests on the host, so they cannot be captured; the Triton
backend can, but its kernels need a GPU or the (slow) interpreter. ``GraphSafeDecodeBackend``
computes decode steps vectorised over the padded block tables, with lengths read from the
metadata tensors and no host synchronisation; steps with prefill chunks (never captured) take
the reference path.
"""
from __future__ import annotations

import torch

from pagedllm.attention.backend import write_kv
from pagedllm.attention.torch_ref import TorchReferenceBackend
from pagedllm.worker.cuda_graphs import DecodeGraphs


class GraphSafeDecodeBackend(TorchReferenceBackend):
    name = "graph-safe-test"
    supports_cuda_graphs = True

    def forward(self, query, key, value, key_cache, value_cache, meta, scale, sliding_window=None,
                logits_soft_cap=None, attention_chunk_size=None):
        if meta.max_query_len > 1 or sliding_window or logits_soft_cap or attention_chunk_size:  # host values
            return super().forward(query, key, value, key_cache, value_cache, meta, scale, sliding_window,
                                   logits_soft_cap, attention_chunk_size)
        write_kv(key, value, key_cache, value_cache, meta.slot_mapping)
        n, heads, head_dim = query.shape
        kv_heads = key_cache.shape[1]
        tables = meta.block_tables.long()  # [n, max_blocks]
        # [n, max_blocks, kv_heads, bs, dim] -> [n, kv_heads, max_blocks * bs, dim] -> per query head
        k = key_cache[tables].transpose(1, 2).reshape(n, kv_heads, -1, head_dim).float()
        v = value_cache[tables].transpose(1, 2).reshape(n, kv_heads, -1, head_dim).float()
        k, v = k.repeat_interleave(heads // kv_heads, dim=1), v.repeat_interleave(heads // kv_heads, dim=1)
        t = torch.arange(k.shape[2], device=query.device)
        past_end = (t[None, :] >= meta.seq_lens[:, None])[:, None, :, None]  # [n, 1, T, 1]
        # slots past a sequence's end hold whatever the pool held (torch.empty): NaN * 0 is NaN
        k, v = k.masked_fill(past_end, 0), v.masked_fill(past_end, 0)
        scores = torch.einsum("nhd,nhtd->nht", query.float() * scale, k)
        scores = scores.masked_fill(past_end[..., 0], float("-inf"))
        return torch.einsum("nht,nhtd->nhd", scores.softmax(dim=-1), v).to(query.dtype)


class EagerStandIn(DecodeGraphs):
    """Captures nothing: ``replay`` runs the model eagerly on the graph's own buffers and
    metadata, so everything around the CUDA capture runs on the CPU (the pad block, the padded
    buffers, the runner's hook); the real capture is tests/e2e/test_cuda_graph_replay.py's."""

    def capture(self, model, kv_caches) -> None:
        self.model, self.kv_caches = model, kv_caches

    def replay(self, meta):
        self.replays += 1
        size = meta.num_reqs
        return self.model(self.buffers["input_ids"][:size], self.buffers["positions"][:size], self.kv_caches, meta)

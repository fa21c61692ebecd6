"""Reference paged attention in plain PyTorch: the readable oracle the other backends match.

For every request it walks the block table one block at a time, keeping the online-softmax
state per (query token, head): running max ``m``, running sum ``l`` and an accumulator ``acc``
rescaled by ``exp(m_old - m_new)`` whenever the max grows. Slow, but obviously right. An
attention sink (GPT-OSS) is one more term ``exp(sink - m)`` in the final ``row_sum``.
"""
from __future__ import annotations

import torch

from pagedllm.attention.backend import AttentionBackend, check_chunk_size, check_sinks, visible_keys, write_kv
from pagedllm.attention.metadata import AttentionMetadata


class TorchReferenceBackend(AttentionBackend):
    name = "torch"

    def forward(self, query, key, value, key_cache, value_cache, meta: AttentionMetadata, scale,
                sliding_window: int | None = None, logits_soft_cap: float | None = None,
                attention_chunk_size: int | None = None, sinks=None):
        check_chunk_size(attention_chunk_size)
        sinks = check_sinks(sinks, query.shape[1])
        write_kv(key, value, key_cache, value_cache, meta.slot_mapping)
        out = torch.empty_like(query)
        for r, start, end, seq_len in meta.request_spans():
            ends = None if meta.attend_ends is None else meta.attend_ends[start:end]
            out[start:end] = _attend_one(query[start:end], key_cache, value_cache, meta.block_tables[r], seq_len,
                                         scale, sliding_window, logits_soft_cap, attention_chunk_size, sinks, ends)
        return out


def _attend_one(q, key_cache, value_cache, block_table, seq_len: int, scale: float, window: int | None = None,
                soft_cap: float | None = None, chunk: int | None = None, sinks: torch.Tensor | None = None,
                attend_ends: torch.Tensor | None = None):
    """Online-softmax attention of one request's query chunk over its paged context
    (``attend_ends``: each query token's visible end, exclusive; default its position + 1)."""
    q_len, num_heads, head_dim = q.shape
    num_kv_heads, block_size = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    qf = q.float() * scale
    q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)  # [q_len]
    q_end = q_pos + 1 if attend_ends is None else attend_ends.to(q.device)  # [q_len]
    m = torch.full((q_len, num_heads), float("-inf"), device=q.device)
    row_sum = torch.zeros(q_len, num_heads, device=q.device)
    acc = torch.zeros(q_len, num_heads, head_dim, device=q.device)
    for b in range((seq_len + block_size - 1) // block_size):
        block_id = int(block_table[b])
        n = min(block_size, seq_len - b * block_size)  # valid tokens in this (maybe partial) block
        # [num_kv_heads, n, head_dim] -> [num_heads, n, head_dim] (GQA: each KV head serves a group)
        k = key_cache[block_id, :, :n].float().repeat_interleave(group, dim=0)
        v = value_cache[block_id, :, :n].float().repeat_interleave(group, dim=0)
        s = torch.einsum("qhd,hkd->qhk", qf, k)  # [q_len, num_heads, n]
        if soft_cap:
            s = torch.tanh(s / soft_cap) * soft_cap
        k_pos = torch.arange(b * block_size, b * block_size + n, device=q.device)
        visible = visible_keys(q_pos, k_pos, window, chunk, q_end)  # [q_len, n]
        s = s.masked_fill(~visible[:, None, :], float("-inf"))
        m_new = torch.maximum(m, s.amax(dim=-1))
        # rows with nothing visible yet keep m = -inf; use 0 there to avoid inf - inf
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp(s - m_safe[..., None])  # [q_len, num_heads, n]
        correction = torch.exp(m - m_safe)
        row_sum = row_sum * correction + p.sum(dim=-1)
        acc = acc * correction[..., None] + torch.einsum("qhk,hkd->qhd", p, v)
        m = m_new
    if sinks is not None:  # the sink's share of the denominator: exp(sink) = exp(m) * exp(sink - m)
        row_sum = row_sum + torch.exp(sinks.to(q.device)[None, :] - m)
    return (acc / row_sum[..., None]).to(q.dtype)

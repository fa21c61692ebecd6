"""Portable fast-enough backend: gather each request's K/V through its block table, then SDPA.

Used on CUDA when triton is not installed, and on CPU when the C kernel cannot be built. It
copies a request's context per call (the C kernel does not), but runs one fused SDPA per request.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.attention.backend import AttentionBackend, check_chunk_size, check_sinks, visible_keys, write_kv
from pagedllm.attention.metadata import AttentionMetadata


class SdpaBackend(AttentionBackend):
    name = "sdpa"

    def forward(self, query, key, value, key_cache, value_cache, meta: AttentionMetadata, scale,
                sliding_window: int | None = None, logits_soft_cap: float | None = None,
                attention_chunk_size: int | None = None, sinks=None):
        check_chunk_size(attention_chunk_size)
        sinks = check_sinks(sinks, query.shape[1])
        write_kv(key, value, key_cache, value_cache, meta.slot_mapping)
        out = torch.empty_like(query)
        num_heads, num_kv_heads = query.shape[1], key_cache.shape[1]
        bs, head_dim = key_cache.shape[2], key_cache.shape[3]
        for r, start, end, seq_len in meta.request_spans():
            blocks = meta.block_tables[r, : (seq_len + bs - 1) // bs].long()
            # (cast: the cache may be stored in another dtype, kv_cache_dtype)
            # [n_blocks, kv_heads, bs, hd] -> [kv_heads, n_blocks * bs, hd] -> first seq_len tokens
            k = key_cache[blocks].transpose(0, 1).reshape(num_kv_heads, -1, head_dim)[:, :seq_len].to(query.dtype)
            v = value_cache[blocks].transpose(0, 1).reshape(num_kv_heads, -1, head_dim)[:, :seq_len].to(query.dtype)
            q = query[start:end].transpose(0, 1)  # [heads, q_len, dim]
            if meta.attend_ends is None:
                mask = _causal_mask(end - start, seq_len, q.device, sliding_window, attention_chunk_size)
            else:  # bidirectional image spans (metadata.py)
                mask = meta.visible(start, end, seq_len, sliding_window, attention_chunk_size).to(q.device)
            if logits_soft_cap or sinks is not None:
                o = _explicit_attention(q, k, v, mask, scale, logits_soft_cap, sinks)
            else:
                o = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, scale=scale,
                                                   enable_gqa=num_heads != num_kv_heads)[0]
            out[start:end] = o.transpose(0, 1)
        return out


def _explicit_attention(q, k, v, mask, scale: float, soft_cap: float | None,
                        sinks: torch.Tensor | None) -> torch.Tensor:
    """SDPA has no soft-cap or sink hook, so the scores are computed explicitly:
    q [heads, q_len, dim], k/v [kv_heads, seq_len, dim] -> [heads, q_len, dim]. A sink is one
    more score column, dropped after the softmax (it has no value row)."""
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)  # [heads, seq_len, dim]
    s = torch.matmul(q.float(), k.float().transpose(1, 2)) * scale  # [heads, q_len, seq_len]
    if soft_cap:
        s = torch.tanh(s / soft_cap) * soft_cap
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink_col = sinks.to(s.device)[:, None, None].expand(-1, s.shape[1], 1)  # [heads, q_len, 1]
        p = torch.softmax(torch.cat([s, sink_col], dim=-1), dim=-1)[..., :-1]
    else:
        p = torch.softmax(s, dim=-1)
    return torch.matmul(p, v.float()).to(q.dtype)


def _causal_mask(q_len: int, seq_len: int, device, window: int | None = None,
                 chunk: int | None = None) -> torch.Tensor | None:
    windowed = bool(window) and seq_len > window
    chunked = bool(chunk) and seq_len > chunk
    if q_len == 1 and not windowed and not chunked:
        return None  # a decode token sees the whole context
    q_pos = torch.arange(seq_len - q_len, seq_len, device=device)
    k_pos = torch.arange(seq_len, device=device)
    return visible_keys(q_pos, k_pos, window if windowed else None, chunk if chunked else None)  # [q_len, seq_len]

"""Portable fast-enough backend: gather each request's K/V through its block table, then SDPA.

Used on CUDA when triton is not installed, and on CPU when the C kernel cannot be built. It
copies a request's context per call (the C kernel does not), but runs one fused SDPA per request.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.attention.backend import AttentionBackend, write_kv
from pagedllm.attention.metadata import AttentionMetadata


class SdpaBackend(AttentionBackend):
    name = "sdpa"

    def forward(self, query, key, value, key_cache, value_cache, meta: AttentionMetadata, scale,
                sliding_window: int | None = None, logits_soft_cap: float | None = None):
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
                mask = _causal_mask(end - start, seq_len, q.device, sliding_window)
            else:  # bidirectional image spans (metadata.py)
                mask = meta.visible(start, end, seq_len, sliding_window).to(q.device)
            if logits_soft_cap:
                o = _soft_capped_attention(q, k, v, mask, scale, logits_soft_cap)
            else:
                o = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, scale=scale,
                                                   enable_gqa=num_heads != num_kv_heads)[0]
            out[start:end] = o.transpose(0, 1)
        return out


def _soft_capped_attention(q, k, v, mask, scale: float, soft_cap: float) -> torch.Tensor:
    """SDPA has no soft-cap hook, so the capped scores are computed explicitly:
    q [heads, q_len, dim], k/v [kv_heads, seq_len, dim] -> [heads, q_len, dim]."""
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)  # [heads, seq_len, dim]
    s = torch.matmul(q.float(), k.float().transpose(1, 2)) * scale  # [heads, q_len, seq_len]
    s = torch.tanh(s / soft_cap) * soft_cap
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v.float()).to(q.dtype)


def _causal_mask(q_len: int, seq_len: int, device, window: int | None = None) -> torch.Tensor | None:
    windowed = bool(window) and seq_len > window
    if q_len == 1 and not windowed:
        return None  # a decode token sees the whole context
    q_pos = torch.arange(seq_len - q_len, seq_len, device=device)
    k_pos = torch.arange(seq_len, device=device)[None, :]
    mask = k_pos <= q_pos[:, None]  # [q_len, seq_len]
    return mask & (k_pos > q_pos[:, None] - window) if windowed else mask

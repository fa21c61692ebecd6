"""Random paged batches and a dense float64 oracle, shared by backend tests and benchmarks.

A batch is built from *dense* per-request context K/V first; the already-cached part is then
scattered into a pool of shuffled physical blocks (so pages are non-contiguous and the pool
holds garbage everywhere else), and the new part is handed to the backend as ``key``/``value``.
The oracle therefore never looks at the paged cache.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F

from pagedllm.attention.metadata import AttentionMetadata


@dataclass
class PagedBatch:
    query: torch.Tensor  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor  # [num_blocks, num_kv_heads, block_size, head_dim]
    value_cache: torch.Tensor  # [num_blocks, num_kv_heads, block_size, head_dim]
    meta: AttentionMetadata
    ctx_k: list[torch.Tensor]  # per request [seq_len, num_kv_heads, head_dim], full context
    ctx_v: list[torch.Tensor]
    scale: float

    def fresh_caches(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the pool, so several backends can each write into their own."""
        return self.key_cache.clone(), self.value_cache.clone()

    def to(self, device: torch.device | str) -> PagedBatch:
        """The batch with its inputs, pool and metadata on ``device`` (the oracle's dense
        context stays on the CPU)."""
        meta = self.meta
        meta_tensors = {f: getattr(meta, f).to(device)
                        for f in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping", "attend_ends")
                        if getattr(meta, f) is not None}
        moved = {f: getattr(self, f).to(device) for f in ("query", "key", "value", "key_cache", "value_cache")}
        return replace(self, meta=replace(meta, **meta_tensors), **moved)


def make_paged_batch(
    reqs: list[tuple[int, int]],  # per request (num_cached, q_len); seq_len = num_cached + q_len
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    seed: int = 0,
    cache_dtype: torch.dtype = torch.float32,
    extra_blocks: int = 3,
) -> PagedBatch:
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in reqs]
    q_lens = [q for _, q in reqs]
    # round through the cache dtype so the oracle sees exactly the values the cache stores
    def rounded(s: int) -> torch.Tensor:
        return torch.randn(s, num_kv_heads, head_dim, generator=g).to(cache_dtype).float()

    ctx_k = [rounded(s) for s in seq_lens]
    ctx_v = [rounded(s) for s in seq_lens]

    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + extra_blocks
    perm = torch.randperm(num_blocks, generator=g).tolist()
    max_blocks = max(blocks_per_req, default=0) + 1  # + 1: a -1 column past every table's end
    block_tables = np.full((len(reqs), max_blocks), -1, dtype=np.int32)
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    key_cache = torch.randn(shape, generator=g).to(cache_dtype)  # garbage outside live slots
    value_cache = torch.randn(shape, generator=g).to(cache_dtype)
    for r, (cached, _) in enumerate(reqs):
        ids = [perm.pop() for _ in range(blocks_per_req[r])]
        block_tables[r, : len(ids)] = ids
        for p in range(cached):  # the already-cached prefix lives in the pool
            blk, off = ids[p // block_size], p % block_size
            key_cache[blk, :, off] = ctx_k[r][p].to(cache_dtype)
            value_cache[blk, :, off] = ctx_v[r][p].to(cache_dtype)

    new = lambda ctx: torch.cat([c[c.shape[0] - q :] for c, q in zip(ctx, q_lens)])  # noqa: E731
    num_tokens = sum(q_lens)
    return PagedBatch(
        query=torch.randn(num_tokens, num_heads, head_dim, generator=g),
        key=new(ctx_k) if reqs else torch.empty(0, num_kv_heads, head_dim),
        value=new(ctx_v) if reqs else torch.empty(0, num_kv_heads, head_dim),
        key_cache=key_cache,
        value_cache=value_cache,
        meta=AttentionMetadata.build(
            np.array(q_lens), np.array(seq_lens), block_tables, block_size
        ),
        ctx_k=ctx_k,
        ctx_v=ctx_v,
        scale=head_dim**-0.5,
    )


def dense_attention_f64(batch: PagedBatch, sliding_window: int | None = None,
                        logits_soft_cap: float | None = None, attention_chunk_size: int | None = None,
                        sinks: torch.Tensor | None = None) -> torch.Tensor:
    """[num_tokens, num_heads, head_dim] float64: SDPA per request with a positional causal mask
    (extended to ``meta.attend_ends`` where set; with ``sliding_window`` W, only positions past
    p - W visible; with ``logits_soft_cap`` c, explicit softmax over ``tanh(s / c) * c``; with
    ``attention_chunk_size`` C, only the positions of the query's own C-aligned chunk visible; with
    ``sinks`` [num_heads], one more logit per head in the softmax, whose probability is dropped, as
    transformers' GPT-OSS does)."""
    qsl = batch.meta.query_start_loc.tolist()
    num_heads = batch.query.shape[1]
    outs = []
    for r, seq_len in enumerate(batch.meta.seq_lens.tolist()):
        q = batch.query[qsl[r] : qsl[r + 1]].double()  # [q_len, H, D]
        q_len = q.shape[0]
        if q_len == 0:
            continue
        group = num_heads // batch.ctx_k[r].shape[1]
        k = batch.ctx_k[r].double().repeat_interleave(group, dim=1)  # [seq_len, H, D]
        v = batch.ctx_v[r].double().repeat_interleave(group, dim=1)
        q_pos = torch.arange(seq_len - q_len, seq_len)
        k_pos = torch.arange(seq_len)[None, :]
        ends = batch.meta.attend_ends  # bidirectional image spans (metadata.py); None: causal
        hi = q_pos + 1 if ends is None else ends[qsl[r]:qsl[r + 1]].long().cpu()
        mask = k_pos < hi[:, None]  # [q_len, seq_len]
        if sliding_window:
            mask &= k_pos > q_pos[:, None] - sliding_window
        if attention_chunk_size:
            mask &= k_pos // attention_chunk_size == (q_pos // attention_chunk_size)[:, None]
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [H, len, D]
        if logits_soft_cap or sinks is not None:
            s = q @ k.transpose(1, 2) * batch.scale  # [H, q_len, seq_len]
            if logits_soft_cap:
                s = torch.tanh(s / logits_soft_cap) * logits_soft_cap
            s = s.masked_fill(~mask, float("-inf"))
            if sinks is not None:
                s = torch.cat([s, sinks.double()[:, None, None].expand(-1, q_len, 1)], dim=-1)
            o = torch.softmax(s, dim=-1)[..., :seq_len] @ v
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=batch.scale)
        outs.append(o.transpose(0, 1))
    if not outs:
        return torch.empty(0, *batch.query.shape[1:], dtype=torch.float64)
    return torch.cat(outs)


def gather_context(cache: torch.Tensor, batch: PagedBatch, r: int) -> torch.Tensor:
    """Request r's context [seq_len, num_kv_heads, head_dim] read back from a paged cache."""
    seq_len = int(batch.meta.seq_lens[r])
    block_size = cache.shape[2]
    pos = torch.arange(seq_len)
    blocks = batch.meta.block_tables[r].long()[pos // block_size]
    return cache[blocks, :, pos % block_size]

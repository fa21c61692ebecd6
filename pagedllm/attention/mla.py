"""Multi-head latent attention (MLA, DeepSeek V2/V3) over a paged latent cache.

A token's K and V are never stored. Each layer caches one latent per token (kv_cache/spec.py,
``KVCacheSpec.mla``)::

    latent = [ c_kv (kv_lora_rank, after kv_a_layernorm) | k_pe (qk_rope_head_dim, rope'd) ]

and every head's key and value are linear images of it through ``kv_b_proj``, whose weight is
``[heads, nope + v, kv_lora_rank]`` per head: ``W_UK = [:, :nope]``, ``W_UV = [:, nope:]``::

    k_h = [ W_UK_h c_kv | k_pe ]          v_h = W_UV_h c_kv
    score_h(q, t) = q_nope_h . W_UK_h c_kv(t) + q_pe_h . k_pe(t)
                  = (W_UK_h^T q_nope_h) . c_kv(t) + q_pe_h . k_pe(t)          (absorbed)
    out_h = sum_t p_h(t) v_h(t) = W_UV_h (sum_t p_h(t) c_kv(t))                (absorbed)

Two equal ways to compute it, picked per request by cost:

- *decompress* (prefill): gather the context's latents, expand them to per-head K and V with
  ``W_UK`` / ``W_UV``, run ordinary causal attention. ``seq_len * kv_lora_rank * heads * (nope + v)``
  multiply-adds to expand, then attention at head width.
- *absorbed* (decode): fold ``q_nope`` into ``W_UK`` once per query token, attend over the latents
  themselves (one "KV head" of width ``kv_lora_rank + rope`` shared by every query head, like
  MQA), and map the latent-space output through ``W_UV``. ``2 * q_len * seq_len * kv_lora_rank *
  heads`` multiply-adds over the context: cheaper than expanding for chunks shorter than about
  ``kv_lora_rank * (nope + v) / (2 * kv_lora_rank - nope - v)`` tokens (``absorbs``; DeepSeek
  V2/V3: 170, so decode, verify and short prefill chunks take it).

Both read only latents through the block table; ``mla_reference`` below is the float64 oracle.

The absorbed requests of a step go through one kernel call, reading only latents: on CPU tensors
the C kernel (``native/csrc/mla_decode.c``), on CUDA the Triton kernel
(``attention/triton/mla_kernels.py``); both take the query ``[W_UK^T q_nope | q_pe]`` and return
the latent-space output, which ``W_UV`` maps to the heads' values. Each latent row is read once for
every head of a token and p.v covers only the ``kv_lora_rank`` channels. The decompressed requests
(and everything without a kernel) run in torch.
"""
from __future__ import annotations

import itertools
import logging

import torch

from pagedllm.attention.kv_quant import to_cache_dtype
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.triton.latent import latent_attention, unsupported_latent_cache
from pagedllm.native import bindings

logger = logging.getLogger(__name__)


def write_latent(latent: torch.Tensor, latent_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatters new latents ``[num_tokens, kv_lora_rank + rope]`` into their slots of
    ``latent_cache`` ``[num_blocks, 1, block_size, kv_lora_rank + rope]``."""
    block_size = latent_cache.shape[2]
    # fp8: unscaled, saturating at the format's largest finite value (kv_cache/spec.py check_cache)
    latent_cache[slot_mapping // block_size, 0, slot_mapping % block_size] = to_cache_dtype(latent, latent_cache.dtype)


def gather_latents(latent_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """One request's first ``seq_len`` latents from its blocks: ``[seq_len, kv_lora_rank + rope]``."""
    block_size = latent_cache.shape[2]
    blocks = block_table[: (seq_len + block_size - 1) // block_size].long()
    return latent_cache[blocks, 0].reshape(-1, latent_cache.shape[-1])[:seq_len]  # [seq_len, D]


def causal_mask(q_len: int, seq_len: int, device) -> torch.Tensor:
    """``[q_len, seq_len]`` True where query i (at position seq_len - q_len + i) sees key t."""
    q_pos = torch.arange(seq_len - q_len, seq_len, device=device)
    return torch.arange(seq_len, device=device)[None, :] <= q_pos[:, None]


def absorbs(q_len: int, qk_nope_head_dim: int, v_head_dim: int, kv_lora_rank: int, qk_rope_head_dim: int) -> bool:
    """Whether the absorbed form takes fewer multiply-adds for a ``q_len``-token chunk (per head and
    context token: ``q_len * (2 * rank + rope)`` against ``rank * (nope + v)`` to expand plus
    ``q_len * (nope + rope + v)`` to attend). DeepSeek V2/V3: chunks under 171 tokens. Measured
    on 2 CPU cores (V2-Lite shapes, one layer): decode at context 512 / 2048 / 8192, absorbed (then on
    the generic C paged-attention kernel; the latent kernel: benchmarks/kv_memory.py experiment 5)
    ~9 / 20 / 34 ms against decompressed ~180 / 420 / 1500 ms; a 256-token chunk at
    context 2048, 315 ms against 250 ms; a 1024-token prefill, 515 against 508 ms."""
    absorbed = q_len * (2 * kv_lora_rank + qk_rope_head_dim)
    return absorbed < kv_lora_rank * (qk_nope_head_dim + v_head_dim) + q_len * (
        qk_nope_head_dim + qk_rope_head_dim + v_head_dim)


class MLABackend:
    """Writes the batch's latents into the paged cache and computes MLA per request.

    ``forward`` takes the query split into its no-rope and rope parts, the new tokens' latent
    parts, the layer's latent cache and the two halves of ``kv_b_proj`` (this rank's heads).
    """

    supports_cuda_graphs = False

    def __init__(self, native: bindings.NativeLibrary | None = None, num_threads: int | None = None,
                 triton: bool = False):
        """``native``: the C library whose latent kernel runs the absorbed form on CPU tensors;
        ``triton``: the Triton latent kernel runs it (CUDA tensors, or CPU tensors under
        ``TRITON_INTERPRET=1``). Neither: torch only."""
        if native is not None and triton:
            raise ValueError("MLABackend takes the C library (CPU) or triton=True (CUDA), not both")
        self._native = native
        self._triton = triton
        self._warned: set[str] = set()
        self.num_threads = num_threads
        self.name = "mla-triton" if triton else "mla-cpu" if native is not None else "mla-torch"

    def cuda_graph_blocker(self, dtype: torch.dtype, kv_cache_dtype: torch.dtype, head_dim: int,
                           block_size: int) -> str | None:
        return f"the {self.name} attention backend loops over requests on the host"

    def forward(
        self,
        q_nope: torch.Tensor,  # [num_tokens, heads, nope]
        q_pe: torch.Tensor,  # [num_tokens, heads, rope] (rope'd)
        c_kv: torch.Tensor,  # [num_tokens, kv_lora_rank] (normed)
        k_pe: torch.Tensor,  # [num_tokens, rope] (rope'd)
        latent_cache: torch.Tensor,  # [num_blocks, 1, block_size, kv_lora_rank + rope]
        meta: AttentionMetadata,
        w_uk: torch.Tensor,  # [heads, nope, kv_lora_rank]
        w_uv: torch.Tensor,  # [heads, v, kv_lora_rank]
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, heads, v]
        write_latent(torch.cat([c_kv, k_pe], dim=-1), latent_cache, meta.slot_mapping)
        out = q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], w_uv.shape[1])
        rank = w_uk.shape[2]
        dims = (w_uk.shape[1], w_uv.shape[1], rank, q_pe.shape[-1])  # nope, v, rank, rope: for ``absorbs``
        spans = meta.request_spans()
        if self._has_kernel(latent_cache):
            kernel_spans = [s for s in spans if absorbs(s[2] - s[1], *dims)]
            if kernel_spans:
                self._absorbed_kernel(q_nope, q_pe, latent_cache, meta, kernel_spans, w_uk, w_uv, scale, out)
                spans = [s for s in spans if s not in kernel_spans]
        for r, start, end, seq_len in spans:
            latents = gather_latents(latent_cache, meta.block_tables[r], seq_len).to(q_nope.dtype)
            c, pe = latents[:, :rank], latents[:, rank:]  # [seq_len, rank], [seq_len, rope]
            attend = absorbed if absorbs(end - start, *dims) else decompressed
            out[start:end] = attend(q_nope[start:end], q_pe[start:end], c, pe, w_uk, w_uv, scale)
        return out

    def _has_kernel(self, latent_cache: torch.Tensor) -> bool:
        """Whether a latent kernel runs the absorbed requests: the C one on CPU tensors, the Triton
        one where triton compiles the cache dtype (not an e4m3 cache before sm_89: torch runs it,
        with a warning, once)."""
        if not self._triton:
            return self._native is not None and latent_cache.device.type == "cpu"
        reason = unsupported_latent_cache(latent_cache)
        if reason is not None and reason not in self._warned:
            self._warned.add(reason)
            logger.warning("%s: multi-head latent attention runs in torch instead", reason)
        return reason is None

    def _absorbed_kernel(self, q_nope, q_pe, latent_cache, meta: AttentionMetadata, spans, w_uk, w_uv,
                         scale: float, out: torch.Tensor) -> None:
        """The absorbed form of ``spans``' requests in one latent-kernel call (module docstring)."""
        device, rank = latent_cache.device, w_uk.shape[2]
        q_lens = [end - start for _, start, end, _ in spans]
        if len(spans) == meta.num_reqs:  # every request of the step (a decode step): its metadata as it is
            rows = slice(0, spans[-1][2])
            qsl, seq_lens, tables = meta.query_start_loc, meta.seq_lens, meta.block_tables.contiguous()
        else:
            rows = torch.cat([torch.arange(start, end) for _, start, end, _ in spans]).to(device)  # their tokens
            qsl = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=device)
            seq_lens = torch.tensor([n for _, _, _, n in spans], dtype=torch.int32, device=device)
            tables = meta.block_tables[[r for r, _, _, _ in spans]].to(torch.int32).contiguous()
        q_lat = absorb_query(q_nope[rows], w_uk)  # [n, heads, rank]
        q = torch.cat([q_lat, q_pe[rows]], dim=-1)  # [n, heads, rank + rope]
        if self._triton:
            o_lat = latent_attention(q.contiguous(), latent_cache, tables, qsl, seq_lens, rank, scale,
                                     max(q_lens), max(n for _, _, _, n in spans))
        else:
            q = q.float().contiguous()
            o_lat = q.new_empty(q.shape[0], q.shape[1], rank)
            threads = max(1, self.num_threads or torch.get_num_threads())
            self._native.mla_latent_attention(q, o_lat, latent_cache, tables, qsl, seq_lens, rank, float(scale),
                                              threads)
        out[rows] = latent_to_value(o_lat.to(w_uv.dtype), w_uv).to(out.dtype)


def absorb_query(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """``W_UK_h^T q_nope_h`` per head: ``[q_len, heads, rank]``. A batched matmul over heads that
    reads ``W_UK`` in place (an einsum here copied it: ~50x slower at decode)."""
    return torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [heads, q_len, rank] -> [q_len, heads, rank]


def latent_to_value(o_lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """``W_UV_h o_lat_h`` per head: ``[q_len, heads, v]``."""
    return torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)


def decompressed(q_nope, q_pe, c, pe, w_uk, w_uv, scale: float) -> torch.Tensor:
    """Expand the context's latents to per-head K/V, then causal attention: ``[q_len, heads, v]``."""
    k_nope = torch.matmul(c, w_uk.transpose(1, 2))  # [heads, seq_len, nope]
    v = torch.matmul(c, w_uv.transpose(1, 2))  # [heads, seq_len, v]
    k = torch.cat([k_nope, pe[None].expand(k_nope.shape[0], -1, -1)], dim=-1)  # [heads, seq_len, nope + rope]
    q = torch.cat([q_nope, q_pe], dim=-1).transpose(0, 1)  # [heads, q_len, nope + rope]
    mask = causal_mask(q.shape[1], c.shape[0], q.device)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.transpose(0, 1)  # [q_len, heads, v]


def absorbed(q_nope, q_pe, c, pe, w_uk, w_uv, scale: float) -> torch.Tensor:
    """Attend over the latents with ``q_nope`` folded into ``W_UK``: ``[q_len, heads, v]``."""
    q_lat = absorb_query(q_nope, w_uk)  # [q_len, heads, rank]
    scores = torch.einsum("qhr,sr->qhs", q_lat, c) + torch.einsum("qhe,se->qhs", q_pe, pe)  # [q_len, heads, seq]
    mask = causal_mask(q_nope.shape[0], c.shape[0], q_nope.device)
    probs = torch.softmax((scores.float() * scale).masked_fill(~mask[:, None, :], float("-inf")), dim=-1)
    o_lat = torch.einsum("qhs,sr->qhr", probs.to(c.dtype), c)  # [q_len, heads, rank]
    return latent_to_value(o_lat, w_uv)  # [q_len, heads, v]


def mla_reference(q_nope, q_pe, c, pe, w_uk, w_uv, scale: float) -> torch.Tensor:
    """The oracle: one request's contiguous context, K/V expanded and attended in float64 with an
    explicit softmax (what transformers' DeepSeek attention computes): ``[q_len, heads, v]``."""
    q_nope, q_pe, c, pe, w_uk, w_uv = (t.double() for t in (q_nope, q_pe, c, pe, w_uk, w_uv))
    k = torch.cat([torch.einsum("sr,hdr->hsd", c, w_uk), pe[None].expand(w_uk.shape[0], -1, -1)], dim=-1)
    v = torch.einsum("sr,hdr->hsd", c, w_uv)  # [heads, seq_len, v]
    q = torch.cat([q_nope, q_pe], dim=-1).transpose(0, 1)  # [heads, q_len, nope + rope]
    scores = (q @ k.transpose(1, 2)) * scale  # [heads, q_len, seq_len]
    scores = scores.masked_fill(~causal_mask(q.shape[1], c.shape[0], q.device)[None], float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v).transpose(0, 1)  # [q_len, heads, v]

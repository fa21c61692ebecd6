"""Triton kernels for multi-head latent attention (MLA) in the weight-absorbed form: the part of a
decode step (or short chunk) that reads the context, over the paged latent cache only.

attention/mla.py folds ``q_nope`` into ``W_UK`` and maps the output through ``W_UV`` (batched
GEMMs); here, per query token, every head attends over the same latents::

    latent(t) = [ c_kv(t) (RANK) | k_pe(t) (ROPE) ]                 one row per context token
    s_h(t)    = scale * (q_lat_h . c_kv(t) + q_pe_h . k_pe(t))
    o_h       = sum_t softmax_t(s_h(t)) c_kv(t)                      [RANK]: the latent-space output

A program owns ``BLOCK_H`` heads of one query token (all heads share the one latent "KV head",
so a latent tile is loaded once for all of them; MQA-like, the way FlashMLA tiles it) and walks
the token's causal context ``TILE_N`` keys at a time through the block table. With several
splits (flash-decoding: a small batch at a long context leaves most SMs idle otherwise) split
``s`` takes its share of the key tiles and writes its unnormalised partials, which
``mla_merge_kernel`` combines. The online softmax and its names are those of ``kernels.py``.

Dtypes: the query keeps the model's dtype and latent tiles are widened to it in registers, so an
fp8 latent cache under a half-precision model runs the tensor-core dots of a half cache; a float32
model computes in full-precision FMA (``kernels._dot``).
"""
import triton
import triton.language as tl

from pagedllm.attention.triton.kernels import LOG2E, _dot


@triton.jit
def _request_of_token(query_start_loc_ptr, token, num_reqs):
    """The request r with ``qsl[r] <= token < qsl[r + 1]`` (binary search; no host table)."""
    lo: tl.int32 = 0
    hi: tl.int32 = num_reqs  # a tensor even when the JIT makes num_reqs == 1 a constexpr (loop-carried)
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) <= token:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def mla_decode_kernel(
    out_ptr, acc_ptr, m_ptr, row_sum_ptr,
    query_ptr, latent_cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
    scale, num_reqs, num_heads, rank, rope, block_size, num_splits,
    q_stride_t, q_stride_h, o_stride_t, o_stride_h, a_stride_s, a_stride_t, a_stride_h, st_stride_s, st_stride_t,
    c_stride_b, c_stride_s, bt_stride,
    BLOCK_H: tl.constexpr, TILE_N: tl.constexpr, RANK_PAD: tl.constexpr, ROPE_PAD: tl.constexpr,
):  # fmt: skip
    """Grid ``(num_tokens, cdiv(num_heads, BLOCK_H), num_splits)``.

    query ``[num_tokens, num_heads, rank + rope]`` (``[q_lat | q_pe]``), latent cache ``[num_blocks,
    1, block_size, rank + rope]``. One split: writes the normalised ``out`` ``[num_tokens, num_heads,
    rank]``. Several: ``acc`` (float32 ``[num_splits, num_tokens, num_heads, rank]``), ``m`` and
    ``row_sum`` (``[num_splits, num_tokens, num_heads]``) for ``mla_merge_kernel``."""
    token = tl.program_id(0)
    req = _request_of_token(query_start_loc_ptr, token, num_reqs)
    q_begin = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_begin
    q_pos = tl.load(seq_lens_ptr + req) - q_len + (token - q_begin)  # the token's context position
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    head_ok = heads < num_heads
    r = tl.arange(0, RANK_PAD)
    e = tl.arange(0, ROPE_PAD)
    r_ok, e_ok = r < rank, e < rope
    token64 = token.to(tl.int64)
    q_rows = query_ptr + token64 * q_stride_t + heads[:, None] * q_stride_h  # [BLOCK_H, 1]
    q_lat = tl.load(q_rows + r[None, :], mask=head_ok[:, None] & r_ok[None, :], other=0.0)  # [BLOCK_H, RANK_PAD]
    q_pe = tl.load(q_rows + rank + e[None, :], mask=head_ok[:, None] & e_ok[None, :], other=0.0)
    # split s takes its share of the key tiles of [0, q_pos] (none, if there are fewer tiles than splits)
    k_end = q_pos + 1
    split = tl.program_id(2)
    tiles_per_split = tl.cdiv(tl.cdiv(k_end, TILE_N), num_splits)
    k_begin = split * tiles_per_split * TILE_N
    k_end = tl.minimum(k_begin + tiles_per_split * TILE_N, k_end)
    block_table_ptr = block_tables_ptr + req.to(tl.int64) * bt_stride
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, RANK_PAD], tl.float32)
    for tile_start in range(k_begin, k_end, TILE_N):
        k_pos = tile_start + tl.arange(0, TILE_N)  # [TILE_N]
        k_ok = k_pos < k_end  # masked loads: a slot past the context may hold NaN (0 * NaN = NaN in p @ c)
        block_id = tl.load(block_table_ptr + k_pos // block_size, mask=k_ok, other=0).to(tl.int64)
        rows = latent_cache_ptr + block_id * c_stride_b + (k_pos % block_size) * c_stride_s  # [TILE_N]
        c = tl.load(rows[:, None] + r[None, :], mask=k_ok[:, None] & r_ok[None, :], other=0.0)  # [TILE_N, RANK_PAD]
        pe = tl.load(rows[:, None] + rank + e[None, :], mask=k_ok[:, None] & e_ok[None, :], other=0.0)
        if c.dtype != q_lat.dtype:  # widened in registers to the query's dtype (module doc)
            c = c.to(q_lat.dtype)
            pe = pe.to(q_lat.dtype)
        s = (_dot(q_lat, tl.trans(c)) + _dot(q_pe, tl.trans(pe))) * scale  # [BLOCK_H, TILE_N]
        s = tl.where(k_ok[None, :], s * LOG2E, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key seen yet: avoid inf - inf
        p = tl.exp2(s - m_safe[:, None])  # [BLOCK_H, TILE_N]
        correction = tl.exp2(m - m_safe)
        row_sum = row_sum * correction + tl.sum(p, axis=1)
        acc = acc * correction[:, None] + _dot(p.to(c.dtype), c)
        m = m_new
    mask = head_ok[:, None] & r_ok[None, :]
    if num_splits > 1:
        rows_a = split.to(tl.int64) * a_stride_s + token64 * a_stride_t + heads * a_stride_h  # [BLOCK_H]
        tl.store(acc_ptr + rows_a[:, None] + r[None, :], acc, mask=mask)
        stat = split.to(tl.int64) * st_stride_s + token64 * st_stride_t + heads
        tl.store(m_ptr + stat, m, mask=head_ok)
        tl.store(row_sum_ptr + stat, row_sum, mask=head_ok)
    else:
        out = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]  # every token sees itself: row_sum > 0
        rows_o = token64 * o_stride_t + heads * o_stride_h
        tl.store(out_ptr + rows_o[:, None] + r[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def mla_merge_kernel(
    out_ptr, acc_ptr, m_ptr, row_sum_ptr, num_splits, rank,
    o_stride_t, o_stride_h, a_stride_s, a_stride_t, a_stride_h, st_stride_s, st_stride_t,
    RANK_PAD: tl.constexpr,
):  # fmt: skip
    """One program per (token, head): merges the splits' online-softmax states, as
    ``kernels.reduce_splits_kernel`` does at head width (RANK_PAD is wider than its rows)."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    r = tl.arange(0, RANK_PAD)
    r_ok = r < rank
    m = tl.full([1], float("-inf"), tl.float32)
    row_sum = tl.zeros([1], tl.float32)
    acc = tl.zeros([RANK_PAD], tl.float32)
    for split in range(num_splits):
        stat = split * st_stride_s + token * st_stride_t + head
        m_split = tl.load(m_ptr + stat)
        m_new = tl.maximum(m, m_split)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a split that saw no key: m = -inf, sum 0
        correction = tl.exp2(m - m_safe)
        weight = tl.exp2(m_split - m_safe)
        row_sum = row_sum * correction + tl.load(row_sum_ptr + stat) * weight
        split_acc = tl.load(acc_ptr + split * a_stride_s + token * a_stride_t + head * a_stride_h + r, mask=r_ok)
        acc = acc * correction + split_acc * weight
        m = m_new
    out = acc / tl.where(row_sum == 0.0, 1.0, row_sum)
    tl.store(out_ptr + token * o_stride_t + head * o_stride_h + r, out.to(out_ptr.dtype.element_ty), mask=r_ok)

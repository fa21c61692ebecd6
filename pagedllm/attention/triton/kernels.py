"""Triton kernels for paged attention: the K/V write, the unified attention kernel (which also
runs split-KV, i.e. flash-decoding, when its grid has several splits) and the merge of splits.

The attention loop reads like ``torch_ref._attend_one``: the same names (``q_pos``, ``k_pos``,
``causal``, ``m``, ``row_sum``, ``acc``, ``correction``) for the same quantities. Two
differences: one program owns a tile of ``BLOCK_M`` query rows, where a row is one (query token,
query head) pair of a single request and a single GQA group, so each K/V tile is loaded once
for all the group's heads; and the keys are walked ``TILE_N`` positions at a time, each key
finding its physical block through the block table (so ``TILE_N`` and the cache block size are
independent). The softmax runs in base 2 (``exp(x) == exp2(x * log2(e))``), so ``m`` is in
base-2 units.

A program's rows (``hp`` = heads per program, ``min(group, 16)``)::

    row  0 .. hp-1      query token q_first,     heads sub*hp .. sub*hp+hp-1 of KV head kvh
    row hp .. 2hp-1     query token q_first + 1, same heads
    ...                 (block_q = BLOCK_M // hp tokens; rows past them are masked)

Query tiles are numbered across the batch so that request r owns the tiles
``qsl[r] // block_q + r .. qsl[r + 1] // block_q + r`` (at least one, possibly an empty one);
a program finds its request by binary search over ``query_start_loc`` (no per-step host table).

Mixed dtypes: the query keeps its dtype and K/V tiles are widened to it in registers after the
load, so the dots run at the precision of a same-dtype cache: an fp8 cache (e4m3 / e5m2 convert
exactly to float16 and bfloat16) under a half-precision model uses the tensor cores as a float16 /
bfloat16 cache does, reading half the bytes; a float32 model computes in float32 (full-precision
FMA, ``_dot``) over any cache. The fp8 scales never reach the kernel: the model folds them into
the query (``q * k_scale``, so the scores come out scaled) and the output (``* v_scale``), see
``attention/kv_quant.py``.

Whether these run compiled or in Triton's interpreter is decided when this module is imported
(``triton.jit`` reads ``TRITON_INTERPRET`` then, and triton's own library functions were decorated
the same way when triton was imported), so one process runs in one mode.
"""
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
# the row width of the copy and merge kernels: any supported head_dim (masked), so one compiled
# variant per dtype instead of one per head size
MAX_HEAD_DIM = tl.constexpr(256)


@triton.jit
def write_kv_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    head_dim, block_size,
    k_stride_t, k_stride_h, v_stride_t, v_stride_h, c_stride_b, c_stride_h, c_stride_s,
):  # fmt: skip
    """One program per (token, KV head): copies a head_dim row into its slot (negative: skip)."""
    token = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block_id = slot // block_size
    offset = slot % block_size
    d = tl.arange(0, MAX_HEAD_DIM)
    d_ok = d < head_dim
    dst = block_id * c_stride_b + kv_head * c_stride_h + offset * c_stride_s + d
    k = tl.load(key_ptr + token * k_stride_t + kv_head * k_stride_h + d, mask=d_ok)
    tl.store(key_cache_ptr + dst, k.to(key_cache_ptr.dtype.element_ty), mask=d_ok)
    v = tl.load(value_ptr + token * v_stride_t + kv_head * v_stride_h + d, mask=d_ok)
    tl.store(value_cache_ptr + dst, v.to(value_cache_ptr.dtype.element_ty), mask=d_ok)


@triton.jit
def _find_request(query_start_loc_ptr, tile, num_reqs, block_q):
    """The last request r whose first query tile ``qsl[r] // block_q + r`` is <= ``tile``."""
    lo: tl.int32 = 0
    hi: tl.int32 = num_reqs  # a tensor even when the JIT makes num_reqs == 1 a constexpr (loop-carried)
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // block_q + mid
        if first_tile <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _tanh(x):
    """tanh from exp (no libdevice, so the interpreter runs it too); exact at +-inf."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _dot(a, b):
    """``a @ b`` with float32 accumulation; float32 operands use full-precision FMA (no TF32)."""
    if a.dtype == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _attend_keys(
    q, q_pos, row_ok, k_lo, k_begin, k_end,
    key_cache_ptr, value_cache_ptr, block_table_ptr, kv_head, head_dim, block_size,
    c_stride_b, c_stride_h, c_stride_s, scale, soft_cap, window,
    BLOCK_M: tl.constexpr, TILE_N: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):  # fmt: skip
    """Online softmax of the rows ``q`` ([BLOCK_M, HEAD_DIM_PAD]) over context positions
    ``k_begin .. k_end`` (``k_begin`` a multiple of TILE_N); returns (acc, m, row_sum).

    Only keys in ``[k_lo, k_end)`` (what some row may see) are loaded; the others read as 0.
    Masking the scores alone is not enough: a slot no row sees may hold uninitialised memory
    (past a sequence's end, before a window), and a NaN in V gives ``0 * NaN = NaN`` in the dot."""
    d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = d < head_dim
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    for tile_start in range(k_begin, k_end, TILE_N):
        k_pos = tile_start + tl.arange(0, TILE_N)  # [TILE_N]
        k_ok = (k_pos >= k_lo) & (k_pos < k_end)
        block_id = tl.load(block_table_ptr + k_pos // block_size, mask=k_ok, other=0).to(tl.int64)
        # [TILE_N] row offsets: int64, because block_id * c_stride_b overflows int32 on big pools
        rows = block_id * c_stride_b + kv_head * c_stride_h + (k_pos % block_size) * c_stride_s
        kv_mask = k_ok[:, None] & d_ok[None, :]
        k = tl.load(key_cache_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [TILE_N, D]
        v = tl.load(value_cache_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if k.dtype != q.dtype:  # widened in registers to q's dtype (module doc: mixed dtypes)
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        s = _dot(q, tl.trans(k)) * scale  # [BLOCK_M, TILE_N]
        if soft_cap > 0:
            s = _tanh(s / soft_cap) * soft_cap
        causal = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :] & row_ok[:, None]
        if window > 0:
            causal &= k_pos[None, :] > q_pos[:, None] - window
        s = tl.where(causal, s * LOG2E, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        # rows with nothing visible yet keep m = -inf; use 0 there to avoid inf - inf
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])  # [BLOCK_M, TILE_N]
        correction = tl.exp2(m - m_safe)
        row_sum = row_sum * correction + tl.sum(p, axis=1)
        acc = acc * correction[:, None] + _dot(p.to(v.dtype), v)
        m = m_new
    return acc, m, row_sum


@triton.jit
def _tile_rows(query_start_loc_ptr, num_reqs, block_q, heads_per_prog, group,
               BLOCK_M: tl.constexpr):
    """Which request and rows this program owns: (request, first query token of the request,
    q_len, the rows' query index within the request, head within the group, row valid)."""
    tile = tl.program_id(0)
    sub = tl.program_id(1) % tl.cdiv(group, heads_per_prog)
    req = _find_request(query_start_loc_ptr, tile, num_reqs, block_q)
    q_begin = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_begin
    q_first = (tile - (q_begin // block_q + req)) * block_q
    rows = tl.arange(0, BLOCK_M)
    q_idx = q_first + rows // heads_per_prog  # [BLOCK_M]
    head_in_group = sub * heads_per_prog + rows % heads_per_prog
    row_ok = (rows < block_q * heads_per_prog) & (q_idx < q_len) & (head_in_group < group)
    return req, q_begin, q_len, q_first, q_idx, head_in_group, row_ok


@triton.jit
def _key_range(seq_len, q_len, q_first, block_q, window):
    """Context positions the tile's rows can see: [k_lo, k_end).

    ::  context: [ cached ........ | new: q_first .. q_last ]
        k_end = position of q_last + 1  (causal)
        k_lo  = position of q_first - window + 1  (0 without a window)
    """
    ctx_start = seq_len - q_len  # position of the request's query 0
    k_end = ctx_start + tl.minimum(q_first + block_q, q_len)
    k_lo = tl.where(window > 0, tl.maximum(ctx_start + q_first - window + 1, 0), 0)
    return k_lo, k_end


@triton.jit
def paged_attention_kernel(
    out_ptr, acc_ptr, m_ptr, row_sum_ptr,
    query_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
    scale, soft_cap, window, num_reqs, group, heads_per_prog, block_q, head_dim, block_size, num_splits,
    q_stride_t, q_stride_h, o_stride_t, o_stride_h, a_stride_s, a_stride_t, a_stride_h, st_stride_s, st_stride_t,
    c_stride_b, c_stride_h, c_stride_s, bt_stride,
    BLOCK_M: tl.constexpr, TILE_N: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
):  # fmt: skip
    """Grid ``(query tiles, num_kv_heads * subgroups, num_splits)``.

    One split: writes the normalised output ``out`` [num_tokens, num_heads, head_dim]. Several
    (flash-decoding): split ``s`` attends to its share of each tile's key range and writes its
    unnormalised ``acc`` (float32 [num_splits, num_tokens, num_heads, head_dim]), ``m`` and
    ``row_sum`` ([num_splits, num_tokens, num_heads]); ``reduce_splits_kernel`` merges them.
    """
    req, q_begin, q_len, q_first, q_idx, head_in_group, row_ok = _tile_rows(
        query_start_loc_ptr, num_reqs, block_q, heads_per_prog, group, BLOCK_M)
    if q_first >= q_len:
        return  # an empty tile (a request's tile count is rounded up)
    kv_head = tl.program_id(1) // tl.cdiv(group, heads_per_prog)
    seq_len = tl.load(seq_lens_ptr + req)
    q_pos = seq_len - q_len + q_idx  # [BLOCK_M] context position of each row's token
    head = kv_head * group + head_in_group
    token = (q_begin + q_idx).to(tl.int64)
    d = tl.arange(0, HEAD_DIM_PAD)
    mask = row_ok[:, None] & (d < head_dim)[None, :]
    q = tl.load(query_ptr + (token * q_stride_t + head * q_stride_h)[:, None] + d[None, :], mask=mask, other=0.0)
    k_lo, k_end = _key_range(seq_len, q_len, q_first, block_q, window)
    k_begin = k_lo // TILE_N * TILE_N  # the key tiles are aligned; k_lo masks the first one
    # split s takes its share of the key tiles (none, if there are fewer tiles than splits); the
    # split count is fixed at launch (under a CUDA graph: at capture), the lengths are read here
    split = tl.program_id(2)
    tiles_per_split = tl.cdiv(tl.cdiv(k_end - k_begin, TILE_N), num_splits)
    k_begin = k_begin + split * tiles_per_split * TILE_N
    k_end = tl.minimum(k_begin + tiles_per_split * TILE_N, k_end)
    block_table_ptr = block_tables_ptr + req.to(tl.int64) * bt_stride
    acc, m, row_sum = _attend_keys(
        q, q_pos, row_ok, k_lo, k_begin, k_end, key_cache_ptr, value_cache_ptr, block_table_ptr,
        kv_head, head_dim, block_size, c_stride_b, c_stride_h, c_stride_s, scale, soft_cap, window,
        BLOCK_M, TILE_N, HEAD_DIM_PAD)  # fmt: skip
    if num_splits > 1:
        rows = split.to(tl.int64) * a_stride_s + token * a_stride_t + head * a_stride_h  # [BLOCK_M]
        tl.store(acc_ptr + rows[:, None] + d[None, :], acc, mask=mask)
        stat_rows = split.to(tl.int64) * st_stride_s + token * st_stride_t + head
        tl.store(m_ptr + stat_rows, m, mask=row_ok)
        tl.store(row_sum_ptr + stat_rows, row_sum, mask=row_ok)
    else:
        out = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]  # masked rows have row_sum 0
        rows = token * o_stride_t + head * o_stride_h
        tl.store(out_ptr + rows[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def reduce_splits_kernel(
    out_ptr, acc_ptr, m_ptr, row_sum_ptr, num_splits, head_dim,
    o_stride_t, o_stride_h, a_stride_s, a_stride_t, a_stride_h, st_stride_s, st_stride_t,
):  # fmt: skip
    """One program per (token, head): merges the splits' online-softmax states (the same
    rescaling as one more step of the online softmax, split by split)."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, MAX_HEAD_DIM)
    d_ok = d < head_dim
    m = tl.full([1], float("-inf"), tl.float32)  # [1]: a loop-carried value with a fixed type
    row_sum = tl.zeros([1], tl.float32)
    acc = tl.zeros([MAX_HEAD_DIM], tl.float32)
    for split in range(num_splits):
        stat = split * st_stride_s + token * st_stride_t + head
        m_split = tl.load(m_ptr + stat)
        m_new = tl.maximum(m, m_split)
        # a split that saw no key has m = -inf and row_sum = 0; every row sees its own position
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        correction = tl.exp2(m - m_safe)
        weight = tl.exp2(m_split - m_safe)
        split_sum = tl.load(row_sum_ptr + stat)
        row_sum = row_sum * correction + split_sum * weight
        split_acc = tl.load(acc_ptr + split * a_stride_s + token * a_stride_t + head * a_stride_h + d, mask=d_ok)
        acc = acc * correction + split_acc * weight
        m = m_new
    out = acc / tl.where(row_sum == 0.0, 1.0, row_sum)  # every split empty: 0, not NaN
    tl.store(out_ptr + token * o_stride_t + head * o_stride_h + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)

"""CpuAttentionBackend against the torch reference and against dense float64 SDPA."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.attention.cpu import CpuAttentionBackend, get_cpu_backend
from pagedllm.attention.testing import (
    PagedBatch,
    dense_attention_f64,
    gather_context,
    make_paged_batch,
)
from pagedllm.attention.torch_ref import TorchReferenceBackend
from pagedllm.native import bindings
from pagedllm.native.bindings import NativeLibrary

pytestmark = [pytest.mark.skipif(not CpuAttentionBackend.is_available(), reason="no C compiler"),
              pytest.mark.usefixtures("single_torch_thread")]

ATOL = RTOL = 1e-5


# (num_cached, q_len): decodes, a fresh prefill, chunks starting mid-context, partial blocks
MIXED = [(0, 1), (37, 1), (5, 20), (40, 33), (0, 70), (100, 1), (16, 16), (31, 2)]


def run(backend, batch: PagedBatch, query=None, key=None, value=None, window=None, chunk=None):
    kc, vc = batch.fresh_caches()
    q = batch.query if query is None else query
    k = batch.key if key is None else key
    v = batch.value if value is None else value
    out = backend.forward(q, k, v, kc, vc, batch.meta, batch.scale, window, attention_chunk_size=chunk)
    return out, kc, vc


def check_against_oracles(batch: PagedBatch, backend=None, window=None, chunk=None):
    out, kc, vc = run(backend or CpuAttentionBackend(num_threads=2, parallel_work=0), batch, window=window,
                      chunk=chunk)
    ref, kc_ref, vc_ref = run(TorchReferenceBackend(), batch, window=window, chunk=chunk)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)
    dense = dense_attention_f64(batch, window, attention_chunk_size=chunk)
    torch.testing.assert_close(out.double(), dense, atol=ATOL, rtol=RTOL)
    # the written slots hold exactly the new K/V, and nothing else in the pool changed
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    for r in range(batch.meta.num_reqs):
        assert torch.equal(gather_context(kc, batch, r).float(), batch.ctx_k[r])
        assert torch.equal(gather_context(vc, batch, r).float(), batch.ctx_v[r])
    return out


@pytest.mark.parametrize("block_size", [8, 16, 32, 64, 128])
@pytest.mark.parametrize("group", [1, 2, 4, 8])  # query heads per KV head
@pytest.mark.parametrize("head_dim", [64])
def test_mixed_batch_matches_reference_and_dense(block_size, head_dim, group):
    batch = make_paged_batch(MIXED, num_heads=4 * group, num_kv_heads=4, head_dim=head_dim,
                             block_size=block_size, seed=block_size + head_dim + group)  # fmt: skip
    check_against_oracles(batch)


@pytest.mark.parametrize("window", [1, 5, 16, 37, 1000])
@pytest.mark.parametrize("block_size", [8, 32])
def test_sliding_window(window, block_size):
    """Each row sees only its last ``window`` positions: decodes, prefill chunks starting
    mid-context and tiles whose rows have different window starts, against both oracles."""
    batch = make_paged_batch(MIXED + [(120, 40)], num_heads=8, num_kv_heads=2, head_dim=64,
                             block_size=block_size, seed=window)  # fmt: skip
    out = check_against_oracles(batch, window=window)
    if window < 100:  # the window changes the answer for the long requests
        assert not torch.allclose(out.double(), dense_attention_f64(batch), atol=1e-3)


@pytest.mark.parametrize("chunk, window", [(1, None), (8, None), (24, None), (64, None), (100, 37)])
@pytest.mark.parametrize("block_size", [8, 16])
def test_chunked_local_attention(chunk, window, block_size):
    """Chunked local attention (Llama 4): each row sees only its own ``chunk``-aligned chunk, on
    decodes, prefill chunks that cross chunk boundaries and tiles whose rows sit in different
    chunks (the wide AVX-512 path too: 8 query heads per KV head), against both oracles."""
    batch = make_paged_batch(MIXED + [(120, 40)], num_heads=8, num_kv_heads=1, head_dim=64,
                             block_size=block_size, seed=chunk)  # fmt: skip
    out = check_against_oracles(batch, window=window, chunk=chunk)
    assert not torch.allclose(out.double(), dense_attention_f64(batch, window), atol=1e-3)


def test_bad_attention_chunk_size_is_refused():
    batch = make_paged_batch([(3, 2)], num_heads=2, num_kv_heads=1, head_dim=64, block_size=8)
    with pytest.raises(ValueError, match="attention_chunk_size=-1 must be None or an int > 0"):
        run(CpuAttentionBackend(), batch, chunk=-1)


# Decode rows (q_len 1) at contexts on and around block edges. With at least one decode item per
# thread, a decode item takes several kv heads of its request and walks each chunk of blocks
# head after head (paged_attention.c: decode_heads_per_item): 24 decodes on 2 threads -> all
# heads in one item.
DECODES = [(c, 1) for c in (0, 1, 15, 16, 17, 63, 64, 65, 100, 200, 5, 33)] * 2


@pytest.mark.parametrize("block_size", [8, 16, 128])
@pytest.mark.parametrize("group", [1, 2, 16])  # 16: each head's rows take the wide path
def test_decode_items_over_several_kv_heads(block_size, group):
    num_kv_heads = 4 if group == 16 else 8
    batch = make_paged_batch(DECODES + [(40, 33), (0, 20)], num_heads=group * num_kv_heads,
                             num_kv_heads=num_kv_heads, head_dim=64, block_size=block_size,
                             seed=block_size + group)  # fmt: skip
    check_against_oracles(batch)


@pytest.mark.parametrize("window", [None, 21])
def test_many_items_claimed_one_ahead(window):
    """From 8 items per thread each thread claims its next item early (to prefetch its first
    chunk, starting past a sliding window's first blocks): every item still runs exactly once."""
    batch = make_paged_batch(DECODES * 2 + [(70, 9)], num_heads=8, num_kv_heads=4, head_dim=64, block_size=8,
                             seed=3)
    check_against_oracles(batch, window=window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [None, 20])
def test_decode_items_with_a_remainder_of_heads(dtype, window):
    """One decode on 2 threads with 5 kv heads: items of 3 heads and of 2 (the heads per item
    halve, rounding up, until each thread has an item); windows and a float16 cache on that path."""
    batch = make_paged_batch([(200, 1)], num_heads=10, num_kv_heads=5, head_dim=64, block_size=16,
                             cache_dtype=dtype, seed=7)  # fmt: skip
    check_against_oracles(batch, window=window)


@pytest.mark.parametrize("group", [1, 8])
def test_head_dim_128(group):
    test_mixed_batch_matches_reference_and_dense(16, 128, group)


# 12 and 4 are not multiples of 8: they take the scalar tails
@pytest.mark.parametrize("head_dim", [8, 16, 80, 96, 256, 12, 4])
def test_other_head_dims(head_dim):
    batch = make_paged_batch(MIXED[:5], num_heads=4, num_kv_heads=2, head_dim=head_dim,
                             block_size=16)  # fmt: skip
    check_against_oracles(batch)


@pytest.mark.parametrize("block_size", [1, 3, 64])
def test_odd_block_sizes(block_size):
    batch = make_paged_batch(MIXED, num_heads=8, num_kv_heads=2, head_dim=64, block_size=block_size)
    check_against_oracles(batch)


def test_long_prefill_spans_many_tiles():
    batch = make_paged_batch([(50, 300), (0, 1), (7, 129)], num_heads=8, num_kv_heads=4,
                             head_dim=64, block_size=16)  # fmt: skip
    check_against_oracles(batch)


def test_decode_only_and_prefill_only():
    check_against_oracles(make_paged_batch([(c, 1) for c in range(0, 200, 13)], 8, 4, 64, 16))
    check_against_oracles(make_paged_batch([(0, 37), (0, 64)], 8, 4, 64, 16))


def test_request_with_no_new_tokens_is_skipped():
    batch = make_paged_batch([(10, 3), (20, 0), (5, 1)], num_heads=4, num_kv_heads=2, head_dim=64,
                             block_size=8)  # fmt: skip
    check_against_oracles(batch)


def test_empty_batch():
    batch = make_paged_batch([], num_heads=4, num_kv_heads=2, head_dim=64, block_size=8)
    out, _, _ = run(CpuAttentionBackend(), batch)
    assert out.shape == (0, 4, 64)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2])
def test_half_precision_cache(dtype):
    """float16/bfloat16 and the fp8 formats (their scales are folded in by the model, so the
    kernel stores K/V rounded to the cache dtype and widens them exactly)."""
    batch = make_paged_batch(MIXED, num_heads=8, num_kv_heads=4, head_dim=64, block_size=16,
                             cache_dtype=dtype)  # fmt: skip
    check_against_oracles(batch)


def test_half_precision_query_returns_query_dtype():
    batch = make_paged_batch(MIXED, num_heads=8, num_kv_heads=4, head_dim=64, block_size=16,
                             cache_dtype=torch.bfloat16)  # fmt: skip
    q = batch.query.bfloat16()
    out, _, _ = run(CpuAttentionBackend(), batch, query=q)
    ref, _, _ = run(TorchReferenceBackend(), batch, query=q)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), atol=1e-2, rtol=1e-2)


def test_strided_views_of_fused_qkv():
    """q/k/v sliced out of one projection output are read through their strides."""
    batch = make_paged_batch(MIXED, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16)
    qkv = torch.cat([batch.query, batch.key, batch.value], dim=1)  # [T, 8 + 2 + 2, D]
    q, k, v = qkv[:, :8], qkv[:, 8:10], qkv[:, 10:]
    assert not q.is_contiguous()
    out, kc, _ = run(CpuAttentionBackend(), batch, query=q, key=k, value=v)
    torch.testing.assert_close(out.double(), dense_attention_f64(batch), atol=ATOL, rtol=RTOL)
    for r in range(batch.meta.num_reqs):
        assert torch.equal(gather_context(kc, batch, r), batch.ctx_k[r])


def test_thread_count_does_not_change_results():
    batch = make_paged_batch(MIXED, num_heads=8, num_kv_heads=4, head_dim=64, block_size=16)
    # each item is computed by one thread, so results are bitwise identical for any count
    outs = [run(CpuAttentionBackend(num_threads=n, parallel_work=0), batch)[0] for n in (1, 2, 3)]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_padding_slots_are_not_written():
    batch = make_paged_batch([(3, 4)], num_heads=4, num_kv_heads=2, head_dim=8, block_size=4)
    kc, vc = batch.fresh_caches()
    kc0 = kc.clone()
    slots = torch.full((4,), -1, dtype=torch.int64)
    CpuAttentionBackend().write_kv(batch.key, batch.value, kc, vc, slots)
    assert torch.equal(kc, kc0)


def test_rejects_mismatched_shapes():
    batch = make_paged_batch([(3, 4)], num_heads=4, num_kv_heads=2, head_dim=8, block_size=4)
    kc, vc = batch.fresh_caches()
    with pytest.raises(ValueError):
        CpuAttentionBackend().forward(batch.query[:, :3], batch.key, batch.value, kc, vc,
                                      batch.meta, batch.scale)  # fmt: skip
    with pytest.raises(ValueError):
        CpuAttentionBackend().forward(batch.query, batch.key, batch.value, kc[:, :, :2], vc,
                                      batch.meta, batch.scale)  # fmt: skip


def test_rejects_out_of_range_metadata_instead_of_crashing():
    batch = make_paged_batch([(10, 3), (4, 2)], num_heads=4, num_kv_heads=2, head_dim=8,
                             block_size=4)  # fmt: skip
    num_blocks = batch.key_cache.shape[0]
    bad_table = batch.meta.block_tables.clone()
    bad_table[1, 0] = num_blocks  # one past the pool
    bad_slots = batch.meta.slot_mapping.clone()
    bad_slots[0] = num_blocks * 4
    short_seq = batch.meta.seq_lens.clone()
    short_seq[0] = 2  # fewer context tokens than new tokens
    bad_metas = [
        replace(batch.meta, block_tables=bad_table),
        replace(batch.meta, slot_mapping=bad_slots),
        replace(batch.meta, seq_lens=short_seq),
    ]
    for meta in bad_metas:
        kc, vc = batch.fresh_caches()
        with pytest.raises(ValueError, match="out of range"):
            CpuAttentionBackend().forward(batch.query, batch.key, batch.value, kc, vc, meta,
                                          batch.scale)  # fmt: skip


reqs_strategy = st.lists(st.tuples(st.integers(0, 70), st.integers(1, 40)), min_size=1, max_size=5)


@settings(max_examples=40, deadline=None)
@given(
    reqs=reqs_strategy,
    num_kv_heads=st.integers(1, 3),
    group=st.sampled_from([1, 2, 4]),
    head_dim=st.sampled_from([8, 16, 24, 64, 128]),
    block_size=st.sampled_from([1, 4, 8, 16, 32]),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_random_shapes_match_dense(reqs, num_kv_heads, group, head_dim, block_size, seed):
    num_heads = num_kv_heads * group
    batch = make_paged_batch(reqs, num_heads, num_kv_heads, head_dim, block_size, seed=seed)
    out, kc, _ = run(CpuAttentionBackend(num_threads=2, parallel_work=0), batch)
    torch.testing.assert_close(out.double(), dense_attention_f64(batch), atol=ATOL, rtol=RTOL)
    for r in range(batch.meta.num_reqs):
        assert torch.equal(gather_context(kc, batch, r), batch.ctx_k[r])


# --- build / fallback ------------------------------------------------------------------------


def test_build_is_cached_by_content(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    lib = NativeLibrary.build()
    built = list((tmp_path / "kernels").glob("pagedllm_native-*.so"))
    assert len(built) == 1 and lib.path == built[0]
    mtime = built[0].stat().st_mtime_ns
    NativeLibrary.build()  # second load reuses the cached file
    assert built[0].stat().st_mtime_ns == mtime
    assert not list((tmp_path / "kernels").glob("*.tmp"))


def test_portable_scalar_build_matches_dense(tmp_path):
    """Without -march=native there is no AVX2: the scalar fallbacks must be right too."""
    lib = NativeLibrary.build(cache_dir=tmp_path, cflags=("-O2", "-fopenmp", "-shared", "-fPIC"))
    assert not lib.has_avx2
    backend = CpuAttentionBackend(num_threads=2, parallel_work=0, library=lib)
    for head_dim, cache_dtype in ((64, torch.float32), (12, torch.float16), (16, torch.bfloat16),
                                  (20, torch.float8_e4m3fn), (12, torch.float8_e5m2)):
        batch = make_paged_batch(MIXED, num_heads=8, num_kv_heads=2, head_dim=head_dim,
                                 block_size=8, cache_dtype=cache_dtype)  # fmt: skip
        check_against_oracles(batch, backend)


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"), reason="needs an AVX2 CPU")
def test_avx2_build_without_avx512_matches_dense(tmp_path):
    """On an AVX-512 host the default build takes the 512-bit loops: the AVX2-only loops
    (8 accumulators, two-row p.v in 32-column slabs) are checked by a build without AVX-512."""
    lib = NativeLibrary.build(cache_dir=tmp_path, cflags=("-O2", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared",
                                                          "-fPIC"))
    assert lib.has_avx2
    backend = CpuAttentionBackend(num_threads=2, parallel_work=0, library=lib)
    for head_dim, group, window in ((64, 2, None), (128, 1, None), (80, 4, 9), (12, 2, None)):
        batch = make_paged_batch(MIXED, num_heads=2 * group, num_kv_heads=2, head_dim=head_dim, block_size=8)
        check_against_oracles(batch, backend, window=window)


def test_missing_compiler_raises(tmp_path):
    with pytest.raises(RuntimeError):
        NativeLibrary.build(cc=str(tmp_path / "no-such-cc"), cache_dir=tmp_path)


def test_engine_selector_falls_back_to_sdpa_without_the_kernel(monkeypatch):
    from pagedllm.attention.sdpa import SdpaBackend
    from pagedllm.attention.selector import get_attention_backend
    monkeypatch.setattr(bindings, "load_default", lambda: None)
    assert isinstance(get_attention_backend("auto", torch.device("cpu")), SdpaBackend)
    with pytest.raises(ValueError, match="attention_backend='cpu'"):
        get_attention_backend("cpu", torch.device("cpu"))


def test_fallback_to_reference_when_unavailable(monkeypatch):
    monkeypatch.setattr(bindings, "load_default", lambda: None)
    assert isinstance(get_cpu_backend(), TorchReferenceBackend)
    assert not CpuAttentionBackend.is_available()
    with pytest.raises(RuntimeError):
        CpuAttentionBackend()


def test_small_steps_run_serially_with_same_result():
    batch = make_paged_batch([(30, 1), (7, 1)], num_heads=8, num_kv_heads=4, head_dim=64,
                             block_size=16)  # fmt: skip
    serial, _, _ = run(CpuAttentionBackend(num_threads=2), batch)  # under the default threshold
    threaded, _, _ = run(CpuAttentionBackend(num_threads=2, parallel_work=0), batch)
    assert torch.equal(serial, threaded)


def test_get_cpu_backend_prefers_kernel():
    backend = get_cpu_backend(num_threads=1)
    assert isinstance(backend, CpuAttentionBackend) and backend.name == "cpu"


@pytest.mark.parametrize("group, head_dim, window", [(1, 64, None), (2, 64, 50), (8, 128, None), (4, 128, 7)])
def test_many_row_prefill_tiles(group, head_dim, window):
    """Prefill tiles of >= 16 rows (the key-major path where AVX-512 is built): row counts that
    are not multiples of 4 or 16, chunks starting mid-context, rows with no visible key in a
    chunk (window), against both oracles."""
    batch = make_paged_batch([(0, 150), (70, 45), (300, 19), (5, 1)], num_heads=2 * group, num_kv_heads=2,
                             head_dim=head_dim, block_size=16, seed=group + head_dim)
    check_against_oracles(batch, window=window)

"""The torch backends (reference and the SDPA fallback) against dense float64 attention."""
from __future__ import annotations

import pytest
import torch

from pagedllm.attention.sdpa import SdpaBackend
from pagedllm.attention.testing import dense_attention_f64, gather_context, make_paged_batch
from pagedllm.attention.torch_ref import TorchReferenceBackend

pytestmark = pytest.mark.usefixtures("single_torch_thread")

MIXED = [(0, 1), (37, 1), (5, 20), (40, 33), (0, 17), (16, 16)]


@pytest.mark.parametrize("backend", [TorchReferenceBackend, SdpaBackend], ids=["torch", "sdpa"])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_torch_backends_match_dense_f64(backend, block_size, head_dim, group):
    batch = make_paged_batch(MIXED, num_heads=2 * group, num_kv_heads=2, head_dim=head_dim,
                             block_size=block_size, seed=group)  # fmt: skip
    kc, vc = batch.fresh_caches()
    out = backend().forward(batch.query, batch.key, batch.value, kc, vc, batch.meta,
                                          batch.scale)  # fmt: skip
    torch.testing.assert_close(out.double(), dense_attention_f64(batch), atol=1e-5, rtol=1e-5)
    for r in range(batch.meta.num_reqs):
        assert torch.equal(gather_context(kc, batch, r).float(), batch.ctx_k[r])
        assert torch.equal(gather_context(vc, batch, r), batch.ctx_v[r])


@pytest.mark.parametrize("backend", [TorchReferenceBackend, SdpaBackend], ids=["torch", "sdpa"])
@pytest.mark.parametrize("window", [1, 7, 30])
def test_torch_backends_sliding_window(backend, window):
    batch = make_paged_batch(MIXED, num_heads=4, num_kv_heads=2, head_dim=64, block_size=8, seed=window)
    kc, vc = batch.fresh_caches()
    out = backend().forward(batch.query, batch.key, batch.value, kc, vc, batch.meta, batch.scale, window)
    torch.testing.assert_close(out.double(), dense_attention_f64(batch, window), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", [TorchReferenceBackend, SdpaBackend], ids=["torch", "sdpa"])
@pytest.mark.parametrize("chunk, window", [(1, None), (8, None), (13, None), (16, 5)])
def test_torch_backends_chunked_local_attention(backend, chunk, window):
    """Chunked local attention (Llama 4): a token sees only its own ``chunk``-aligned chunk
    (and, with a window too, the window's part of it), decodes and chunks across boundaries."""
    batch = make_paged_batch(MIXED, num_heads=4, num_kv_heads=2, head_dim=64, block_size=8, seed=chunk)
    kc, vc = batch.fresh_caches()
    out = backend().forward(batch.query, batch.key, batch.value, kc, vc, batch.meta, batch.scale, window,
                            attention_chunk_size=chunk)
    dense = dense_attention_f64(batch, window, attention_chunk_size=chunk)
    torch.testing.assert_close(out.double(), dense, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out.double(), dense_attention_f64(batch, window), atol=1e-3)  # the chunks mattered


@pytest.mark.parametrize("backend", [TorchReferenceBackend, SdpaBackend], ids=["torch", "sdpa"])
@pytest.mark.parametrize("chunk", [0, -8, 8.0, True])
def test_bad_attention_chunk_size_is_refused(backend, chunk):
    batch = make_paged_batch(MIXED, num_heads=4, num_kv_heads=2, head_dim=64, block_size=8)
    kc, vc = batch.fresh_caches()
    with pytest.raises(ValueError, match=f"attention_chunk_size={chunk!r} must be None or an int > 0"):
        backend().forward(batch.query, batch.key, batch.value, kc, vc, batch.meta, batch.scale,
                          attention_chunk_size=chunk)


@pytest.mark.parametrize("backend", [TorchReferenceBackend, SdpaBackend], ids=["torch", "sdpa"])
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_torch_backends_over_an_fp8_cache(backend, cache_dtype):
    """K/V are stored rounded to fp8 and widened on read: dense attention over the fp8-rounded
    K/V (the batch's context is rounded through the cache dtype) is the reference."""
    batch = make_paged_batch(MIXED, num_heads=4, num_kv_heads=2, head_dim=64, block_size=8, cache_dtype=cache_dtype)
    kc, vc = batch.fresh_caches()
    out = backend().forward(batch.query, batch.key, batch.value, kc, vc, batch.meta, batch.scale)
    torch.testing.assert_close(out.double(), dense_attention_f64(batch), atol=1e-5, rtol=1e-5)
    for r in range(batch.meta.num_reqs):
        assert torch.equal(gather_context(kc, batch, r).float(), batch.ctx_k[r])

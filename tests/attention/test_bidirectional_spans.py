"""Bidirectional image spans (Gemma 3; attention/metadata.py ``attend_ends``): every backend sees
a token's span both ways, the sliding window still bounding it from below, as the dense oracle."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from pagedllm.attention.cpu import CpuAttentionBackend
from pagedllm.attention.sdpa import SdpaBackend
from pagedllm.attention.testing import dense_attention_f64, make_paged_batch
from pagedllm.attention.torch_ref import TorchReferenceBackend

pytestmark = pytest.mark.usefixtures("single_torch_thread")

REQS = [(0, 12), (9, 1), (5, 10)]  # (cached, new): a prefill from 0, a decode, a chunk mid-context
# image runs [start, end) by request, in context positions: one inside the first request's
# chunk, one in the third's that starts before the chunk (its head cached by a prefix hit)
RUNS = {0: [(3, 8)], 2: [(4, 9)]}


# longer chunks for the C kernel's tiled paths: 40 new tokens make two items of 32 and 8 tokens
# (head_dim 64, GQA 2; AVX-512: the key-major "wide" path), and the first item's last tokens sit in
# a run that ends inside the second; plus a decode, and a run whose head a prefix hit cached
LONG_REQS = [(0, 40), (21, 1), (13, 30)]
LONG_RUNS = {0: [(4, 9), (28, 37)], 2: [(10, 30)]}


def _with_spans(batch, reqs=REQS, runs=RUNS):
    ends = []
    for r, (cached, new) in enumerate(reqs):
        pos = np.arange(cached, cached + new)
        e = pos + 1
        for start, end in runs.get(r, []):
            e[(pos >= start) & (pos < end)] = end
        ends.append(e)
    return replace(batch, meta=replace(batch.meta, attend_ends=torch.from_numpy(np.concatenate(ends)).int()))


BACKENDS = [TorchReferenceBackend, SdpaBackend]
if CpuAttentionBackend.is_available():
    BACKENDS.append(CpuAttentionBackend)


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: b.name)
@pytest.mark.parametrize("window", [None, 3])
def test_spans_match_the_dense_oracle(backend, window):
    causal = make_paged_batch(REQS, num_heads=4, num_kv_heads=2, head_dim=32, block_size=8, seed=3)
    batch = _with_spans(causal)
    kc, vc = batch.fresh_caches()
    out = backend().forward(batch.query, batch.key, batch.value, kc, vc, batch.meta, batch.scale, window)
    want = dense_attention_f64(batch, window)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    # the spans change what a run's tokens see (so the comparison above can fail)
    assert not torch.allclose(want, dense_attention_f64(causal, window), atol=1e-3)


@pytest.mark.skipif(not CpuAttentionBackend.is_available(), reason="the C library cannot be built here")
@pytest.mark.parametrize("window,chunk", [(None, None), (6, None), (None, 16)])
@pytest.mark.parametrize("threads", [1, 2])
def test_c_kernel_spans_over_tiles_and_blocks(window, chunk, threads):
    """The C kernel takes the spans itself (no fallback): runs that cross blocks and the kernel's
    token tiles, with a sliding window or chunked local attention bounding them from below."""
    causal = make_paged_batch(LONG_REQS, num_heads=4, num_kv_heads=2, head_dim=64, block_size=8, seed=5)
    batch = _with_spans(causal, LONG_REQS, LONG_RUNS)
    kc, vc = batch.fresh_caches()
    backend = CpuAttentionBackend(num_threads=threads, parallel_work=0)
    out = backend.forward(batch.query, batch.key, batch.value, kc, vc, batch.meta, batch.scale, window,
                          attention_chunk_size=chunk)
    # (with chunked local attention the torch backends bound a span only from below, as the C kernel
    # does; the dense oracle also cuts it at the chunk's end, so the reference is the comparison)
    ref_kc, ref_vc = batch.fresh_caches()
    want = TorchReferenceBackend().forward(batch.query, batch.key, batch.value, ref_kc, ref_vc, batch.meta,
                                           batch.scale, window, attention_chunk_size=chunk)
    if chunk is None:
        torch.testing.assert_close(want.double(), dense_attention_f64(batch, window), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out.double(), dense_attention_f64(causal, window, attention_chunk_size=chunk), atol=1e-3)


@pytest.mark.skipif(not CpuAttentionBackend.is_available(), reason="the C library cannot be built here")
def test_portable_scalar_c_build_with_spans(tmp_path):
    """The scalar fallbacks (no AVX) honour the spans too."""
    from pagedllm.native.bindings import NativeLibrary
    lib = NativeLibrary.build(cache_dir=tmp_path, cflags=("-O2", "-fopenmp", "-shared", "-fPIC"))
    batch = _with_spans(make_paged_batch(LONG_REQS, num_heads=4, num_kv_heads=2, head_dim=16, block_size=8, seed=6),
                        LONG_REQS, LONG_RUNS)
    kc, vc = batch.fresh_caches()
    out = CpuAttentionBackend(num_threads=2, parallel_work=0, library=lib).forward(
        batch.query, batch.key, batch.value, kc, vc, batch.meta, batch.scale, 5)
    torch.testing.assert_close(out.double(), dense_attention_f64(batch, 5), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not CpuAttentionBackend.is_available(), reason="the C library cannot be built here")
@pytest.mark.parametrize("bad", ["before_own", "past_context", "decreasing"])
def test_c_kernel_refuses_ends_it_cannot_honour(bad):
    """An end before the token's own position + 1, past the context, or smaller than the previous
    token's would read outside the request's blocks or break the kernel's row order: refused."""
    batch = _with_spans(make_paged_batch(REQS, num_heads=4, num_kv_heads=2, head_dim=32, block_size=8, seed=7))
    ends = batch.meta.attend_ends.clone()
    if bad == "before_own":
        ends[1] = 1  # token 1 of the first request sits at position 1 (token 0's end is 1: still in order)
    elif bad == "past_context":
        ends[11] = 13  # the first request's context is 12 tokens
    else:
        ends[1] = 8  # token 1 sees to 8, token 2 only to 3
    kc, vc = batch.fresh_caches()
    with pytest.raises(ValueError):
        CpuAttentionBackend(num_threads=1).forward(batch.query, batch.key, batch.value, kc, vc,
                                                   replace(batch.meta, attend_ends=ends), batch.scale)


def test_triton_hands_spans_to_its_fallback_or_refuses():
    """The Triton kernels are causal only: a step with spans runs on the fallback (SDPA under
    ``auto``), and with none (``attention_backend='triton'``) it is refused, never masked wrong."""
    backend_mod = pytest.importorskip("pagedllm.attention.triton.backend")
    batch = _with_spans(make_paged_batch(REQS, num_heads=4, num_kv_heads=2, head_dim=32, block_size=8, seed=4))
    kc, vc = batch.fresh_caches()
    backend = backend_mod.TritonAttentionBackend(fallback=SdpaBackend())
    out = backend.forward(batch.query, batch.key, batch.value, kc, vc, batch.meta, batch.scale, 3)
    torch.testing.assert_close(out.double(), dense_attention_f64(batch, 3), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="bidirectional image attention"):
        backend_mod.TritonAttentionBackend(fallback=None).forward(batch.query, batch.key, batch.value, kc, vc,
                                                                  batch.meta, batch.scale)

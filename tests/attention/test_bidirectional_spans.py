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


def _with_spans(batch):
    ends = []
    for r, (cached, new) in enumerate(REQS):
        pos = np.arange(cached, cached + new)
        e = pos + 1
        for start, end in RUNS.get(r, []):
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

"""Attention sinks (GPT-OSS: one learned logit per query head in the softmax denominator) in every
backend, against the dense float64 oracle (``dense_attention_f64`` with ``sinks``): the torch
reference, SDPA, the C kernel (its default build, whose rows take the wide AVX-512 path where the
CPU has it, and the portable scalar build) and the Triton kernels, unsplit and split (under
TRITON_INTERPRET=1 on small shapes)."""
from __future__ import annotations

import pytest
import torch

from pagedllm.attention.cpu import CpuAttentionBackend
from pagedllm.attention.sdpa import SdpaBackend
from pagedllm.attention.testing import dense_attention_f64, make_paged_batch
from pagedllm.attention.torch_ref import TorchReferenceBackend
from pagedllm.native.bindings import NativeLibrary

pytestmark = pytest.mark.usefixtures("single_torch_thread")

# (num_cached, q_len): decodes, a fresh prefill, chunks starting mid-context, partial blocks
MIXED = [(0, 1), (37, 1), (5, 20), (40, 9), (0, 17), (16, 16)]
ATOL = RTOL = 1e-5
needs_c = pytest.mark.skipif(not CpuAttentionBackend.is_available(), reason="no C compiler")


def sinks_for(num_heads: int, seed: int = 0) -> torch.Tensor:
    """Per-head logits from strongly negative (almost no effect) to strongly positive (the sink
    takes most of the mass), so both ends of the denominator are exercised."""
    g = torch.Generator().manual_seed(seed)
    return torch.linspace(-6.0, 6.0, num_heads)[torch.randperm(num_heads, generator=g)]


def check(backend, batch, sinks, window=None, device="cpu", atol=ATOL):
    moved = batch.to(device)
    kc, vc = moved.fresh_caches()
    out = backend.forward(moved.query, moved.key, moved.value, kc, vc, moved.meta, moved.scale, window,
                          sinks=sinks.to(device))
    dense = dense_attention_f64(batch, window, sinks=sinks)
    torch.testing.assert_close(out.cpu().double(), dense, atol=atol, rtol=RTOL)
    # the sinks change the answer (the oracle without them differs), so the check can fail
    assert not torch.allclose(out.cpu().double(), dense_attention_f64(batch, window), atol=1e-3)


def cpu_backends():
    yield TorchReferenceBackend()
    yield SdpaBackend()
    if CpuAttentionBackend.is_available():
        yield CpuAttentionBackend(num_threads=2, parallel_work=0)


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("block_size, group", [(8, 1), (16, 4), (8, 16)])  # group 16: the C kernel's wide rows
def test_cpu_side_backends_with_sinks_match_dense_f64(block_size, group, window):
    batch = make_paged_batch(MIXED, num_heads=2 * group, num_kv_heads=2, head_dim=64, block_size=block_size,
                             seed=block_size + group)
    sinks = sinks_for(2 * group, seed=group)
    for backend in cpu_backends():
        check(backend, batch, sinks, window)


@needs_c
def test_portable_scalar_c_build_with_sinks(tmp_path):
    lib = NativeLibrary.build(cache_dir=tmp_path, cflags=("-O2", "-fopenmp", "-shared", "-fPIC"))
    backend = CpuAttentionBackend(num_threads=2, parallel_work=0, library=lib)
    batch = make_paged_batch(MIXED, num_heads=8, num_kv_heads=2, head_dim=16, block_size=8, seed=3)
    check(backend, batch, sinks_for(8), window=5)


def test_sinks_of_the_wrong_shape_are_refused():
    batch = make_paged_batch([(3, 2)], num_heads=4, num_kv_heads=2, head_dim=64, block_size=8)
    kc, vc = batch.fresh_caches()
    for backend in cpu_backends():
        with pytest.raises(ValueError, match=r"sinks must have shape \[4\]"):
            backend.forward(batch.query, batch.key, batch.value, kc, vc, batch.meta, batch.scale, sinks=torch.zeros(2))


@pytest.mark.parametrize("num_splits, window", [(1, None), (3, None), (1, 9)])
def test_triton_with_sinks_matches_dense_f64(num_splits, window):
    """Split-KV adds the sink once, after the merge (kernels.py ``_sink_share``)."""
    pytest.importorskip("pagedllm.attention.triton.backend")
    from pagedllm.attention import triton as triton_pkg
    from pagedllm.attention.triton.backend import TritonAttentionBackend
    device = "cpu" if triton_pkg.interpreting() else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs TRITON_INTERPRET=1 or CUDA")
    reqs = [(0, 1), (45, 1), (5, 12), (30, 1)] if num_splits > 1 else MIXED[:4]
    batch = make_paged_batch(reqs, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, seed=num_splits)
    check(TritonAttentionBackend(num_kv_splits=num_splits), batch, sinks_for(4, seed=1), window, device)

"""MLA over a paged latent cache (attention/mla.py) against the float64 oracle: both the
decompress (prefill) and the weight-absorbed (decode) forms, ragged lengths, partial last blocks,
prefill chunks over a cached prefix and decodes mixed in one batch."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pagedllm.attention import mla
from pagedllm.attention.testing import make_paged_batch
from pagedllm.native import bindings

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

HEADS, NOPE, ROPE, V, RANK = 4, 16, 8, 12, 32
# (cached, new) per request: a fresh prefill, decodes, a chunk over a cached prefix, one block exactly,
# and a chunk long enough that ``absorbs`` picks the decompressed form for it (these shapes: >= 25 tokens)
REQS = [(0, 7), (13, 1), (20, 5), (5, 1), (31, 1), (0, 16), (2, 30)]


def _case(block_size: int, seed: int = 0, cache_dtype: torch.dtype = torch.float32):
    """A paged batch whose one "KV head" is the latent (its values already rounded through
    ``cache_dtype``, so the oracle sees what the cache holds), plus queries and kv_b halves."""
    batch = make_paged_batch(REQS, 1, 1, RANK + ROPE, block_size, seed=seed, cache_dtype=cache_dtype)
    g = torch.Generator().manual_seed(seed + 1)
    n = batch.meta.num_tokens
    q_nope, q_pe = torch.randn(n, HEADS, NOPE, generator=g), torch.randn(n, HEADS, ROPE, generator=g)
    w_uk, w_uv = torch.randn(HEADS, NOPE, RANK, generator=g) * 0.3, torch.randn(HEADS, V, RANK, generator=g) * 0.3
    return batch, q_nope, q_pe, w_uk, w_uv


def _reference(batch, q_nope, q_pe, w_uk, w_uv, scale):
    outs, start = [], 0
    for ctx, (_, q_len) in zip(batch.ctx_k, REQS):
        c, pe = ctx[:, 0, :RANK], ctx[:, 0, RANK:]
        end = start + q_len
        outs.append(mla.mla_reference(q_nope[start:end], q_pe[start:end], c, pe, w_uk, w_uv, scale))
        start = end
    return torch.cat(outs)


def _backend(kind: str) -> mla.MLABackend:
    if kind == "torch":
        return mla.MLABackend()
    if kind == "triton":
        if not INTERPRETED:
            pytest.skip("the Triton latent kernel on CPU tensors needs TRITON_INTERPRET=1")
        return mla.MLABackend(triton=True)
    if not bindings.is_available():
        pytest.skip("the C library does not build here")
    return mla.MLABackend(bindings.library(), num_threads=2)


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("form", ["chosen", "absorbed", "decompressed"])
@pytest.mark.parametrize("kind", ["torch", "native", "triton"])
def test_mla_backend_matches_float64(block_size, form, kind, monkeypatch):
    """``native`` / ``triton``: the absorbed requests on the C / Triton latent kernel."""
    if form != "chosen":
        monkeypatch.setattr(mla, "absorbs", lambda *a: form == "absorbed")
    batch, q_nope, q_pe, w_uk, w_uv = _case(block_size)
    scale = (NOPE + ROPE) ** -0.5
    cache = batch.key_cache.clone()
    new = batch.key[:, 0]  # [num_tokens, RANK + ROPE]: the new tokens' latents
    out = _backend(kind).forward(q_nope, q_pe, new[:, :RANK], new[:, RANK:], cache, batch.meta,
                                 w_uk, w_uv, scale)
    assert out.shape == (batch.meta.num_tokens, HEADS, V)
    torch.testing.assert_close(out.double(), _reference(batch, q_nope, q_pe, w_uk, w_uv, scale),
                               atol=2e-5, rtol=1e-5)
    # the new latents sit in their slots; nothing else was written
    slots = batch.meta.slot_mapping
    torch.testing.assert_close(cache[slots // block_size, 0, slots % block_size], new)
    untouched = torch.ones(cache.shape[0], block_size, dtype=torch.bool)
    untouched[slots // block_size, slots % block_size] = False
    assert torch.equal(cache[:, 0][untouched], batch.key_cache[:, 0][untouched])


def test_absorbed_form_is_chosen_for_short_chunks_only():
    assert mla.absorbs(24, NOPE, V, RANK, ROPE) and not mla.absorbs(25, NOPE, V, RANK, ROPE)
    v2 = dict(qk_nope_head_dim=128, v_head_dim=128, kv_lora_rank=512, qk_rope_head_dim=64)  # DeepSeek V2/V3
    assert mla.absorbs(1, **v2) and mla.absorbs(170, **v2)
    assert not mla.absorbs(171, **v2) and not mla.absorbs(2048, **v2)


@pytest.mark.parametrize("kind", ["torch", "native", "triton"])
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.bfloat16])
def test_narrow_latent_cache_matches_float64_on_the_stored_values(kind, cache_dtype):
    """An fp8 (unscaled) or bf16 latent cache: exact up to float32 math on the values it stores."""
    batch, q_nope, q_pe, w_uk, w_uv = _case(8, cache_dtype=cache_dtype)
    scale = (NOPE + ROPE) ** -0.5
    cache = batch.key_cache.clone()
    new = batch.key[:, 0]
    out = _backend(kind).forward(q_nope, q_pe, new[:, :RANK], new[:, RANK:], cache, batch.meta, w_uk, w_uv, scale)
    torch.testing.assert_close(out.double(), _reference(batch, q_nope, q_pe, w_uk, w_uv, scale), atol=2e-5, rtol=1e-5)
    slots = batch.meta.slot_mapping
    assert cache.dtype == cache_dtype and torch.equal(cache[slots // 8, 0, slots % 8].float(), new)


def test_fp8_latent_saturates_instead_of_overflowing():
    cache = torch.zeros(2, 1, 8, 4, dtype=torch.float8_e4m3fn)
    mla.write_latent(torch.tensor([[1e6, -1e6, 0.5, 2.0]]), cache, torch.tensor([3]))
    assert cache[0, 0, 3].float().tolist() == [448.0, -448.0, 0.5, 2.0]


# --- the latent kernels alone: [W_UK^T q_nope | q_pe] in, the latent-space output out --------------

# more heads than one Triton program holds (16), decodes and short chunks over cached prefixes
KERNEL_REQS = [(40, 1), (3, 1), (17, 4), (0, 2), (70, 1)]


def _latent_case(heads: int, cache_dtype: torch.dtype, seed: int = 3, rank: int = RANK, block_size: int = 8):
    batch = make_paged_batch(KERNEL_REQS, 1, 1, rank + ROPE, block_size, seed=seed, cache_dtype=cache_dtype)
    q = torch.randn(batch.meta.num_tokens, heads, rank + ROPE, generator=torch.Generator().manual_seed(seed))
    return batch, q


def _latent_reference(batch, q: torch.Tensor, scale: float, rank: int = RANK) -> torch.Tensor:
    """float64: each token's softmax over its causal context of latents, times the c_kv part."""
    outs, start = [], 0
    for ctx, (_, q_len) in zip(batch.ctx_k, KERNEL_REQS):
        lat = ctx[:, 0].double()  # [seq_len, RANK + ROPE]
        qs = q[start:start + q_len].double()  # [q_len, heads, RANK + ROPE]
        scores = torch.einsum("qhd,sd->qhs", qs, lat) * scale
        mask = mla.causal_mask(q_len, lat.shape[0], "cpu")[:, None, :]
        outs.append(torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ lat[:, :rank])
        start += q_len
    return torch.cat(outs)


def _run_latent_kernel(kind: str, batch, q: torch.Tensor, scale: float, rank: int = RANK, **kwargs) -> torch.Tensor:
    cache, meta = batch.key_cache.clone(), batch.meta
    block_size = cache.shape[2]
    cache[meta.slot_mapping // block_size, 0, meta.slot_mapping % block_size] = batch.key[:, 0].to(cache.dtype)
    if kind == "triton":
        if not INTERPRETED:
            pytest.skip("the Triton latent kernel on CPU tensors needs TRITON_INTERPRET=1")
        from pagedllm.attention.triton.latent import latent_attention
        return latent_attention(q, cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, RANK, scale,
                                meta.max_query_len, meta.max_seq_len, **kwargs)
    if not bindings.is_available():
        pytest.skip("the C library does not build here")
    out = q.new_empty(q.shape[0], q.shape[1], rank)
    bindings.library().mla_latent_attention(q, out, cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
                                            rank, scale, **kwargs)
    return out


@pytest.mark.parametrize("kind, heads, cache_dtype, kwargs", [
    ("native", 20, torch.float32, dict(num_threads=1)),
    ("native", 3, torch.bfloat16, dict(num_threads=16)),  # fewer tokens than threads: heads split
    ("native", 20, torch.float8_e4m3fn, dict(num_threads=2)),
    ("native", 5, torch.float8_e5m2, dict(num_threads=2)),
    ("native", 4, torch.float16, dict(num_threads=2)),
    ("triton", 20, torch.float32, dict(num_kv_splits=1)),
    ("triton", 3, torch.bfloat16, dict(num_kv_splits=3)),  # flash-decoding splits, some seeing no key
    ("triton", 4, torch.float8_e4m3fn, dict(num_kv_splits=None)),
])  # fmt: skip
def test_latent_kernels_match_float64(kind, heads, cache_dtype, kwargs):
    batch, q = _latent_case(heads, cache_dtype)
    scale = (NOPE + ROPE) ** -0.5
    out = _run_latent_kernel(kind, batch, q, scale, **kwargs)
    assert out.shape == (q.shape[0], heads, RANK)
    torch.testing.assert_close(out.double(), _latent_reference(batch, q, scale), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("heads, rank, block_size, cache_dtype, threads", [
    (16, 40, 8, torch.float32, 1),  # a rank that is not a multiple of the 32 output columns per pass
    (40, 48, 128, torch.bfloat16, 16),  # heads split into two items of 20 (padded to 32); 64-key chunks of a block
    (17, 32, 16, torch.float8_e4m3fn, 2),
])  # fmt: skip
def test_native_latent_kernel_items_of_many_heads(heads, rank, block_size, cache_dtype, threads):
    """Items of 16 heads or more: on an AVX-512 build the heads are the vector lanes of the scores
    and the softmax (padded to a multiple of 16), keys go in chunks of 64 across block boundaries or
    inside a larger block, and the output's columns in passes of 32; float64 agrees."""
    batch, q = _latent_case(heads, cache_dtype, rank=rank, block_size=block_size)
    scale = (NOPE + ROPE) ** -0.5
    out = _run_latent_kernel("native", batch, q, scale, rank=rank, num_threads=threads)
    torch.testing.assert_close(out.double(), _latent_reference(batch, q, scale, rank), atol=2e-5, rtol=1e-5)


def test_native_latent_kernel_refuses_metadata_past_the_pool():
    batch, q = _latent_case(2, torch.float32)
    batch.meta.block_tables[0, 0] = batch.key_cache.shape[0]  # a block id past the pool
    with pytest.raises(ValueError, match="metadata out of range"):
        _run_latent_kernel("native", batch, q, 1.0, num_threads=1)


def test_triton_latent_kernel_compiles_for_sm90(tmp_path):
    """The latent kernels at DeepSeek's shape (rank 512, rope 64), every dtype pair, split and
    not, compiled to cubin for sm_90 with the wheel's ptxas (a subprocess: this one's triton is
    in interpreter mode); half-precision queries over half or fp8 latents take the tensor cores."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "pagedllm.attention.triton.aot", "--arch", "90", "--mla"],
                          env=dict(env, TRITON_CACHE_DIR=str(tmp_path), PYTHONWARNINGS="ignore"),
                          capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    decode = [line for line in lines if "mla_decode_kernel" in line]
    assert len(decode) == 10 and len(lines) == 15  # 5 dtype pairs x (unsplit, split + merge)
    for line in decode:
        half = "query=fp32" not in line
        assert ("dot=mma.sync.aligned." in line) == half and ("dot=fma" in line) != half, line

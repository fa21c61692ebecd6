"""MLA over a paged latent cache (attention/mla.py) against the float64 oracle: both the
decompress (prefill) and the weight-absorbed (decode) forms, ragged lengths, partial last blocks,
prefill chunks over a cached prefix and decodes mixed in one batch."""
from __future__ import annotations

import pytest
import torch

from pagedllm.attention import mla
from pagedllm.attention.testing import make_paged_batch
from pagedllm.native import bindings

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
    if not bindings.is_available():
        pytest.skip("the C library does not build here")
    return mla.MLABackend(bindings.library(), num_threads=2)


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("form", ["chosen", "absorbed", "decompressed"])
@pytest.mark.parametrize("kind", ["torch", "native"])
def test_mla_backend_matches_float64(block_size, form, kind, monkeypatch):
    """``native``: the absorbed requests on the C paged-attention kernel (the latent as one KV head)."""
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


@pytest.mark.parametrize("kind", ["torch", "native"])
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

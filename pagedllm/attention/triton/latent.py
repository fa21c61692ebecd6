"""Host side of the MLA latent kernels (``mla_kernels.py``): tile shapes, the split choice and the
launches as data (``launch.Launch``, so ``aot.py`` compiles what runs)."""
from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType

import torch

from pagedllm.attention.triton.launch import Launch
from pagedllm.attention.triton.plan import choose_num_kv_splits, next_pow2

# (query dtype, latent cache dtype): a half model over its own dtype or an fp8 cache, float32 throughout
LATENT_DTYPES = ((torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                 (torch.bfloat16, torch.float8_e4m3fn), (torch.float16, torch.float8_e5m2))
BLOCK_H = 16  # heads of one token per program: tl.dot's smallest M (DeepSeek V3's 128 heads: 8 programs)
MIN_PAD = 16  # tl.dot's smallest K and N: a rope or rank narrower than this is padded (masked) to it


@functools.cache
def load_mla_kernels() -> ModuleType:
    from pagedllm.attention.triton import mla_kernels
    return mla_kernels


@dataclass(frozen=True)
class LatentTiles:
    """Constexprs and launch options of ``mla_decode_kernel``."""

    rank_pad: int
    rope_pad: int
    tile_n: int  # keys per step: 32 at DeepSeek's rank 512 keeps a latent tile at 32 KiB in half precision
    num_warps: int = 4
    num_stages: int = 2


def latent_tiles(rank: int, rope: int) -> LatentTiles:
    rank_pad, rope_pad = max(MIN_PAD, next_pow2(rank)), max(MIN_PAD, next_pow2(rope))
    return LatentTiles(rank_pad, rope_pad, tile_n=32 if rank_pad >= 512 else 64)


def unsupported_latent_cache(latent_cache: torch.Tensor) -> str | None:
    """Why triton cannot compile the kernel for this cache's dtype on its GPU, or None."""
    from pagedllm.attention.triton.backend import _device_reason
    return _device_reason(latent_cache.dtype, latent_cache.device)


def check_latent_call(query: torch.Tensor, latent_cache: torch.Tensor, rank: int) -> None:
    """Raises ValueError for arguments the kernel would misread (it trusts them)."""
    if query.dim() != 3 or latent_cache.dim() != 4 or latent_cache.shape[1] != 1:
        raise ValueError(f"query must be [tokens, heads, rank + rope] and the latent cache [blocks, 1, block_size, "
                         f"rank + rope], got {tuple(query.shape)} and {tuple(latent_cache.shape)}")
    if query.shape[2] != latent_cache.shape[3] or not 0 < rank < query.shape[2]:
        raise ValueError(f"kv_lora_rank={rank} and query width {query.shape[2]} do not fit the latent width "
                         f"{latent_cache.shape[3]}")
    if query.stride(2) != 1 or not latent_cache.is_contiguous():
        raise ValueError("the query needs a unit inner stride and the latent cache must be contiguous")


def latent_launches(query: torch.Tensor, latent_cache: torch.Tensor, block_tables: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, rank: int, scale: float,
                    out: torch.Tensor, num_splits: int) -> list[Launch]:
    """The attention launch (and the merge with several splits) into ``out`` ``[tokens, heads, rank]``."""
    num_tokens, num_heads, _ = query.shape
    tiles = latent_tiles(rank, query.shape[2] - rank)
    shape = (num_splits, num_tokens, num_heads) if num_splits > 1 else (1, 1, 1)
    acc = torch.empty(*shape, rank if num_splits > 1 else 1, dtype=torch.float32, device=query.device)
    m, row_sum = (torch.empty(shape, dtype=torch.float32, device=query.device) for _ in range(2))
    strides = dict(o_stride_t=out.stride(0), o_stride_h=out.stride(1), a_stride_s=acc.stride(0),
                   a_stride_t=acc.stride(1), a_stride_h=acc.stride(2), st_stride_s=m.stride(0), st_stride_t=m.stride(1))
    args = dict(
        out_ptr=out, acc_ptr=acc, m_ptr=m, row_sum_ptr=row_sum, query_ptr=query, latent_cache_ptr=latent_cache,
        block_tables_ptr=block_tables, query_start_loc_ptr=query_start_loc, seq_lens_ptr=seq_lens,
        scale=float(scale), num_reqs=seq_lens.shape[0], num_heads=num_heads, rank=rank,
        rope=query.shape[2] - rank, block_size=latent_cache.shape[2], num_splits=num_splits,
        q_stride_t=query.stride(0), q_stride_h=query.stride(1), **strides,
        c_stride_b=latent_cache.stride(0), c_stride_s=latent_cache.stride(2), bt_stride=block_tables.stride(0),
    )  # fmt: skip
    constexprs = dict(BLOCK_H=BLOCK_H, TILE_N=tiles.tile_n, RANK_PAD=tiles.rank_pad, ROPE_PAD=tiles.rope_pad)
    grid = (num_tokens, -(-num_heads // BLOCK_H), num_splits)
    launches = [Launch("mla_decode_kernel", grid, args, constexprs,
                       dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages))]
    if num_splits > 1:
        merge = dict(out_ptr=out, acc_ptr=acc, m_ptr=m, row_sum_ptr=row_sum, num_splits=num_splits, rank=rank,
                     **strides)
        launches.append(Launch("mla_merge_kernel", (num_tokens, num_heads), merge, dict(RANK_PAD=tiles.rank_pad)))
    return launches


def latent_attention(query: torch.Tensor, latent_cache: torch.Tensor, block_tables: torch.Tensor,
                     query_start_loc: torch.Tensor, seq_lens: torch.Tensor, rank: int, scale: float,
                     max_query_len: int, max_seq_len: int, num_kv_splits: int | None = None) -> torch.Tensor:
    """MLA's absorbed form over the paged latents: ``[tokens, heads, rank]`` in the query's dtype.

    query ``[tokens, heads, rank + rope]`` = ``[W_UK^T q_nope | q_pe]``; metadata int32 on the
    cache's device (``block_tables`` ``[reqs, max_blocks]``, ``query_start_loc`` ``[reqs + 1]``,
    ``seq_lens`` ``[reqs]``, contexts including the new tokens, which must already be written).
    ``max_query_len`` / ``max_seq_len``: host maxima for the split choice (``num_kv_splits``: None
    picks it with ``plan.choose_num_kv_splits``, an int forces it). CUDA tensors, or CPU tensors
    under ``TRITON_INTERPRET=1``."""
    from pagedllm.attention.triton.backend import TritonAttentionBackend, _num_sms
    TritonAttentionBackend.check_device(query.device)
    check_latent_call(query, latent_cache, rank)
    out = query.new_empty(query.shape[0], query.shape[1], rank)
    if query.shape[0] == 0:
        return out
    num_programs = query.shape[0] * -(-query.shape[1] // BLOCK_H)
    num_splits = num_kv_splits or choose_num_kv_splits(num_programs, max_query_len, max_seq_len,
                                                       _num_sms(query.device))
    kernels = load_mla_kernels()
    for launch in latent_launches(query, latent_cache, block_tables, query_start_loc, seq_lens, rank, scale, out,
                                  num_splits):
        launch.run(kernels)
    return out


def shipped_latent_launches(rank: int = 512, rope: int = 64, heads: int = 16) -> Iterator[Launch]:
    """One launch per (query dtype, cache dtype) the MLA backend issues, at DeepSeek's latent shape,
    unsplit and split (with the merge), over meta-device tensors: what ``aot.compile_launch``
    compiles for GPU targets."""
    for q_dtype, cache_dtype in LATENT_DTYPES:
        query = torch.empty(4, heads, rank + rope, dtype=q_dtype, device="meta")
        cache = torch.empty(16, 1, 16, rank + rope, dtype=cache_dtype, device="meta")
        meta = [torch.empty(n, dtype=torch.int32, device="meta") for n in ((2, 8), (3,), (2,))]
        for num_splits in (1, 3):
            out = query.new_empty(4, heads, rank)
            yield from latent_launches(query, cache, *meta, rank, 0.1, out, num_splits)

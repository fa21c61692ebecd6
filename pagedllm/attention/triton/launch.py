"""Kernel launches as data: which kernel, its grid, arguments, constexprs and options.

The backend runs them; ``aot.py`` compiles the very same argument lists ahead of time for real
GPUs, so the two cannot drift apart.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType

import torch

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.triton.plan import AttentionTiles, num_query_tiles


@dataclass(frozen=True)
class Launch:
    kernel: str  # attribute of the kernels module
    grid: tuple[int, ...]
    args: dict[str, object]  # runtime arguments, in the kernel's order
    constexprs: dict[str, int | bool]
    options: dict[str, int] = field(default_factory=dict)  # num_warps, num_stages

    def run(self, kernels: ModuleType) -> None:
        getattr(kernels, self.kernel)[self.grid](**self.args, **self.constexprs, **self.options)

    def template(self) -> Launch:
        """This launch without its tensors (None in their place): what a call of the same shapes,
        strides, dtypes and options reuses, binding its own tensors (``bind``). Holds no tensor,
        so a cached template keeps no activation alive."""
        args = {k: None if isinstance(v, torch.Tensor) else v for k, v in self.args.items()}
        return Launch(self.kernel, self.grid, args, self.constexprs, self.options)

    def bind(self, **tensors: torch.Tensor) -> Launch:
        """The template with this call's tensors; every tensor argument must be given."""
        args = {**self.args, **tensors}
        missing = [k for k, v in args.items() if v is None]
        if missing or len(args) != len(self.args):
            raise ValueError(f"{self.kernel}: bind needs exactly the tensor arguments, missing {missing}")
        return Launch(self.kernel, self.grid, args, self.constexprs, self.options)


def write_kv_launch(key, value, key_cache, value_cache, slot_mapping) -> Launch:
    """Scatter ``key``/``value`` ([num_tokens, num_kv_heads, head_dim], unit stride in head_dim)."""
    _, num_kv_heads, block_size, head_dim = key_cache.shape
    args = dict(key_ptr=key, value_ptr=value, key_cache_ptr=key_cache, value_cache_ptr=value_cache,
                slot_mapping_ptr=slot_mapping, head_dim=head_dim, block_size=block_size,
                k_stride_t=key.stride(0), k_stride_h=key.stride(1), v_stride_t=value.stride(0),
                v_stride_h=value.stride(1), **_cache_strides(key_cache))
    return Launch("write_kv_kernel", (key.shape[0], num_kv_heads), args, {})


def _cache_strides(cache: torch.Tensor) -> dict[str, int]:
    return dict(c_stride_b=cache.stride(0), c_stride_h=cache.stride(1), c_stride_s=cache.stride(2))


@dataclass(frozen=True)
class AttentionCall:
    """One attention call's tensors and scalars (what the backend's ``forward`` received)."""

    query: torch.Tensor  # [num_tokens, num_heads, head_dim], unit stride in head_dim
    key_cache: torch.Tensor  # [num_blocks, num_kv_heads, block_size, head_dim]
    value_cache: torch.Tensor
    meta: AttentionMetadata
    scale: float
    sliding_window: int  # 0: none
    logits_soft_cap: float  # 0.0: none

    @property
    def group(self) -> int:
        return self.query.shape[1] // self.key_cache.shape[1]


@dataclass(frozen=True)
class SplitBuffers:
    """Per-split partial results of flash-decoding, float32."""

    acc: torch.Tensor  # [num_splits, num_tokens, num_heads, head_dim], unnormalised
    m: torch.Tensor  # [num_splits, num_tokens, num_heads], running max (base 2)
    row_sum: torch.Tensor  # [num_splits, num_tokens, num_heads]

    @classmethod
    def empty(cls, num_splits: int, query: torch.Tensor) -> SplitBuffers:
        """Buffers for ``query`` [num_tokens, num_heads, head_dim]; with one split the kernel
        never touches them, so one element each keeps the launch signature."""
        num_tokens, num_heads, head_dim = query.shape if num_splits > 1 else (1, 1, 1)
        stats = lambda: torch.empty(num_splits, num_tokens, num_heads, dtype=torch.float32, device=query.device)  # noqa: E731
        acc = torch.empty(num_splits, num_tokens, num_heads, head_dim, dtype=torch.float32, device=query.device)
        return cls(acc, stats(), stats())

    @property
    def num_splits(self) -> int:
        return self.acc.shape[0]


def attention_launch(call: AttentionCall, tiles: AttentionTiles, out: torch.Tensor, splits: SplitBuffers) -> Launch:
    """The unified kernel over the whole batch: into ``out`` ([num_tokens, num_heads, head_dim])
    with one split, else into ``splits`` for ``reduce_launch``."""
    q, meta = call.query, call.meta
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, block_size = call.key_cache.shape[1], call.key_cache.shape[2]
    args = dict(
        out_ptr=out, acc_ptr=splits.acc, m_ptr=splits.m, row_sum_ptr=splits.row_sum,
        query_ptr=q, key_cache_ptr=call.key_cache, value_cache_ptr=call.value_cache,
        block_tables_ptr=meta.block_tables, query_start_loc_ptr=meta.query_start_loc, seq_lens_ptr=meta.seq_lens,
        scale=float(call.scale), soft_cap=float(call.logits_soft_cap), window=int(call.sliding_window),
        num_reqs=meta.num_reqs, group=call.group, heads_per_prog=tiles.heads_per_prog, block_q=tiles.block_q,
        head_dim=head_dim, block_size=block_size, num_splits=splits.num_splits,
        q_stride_t=q.stride(0), q_stride_h=q.stride(1), o_stride_t=out.stride(0), o_stride_h=out.stride(1),
        a_stride_s=splits.acc.stride(0), a_stride_t=splits.acc.stride(1), a_stride_h=splits.acc.stride(2),
        st_stride_s=splits.m.stride(0), st_stride_t=splits.m.stride(1),
        **_cache_strides(call.key_cache), bt_stride=meta.block_tables.stride(0),
    )  # fmt: skip
    grid = (num_query_tiles(num_tokens, meta.num_reqs, tiles.block_q), num_kv_heads * tiles.subgroups,
            splits.num_splits)
    constexprs = dict(BLOCK_M=tiles.block_m, TILE_N=tiles.tile_n, HEAD_DIM_PAD=tiles.head_dim_pad)
    return Launch("paged_attention_kernel", grid, args, constexprs,
                  dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages))


def reduce_launch(out: torch.Tensor, splits: SplitBuffers) -> Launch:
    """Merges the splits into ``out`` [num_tokens, num_heads, head_dim]."""
    acc, m = splits.acc, splits.m
    num_splits, num_tokens, num_heads, head_dim = acc.shape
    args = dict(out_ptr=out, acc_ptr=acc, m_ptr=m, row_sum_ptr=splits.row_sum, num_splits=num_splits,
                head_dim=head_dim, o_stride_t=out.stride(0), o_stride_h=out.stride(1), a_stride_s=acc.stride(0),
                a_stride_t=acc.stride(1), a_stride_h=acc.stride(2), st_stride_s=m.stride(0), st_stride_t=m.stride(1))
    return Launch("reduce_splits_kernel", (num_tokens, num_heads), args, {})

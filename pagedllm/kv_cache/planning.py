"""KV-cache arithmetic shared by the engine and ``pagedllm plan``: bytes per token / block, blocks per sequence.

Pure functions of the model's shape; no tensors are allocated. The engine sizes its pool with them
(``kv_cache.sizing.block_bytes``, the executor) and the planner reports
the same numbers, so a plan cannot drift from what the engine allocates.
"""
from __future__ import annotations

import torch

from pagedllm.utils import cdiv


def kv_bytes(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, num_tokens: int = 1) -> int:
    """Bytes of K and V for ``num_tokens`` tokens across all layers (one block: ``num_tokens=block_size``).

    The cache is ``[num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim]`` (worker/cache_engine.py),
    so one token costs ``2 * num_layers * num_kv_heads * head_dim`` elements.
    """
    return 2 * num_layers * num_kv_heads * head_dim * num_tokens * dtype.itemsize


def blocks_per_sequence(num_tokens: int, block_size: int) -> int:
    """Blocks a ``num_tokens`` sequence holds: the last one may be partly filled."""
    return cdiv(num_tokens, block_size)


def mean_blocks_per_sequence(mean_len: float, block_size: int) -> float:
    """Expected blocks per sequence of mean length ``mean_len``: on average the last block is half empty."""
    return mean_len / block_size + 0.5

"""KV-cache arithmetic shared by the engine and ``pagedllm plan``: bytes per token / block, blocks per sequence.

Pure functions of the model's shape; no tensors are allocated. The engine sizes its pool with them
(``kv_cache.sizing.block_bytes``, the executor) and the planner reports
the same numbers, so a plan cannot drift from what the engine allocates.
"""
from __future__ import annotations

import torch

from pagedllm.kv_cache.spec import KVCacheSpec
from pagedllm.utils import cdiv


def kv_bytes(num_layers: int, spec: KVCacheSpec, dtype: torch.dtype, num_tokens: int = 1) -> int:
    """Bytes of KV for ``num_tokens`` tokens across ``num_layers`` layers of ``spec`` (one block:
    ``num_tokens=block_size``).

    The cache is ``spec.pool_shape(...)`` (worker/cache_engine.py): K and V per KV head
    (``2 * num_kv_heads * head_dim`` elements a token and layer) or one MLA latent
    (``kv_lora_rank + qk_rope_head_dim``).
    """
    return spec.bytes(num_layers, dtype, num_tokens)


def blocks_per_sequence(num_tokens: int, block_size: int) -> int:
    """Blocks a ``num_tokens`` sequence holds: the last one may be partly filled."""
    return cdiv(num_tokens, block_size)


def mean_blocks_per_sequence(mean_len: float, block_size: int) -> float:
    """Expected blocks per sequence of mean length ``mean_len``: on average the last block is half empty."""
    return mean_len / block_size + 0.5

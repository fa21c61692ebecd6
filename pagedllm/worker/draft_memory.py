"""What a draft model takes from the KV budget: its weights, and one draft block per target block.

The draft runs on rank 0 with a KV pool of as many blocks as the target's (draft_model.py), so
the executor sizes the target's pool from ``(budget - draft weights) / (target block + draft
block)``: the two pools together, with the draft's weights, fit where the target alone was sized.
"""
from __future__ import annotations

from dataclasses import dataclass

from pagedllm.config import EngineConfig
from pagedllm.kv_cache import sizing
from pagedllm.models.loader import checkpoint_bytes


@dataclass(frozen=True)
class DraftMemory:
    weight_bytes: int  # the draft's weights, in its dtype
    block_bytes: int  # one draft KV block (the target's block size, all of the draft's layers)


NO_DRAFT = DraftMemory(0, 0)


def draft_memory(config: EngineConfig) -> DraftMemory:
    """The draft model's memory for an engine config (zero without a draft model)."""
    spec = config.speculative
    if spec is None or spec.draft is None:
        return NO_DRAFT
    draft = spec.draft
    cache_dtype = config.cache.cache_dtype or draft.dtype
    return DraftMemory(checkpoint_bytes(draft.model, draft.dtype),
                       sizing.block_bytes(draft, draft.num_kv_heads, config.cache.block_size, cache_dtype))

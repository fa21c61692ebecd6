"""The attention backend interface.

KV cache layout (chosen for the CPU kernel, shared by every backend): for each layer one key
tensor and one value tensor, each ``[num_blocks, num_kv_heads, block_size, head_dim]``. One
(block, kv head) pair is a contiguous ``block_size x head_dim`` tile, so a kernel that walks a
block table for one KV head streams through memory with unit stride.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from pagedllm.attention.kv_quant import to_cache_dtype
from pagedllm.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    """Writes the batch's new K/V into the paged cache and computes paged attention."""

    name: str = "abstract"
    # True when ``forward`` may be captured in a CUDA graph (worker/cuda_graphs.py): no host
    # synchronisation, no host-side loop over the batch, request lengths read from the metadata
    # tensors with ``max_seq_len`` / ``max_query_len`` used only as upper bounds.
    supports_cuda_graphs: bool = False

    def cuda_graph_blocker(self, dtype: torch.dtype, kv_cache_dtype: torch.dtype, head_dim: int,
                           block_size: int) -> str | None:
        """Why decode steps of a model with these attention shapes cannot be captured in CUDA
        graphs with this backend, or None (a backend that hands some configurations to another
        backend overrides it)."""
        return None if self.supports_cuda_graphs else f"attention backend {self.name!r} is not graph-safe"

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        key_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
        value_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, head_dim]
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        attention_chunk_size: int | None = None,
        sinks: torch.Tensor | None = None,  # [num_heads] float32
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Stores ``key``/``value`` at ``meta.slot_mapping``, then attends causally; with a
        ``sliding_window`` W, the token at position p sees positions p - W + 1 .. p only; with a
        ``logits_soft_cap`` c (Gemma 2), each scaled score s becomes ``tanh(s / c) * c`` before the
        softmax; with an ``attention_chunk_size`` C (chunked local attention, Llama 4), the context
        is cut into chunks of C positions and the token at position p sees ``p // C * C .. p`` only
        (its own chunk); with ``sinks`` (GPT-OSS attention sinks, one learned logit per query head)
        the softmax denominator gains ``exp(sinks[h])``, as if each row saw one more key whose value
        is zero. A backend that cannot do something it is asked raises ValueError."""


def check_soft_cap(logits_soft_cap: float | None, backend: str) -> None:
    """For backends without a soft-cap: refuse one instead of ignoring it."""
    if logits_soft_cap is not None:
        raise ValueError(f"logits_soft_cap={logits_soft_cap!r} is not supported by attention_backend={backend!r}; "
                         "use 'torch', 'sdpa' or 'triton'")


def check_chunk_size(attention_chunk_size) -> None:
    """Refuses a chunk size the kernels cannot mean (None: no chunking)."""
    if attention_chunk_size is not None and not (isinstance(attention_chunk_size, int)
                                                 and not isinstance(attention_chunk_size, bool)
                                                 and attention_chunk_size > 0):
        raise ValueError(f"attention_chunk_size={attention_chunk_size!r} must be None or an int > 0")


def visible_keys(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None = None,
                 chunk: int | None = None, ends: torch.Tensor | None = None) -> torch.Tensor:
    """``[q_len, n]`` True where the query at ``q_pos[i]`` sees the key at ``k_pos[j]``: causal (up to
    ``ends[i]``, exclusive, where given: bidirectional image spans, metadata.py), within the sliding
    ``window`` and within the query's attention ``chunk`` where given."""
    hi = q_pos + 1 if ends is None else ends
    visible = k_pos[None, :] < hi[:, None]
    if window:
        visible &= k_pos[None, :] > q_pos[:, None] - window
    if chunk:
        visible &= k_pos[None, :] >= (q_pos // chunk * chunk)[:, None]
    return visible


def check_sinks(sinks: torch.Tensor | None, num_heads: int) -> torch.Tensor | None:
    """``sinks`` as float32 ``[num_heads]`` (contiguous), or None; raises for another shape."""
    if sinks is None:
        return None
    if sinks.shape != (num_heads,):
        raise ValueError(f"sinks must have shape [{num_heads}] (one logit per query head), got {tuple(sinks.shape)}")
    return sinks.float().contiguous()


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatters new K/V ([num_tokens, num_kv_heads, head_dim]) into their slots."""
    block_size = key_cache.shape[2]
    blocks = slot_mapping // block_size
    offsets = slot_mapping % block_size
    # advanced indices on dims 0 and 2 -> the indexed view is [num_tokens, num_kv_heads, head_dim]
    key_cache[blocks, :, offsets] = to_cache_dtype(key, key_cache.dtype)
    value_cache[blocks, :, offsets] = to_cache_dtype(value, value_cache.dtype)

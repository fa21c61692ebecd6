"""Fast CPU paged attention: a plain C kernel (``native/csrc/paged_attention.c``) bound with ctypes.

KV cache layout, per layer: ``key_cache`` and ``value_cache`` each
``[num_blocks, num_kv_heads, block_size, head_dim]``, contiguous. Why this order:

* The kernel's unit of work is one (request, kv head [, tile of query tokens]). For such an
  item, one (block, kv head) pair is a single contiguous ``block_size x head_dim`` tile, so it
  walks its block table reading whole tiles with unit stride (hardware-prefetch friendly) and
  never touches the other heads' data (a ``[..., block_size, num_kv_heads, head_dim]`` layout
  would interleave heads and waste cache lines / bandwidth per item).
* Keys and values are separate tensors with the same layout, so one offset addresses both.
* ``head_dim`` innermost: the q.k dot products and the p*v accumulation vectorize over it.

A step is two C calls: ``pa_write_kv`` scatters the new K/V into their slots (a row memcpy
per token and kv head), then ``pa_attention`` attends. Writing first is what lets a prefill
chunk's tokens see each other. The attention reads K/V in place through the block tables (no
gather copy), processes the query heads of a GQA group together so each K/V tile is loaded once
for the whole group (and, for prefill chunks, once for a tile of query tokens), folds 64 keys
at a time into each row's online softmax, and runs items in parallel with OpenMP. Decode tokens
and prefill chunks (causal inside the chunk, possibly starting mid-context; a bidirectional
image span's tokens see its whole run, ``meta.attend_ends``) go in the same call. Hot loops
are AVX2/FMA intrinsics (q.k and p.v: AVX-512 where built for it) with scalar fallbacks;
metadata that would index outside the tensors is rejected (ValueError) rather than
crashing the process.

Dtypes: the cache may be float32, float16, bfloat16 or fp8 e4m3 / e5m2 (converted to float32
per tile, in a per-thread scratch buffer, when read; fp8 scales are folded in by the model,
``attention/kv_quant.py``); the math and the accumulation are float32. Queries are
computed in float32 and the output is cast back to ``query.dtype``.

Build: the kernel is part of the CPU C library (``pagedllm/native``), compiled on first use
with the system C compiler and cached (``native/build.py``). If it cannot be built,
``get_cpu_backend()`` returns the torch reference backend; the engine's selector
(``attention/selector.py``) falls back to the faster SDPA backend instead.
"""
from __future__ import annotations

import torch

from pagedllm.attention.backend import AttentionBackend, check_chunk_size, check_sinks, check_soft_cap
from pagedllm.attention.kv_quant import to_cache_dtype
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.torch_ref import TorchReferenceBackend
from pagedllm.native import bindings
from pagedllm.utils import graph_break


def _rows_contiguous(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[tokens, heads, head_dim] in ``dtype`` with a unit-stride last dim (other strides are
    passed to C, so views of a fused QKV projection need no copy)."""
    t = to_cache_dtype(t, dtype)  # (fp8 caches: saturating)
    return t if t.stride(-1) == 1 else t.contiguous()


def _attend_ends(meta: AttentionMetadata) -> torch.Tensor | None:
    """Bidirectional image spans (metadata.py) as the kernel reads them, or None (causal)."""
    ends = meta.attend_ends
    return None if ends is None else ends.to(device="cpu", dtype=torch.int32).contiguous()


def _meta_arrays(meta: AttentionMetadata):
    """Metadata tensors in the exact dtypes/contiguity the C signature assumes (no-ops normally)."""
    as_i32 = lambda t: t.to(device="cpu", dtype=torch.int32).contiguous()  # noqa: E731
    slots = meta.slot_mapping.to(device="cpu", dtype=torch.int64).contiguous()
    return as_i32(meta.query_start_loc), as_i32(meta.seq_lens), as_i32(meta.block_tables), slots


class CpuAttentionBackend(AttentionBackend):
    """Paged attention with the compiled C kernel.

    ``num_threads`` defaults, per call, to ``torch.get_num_threads()``. Steps with less work
    than ``parallel_work`` multiply-adds (query rows x visible keys x head_dim; the default is
    ~50 us of work, e.g. a decode batch of a few short sequences) run on the calling thread,
    because waking the thread team would cost more than it saves.
    """

    name = "cpu"
    DEFAULT_PARALLEL_WORK = 1 << 19

    def __init__(self, num_threads: int | None = None, parallel_work: int = DEFAULT_PARALLEL_WORK,
                 library: bindings.NativeLibrary | None = None):
        """``library``: a specific build of the C library (tests: the portable scalar build);
        default the process-wide one (``NativeLibraryError`` if it cannot be built)."""
        self._native = library or bindings.library()
        self.num_threads = num_threads
        self.parallel_work = parallel_work

    @staticmethod
    def is_available() -> bool:
        return bindings.is_available()

    def _threads(self) -> int:
        return max(1, self.num_threads or torch.get_num_threads())

    @graph_break  # a ctypes call: under torch.compile, a clean graph break
    def forward(self, query, key, value, key_cache, value_cache, meta: AttentionMetadata, scale,
                sliding_window: int | None = None, logits_soft_cap: float | None = None,
                attention_chunk_size: int | None = None, sinks=None):
        check_soft_cap(logits_soft_cap, self.name)
        check_chunk_size(attention_chunk_size)
        sinks = check_sinks(sinks, query.shape[1])
        self._check_shapes(query, key, value, key_cache, value_cache, meta)
        qsl, seq_lens, block_tables, slots = _meta_arrays(meta)
        self.write_kv(key, value, key_cache, value_cache, slots)

        q = _rows_contiguous(query, torch.float32)
        num_tokens, num_heads, head_dim = q.shape
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=torch.float32)  # ints: faster than a Size
        if num_tokens == 0:
            return out.to(query.dtype)
        self._native.attention(q, out, key_cache, value_cache, block_tables, qsl, seq_lens, float(scale),
                               sliding_window or 0, self._threads(), self.parallel_work, attention_chunk_size or 0,
                               sinks=None if sinks is None else sinks.cpu(), attend_ends=_attend_ends(meta))
        return out if query.dtype == torch.float32 else out.to(query.dtype)

    def write_kv(self, key, value, key_cache, value_cache, slot_mapping: torch.Tensor) -> None:
        """Scatters [num_tokens, num_kv_heads, head_dim] K/V into their slots (negative = skip)."""
        k = _rows_contiguous(key, key_cache.dtype)
        v = _rows_contiguous(value, value_cache.dtype)
        slots = slot_mapping.to(torch.int64).contiguous()
        self._native.write_kv(k, v, key_cache, value_cache, slots, self._threads())

    def _check_shapes(self, query, key, value, key_cache, value_cache, meta: AttentionMetadata) -> None:
        """The C kernel trusts its arguments, so everything it relies on is checked here."""
        for name, t in (("query", query), ("key", key), ("value", value),
                        ("key_cache", key_cache), ("value_cache", value_cache)):  # fmt: skip
            if t.device.type != "cpu":
                raise ValueError(f"{name} must be on the CPU, got {t.device}")
        if key_cache.shape != value_cache.shape or key_cache.dtype != value_cache.dtype:
            raise ValueError("key_cache and value_cache must have the same shape and dtype")
        if not self._native.supports_cache_dtype(key_cache.dtype):
            raise ValueError(f"unsupported cache dtype {key_cache.dtype}")
        _check_layout(query, key, value, key_cache, value_cache, meta)


def _check_layout(query, key, value, key_cache, value_cache, meta: AttentionMetadata) -> None:
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("the KV cache must be contiguous (it is written in place)")
    _, num_kv_heads, block_size, head_dim = key_cache.shape
    num_tokens, num_heads, q_dim = query.shape
    if block_size != meta.block_size:
        raise ValueError(f"cache block size {block_size} != metadata block size {meta.block_size}")
    if q_dim != head_dim or num_heads % num_kv_heads != 0:
        raise ValueError(f"query {tuple(query.shape)} does not fit cache {tuple(key_cache.shape)}")
    if key.shape != (num_tokens, num_kv_heads, head_dim) or value.shape != key.shape:
        raise ValueError(f"key/value must be [{num_tokens}, {num_kv_heads}, {head_dim}]")
    if meta.num_tokens != num_tokens:
        raise ValueError(f"metadata has {meta.num_tokens} tokens, query has {num_tokens}")


def get_cpu_backend(num_threads: int | None = None) -> AttentionBackend:
    """The compiled CPU backend if it builds, else the torch reference (after a warning)."""
    if not bindings.is_available():
        return TorchReferenceBackend()
    return CpuAttentionBackend(num_threads=num_threads)

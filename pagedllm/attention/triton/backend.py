"""TritonAttentionBackend: K/V write + paged attention with the Triton kernels."""
from __future__ import annotations

import functools
import logging
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from pagedllm.attention.backend import AttentionBackend, check_chunk_size, check_sinks
from pagedllm.attention.kv_quant import is_fp8, to_cache_dtype
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.triton import import_error, interpreting, load_kernels
from pagedllm.attention.triton.launch import (
    AttentionCall,
    Launch,
    SplitBuffers,
    attention_launch,
    reduce_launch,
    write_kv_launch,
)
from pagedllm.attention.triton.plan import (
    E4M3_MIN_CAPABILITY,
    E5M2_BEFORE_SM89_TRITON,
    SUPPORTED_BLOCK_SIZES,
    SUPPORTED_DTYPES,
    SUPPORTED_HEAD_DIMS,
    AttentionTiles,
    attention_tiles,
    choose_num_kv_splits,
    device_lacks_dtype,
    installed_triton_version,
    is_prefill_step,
    num_query_tiles,
)

logger = logging.getLogger(__name__)
MAX_PLANS = 256  # launch plans kept per backend (least recently used dropped): eager prefill shapes vary


@dataclass
class LaunchPlan:
    """What ``forward`` derives from a call's shapes, strides, dtypes, devices and options alone,
    computed once per such signature (``plan_key``): the validation's verdict, the tile shapes
    and the launches as templates (``Launch.template``: no tensors), each call binding its own."""

    fallback_reason: str | None  # the kernels do not cover this configuration
    num_programs: int = 0  # the unsplit grid of decode tiles, for the split heuristic (decode steps only)
    write: Launch | None = None  # the K/V write, from the first call with new tokens
    # per (split count, prefill tiles): the call-dependent choices (they follow the host maxima
    # max_seq_len and max_query_len), filled as met
    attention: dict[tuple[int, bool], tuple[Launch, Launch | None]] = field(default_factory=dict)


class TritonAttentionBackend(AttentionBackend):
    """Paged attention in Triton: one kernel for the flat mixed batch (decodes and prefill
    chunks), reading K/V in place through the block tables, plus a split-KV variant for long
    contexts at small batch.

    On CUDA tensors the kernels are compiled; CPU tensors need Triton's interpreter
    (``TRITON_INTERPRET=1`` before triton is imported; correct but slow: for tests).
    ``num_kv_splits``: None picks the split count per step with
    ``plan.choose_num_kv_splits``; an int forces it (1: never split).

    A configuration the kernels do not cover (head_dim, block_size, dtypes; see
    ``unsupported_reason``) raises ValueError, unless a ``fallback`` backend is given (what
    ``attention_backend="auto"`` does on CUDA): then a warning names the reason, once, and the
    fallback runs those calls.

    Host work per call: the validation, the tile shapes and the launches' arguments but the
    tensors are computed once per call signature (``plan_key``: shapes, strides, dtypes,
    devices, options) and kept in a ``LaunchPlan`` (the last MAX_PLANS), so a decode step of a
    known batch size only binds its tensors, whether eager or being captured.
    """

    name = "triton"
    # graph-safe (the contract on AttentionBackend): the kernels read every length from the
    # metadata tensors, mask K and V loads past them, and the host-side launch parameters (grid,
    # split count, split buffers) depend only on the batch's shape and the host maxima, which
    # the capture fixes per batch size (num_tokens = num_reqs = size, max_seq_len = max_model_len)
    supports_cuda_graphs = True

    def __init__(self, num_kv_splits: int | None = None, fallback: AttentionBackend | None = None):
        error = import_error()
        if error is not None:
            raise ValueError(f"attention_backend='triton' needs triton and numpy: {error}")
        if num_kv_splits is not None and not (isinstance(num_kv_splits, int) and num_kv_splits >= 1):
            raise ValueError(f"num_kv_splits={num_kv_splits!r} must be None or an int >= 1")
        self.num_kv_splits = num_kv_splits
        self.fallback = fallback
        self._warned: set[str] = set()
        self._plans: OrderedDict[tuple, LaunchPlan] = OrderedDict()  # plan_key -> plan

    @staticmethod
    def check_device(device: torch.device) -> None:
        """Raises ValueError if the kernels cannot run on ``device`` in this process."""
        if device.type != "cuda" and not interpreting():
            raise ValueError(f"attention_backend='triton' on {device.type} runs in Triton's interpreter: set "
                             "TRITON_INTERPRET=1 in the environment before starting (or use a CUDA device)")

    def cuda_graph_blocker(self, dtype: torch.dtype, kv_cache_dtype: torch.dtype, head_dim: int,
                           block_size: int) -> str | None:
        """A configuration the kernels do not cover runs on the fallback, which must then be
        graph-safe too (SDPA, the one ``auto`` picks, is not)."""
        reason = unsupported_config(head_dim, block_size, dtype, kv_cache_dtype)
        if reason is None and torch.cuda.is_available():
            reason = _device_reason(kv_cache_dtype, torch.device("cuda", torch.cuda.current_device()))
        if reason is None or self.fallback is None:  # no fallback: forward refuses the configuration
            return None
        blocker = self.fallback.cuda_graph_blocker(dtype, kv_cache_dtype, head_dim, block_size)
        return None if blocker is None else f"{reason}, so the {self.fallback.name} backend runs it: {blocker}"

    def forward(self, query, key, value, key_cache, value_cache, meta: AttentionMetadata, scale,
                sliding_window: int | None = None, logits_soft_cap: float | None = None,
                attention_chunk_size: int | None = None, sinks=None):
        sinks = check_sinks(sinks, query.shape[1])
        if meta.attend_ends is not None:  # bidirectional image spans (metadata.py): the kernels are causal only
            extra = {} if sinks is None else {"sinks": sinks}
            return self._fallback_for("bidirectional image attention (Gemma 3) is not in the Triton kernels").forward(
                query, key, value, key_cache, value_cache, meta, scale, sliding_window, logits_soft_cap,
                attention_chunk_size, **extra)
        plan = self._plan(query, key, value, key_cache, value_cache, meta, scale, sliding_window, logits_soft_cap,
                          attention_chunk_size, sinks)
        if plan.fallback_reason is not None:
            extra = {} if sinks is None else {"sinks": sinks}  # a fallback without sinks need not know of them
            return self._fallback_for(plan.fallback_reason).forward(query, key, value, key_cache, value_cache, meta,
                                                                    scale, sliding_window, logits_soft_cap,
                                                                    attention_chunk_size, **extra)
        kernels = load_kernels()
        query, key, value = (_unit_stride(t) for t in (query, key, value))
        if is_fp8(key_cache.dtype):  # rounded here (saturating, to nearest even); the kernel copies bytes
            key, value = to_cache_dtype(key, key_cache.dtype), to_cache_dtype(value, key_cache.dtype)
        if key.shape[0]:
            if plan.write is None:  # this call's launch, as the template for the next ones
                plan.write = write_kv_launch(key, value, key_cache, value_cache, meta.slot_mapping).template()
            plan.write.bind(key_ptr=key, value_ptr=value, key_cache_ptr=key_cache, value_cache_ptr=value_cache,
                            slot_mapping_ptr=meta.slot_mapping).run(kernels)
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
        if query.shape[0] == 0:
            return out
        call = AttentionCall(query, key_cache, value_cache, meta, scale, sliding_window or 0, logits_soft_cap or 0.0,
                             attention_chunk_size or 0, sinks)
        self._attend(kernels, plan, call, out)
        return out

    def _plan(self, query, key, value, key_cache, value_cache, meta, scale, sliding_window,
              logits_soft_cap, attention_chunk_size=None, sinks=None) -> LaunchPlan:
        """The call's plan: cached, or validated (``check_call`` raises for a bad call) and built."""
        cache_key = plan_key(query, key, value, key_cache, value_cache, meta, scale, sliding_window, logits_soft_cap,
                             attention_chunk_size, sinks)
        plan = self._plans.get(cache_key)
        if plan is not None:
            self._plans.move_to_end(cache_key)
            return plan
        reason = unsupported_reason(query, key_cache)
        if reason is None:
            check_call(query, key, value, key_cache, value_cache, meta, sliding_window, logits_soft_cap)
            check_chunk_size(attention_chunk_size)
            self.check_device(query.device)
            call = AttentionCall(query, key_cache, value_cache, meta, scale, 0, 0.0)
            plan = LaunchPlan(None, _num_programs(call, attention_tiles(query.shape[2], call.group)))
        else:
            plan = LaunchPlan(reason)
        self._plans[cache_key] = plan
        if len(self._plans) > MAX_PLANS:
            self._plans.popitem(last=False)
        return plan

    def _fallback_for(self, reason: str) -> AttentionBackend:
        if self.fallback is None:
            raise ValueError(reason)
        if reason not in self._warned:
            self._warned.add(reason)
            logger.warning("%s: using the %s attention backend instead", reason, self.fallback.name)
        return self.fallback

    def _attend(self, kernels, plan: LaunchPlan, call: AttentionCall, out: torch.Tensor) -> None:
        meta = call.meta
        num_splits = self.num_kv_splits or choose_num_kv_splits(
            plan.num_programs, meta.max_query_len, meta.max_seq_len, _num_sms(call.query.device))
        splits = SplitBuffers.empty(num_splits, call.query)
        variant = (num_splits, is_prefill_step(meta.max_query_len))
        if variant not in plan.attention:  # this call's launches, as templates for the next ones
            tiles = attention_tiles(call.query.shape[2], call.group, prefill=variant[1])
            reduce = reduce_launch(out, splits, call).template() if num_splits > 1 else None
            plan.attention[variant] = (attention_launch(call, tiles, out, splits).template(), reduce)
        attention, reduce = plan.attention[variant]
        attention.bind(out_ptr=out, acc_ptr=splits.acc, m_ptr=splits.m, row_sum_ptr=splits.row_sum,
                       query_ptr=call.query, key_cache_ptr=call.key_cache, value_cache_ptr=call.value_cache,
                       block_tables_ptr=meta.block_tables, query_start_loc_ptr=meta.query_start_loc,
                       seq_lens_ptr=meta.seq_lens, sinks_ptr=call.sinks_arg).run(kernels)
        if reduce is not None:
            reduce.bind(out_ptr=out, acc_ptr=splits.acc, m_ptr=splits.m, row_sum_ptr=splits.row_sum,
                        sinks_ptr=call.sinks_arg).run(kernels)


def plan_key(query, key, value, key_cache, value_cache, meta: AttentionMetadata, scale, sliding_window,
             logits_soft_cap, attention_chunk_size=None, sinks: torch.Tensor | None = None) -> tuple:
    """What a call's validation and launch arguments depend on: every tensor's shape, strides,
    dtype and device, the block size and the options (with their types, so that a cached plan
    never lets through an argument the validation refuses, e.g. a float window)."""
    tensors = (query, key, value, key_cache, value_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens,
               meta.slot_mapping, *(() if sinks is None else (sinks,)))
    return (tuple((t.shape, t.stride(), t.dtype, t.device) for t in tensors), meta.block_size, scale, type(scale),
            sliding_window, type(sliding_window), logits_soft_cap, type(logits_soft_cap), attention_chunk_size,
            type(attention_chunk_size))


def _num_programs(call: AttentionCall, tiles: AttentionTiles) -> int:
    tiles_q = num_query_tiles(call.query.shape[0], call.meta.num_reqs, tiles.block_q)
    return tiles_q * call.key_cache.shape[1] * tiles.subgroups


@functools.cache
def _num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 elsewhere (the interpreter gains nothing
    from a split, so the heuristic never splits there)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def _unit_stride(t: torch.Tensor) -> torch.Tensor:
    """The kernels take strides for tokens and heads but assume a unit stride in head_dim."""
    return t if t.stride(-1) == 1 else t.contiguous()


def unsupported_reason(query: torch.Tensor, key_cache: torch.Tensor) -> str | None:
    """Which part of the model / cache configuration the kernels do not cover, or None."""
    _, _, block_size, head_dim = key_cache.shape
    return (unsupported_config(head_dim, block_size, query.dtype, key_cache.dtype)
            or _device_reason(key_cache.dtype, key_cache.device))


def _device_reason(kv_cache_dtype: torch.dtype, device: torch.device) -> str | None:
    if device.type != "cuda" or not device_lacks_dtype(kv_cache_dtype, torch.cuda.get_device_capability(device)):
        return None
    if kv_cache_dtype == torch.float8_e5m2:  # only triton < 3.7 lacks it there (plan.py)
        return (f"kv cache dtype {kv_cache_dtype} needs triton >= {_dotted(E5M2_BEFORE_SM89_TRITON)} below compute "
                f"capability {E4M3_MIN_CAPABILITY} for attention_backend='triton' (installed: "
                f"{_dotted(installed_triton_version())}; use kv_cache_dtype='auto' there)")
    return (f"kv cache dtype {kv_cache_dtype} needs compute capability {E4M3_MIN_CAPABILITY} or newer for "
            f"attention_backend='triton' (use kv_cache_dtype='fp8_e5m2' there, with triton >= "
            f"{_dotted(E5M2_BEFORE_SM89_TRITON)})")


def _dotted(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))


def unsupported_config(head_dim: int, block_size: int, dtype: torch.dtype, kv_cache_dtype: torch.dtype) -> str | None:
    """``unsupported_reason`` from the configuration alone (before any call)."""
    for name, value, allowed in (("head_dim", head_dim, SUPPORTED_HEAD_DIMS),
                                 ("block_size", block_size, SUPPORTED_BLOCK_SIZES),
                                 ("(query dtype, kv cache dtype)", (dtype, kv_cache_dtype), SUPPORTED_DTYPES)):
        if value not in allowed:
            return f"{name}={value} is not supported by attention_backend='triton'; allowed: {allowed}"
    return None


def check_call(query, key, value, key_cache, value_cache, meta: AttentionMetadata,
               sliding_window: int | None, logits_soft_cap: float | None) -> None:
    """Raises ValueError for inconsistent arguments (the kernels trust them)."""
    _, num_kv_heads, block_size, head_dim = key_cache.shape
    num_tokens, num_heads, _ = query.shape
    if value_cache.shape != key_cache.shape or value_cache.dtype != key_cache.dtype:
        raise ValueError("key_cache and value_cache must have the same shape and dtype")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("the KV cache must be contiguous (it is written in place)")
    if query.shape[2] != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"query {tuple(query.shape)} does not fit the cache {tuple(key_cache.shape)}")
    if key.shape != (num_tokens, num_kv_heads, head_dim) or value.shape != key.shape:
        raise ValueError(f"key/value must be [{num_tokens}, {num_kv_heads}, {head_dim}], got {tuple(key.shape)}")
    if meta.block_size != block_size or meta.num_tokens != num_tokens:
        raise ValueError(f"metadata (block_size={meta.block_size}, {meta.num_tokens} tokens) does not match "
                         f"the cache block size {block_size} and the {num_tokens} query tokens")
    _check_options(sliding_window, logits_soft_cap)
    _check_devices(query, key, value, key_cache, value_cache, meta)


def _check_options(sliding_window, logits_soft_cap) -> None:
    if sliding_window is not None and not (isinstance(sliding_window, int) and sliding_window >= 0):
        raise ValueError(f"sliding_window={sliding_window!r} must be None or an int >= 0 (0: no window)")
    if logits_soft_cap is not None and not logits_soft_cap > 0:
        raise ValueError(f"logits_soft_cap={logits_soft_cap!r} must be None or > 0")


def _check_devices(*tensors_and_meta) -> None:
    *tensors, meta = tensors_and_meta
    tensors += [meta.block_tables, meta.query_start_loc, meta.seq_lens, meta.slot_mapping]
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"query, key, value, the KV cache and the metadata must be on one device, got {devices}")
    for name in ("block_tables", "query_start_loc", "seq_lens"):
        t = getattr(meta, name)
        if t.dtype != torch.int32 or (t.numel() and t.stride(-1) != 1):
            raise ValueError(f"metadata {name} must be int32 with unit stride, got {t.dtype} {t.stride()}")

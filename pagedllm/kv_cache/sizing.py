"""KV cache memory arithmetic: bytes per token and block, and how many blocks a budget buys.

The executor measures (free memory, the activation peak of a profiling forward); everything it
computes from those numbers lives here, so the engine and the tests share one formula.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.config import CacheConfig, ModelConfig, SchedulerConfig
from pagedllm.kv_cache.planning import blocks_per_sequence, kv_bytes
from pagedllm.kv_cache.spec import KVCacheSpec, kv_spec_for
from pagedllm.utils import human_bytes


def model_kv_spec(model: ModelConfig, num_kv_heads: int) -> KVCacheSpec:
    """What a token stores in each of ``model``'s layers on a rank holding ``num_kv_heads`` KV heads."""
    return kv_spec_for(model.hf_config, num_kv_heads, model.head_dim)


def block_bytes(model: ModelConfig, num_kv_heads: int, block_size: int, dtype: torch.dtype,
                num_layers: int | None = None) -> int:
    """One KV block on one rank (``num_kv_heads``: the heads it holds; ``num_layers``: the layers
    its pipeline stage holds, default all), by planning's one formula over the model's spec."""
    return kv_bytes(num_layers or model.num_layers, model_kv_spec(model, num_kv_heads), dtype, block_size)


def useful_blocks(sched: SchedulerConfig, block_size: int) -> int:
    """More blocks than ``max_num_seqs`` full-length sequences can hold would never be used."""
    return sched.max_num_seqs * blocks_per_sequence(sched.max_model_len, block_size)


def cpu_budget(utilization: float, available: int, activation: int, cap: int) -> int:
    """KV bytes on a CPU device: ``utilization`` x available RAM less the activation peak, at
    most ``cap`` (like vLLM's VLLM_CPU_KVCACHE_SPACE), so several engines on one machine fit."""
    return int(max(0, min(utilization * available - activation, cap)))


def cuda_budget(utilization: float, total: int, peak_allocated: int) -> int:
    """KV bytes on a GPU: ``utilization`` x its memory less what weights and activations peaked at."""
    return int(max(0, total * utilization - peak_allocated))


@dataclass(frozen=True)
class KVCacheSize:
    num_blocks: int  # on the device, per rank (every rank holds the same block ids)
    num_cpu_blocks: int  # swap space, 0 unless preemption_mode="swap"


def plan_cache(cache: CacheConfig, sched: SchedulerConfig, nbytes_per_block: int, budget: int | None) -> KVCacheSize:
    """Blocks for a device budget in bytes (``None`` when ``num_gpu_blocks_override`` is set);
    raises ValueError when one max_model_len sequence does not fit."""
    cap = useful_blocks(sched, cache.block_size)
    if cache.num_gpu_blocks_override:
        num_blocks = cache.num_gpu_blocks_override
    else:
        num_blocks = min(budget // nbytes_per_block, cap)
    check_fits(num_blocks, cache.block_size, sched.max_model_len)
    num_cpu = min(cache.swap_space // nbytes_per_block, cap) if sched.preemption_mode == "swap" else 0
    return KVCacheSize(int(num_blocks), int(num_cpu))


def describe(num_blocks: int, nbytes_per_block: int, block_size: int, max_model_len: int) -> str:
    """The start-up log line: blocks, bytes, tokens, and how many full-length sequences fit."""
    per_seq = blocks_per_sequence(max_model_len, block_size)
    size = human_bytes(num_blocks * nbytes_per_block)
    return (f"KV cache: {num_blocks} blocks x {block_size} tokens ({size}) = {num_blocks * block_size} tokens; "
            f"{num_blocks / per_seq:.1f} sequences of max_model_len={max_model_len}")


def check_fits(num_blocks: int, block_size: int, max_model_len: int) -> None:
    per_seq = blocks_per_sequence(max_model_len, block_size)
    if num_blocks < per_seq:
        raise ValueError(
            f"the KV cache holds {num_blocks} blocks ({num_blocks * block_size} tokens) but one max_model_len="
            f"{max_model_len} sequence needs {per_seq} blocks; raise kv_cache_memory or gpu_memory_utilization, "
            "or lower max_model_len")

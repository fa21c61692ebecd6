"""Sizing and construction of the KV tiers from ``CacheConfig`` (shared by the engine and the ranks)."""
from __future__ import annotations

from pagedllm.config import CacheConfig, EngineConfig
from pagedllm.kv_cache.offload.disk_tier import DiskTier
from pagedllm.kv_cache.offload.fingerprint import kv_fingerprint
from pagedllm.kv_cache.offload.manager import OffloadManager


def tiers_enabled(cache: CacheConfig) -> bool:
    return cache.kv_offload_cpu_bytes > 0 or cache.kv_offload_dir is not None


def num_cpu_tier_blocks(cache: CacheConfig, block_bytes: int) -> int:
    """CPU tier slots per rank: ``--kv-offload-cpu-gb`` is per rank, like ``--swap-space``."""
    return cache.kv_offload_cpu_bytes // block_bytes


def build_offload_manager(config: EngineConfig, block_bytes: int) -> OffloadManager | None:
    """The scheduler's tier manager (None without tiers), checking disk entries of every rank."""
    cache = config.cache
    if not tiers_enabled(cache):
        return None
    disks = []
    if cache.kv_offload_dir is not None:
        disks = [DiskTier(cache.kv_offload_dir, kv_fingerprint(config, rank), cache.kv_offload_disk_bytes)
                 for rank in range(config.parallel.tensor_parallel_size)]
    return OffloadManager(num_cpu_tier_blocks(cache, block_bytes), disks, block_bytes)

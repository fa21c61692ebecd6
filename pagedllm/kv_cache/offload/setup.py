"""Sizing and construction of the KV tiers from ``CacheConfig`` (shared by the engine and the ranks)."""
from __future__ import annotations

import threading
from concurrent.futures import Future

from pagedllm.config import CacheConfig, EngineConfig
from pagedllm.kv_cache.offload.disk_tier import DiskTier
from pagedllm.kv_cache.offload.fingerprint import kv_fingerprints
from pagedllm.kv_cache.offload.manager import OffloadManager
from pagedllm.kv_cache.offload.remote_tier import RemoteTier


def tiers_enabled(cache: CacheConfig) -> bool:
    return cache.kv_offload_cpu_bytes > 0 or cache.kv_offload_dir is not None or cache.kv_offload_remote is not None


def _keyed_tiers(cache: CacheConfig) -> bool:
    """A disk or remote tier: entries named by fingerprint."""
    return cache.kv_offload_dir is not None or cache.kv_offload_remote is not None


def num_cpu_tier_blocks(cache: CacheConfig, block_bytes: int) -> int:
    """CPU tier slots per rank: ``--kv-offload-cpu-gb`` is per rank, like ``--swap-space``."""
    return cache.kv_offload_cpu_bytes // block_bytes


def tier_fingerprints(config: EngineConfig) -> tuple[str, ...]:
    """Every tensor-parallel rank's disk- and remote-tier fingerprint (``kv_fingerprints``), or ()
    without either; computed once, by the executor, and shared with the ranks and the scheduler."""
    return kv_fingerprints(config) if _keyed_tiers(config.cache) else ()


def prefetch_tier_fingerprints(config: EngineConfig) -> Future:
    """``tier_fingerprints(config)`` computed on a thread (it reads every weights file whole, the
    first time on a machine): call it before loading the weights so the two overlap, and take
    ``.result()`` when the KV pool is allocated."""
    future: Future = Future()
    if not _keyed_tiers(config.cache):
        future.set_result(())
        return future

    def run() -> None:
        try:
            future.set_result(tier_fingerprints(config))
        except BaseException as exc:  # handed to whoever takes the result
            future.set_exception(exc)

    threading.Thread(target=run, name="kv-tier-fingerprint", daemon=True).start()
    return future


def build_offload_manager(config: EngineConfig, block_bytes: int,
                          fingerprints: tuple[str, ...] | None = None) -> OffloadManager | None:
    """The scheduler's tier manager (None without tiers), checking disk and remote entries of every
    rank; ``fingerprints``: ``tier_fingerprints(config)`` when already computed."""
    cache = config.cache
    if not tiers_enabled(cache):
        return None
    disks, remotes = [], []
    if _keyed_tiers(cache):
        fingerprints = fingerprints or tier_fingerprints(config)
    if cache.kv_offload_dir is not None:
        disks = [DiskTier(cache.kv_offload_dir, fp, cache.kv_offload_disk_bytes) for fp in fingerprints]
    if cache.kv_offload_remote is not None:
        remotes = [RemoteTier(cache.kv_offload_remote, fp, cache.kv_offload_remote_ttl_s) for fp in fingerprints]
    return OffloadManager(num_cpu_tier_blocks(cache, block_bytes), disks, block_bytes, remotes, cache.kv_role)

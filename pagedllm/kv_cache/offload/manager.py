"""Scheduler-side tier manager: where each evicted prefix block went, and the moves to ask for.

The block pool calls :meth:`OffloadManager.on_evict` when it hands out a block whose hash it
forgets; the block goes to the CPU tier and, with a disk tier, is also queued for disk
(write-through): the CPU tier's entries are the most recently evicted, i.e. the heads of the
prefixes (the pool evicts a request's tail first), and a prefix walk stops at its first miss,
so without them on disk a restart would lose every prefix whole. A CPU-tier entry that leaves
it goes to disk only if its write did not land (e.g. the budget was full then); at shutdown,
:meth:`persist_ops` writes what the device pool and the CPU tier still hold.

The KV manager calls :meth:`lookup` block by block past the device pool's hits and
:meth:`add_load` for a request's hits; :meth:`take_ops` hands the step's moves and loads to the
scheduler output, and :meth:`finish_load` settles a load with what the ranks reported.

A disk tier whose filesystem calls keep failing (here: its presence checks; on the ranks: reads
and writes, reported through :meth:`note_report`) is turned off: no more disk moves, loads or
checks, and the engine goes on with the device pool and the CPU tier. Failed calls are counted
per operation in the tier's ``errors`` (``pagedllm:kv_offload_errors_total{tier,op}``).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from pagedllm.contracts.tier_ops import (
    CPU_TO_DISK,
    DEVICE_TO_CPU,
    DEVICE_TO_DISK,
    TIER_CPU,
    TIER_DISK,
    LoadJob,
    LoadReport,
    TierOps,
)
from pagedllm.kv_cache.offload.cpu_tier import CpuTierIndex
from pagedllm.kv_cache.offload.disk_tier import DiskTier
from pagedllm.kv_cache.offload.tier_fs import OPS


@dataclass
class TierStats:
    """One tier's counters (blocks, bytes, seconds), cumulative."""

    hits: int = 0  # blocks found here and loaded intact
    misses: int = 0  # blocks looked up here and not found (once per admitted request) or found corrupt
    stored_blocks: int = 0
    bytes_stored: int = 0
    bytes_loaded: int = 0
    loads: int = 0  # requests that loaded blocks from this tier
    load_seconds: float = 0.0
    errors: Counter[str] = field(default_factory=Counter)  # op -> failed filesystem calls the ranks reported
    disabled: int = 0  # 1 once the tier was turned off for failing

    def as_dict(self) -> dict[str, float]:
        return {k: v for k, v in vars(self).items() if k != "errors"}


class OffloadManager:
    """The CPU tier's index and the disk tier's presence checks for one engine (every rank).

    ``disk_tiers`` holds one :class:`DiskTier` per tensor-parallel rank (each with its rank's
    fingerprint): a block counts as on disk only when every rank's file is there.
    """

    def __init__(self, num_cpu_slots: int, disk_tiers: list[DiskTier], block_bytes: int):
        self.cpu = CpuTierIndex(num_cpu_slots)
        self.disk_tiers = disk_tiers
        self.block_bytes = block_bytes
        self.stats = {TIER_CPU: TierStats(), TIER_DISK: TierStats()}
        self._ops = TierOps()
        self._jobs: dict[str, LoadJob] = {}
        self._in_flight: set[bytes] = set()  # hashes some request is loading this step
        # hashes this engine queued for disk or found there: spares the filesystem checks on every
        # rank per evicted block and per lookup; a file deleted since (budget, another engine) is
        # a load miss, which drops its hash
        self._disk_known: set[bytes] = set()
        # hashes with a disk write in the ops not yet taken: a block written through and evicted
        # from the CPU tier in the same run of evictions needs no second (CPU -> disk) write
        self._disk_queued: set[bytes] = set()
        self.disk_disabled_reason: str | None = None

    @property
    def has_disk(self) -> bool:
        """A disk tier is configured and still on (see :meth:`disable_disk`)."""
        if not self.disk_tiers or self.disk_disabled_reason is not None:
            return False
        failed = next((t for t in self.disk_tiers if t.disabled), None)
        if failed is not None:  # this side's presence checks kept failing
            self.disable_disk(failed.health.disabled_reason)
            return False
        return True

    def disable_disk(self, reason: str) -> None:
        """Turns the disk tier off for this engine: lookups miss it and no block goes there any more
        (loads already asked for fail on the ranks and count as misses)."""
        if self.disk_disabled_reason is None and self.disk_tiers:
            self.disk_disabled_reason = reason
            self.stats[TIER_DISK].disabled = 1
            self._disk_known.clear()
            self._disk_queued.clear()

    # ------------------------------------------------------------------ eviction
    def on_evict(self, block_id: int, block_hash: bytes) -> None:
        """The pool is handing out ``block_id``: keep its K/V (named by ``block_hash``) in a tier."""
        if self.cpu.get(block_hash) is not None:
            self.cpu.touch(block_hash)
            return
        if self.cpu.num_slots:
            self._store_cpu(block_id, block_hash)
        if self.has_disk and block_hash not in self._disk_known:  # write-through: what the CPU
            self._store_disk(DEVICE_TO_DISK, block_id, block_hash)  # tier holds at shutdown survives too

    def _store_cpu(self, block_id: int, block_hash: bytes) -> None:
        placed = self.cpu.insert(block_hash)
        if placed is None:  # every slot is being loaded from: only the disk tier (if any) keeps it
            return
        slot, evicted = placed
        if evicted is not None and self._needs_spill(evicted[0]):
            self._store_disk(CPU_TO_DISK, evicted[1], evicted[0])  # its write-through did not land
        self._ops.moves.append((DEVICE_TO_CPU, block_id, slot))
        self._count_store(TIER_CPU)

    def _needs_spill(self, block_hash: bytes) -> bool:
        """A block leaving the CPU tier goes to disk unless its write is queued this step or landed."""
        return self.has_disk and block_hash not in self._disk_queued and not self._on_disk_now(block_hash)

    def _store_disk(self, kind: str, source: int, block_hash: bytes) -> None:
        self._ops.moves.append((kind, source, block_hash))
        self._disk_known.add(block_hash)
        self._disk_queued.add(block_hash)
        self._count_store(TIER_DISK)

    def _count_store(self, tier: str) -> None:
        s = self.stats[tier]
        s.stored_blocks += 1
        s.bytes_stored += self.block_bytes

    # ------------------------------------------------------------------ lookup and loads
    def on_disk(self, block_hash: bytes) -> bool:
        """Queued for disk by this engine, or (checked once, then remembered) on every rank's disk."""
        if not self.has_disk:
            return False
        if block_hash in self._disk_known:
            return True
        if self._on_disk_now(block_hash):
            self._disk_known.add(block_hash)
            return True
        return False

    def _on_disk_now(self, block_hash: bytes) -> bool:
        """Every rank's file is there now (a filesystem check per rank; a failed check is a miss)."""
        return self.has_disk and all(t.contains(block_hash) for t in self.disk_tiers)

    def lookup(self, block_hash: bytes, misses: dict[str, int]) -> tuple[str, int] | None:
        """``(tier, CPU slot or -1)`` holding the block, or None; adds the tiers it missed in to
        ``misses`` (counted by :meth:`count_misses` once the request is admitted: a request
        waiting at the head of the queue looks its prefix up again every step)."""
        slot = self.cpu.get(block_hash)
        if slot is not None:
            return TIER_CPU, slot
        if self.cpu.num_slots:
            misses[TIER_CPU] = misses.get(TIER_CPU, 0) + 1
        if self.on_disk(block_hash):
            return TIER_DISK, -1
        if self.has_disk:
            misses[TIER_DISK] = misses.get(TIER_DISK, 0) + 1
        return None

    def count_misses(self, misses: dict[str, int]) -> None:
        """Counts the tier misses of an admitted request's prefix walk (see :meth:`lookup`)."""
        for tier, n in misses.items():
            self.stats[tier].misses += n

    def pin(self, slot: int) -> None:
        """Keeps a CPU slot a load will read from (call before allocating the load's blocks)."""
        self.cpu.pin(slot)

    def is_loading(self, block_hash: bytes) -> bool:
        """Another request is loading this block this step (a second load would duplicate it)."""
        return block_hash in self._in_flight

    def add_load(self, job: LoadJob) -> None:
        self._jobs[job.request_id] = job
        self._in_flight.update(item.block_hash for item in job.items)
        self._ops.loads.append(job)

    def take_ops(self) -> TierOps:
        """The moves and loads accumulated since the last call."""
        ops, self._ops = self._ops, TierOps()
        self._disk_queued.clear()
        return ops

    def finish_load(self, request_id: str, num_ok: int) -> LoadJob:
        """Settles a load: unpins its CPU slots, counts hits (the first ``num_ok`` items) and the
        first failed item as a miss of its tier; returns the job."""
        job = self._jobs.pop(request_id)
        self._in_flight.difference_update(item.block_hash for item in job.items)
        for item in job.items:
            if item.tier == TIER_CPU:
                self.cpu.unpin(item.cpu_slot)
        for tier in {item.tier for item in job.items}:
            self.stats[tier].loads += 1
        for item in job.items[:num_ok]:
            self.stats[item.tier].hits += 1
            self.stats[item.tier].bytes_loaded += self.block_bytes
        if num_ok < len(job.items):
            failed = job.items[num_ok]
            self.stats[failed.tier].misses += 1
            if failed.tier == TIER_DISK:
                self._disk_known.discard(failed.block_hash)  # deleted or damaged since
        return job

    def note_report(self, report: LoadReport) -> None:
        """The ranks' load times, failed filesystem calls and disabled tiers of one step (the
        loads themselves are settled by :meth:`finish_load`)."""
        for tier, s in report.seconds.items():
            self.stats[tier].load_seconds += s
        for tier, ops in report.errors.items():
            self.stats[tier].errors.update(ops)
        if TIER_DISK in report.disabled:
            self.disable_disk(report.disabled[TIER_DISK])

    @property
    def num_loads_in_flight(self) -> int:
        return len(self._jobs)

    def persist_ops(self, device_blocks: list[tuple[int, bytes]]) -> TierOps:
        """At shutdown: disk writes for the given cached device blocks ``(block id, hash)`` and the
        CPU tier's entries that are not on disk yet, so a restart finds every prefix it can."""
        ops = TierOps()
        if self.has_disk:
            ops.moves += [(DEVICE_TO_DISK, b, h) for b, h in device_blocks if not self._on_disk_now(h)]
            ops.moves += [(CPU_TO_DISK, s, h) for h, s in self.cpu.entries.items() if not self._on_disk_now(h)]
        return ops

    # ------------------------------------------------------------------ reset and stats
    def reset(self) -> None:
        """Forgets the CPU tier (only with no load in flight); the disk tier is cleared by the ranks."""
        self.cpu.clear()
        self._disk_known.clear()  # the ranks may clear the disk tier; lookups re-seed it

    def snapshot(self) -> dict[str, dict]:
        """Per tier, its counters (:class:`TierStats`) and ``errors``, ``{op: failed calls}`` (the
        ranks' and this side's)."""
        out = {tier: s.as_dict() for tier, s in self.stats.items()}
        out[TIER_CPU].update(num_blocks=self.cpu.num_slots, num_used_blocks=len(self.cpu))
        disk_errors = Counter(dict.fromkeys(OPS, 0) if self.disk_tiers else {})  # every op's series from 0
        disk_errors.update(self.stats[TIER_DISK].errors)
        for t in self.disk_tiers:
            disk_errors.update(t.health.errors)
        out[TIER_CPU]["errors"] = dict(self.stats[TIER_CPU].errors)
        out[TIER_DISK]["errors"] = dict(disk_errors)
        return out

    def check_integrity(self) -> None:
        """Between steps: every CPU slot free or holding one hash, and no load left unsettled."""
        self.cpu.check_integrity()
        if self._jobs or self._in_flight:
            raise AssertionError(f"loads never settled: {sorted(self._jobs)}")

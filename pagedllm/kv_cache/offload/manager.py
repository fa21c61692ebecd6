"""Scheduler-side tier manager: where each evicted prefix block went, and the moves to ask for.

The block pool calls :meth:`OffloadManager.on_evict` when it hands out a block whose hash it
forgets; the block goes to the CPU tier and, with a disk tier, is also queued for disk
(write-through): the CPU tier's entries are the most recently evicted, i.e. the heads of the
prefixes (the pool evicts a request's tail first), and a prefix walk stops at its first miss,
so without them on disk a restart would lose every prefix whole. A CPU-tier entry that leaves
it goes to disk only if its write did not land (e.g. the budget was full then); at shutdown,
:meth:`persist_ops` writes what the device pool and the CPU tier still hold.

With a remote tier (a Redis server shared by replicas), every evicted block is also written
there, and so is every cached block whose last request lets it go (:meth:`on_release`): the
other replicas find a prefix as soon as one replica has computed it.

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
    BELOW_CPU,
    DEVICE_TO_CPU,
    TIER_CPU,
    TIER_DISK,
    TIER_REMOTE,
    TO_TIER,
    LoadJob,
    LoadReport,
    TierOps,
)
from pagedllm.kv_cache.offload.cpu_tier import CpuTierIndex
from pagedllm.kv_cache.offload.disk_tier import DiskTier
from pagedllm.kv_cache.offload.kv_transfer import publishes_sync, writes_remote
from pagedllm.kv_cache.offload.remote_tier import REMOTE_OPS, ROUND_TRIP_BUCKETS, RemoteTier
from pagedllm.kv_cache.offload.tier_fs import OPS
from pagedllm.metrics.stats import Histogram


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
    unreachable: int = 0  # remote: calls that failed for want of the server (refused, lost, timed out)
    round_trips: dict[str, Histogram] = field(default_factory=dict)  # remote: op -> seconds per call

    def as_dict(self) -> dict[str, float]:
        return {k: v for k, v in vars(self).items() if k not in ("errors", "round_trips")}

    def record_calls(self, round_trips: list[tuple[str, float]], unreachable: int) -> None:
        for op, seconds in round_trips:
            self.round_trips.setdefault(op, Histogram(ROUND_TRIP_BUCKETS)).observe(seconds)
        self.unreachable += unreachable


class OffloadManager:
    """The CPU tier's index and the disk and remote tiers' presence checks for one engine (every rank).

    ``disk_tiers`` holds one :class:`DiskTier` per tensor-parallel rank (each with its rank's
    fingerprint), ``remote_tiers`` one :class:`RemoteTier` per rank: a block counts as in such a
    tier only when every rank's entry is there. ``kv_role`` (``kv_transfer.py``): a consumer never
    writes to the remote tier; a producer publishes a finished request's blocks (:meth:`publish`).
    """

    def __init__(self, num_cpu_slots: int, disk_tiers: list[DiskTier], block_bytes: int,
                 remote_tiers: list[RemoteTier] | None = None, kv_role: str | None = None):
        self.cpu = CpuTierIndex(num_cpu_slots)
        self.disk_tiers = disk_tiers
        self.remote_tiers = remote_tiers or []
        self.block_bytes = block_bytes
        self.kv_role = kv_role
        self.stats = {TIER_CPU: TierStats(), TIER_DISK: TierStats(), TIER_REMOTE: TierStats()}
        self._ops = TierOps()
        self._jobs: dict[str, LoadJob] = {}
        self._in_flight: set[bytes] = set()  # hashes some request is loading this step
        self._stores = {TIER_DISK: self.disk_tiers, TIER_REMOTE: self.remote_tiers}
        # per tier below the CPU: hashes this engine queued for it or found there: spares the
        # checks on every rank per evicted block and per lookup; an entry deleted since (budget,
        # another engine, Redis' eviction) is a load miss, which drops its hash
        self._known: dict[str, set[bytes]] = {t: set() for t in BELOW_CPU}
        # hashes with a write in the ops not yet taken: a block written through and evicted
        # from the CPU tier in the same run of evictions needs no second (CPU -> tier) write
        self._queued: dict[str, set[bytes]] = {t: set() for t in BELOW_CPU}
        self.disabled_reason: dict[str, str] = {}

    @property
    def has_disk(self) -> bool:
        """A disk tier is configured and still on (see :meth:`disable`)."""
        return self.has(TIER_DISK)

    @property
    def disk_disabled_reason(self) -> str | None:
        return self.disabled_reason.get(TIER_DISK)

    def has(self, tier: str) -> bool:
        """Tier ``tier`` (disk or remote) is configured and still on."""
        stores = self._stores[tier]
        if not stores or tier in self.disabled_reason:
            return False
        failed = next((t for t in stores if t.disabled), None)
        if failed is not None:  # this side's presence checks kept failing
            self.disable(tier, failed.health.disabled_reason)
            return False
        return True

    def disable(self, tier: str, reason: str) -> None:
        """Turns tier ``tier`` (disk or remote) off for this engine: lookups miss it and no block
        goes there any more (loads already asked for fail on the ranks and count as misses)."""
        if tier not in self.disabled_reason and self._stores[tier]:
            self.disabled_reason[tier] = reason
            self.stats[tier].disabled = 1
            self._known[tier].clear()
            self._queued[tier].clear()

    def writes(self, tier: str) -> bool:
        """Blocks go to ``tier`` (configured, on, and for the remote tier, not a consumer's)."""
        return self.has(tier) and (tier != TIER_REMOTE or writes_remote(self.kv_role))

    @property
    def publishes_sync(self) -> bool:
        """A producer: a finished request's blocks are written to the remote tier (and awaited) at once."""
        return publishes_sync(self.kv_role) and self.has(TIER_REMOTE)

    def disable_disk(self, reason: str) -> None:
        self.disable(TIER_DISK, reason)

    # ------------------------------------------------------------------ eviction
    def on_evict(self, block_id: int, block_hash: bytes) -> None:
        """The pool is handing out ``block_id``: keep its K/V (named by ``block_hash``) in a tier."""
        if self.cpu.get(block_hash) is not None:
            self.cpu.touch(block_hash)
            return
        if self.cpu.num_slots:
            self._store_cpu(block_id, block_hash)
        for tier in BELOW_CPU:  # write-through: what the CPU tier holds at shutdown survives too,
            if self.writes(tier) and block_hash not in self._known[tier]:  # and other engines see it now
                self._store(tier, TO_TIER[tier][0], block_id, block_hash)

    def on_release(self, block_id: int, block_hash: bytes) -> None:
        """The last request holding cached ``block_id`` let it go (its K/V computed): publish it to
        the remote tier now, for the other replicas (the block stays cached here; the move is
        applied before any later write into it)."""
        if self.writes(TIER_REMOTE) and block_hash not in self._known[TIER_REMOTE]:
            self._store(TIER_REMOTE, TO_TIER[TIER_REMOTE][0], block_id, block_hash)

    def publish(self, blocks: list[tuple[int, bytes]]) -> None:
        """A producer's request is done with its computed blocks ``(block id, hash)``: each goes to the
        remote tier now, also while other requests still hold it (the engine then awaits the writes
        before the request's last output: the consumer replica finds them as soon as it is asked)."""
        for block_id, block_hash in blocks:
            self.on_release(block_id, block_hash)

    def _store_cpu(self, block_id: int, block_hash: bytes) -> None:
        placed = self.cpu.insert(block_hash)
        if placed is None:  # every slot is being loaded from: only the tiers below (if any) keep it
            return
        slot, evicted = placed
        if evicted is not None:
            for tier in BELOW_CPU:
                if self._needs_spill(tier, evicted[0]):
                    self._store(tier, TO_TIER[tier][1], evicted[1], evicted[0])  # its write-through did not land
        self._ops.moves.append((DEVICE_TO_CPU, block_id, slot))
        self._count_store(TIER_CPU)

    def _needs_spill(self, tier: str, block_hash: bytes) -> bool:
        """A block leaving the CPU tier goes to ``tier`` unless its write is queued this step or landed."""
        return self.writes(tier) and block_hash not in self._queued[tier] and not self._in_tier_now(tier, block_hash)

    def _store(self, tier: str, kind: str, source: int, block_hash: bytes) -> None:
        self._ops.moves.append((kind, source, block_hash))
        self._known[tier].add(block_hash)
        self._queued[tier].add(block_hash)
        self._count_store(tier)

    def _count_store(self, tier: str) -> None:
        s = self.stats[tier]
        s.stored_blocks += 1
        s.bytes_stored += self.block_bytes

    # ------------------------------------------------------------------ lookup and loads
    def in_tier(self, tier: str, block_hash: bytes) -> bool:
        """Queued for ``tier`` by this engine, or (checked once, then remembered) there on every rank."""
        if not self.has(tier):
            return False
        if block_hash in self._known[tier]:
            return True
        if self._in_tier_now(tier, block_hash):
            self._known[tier].add(block_hash)
            return True
        return False

    def check_remote(self, hashes: list[bytes]) -> None:
        """Looks up, in one round trip per rank, which of a prefix's ``hashes`` the remote tier holds
        that this engine does not know of yet (remembered for :meth:`lookup`): a walk would
        otherwise check them one block, one round trip, at a time."""
        if not self.has(TIER_REMOTE):
            return
        unknown = [h for h in hashes if h not in self._known[TIER_REMOTE]]
        if len(unknown) < 2:  # the walk's own check costs the same
            return
        present = [all(found) for found in zip(*(t.contains_many(unknown) for t in self.remote_tiers))]
        self._known[TIER_REMOTE].update(h for h, ok in zip(unknown, present) if ok)

    def on_disk(self, block_hash: bytes) -> bool:
        return self.in_tier(TIER_DISK, block_hash)

    def _in_tier_now(self, tier: str, block_hash: bytes) -> bool:
        """Every rank's entry is there now (a check per rank; a failed check is a miss)."""
        return self.has(tier) and all(t.contains(block_hash) for t in self._stores[tier])

    def lookup(self, block_hash: bytes, misses: dict[str, int]) -> tuple[str, int] | None:
        """``(tier, CPU slot or -1)`` holding the block, or None; adds the tiers it missed in to
        ``misses`` (counted by :meth:`count_misses` once the request is admitted: a request
        waiting at the head of the queue looks its prefix up again every step)."""
        slot = self.cpu.get(block_hash)
        if slot is not None:
            return TIER_CPU, slot
        if self.cpu.num_slots:
            misses[TIER_CPU] = misses.get(TIER_CPU, 0) + 1
        for tier in BELOW_CPU:
            if self.in_tier(tier, block_hash):
                return tier, -1
            if self.has(tier):
                misses[tier] = misses.get(tier, 0) + 1
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
        for queued in self._queued.values():
            queued.clear()
        return ops

    def take_moves(self) -> TierOps:
        """The moves accumulated since the last call, the loads left for the next step (to flush
        the tiers between steps)."""
        moves, self._ops.moves = self._ops.moves, []
        for queued in self._queued.values():
            queued.clear()
        return TierOps(moves=moves)

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
            if failed.tier in BELOW_CPU:
                self._known[failed.tier].discard(failed.block_hash)  # deleted, evicted or damaged since
        return job

    def note_report(self, report: LoadReport) -> None:
        """The ranks' load times, failed filesystem calls and disabled tiers of one step (the
        loads themselves are settled by :meth:`finish_load`)."""
        for tier, s in report.seconds.items():
            self.stats[tier].load_seconds += s
        for tier, ops in report.errors.items():
            self.stats[tier].errors.update(ops)
        for tier, reason in report.disabled.items():
            if tier in BELOW_CPU:
                self.disable(tier, reason)
        for tier in report.round_trips.keys() | report.unreachable.keys():
            self.stats[tier].record_calls(report.round_trips.get(tier, []), report.unreachable.get(tier, 0))

    @property
    def num_loads_in_flight(self) -> int:
        return len(self._jobs)

    def persist_ops(self, device_blocks: list[tuple[int, bytes]]) -> TierOps:
        """At shutdown: disk (and remote) writes for the given cached device blocks ``(block id, hash)``
        and the CPU tier's entries that are not there yet, so a restart finds every prefix it can."""
        ops = TierOps()
        for tier in BELOW_CPU:
            if self.writes(tier):
                from_device, from_cpu = TO_TIER[tier]
                ops.moves += [(from_device, b, h) for b, h in device_blocks if not self._in_tier_now(tier, h)]
                ops.moves += [(from_cpu, s, h) for h, s in self.cpu.entries.items() if not self._in_tier_now(tier, h)]
        return ops

    # ------------------------------------------------------------------ reset and stats
    def reset(self) -> None:
        """Forgets the CPU tier (only with no load in flight); the disk tier is cleared by the ranks."""
        self.cpu.clear()
        for known in self._known.values():
            known.clear()  # the ranks may clear the disk tier; lookups re-seed it

    def snapshot(self) -> dict[str, dict]:
        """Per tier, its counters (:class:`TierStats`) and ``errors``, ``{op: failed calls}`` (the
        ranks' and this side's); the remote tier's also ``round_trips``, ``{op: (cumulative buckets,
        sum of seconds)}`` (rank 0's calls as reported so far, and this side's presence checks)."""
        for t in self.remote_tiers:
            self.stats[TIER_REMOTE].record_calls(*t.calls.take())
        out = {tier: s.as_dict() for tier, s in self.stats.items() if tier == TIER_CPU or self._stores[tier]}
        out[TIER_CPU].update(num_blocks=self.cpu.num_slots, num_used_blocks=len(self.cpu))
        out[TIER_CPU]["errors"] = dict(self.stats[TIER_CPU].errors)
        out[TIER_DISK] = out.get(TIER_DISK, self.stats[TIER_DISK].as_dict())  # always reported, as before
        for tier, ops in ((TIER_DISK, OPS), (TIER_REMOTE, REMOTE_OPS)):
            if tier not in out:
                continue
            errors = Counter(dict.fromkeys(ops, 0) if self._stores[tier] else {})  # every op's series from 0
            errors.update(self.stats[tier].errors)
            for t in self._stores[tier]:
                errors.update(t.health.errors)
            out[tier]["errors"] = dict(errors)
        if TIER_REMOTE in out:
            out[TIER_REMOTE]["round_trips"] = {op: (h.cumulative(), h.total)
                                               for op, h in sorted(self.stats[TIER_REMOTE].round_trips.items())}
        return out

    def check_integrity(self) -> None:
        """Between steps: every CPU slot free or holding one hash, and no load left unsettled."""
        self.cpu.check_integrity()
        if self._jobs or self._in_flight:
            raise AssertionError(f"loads never settled: {sorted(self._jobs)}")

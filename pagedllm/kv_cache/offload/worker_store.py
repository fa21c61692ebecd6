"""One rank's tiers (worker side): the CPU tier tensor, the disk tier, and the I/O thread.

``apply(ops)`` runs before the step's forward: the moves in order (device -> CPU copies,
captures of blocks bound for disk), the CPU-tier loads (a copy), and it queues each request's
disk reads as one job on the I/O thread. ``collect()`` runs after the forward: it waits for
those reads (which overlapped the forward), copies the intact blocks into their device blocks
and reports, per request, how many leading blocks arrived (the minimum over the ranks).

Two I/O threads: one writes (evicted blocks, in order), one reads, so a request's load never
waits behind the writes its own allocation queued. A read only looks for files the scheduler
saw on disk; one deleted in between (the budget, another engine) is a miss. Neither thread
touches the device pool; only the engine thread copies into it. A failed disk call is a miss too
(``DiskTier`` never raises ``OSError``); ``collect()`` reports the failures and, once the disk tier
has disabled itself, that it did, so the scheduler stops asking for it.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from pagedllm.config import EngineConfig
from pagedllm.contracts.tier_ops import (
    BELOW_CPU,
    CPU_TO_DISK,
    CPU_TO_REMOTE,
    DEVICE_TO_CPU,
    TIER_CPU,
    TIER_DISK,
    TIER_REMOTE,
    WRITE_TARGET,
    LoadJob,
    LoadReport,
    TierOps,
)
from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.kv_cache.offload.disk_tier import DiskTier
from pagedllm.kv_cache.offload.fingerprint import kv_fingerprint
from pagedllm.kv_cache.offload.remote_tier import RemoteTier
from pagedllm.kv_cache.offload.setup import num_cpu_tier_blocks, tiers_enabled


class TierStore:
    """Holds this rank's evicted blocks: ``num_slots`` in CPU memory (pinned on CUDA), a disk tier
    and a remote tier (each optional).

    ``kv`` is the device pool ``[num_layers, num_tensors, num_blocks, num_kv_heads, block_size, head_size]``
    (kv_cache/spec.py; ``num_tensors`` is 2 for K/V per head, 1 for an MLA latent); a block is
    ``kv[:, :, b]``, ``[num_layers, num_tensors, num_kv_heads, block_size, head_size]``. The CPU
    tier is slot-major, ``[num_slots, num_layers, num_tensors, num_kv_heads, block_size, head_size]``, so a
    slot (and a run of consecutive slots) is one contiguous range: a device -> host copy lands
    in it directly, with no host temporary (a copy into a strided host view goes through one).
    """

    def __init__(self, kv: torch.Tensor, num_slots: int, disk: DiskTier | None, tp: TensorParallelGroup,
                 remote: RemoteTier | None = None):
        self.kv = kv
        self.block_shape = tuple(kv.shape[:2]) + tuple(kv.shape[3:])
        pin = kv.device.type == "cuda"
        self.cpu = torch.empty((num_slots, *self.block_shape), dtype=kv.dtype, pin_memory=pin) if num_slots else None
        self.disk = disk
        self.remote = remote
        self.tp = tp
        # per tier below the CPU, its own writer and reader: a slow network never holds up the disk
        self.stores = {t: s for t, s in ((TIER_DISK, disk), (TIER_REMOTE, remote)) if s is not None}
        self._writers = {t: ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"kv-{t}-write") for t in self.stores}
        self._readers = {t: ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"kv-{t}-read") for t in self.stores}
        self._pending: list[tuple[LoadJob, dict[str, Future]]] = []
        self._seconds = {TIER_CPU: 0.0, **dict.fromkeys(BELOW_CPU, 0.0)}

    # ------------------------------------------------------------------ before the forward
    def apply(self, ops: TierOps) -> None:
        self._apply_moves(ops.moves)
        for job in ops.loads:
            self._start_load(job)

    def _apply_moves(self, moves: list[tuple[str, int, object]]) -> None:
        """In order, batching runs of device -> CPU copies into one gather each.

        A block bound for disk that also went to the CPU tier in the current run is written from
        its CPU copy (one device -> host copy per block); the other device -> disk blocks are
        gathered in one copy after the loop (moves only read device blocks, and the loads that
        write them run after every move). A CPU -> disk move ends the run: it reads a CPU slot,
        which a later device -> CPU copy may reuse.
        """
        run: dict[int, int] = {}  # device block -> CPU slot, the current run of device -> CPU copies
        run_slots: set[int] = set()  # run's CPU slots, for an O(1) reuse check
        from_cpu: list[tuple[int, int]] = []  # (write index, CPU slot) filled when the run lands
        from_device: list[tuple[int, int]] = []  # (write index, device block) filled after the loop
        writes: list[list] = []  # [tier, hash, block [num_layers, 2, heads, block_size, head_dim]]

        def flush() -> None:
            self._to_cpu(list(run.items()))
            run.clear()
            run_slots.clear()
            if from_cpu:
                blocks = self.cpu[[slot for _, slot in from_cpu]]  # indexing copies
                for k, (i, _) in enumerate(from_cpu):
                    writes[i][2] = blocks[k]
                from_cpu.clear()

        for kind, src, dst in moves:
            if kind == DEVICE_TO_CPU:
                if dst in run_slots:  # a slot written twice in one gather: land the first
                    flush()
                run[src] = dst
                run_slots.add(dst)
            elif kind in (CPU_TO_DISK, CPU_TO_REMOTE):
                flush()
                writes.append([WRITE_TARGET[kind], dst, self.cpu[src].clone()])
            else:  # DEVICE_TO_DISK, DEVICE_TO_REMOTE
                writes.append([WRITE_TARGET[kind], dst, None])
                if src in run:
                    from_cpu.append((len(writes) - 1, run[src]))
                else:
                    from_device.append((len(writes) - 1, src))
        flush()
        if from_device:
            index = torch.tensor([b for _, b in from_device], device=self.kv.device)
            blocks = self.kv[:, :, index].to("cpu")
            for k, (i, _) in enumerate(from_device):
                writes[i][2] = blocks[:, :, k]
        for tier, store in self.stores.items():
            items = [(h, b) for t, h, b in writes if t == tier]
            if items and not store.disabled:  # a full or vanished disk, an unreachable server: future
                self._writers[tier].submit(store.write_many, items)  # hits lost (counted), never the engine

    def _to_cpu(self, pairs: list[tuple[int, int]]) -> None:
        """(device block, CPU slot) pairs: each block lands in its slot with no host temporary."""
        if not pairs:
            return
        if self.kv.device.type == "cpu":  # straight from the pool into the slot: no gather either
            for block, slot in pairs:
                self.cpu[slot].copy_(self.kv[:, :, block])
            return
        src = torch.tensor([b for b, _ in pairs], device=self.kv.device)
        blocks = self.kv[:, :, src].movedim(2, 0).contiguous()  # [n, num_layers, 2, heads, block_size, head_dim]
        for at, slot, n in consecutive_runs([s for _, s in pairs]):
            self.cpu[slot:slot + n].copy_(blocks[at:at + n])  # device -> pinned slots, one DMA per run

    def _from_cpu(self, pairs: list[tuple[int, int]]) -> None:
        """(CPU slot, device block) pairs: the reverse of ``_to_cpu``, read from the slots in place."""
        if self.kv.device.type == "cpu":
            for slot, block in pairs:
                self.kv[:, :, block].copy_(self.cpu[slot])
            return
        blocks = torch.empty((len(pairs), *self.block_shape), dtype=self.kv.dtype, device=self.kv.device)
        for at, slot, n in consecutive_runs([s for s, _ in pairs]):
            blocks[at:at + n].copy_(self.cpu[slot:slot + n], non_blocking=True)  # pinned: stream-ordered
        dst = torch.tensor([b for _, b in pairs], device=self.kv.device)
        self.kv[:, :, dst] = blocks.movedim(0, 2)  # [num_layers, 2, n, heads, block_size, head_dim]

    def _start_load(self, job: LoadJob) -> None:
        t0 = time.perf_counter()
        cpu = [(i.cpu_slot, i.device_block) for i in job.items if i.tier == TIER_CPU]
        if cpu:
            self._from_cpu(cpu)
        self._seconds[TIER_CPU] += time.perf_counter() - t0
        futures = {}
        for tier in self.stores:
            hashes = [i.block_hash for i in job.items if i.tier == tier]
            if hashes:
                futures[tier] = self._readers[tier].submit(self._read, tier, hashes, time.perf_counter())
        self._pending.append((job, futures))

    def _read(self, tier: str, hashes: list[bytes], t0: float) -> tuple[list[torch.Tensor | None], float]:
        if tier == TIER_REMOTE:  # the whole job in one round trip
            blocks = self.remote.read_many(hashes, self.block_shape, self.kv.dtype)
        else:
            blocks = [self.disk.read(h, self.block_shape, self.kv.dtype) for h in hashes]
        return blocks, time.perf_counter() - t0

    # ------------------------------------------------------------------ after the forward
    def collect(self) -> LoadReport:
        """Waits for this step's disk and remote reads, fills the device blocks, reports per request
        (and the tiers' failed calls since the last report)."""
        counts = [self._finish(job, futures) for job, futures in self._pending]
        jobs = [job for job, _ in self._pending]
        self._pending = []
        disabled = {t: s.health.disabled_reason for t, s in self.stores.items() if s.disabled}
        counts, any_disabled = self._agree(counts, [t in disabled for t in BELOW_CPU])
        for tier, flag in zip(BELOW_CPU, any_disabled):
            if flag and tier not in disabled:
                disabled[tier] = "disabled on another tensor-parallel rank"
        errors = {t: e for t, s in self.stores.items() if (e := s.health.take_errors())}
        seconds, self._seconds = self._seconds, {TIER_CPU: 0.0, **dict.fromkeys(BELOW_CPU, 0.0)}
        round_trips, unreachable = self.remote.calls.take() if self.remote is not None else ([], 0)
        return LoadReport({job.request_id: n for job, n in zip(jobs, counts)}, seconds, errors, disabled,
                          {TIER_REMOTE: round_trips} if round_trips else {},
                          {TIER_REMOTE: unreachable} if unreachable else {})

    def _finish(self, job: LoadJob, futures: dict[str, Future]) -> int:
        """Leading items of ``job`` that are now in their device blocks."""
        blocks = {}
        for tier, future in futures.items():
            read, seconds = future.result()
            self._seconds[tier] += seconds
            blocks[tier] = iter(read)
        for n, item in enumerate(job.items):
            if item.tier in BELOW_CPU:
                block = next(blocks[item.tier])
                if block is None:
                    return n
                self.kv[:, :, item.device_block] = block.to(self.kv.device)
        return len(job.items)

    def _agree(self, counts: list[int], disabled: list[bool]) -> tuple[list[int], list[bool]]:
        """Every rank uses the smallest count any rank reached (an entry may be bad on one rank only),
        and learns, per tier below the CPU, whether any rank's is disabled (with loads only: no
        extra collective)."""
        if self.tp.size == 1 or not counts:
            return counts, disabled
        # the group only sums: rank r fills row r, the sum holds every rank's counts (and flags, last)
        k = len(disabled)
        rows = torch.zeros(self.tp.size, len(counts) + k, dtype=torch.int64, device=self.kv.device)  # [ranks, jobs+k]
        rows[self.tp.rank] = torch.tensor([*counts, *map(int, disabled)], dtype=torch.int64)
        self.tp.all_reduce(rows)
        return rows[:, :-k].min(dim=0).values.tolist(), [bool(f) for f in rows[:, -k:].any(dim=0).tolist()]

    # ------------------------------------------------------------------ maintenance
    def flush(self) -> None:
        """Waits for every queued disk and remote write."""
        for writer in self._writers.values():
            writer.submit(lambda: None).result()

    def clear_disk(self) -> None:
        """Deletes this rank's disk and remote entries (after the queued writes land)."""
        self.flush()
        for store in self.stores.values():
            store.clear()

    def close(self) -> None:
        """Stops the I/O threads after the queued writes (and closes the remote tier's connections)."""
        for pool in (*self._readers.values(), *self._writers.values()):
            pool.shutdown(wait=True)
        self._readers, self._writers = {}, {}
        if self.remote is not None:
            self.remote.close()


def consecutive_runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """``(index into slots, first slot, length)`` of each run of consecutive slots, in order."""
    runs: list[tuple[int, int, int]] = []
    for i, slot in enumerate(slots):
        if runs and runs[-1][1] + runs[-1][2] == slot:
            at, first, n = runs[-1]
            runs[-1] = (at, first, n + 1)
        else:
            runs.append((i, slot, 1))
    return runs


def build_tier_store(config: EngineConfig, kv: torch.Tensor, tp: TensorParallelGroup,
                     block_bytes: int, fingerprint: str | None = None) -> TierStore | None:
    """This rank's tiers as ``config.cache`` asks (None without any); ``fingerprint``: this
    rank's disk-tier fingerprint as the executor computed it (None: computed here)."""
    cache = config.cache
    if not tiers_enabled(cache):
        return None
    disk = remote = None
    if cache.kv_offload_dir or cache.kv_offload_remote:
        fingerprint = fingerprint or kv_fingerprint(config, tp.rank)
    if cache.kv_offload_dir:
        disk = DiskTier(cache.kv_offload_dir, fingerprint, cache.kv_offload_disk_bytes)
    if cache.kv_offload_remote:
        remote = RemoteTier(cache.kv_offload_remote, fingerprint, cache.kv_offload_remote_ttl_s)
    return TierStore(kv, num_cpu_tier_blocks(cache, block_bytes), disk, tp, remote)

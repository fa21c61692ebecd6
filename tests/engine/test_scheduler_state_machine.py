"""Hypothesis state machine over the scheduler: random add / step / abort sequences.

The model is replaced by random token draws, so every scheduling path (chunked prefill,
preemption, forks with copy-on-write, prefix hits, aborts) runs hundreds of times quickly;
``check_integrity()`` runs after every step and every block is free at the end. The
incremental block-table updates are applied to a runner-style persistent table, which must
equal the KV manager's table for every scheduled request, every step.

With KV tiers (``TieredSchedulerMachine``), a fake worker carries out the tier moves and loads
(the disk tier is a real one, in a temporary directory); every block's "contents" is the hash
of the tokens computed into it, checked whenever a chunk reads it, and every CPU-tier and disk
entry must hold the block its hash names after each step.
"""
from __future__ import annotations

import random
import shutil
import tempfile
from pathlib import Path

import hypothesis.strategies as st
import torch
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.contracts.sampled_tokens import SampledTokens
from pagedllm.contracts.tier_ops import CPU_TO_DISK, DEVICE_TO_CPU, TIER_CPU, TIER_DISK, LoadReport
from pagedllm.engine.request import Request
from pagedllm.engine.scheduler import Scheduler
from pagedllm.kv_cache.offload.disk_tier import DiskTier
from pagedllm.kv_cache.offload.manager import OffloadManager
from pagedllm.kv_cache.prefix_hash import extend_block_hashes
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.block_table import PersistentBlockTable

NUM_BLOCKS, BLOCK = 24, 8


def fake_step(sched: Scheduler, rng: random.Random, table: PersistentBlockTable, worker=None) -> None:
    out = sched.schedule()
    table.release(out.released_ids)
    if worker is not None:
        worker.execute(sched, out)
    for c in out.chunks:
        assert c.num_blocks * BLOCK >= c.seq_len  # every chunk fits the block table it was given
        row = table.apply(c)
        assert table.table[row, :c.num_blocks].tolist() == sched.kv.block_ids(c.request_id)
    sampled = [SampledTokens(c.request_id, [rng.randrange(3, 12) for _ in range(c.num_samples)],
                             [-1.0] * c.num_samples) for c in out.chunks if c.num_samples]
    sched.update(sampled)
    for pid in list(sched.sequences):
        if sched.is_done(pid):
            sched.release(pid)


class FakeTierWorker:
    """Carries out tier moves and loads on fake contents: a device block, CPU slot or swap slot
    holds the hash of the tokens whose K/V it has; disk entries are real files of that hash."""

    def __init__(self, disk: DiskTier | None):
        self.disk = disk
        self.dev: dict[int, bytes] = {}
        self.cpu: dict[int, bytes] = {}
        self.swap: dict[int, bytes] = {}
        self.damaged: set[str] = set()  # disk files a rule damaged: they read as misses

    def execute(self, sched: Scheduler, out) -> None:
        ops = out.tier_ops
        for kind, src, dst in ops.moves if ops else ():
            self._move(kind, src, dst)
        for d, c in out.blocks_to_swap_out:
            self.swap[c] = self.dev.get(d)
        for c, d in out.blocks_to_swap_in:
            self.dev[d] = self.swap.pop(c)
        for src, dst in out.blocks_to_copy:
            self.dev[dst] = self.dev.get(src)
        report = LoadReport({job.request_id: self._load(job) for job in ops.loads}, {}) if ops and ops.loads else None
        for c in out.chunks:
            self._forward(sched, c)
        sched.finish_loads(report)

    def _move(self, kind: str, src: int, dst) -> None:
        if kind == DEVICE_TO_CPU:
            self.cpu[dst] = self.dev[src]
            return
        content = self.cpu[src] if kind == CPU_TO_DISK else self.dev[src]
        assert content == dst, "a block went to disk under another block's hash"
        self.disk.write_many([(dst, torch.frombuffer(bytearray(content), dtype=torch.uint8))])

    def _load(self, job) -> int:
        for n, item in enumerate(job.items):
            if item.tier == TIER_CPU:
                self.dev[item.device_block] = self.cpu[item.cpu_slot]
                continue
            block = self.disk.read(item.block_hash, (32,), torch.uint8)
            if block is None:
                return n
            self.dev[item.device_block] = bytes(block.tolist())
        return len(job.items)

    def _forward(self, sched: Scheduler, chunk) -> None:
        """Reads every full block before the chunk (it must hold its hash), writes the ones it fills."""
        req = sched.requests[chunk.request_id]
        hashes: list[bytes] = []
        extend_block_hashes(hashes, req.all_token_ids, BLOCK)
        ids = sched.kv.block_ids(chunk.request_id)
        for i in range(chunk.start // BLOCK):
            assert self.dev.get(ids[i]) == hashes[i], f"block {i} of {req.request_id} holds other K/V"
        for i in range(chunk.start // BLOCK, chunk.seq_len // BLOCK):
            self.dev[ids[i]] = hashes[i]

    def check(self, offload: OffloadManager) -> None:
        """Every CPU-tier entry and every disk file holds the block its hash names."""
        for block_hash, slot in offload.cpu.entries.items():
            assert self.cpu[slot] == block_hash
        for path in sorted(self.disk.dir.iterdir()) if self.disk else ():
            assert path.suffix == ".kv", f"stray file in the disk tier: {path.name}"
            block = self.disk.read(bytes.fromhex(path.stem), (32,), torch.uint8)
            if block is None:  # only a damaged file is a miss (reading it deleted it)
                assert path.name in self.damaged, f"{path.name} does not read back"
            else:
                assert bytes(block.tolist()) == bytes.fromhex(path.stem)
            self.damaged.discard(path.name)


class SchedulerMachine(RuleBasedStateMachine):
    preemption_mode = "recompute"
    num_cpu_blocks = 0
    scheduling_policy = "fcfs"

    def __init__(self):
        super().__init__()
        self.worker: FakeTierWorker | None = None  # make_offload sets one with tiers
        self.sched = Scheduler(
            SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=24, max_model_len=96,
                            preemption_mode=self.preemption_mode, scheduling_policy=self.scheduling_policy),
            CacheConfig(block_size=BLOCK, watermark=0.05), NUM_BLOCKS, self.num_cpu_blocks, self.make_offload())
        self.rng = random.Random(0)
        self.next_id = 0
        self.table = PersistentBlockTable(max_blocks_per_seq=2, num_rows=2)  # small: exercises growth

    def make_offload(self) -> OffloadManager | None:
        return None

    @rule(prompt_len=st.integers(1, 60), max_tokens=st.integers(1, 30), n=st.integers(1, 3),
          shared_prefix=st.booleans(), priority=st.integers(-1, 2))
    def add(self, prompt_len, max_tokens, n, shared_prefix, priority):
        # a shared prefix makes prefix-cache hits likely
        prompt = [7] * prompt_len if shared_prefix else [self.rng.randrange(3, 12) for _ in range(prompt_len)]
        params = SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True, temperature=1.0)
        self.sched.check_fits(prompt_len, max_tokens, n)
        priority = priority if self.scheduling_policy == "priority" else 0
        self.sched.add_request(Request(str(self.next_id), prompt, params, frozenset(), priority=priority))
        self.next_id += 1

    @rule()
    def step(self):
        fake_step(self.sched, self.rng, self.table, self.worker)

    @precondition(lambda self: self.sched.sequences)
    @rule(data=st.data())
    def abort(self, data):
        pid = data.draw(st.sampled_from(sorted(self.sched.sequences)))
        self.sched.abort(pid)
        self.sched.release(pid)

    @rule()
    def evict_prefix_cache(self):
        assert self.sched.kv.reset_prefix_cache() == (self.sched.kv.num_free_blocks == NUM_BLOCKS)

    @invariant()
    def integrity(self):
        self.sched.kv.check_integrity()
        assert len(self.sched.running) <= 6

    @invariant()
    def queues_keep_their_order(self):
        """Priority: waiting and swapped requests stay in (priority, arrival) order."""
        if self.scheduling_policy == "priority":
            for queue in (self.sched.waiting, self.sched.swapped):
                keys = [(r.priority, r.arrival_time) for r in queue]
                assert keys == sorted(keys)

    @invariant()
    def stats_agree(self):
        """make_stats() / kv_cache_stats() report what the queues and the pools hold."""
        snap, kv = self.sched.make_stats(), self.sched.kv_cache_stats()
        assert (snap.num_running, snap.num_waiting, snap.num_swapped) == (
            len(self.sched.running), len(self.sched.waiting), len(self.sched.swapped))
        assert snap.num_used_blocks == kv.num_used_blocks == NUM_BLOCKS - kv.num_free_blocks
        assert kv.num_cpu_blocks == self.num_cpu_blocks and 0 <= kv.num_cpu_free_blocks <= self.num_cpu_blocks
        assert kv.num_cached_blocks <= kv.num_free_blocks

    def teardown(self):
        for _ in range(2000):
            if not self.sched.has_unfinished():
                break
            fake_step(self.sched, self.rng, self.table, self.worker)
            self.sched.kv.check_integrity()
        assert not self.sched.has_unfinished(), "requests left unfinished"
        assert self.sched.kv.num_free_blocks == NUM_BLOCKS
        assert self.sched.kv.num_cpu_free_blocks == self.num_cpu_blocks
        assert not self.sched.sequences
        self.table.release(self.sched.schedule().released_ids)
        assert not self.table.rows, "rows of finished requests were never released"


class SwapSchedulerMachine(SchedulerMachine):
    """Swap preemption with a CPU pool small enough that the recompute fallback also runs."""

    preemption_mode = "swap"
    num_cpu_blocks = 10


class PrioritySchedulerMachine(SwapSchedulerMachine):
    """scheduling_policy="priority" with random priorities, swap and recompute preemption."""

    scheduling_policy = "priority"


DOCS = [[random.Random(k).randrange(3, 12) for _ in range(44)] for k in range(2)]


class TieredSchedulerMachine(SwapSchedulerMachine):
    """Swap preemption plus KV tiers: a 4-slot CPU tier over a disk tier of about 30 blocks, whose
    files a rule damages now and then (a damaged entry must be a miss, never loaded)."""

    def make_offload(self) -> OffloadManager:
        self.tmp = tempfile.mkdtemp(prefix="pagedllm-tier-sm-")
        disk = DiskTier(self.tmp, "ab" * 32, 30 * 140)  # a file is 133 bytes here: ~30 blocks
        self.worker = FakeTierWorker(disk)
        return OffloadManager(4, [disk], block_bytes=1)

    @rule(doc=st.integers(0, len(DOCS) - 1), tail=st.integers(1, 20), max_tokens=st.integers(1, 10))
    def add_doc(self, doc, tail, max_tokens):
        """A request over one of a few long documents: they come back after being evicted."""
        prompt = DOCS[doc] + [self.rng.randrange(3, 12) for _ in range(tail)]
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=1.0)
        self.sched.add_request(Request(str(self.next_id), prompt, params, frozenset()))
        self.next_id += 1

    @rule()
    def drain(self):
        """Runs every request to the end: their blocks become cached, then evicted by later ones."""
        for _ in range(200):
            if not self.sched.has_unfinished():
                break
            fake_step(self.sched, self.rng, self.table, self.worker)

    @rule(data=st.data())
    def damage_disk_entry(self, data):
        files = sorted(Path(self.tmp).rglob("*.kv"))
        if files:
            path = data.draw(st.sampled_from(files))
            blob = bytearray(path.read_bytes())
            blob[data.draw(st.integers(0, len(blob) - 1))] ^= 0x40
            path.write_bytes(bytes(blob[:data.draw(st.integers(0, len(blob)))]))
            self.worker.damaged.add(path.name)

    @invariant()
    def tiers_hold_what_they_name(self):
        self.worker.check(self.sched.kv.offload)

    def teardown(self):
        try:
            super().teardown()
            stats = self.sched.kv_cache_stats().offload
            assert set(stats) == {TIER_CPU, TIER_DISK}
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)


SETTINGS = settings(max_examples=60, stateful_step_count=40, deadline=None)
SchedulerMachine.TestCase.settings = SETTINGS
SwapSchedulerMachine.TestCase.settings = SETTINGS
PrioritySchedulerMachine.TestCase.settings = SETTINGS
TieredSchedulerMachine.TestCase.settings = SETTINGS
TestSchedulerMachine = SchedulerMachine.TestCase
TestSwapSchedulerMachine = SwapSchedulerMachine.TestCase
TestPrioritySchedulerMachine = PrioritySchedulerMachine.TestCase
TestTieredSchedulerMachine = TieredSchedulerMachine.TestCase


def test_request_waiting_several_steps_counts_its_tier_miss_once(tmp_path):
    """A request that waits at the head of the queue walks its prefix every step; its CPU and
    disk misses count once, when it is admitted."""
    offload = OffloadManager(4, [DiskTier(tmp_path, "ab" * 16, 1 << 20)], block_bytes=1)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=96, max_model_len=96),
                      CacheConfig(block_size=BLOCK, watermark=0.0), 8, 0, offload)
    rng, table = random.Random(0), PersistentBlockTable(max_blocks_per_seq=8, num_rows=2)
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=1.0)
    sched.add_request(Request("a", [3] * 48, params, frozenset()))  # 6 of the 8 blocks, 7 once decoding
    sched.add_request(Request("b", [4] * 24, params, frozenset()))  # 3 blocks: waits for "a"
    waited = 0
    while "b" not in sched.kv.tables:
        fake_step(sched, rng, table)
        waited += "b" not in sched.kv.tables
    assert waited >= 3
    stats = offload.stats
    assert (stats[TIER_CPU].misses, stats[TIER_DISK].misses) == (2, 2)  # one walk each for "a" and "b"

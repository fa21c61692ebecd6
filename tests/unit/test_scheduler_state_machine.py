"""Hypothesis state machine over the scheduler: random add / step / abort sequences.

The model is replaced by random token draws, so every scheduling path (chunked prefill,
preemption, forks with copy-on-write, prefix hits, aborts) runs hundreds of times quickly;
``check_integrity()`` runs after every step and every block is free at the end. The
incremental block-table updates are applied to a runner-style persistent table, which must
equal the KV manager's table for every scheduled request, every step.
"""
from __future__ import annotations

import random

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.engine.request import Request
from pagedllm.engine.scheduler import SampledTokens, Scheduler
from pagedllm.sampling_params import SamplingParams
from pagedllm.worker.block_table import PersistentBlockTable

NUM_BLOCKS, BLOCK = 24, 8


def fake_step(sched: Scheduler, rng: random.Random, table: PersistentBlockTable) -> None:
    out = sched.schedule()
    table.release(out.released_ids)
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


class SchedulerMachine(RuleBasedStateMachine):
    preemption_mode = "recompute"
    num_cpu_blocks = 0

    def __init__(self):
        super().__init__()
        self.sched = Scheduler(
            SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=24, max_model_len=96,
                            preemption_mode=self.preemption_mode),
            CacheConfig(block_size=BLOCK, watermark=0.05), NUM_BLOCKS, self.num_cpu_blocks)
        self.rng = random.Random(0)
        self.next_id = 0
        self.table = PersistentBlockTable(max_blocks_per_seq=2, num_rows=2)  # small: exercises growth

    @rule(prompt_len=st.integers(1, 60), max_tokens=st.integers(1, 30), n=st.integers(1, 3),
          shared_prefix=st.booleans())
    def add(self, prompt_len, max_tokens, n, shared_prefix):
        # a shared prefix makes prefix-cache hits likely
        prompt = [7] * prompt_len if shared_prefix else [self.rng.randrange(3, 12) for _ in range(prompt_len)]
        params = SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True, temperature=1.0)
        self.sched.check_fits(prompt_len, max_tokens, n)
        self.sched.add_request(Request(str(self.next_id), prompt, params, frozenset()))
        self.next_id += 1

    @rule()
    def step(self):
        fake_step(self.sched, self.rng, self.table)

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
            fake_step(self.sched, self.rng, self.table)
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


SETTINGS = settings(max_examples=60, stateful_step_count=40, deadline=None)
SchedulerMachine.TestCase.settings = SETTINGS
SwapSchedulerMachine.TestCase.settings = SETTINGS
TestSchedulerMachine = SchedulerMachine.TestCase
TestSwapSchedulerMachine = SwapSchedulerMachine.TestCase

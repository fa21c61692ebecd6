"""The dashboard's KV event feed (engine/kv_events.py, kv_cache/events.py) on a real scheduler.

A hypothesis state machine adds requests (shared prefixes for prefix hits, n > 1 for forks and
copy-on-write), steps with random tokens (swap and recompute preemption), aborts and resets the
prefix cache. A viewer subscribes at the start; after every rule the events it received, replayed
onto its snapshot, must equal a fresh snapshot exactly (block ids, reference counts, hash
prefixes, tables), and the replayed reference counts must be what ``check_integrity`` checks:
the number of tables holding each block.
"""
from __future__ import annotations

import random
from collections import Counter

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.contracts.sampled_tokens import SampledTokens
from pagedllm.engine.kv_events import KVEventFeed
from pagedllm.engine.request import Request
from pagedllm.engine.scheduler import Scheduler
from pagedllm.kv_cache.events import KVEventRecorder, Subscription, apply_diff, block_state
from pagedllm.kv_cache.kv_cache_manager import KVCacheManager
from pagedllm.sampling_params import SamplingParams

NUM_BLOCKS, BLOCK = 24, 8
STATE_KEYS = ("ref_cnt", "hashes", "tables")


def _state(snapshot: dict) -> dict:
    return {k: snapshot[k] for k in STATE_KEYS}


class FeedMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.sched = Scheduler(
            SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=24, max_model_len=96, preemption_mode="swap"),
            CacheConfig(block_size=BLOCK, watermark=0.05), NUM_BLOCKS, 10)
        self.feed = KVEventFeed(self.sched)
        self.sub, snapshot = self.feed.subscribe(10_000, 0)
        self.model = _state(snapshot)
        self.rng = random.Random(0)
        self.next_id = 0
        self.steps = 0

    @rule(prompt_len=st.integers(1, 60), max_tokens=st.integers(1, 30), n=st.integers(1, 3),
          shared_prefix=st.booleans())
    def add(self, prompt_len, max_tokens, n, shared_prefix):
        prompt = [7] * prompt_len if shared_prefix else [self.rng.randrange(3, 12) for _ in range(prompt_len)]
        params = SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True, temperature=1.0)
        self.sched.add_request(Request(str(self.next_id), prompt, params, frozenset()))
        self.next_id += 1

    @rule()
    def step(self):
        out = self.sched.schedule()
        sampled = [SampledTokens(c.request_id, [self.rng.randrange(3, 12) for _ in range(c.num_samples)],
                                 [-1.0] * c.num_samples) for c in out.chunks if c.num_samples]
        self.sched.update(sampled)
        for pid in list(self.sched.sequences):
            if self.sched.is_done(pid):
                self.sched.release(pid)
        self.steps += 1
        self.feed.publish(self.steps, out)

    @precondition(lambda self: self.sched.sequences)
    @rule(data=st.data())
    def abort(self, data):
        pid = data.draw(st.sampled_from(sorted(self.sched.sequences)))
        self.sched.abort(pid)
        self.sched.release(pid)
        self.feed.publish(self.steps)

    @rule()
    def reset_prefix_cache(self):
        if self.sched.kv.reset_prefix_cache():
            self.feed.publish(self.steps)

    @invariant()
    def replayed_events_equal_a_fresh_snapshot(self):
        for event in self.sub.take():
            apply_diff(self.model, event)
        assert self.model == _state(self.feed.snapshot(self.steps))
        assert not self.sub.overflowed

    @invariant()
    def replayed_ref_counts_are_table_references(self):
        self.sched.kv.check_integrity()
        held = Counter(b for ids in self.model["tables"].values() for b in ids)
        assert self.model["ref_cnt"] == [held.get(i, 0) for i in range(NUM_BLOCKS)]


FeedMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)
TestFeedMachine = FeedMachine.TestCase


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8), frozenset())


def test_nothing_is_recorded_until_someone_listens():
    kv = KVCacheManager(8, 4)
    feed_kv = KVEventRecorder(kv)
    assert kv.pool.changed is None and kv.changed_tables is None and not feed_kv.enabled
    kv.allocate_slots(_req("a", list(range(6))), 6)
    assert kv.pool.changed is None  # no listener: the pool kept no record


def test_diff_names_exact_blocks_states_and_tables():
    kv = KVCacheManager(8, 4)
    rec = KVEventRecorder(kv)
    rec.enable()
    a = _req("a", list(range(9)))
    assert kv.allocate_slots(a, 9)
    a.num_computed_tokens = 9
    diff = rec.take_diff()
    assert [b[:2] for b in diff["blocks"]] == [[0, 1], [1, 1], [2, 1]]
    assert [b[2] is not None for b in diff["blocks"]] == [True, True, False]  # two full blocks hashed
    assert diff["tables"] == {"a": [0, 1, 2]}
    b = _req("b", list(range(8)) + [99])
    hits, _ = kv.get_computed_blocks(b)
    assert kv.allocate_slots(b, 1, hits)
    diff = rec.take_diff()
    assert [b[:2] for b in diff["blocks"]] == [[0, 2], [1, 2], [3, 1]]
    assert [block_state(r, h) for _, r, h in diff["blocks"]] == ["shared", "shared", "used"]
    kv.free(a)
    kv.free(b)
    diff = rec.take_diff()
    assert diff["tables"] == {"a": None, "b": None}
    assert {i: block_state(r, h) for i, r, h in diff["blocks"]} == {0: "cached", 1: "cached", 2: "free",
                                                                    3: "free"}
    assert rec.take_diff() == {"blocks": [], "tables": {}}


def test_a_slow_viewer_drops_to_a_fresh_snapshot_and_memory_stays_bounded():
    sub = Subscription(maxlen=3)
    for i in range(3):
        sub.push({"step": i})
    sub.push({"step": 3})
    assert sub.overflowed and sub.dropped == 4 and sub.take() == []
    sub.push({"step": 4})
    assert sub.dropped == 5 and sub.take() == []


def test_the_recorder_stops_when_the_last_viewer_leaves():
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64),
                      CacheConfig(block_size=BLOCK), NUM_BLOCKS)
    feed = KVEventFeed(sched)
    sub, snapshot = feed.subscribe(8, 0)
    assert feed.listening and sched.kv.pool.changed is not None
    assert snapshot["num_blocks"] == NUM_BLOCKS and snapshot["ref_cnt"] == [0] * NUM_BLOCKS
    sub.close()
    feed.publish(1)
    assert not feed.listening and sched.kv.pool.changed is None and sched.kv.changed_tables is None

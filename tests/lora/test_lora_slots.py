"""The adapter slot pool under the scheduler: a hypothesis state machine over random add (with
adapters) / step / abort / preemption sequences, with a fake worker that keeps which adapter each
slot holds. Every chunk must run on a slot holding its request's adapter, a referenced slot is
never reloaded, references equal the live sequences holding them, and every slot is free at the end."""
from __future__ import annotations

import sys
from pathlib import Path

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import invariant, rule

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))  # the plain scheduler machine's module
from test_scheduler_state_machine import BLOCK, NUM_BLOCKS, SchedulerMachine  # noqa: E402

from pagedllm.config import CacheConfig, LoRAConfig, SchedulerConfig
from pagedllm.engine.request import Request
from pagedllm.engine.scheduler import Scheduler
from pagedllm.lora.request import LoRARequest
from pagedllm.lora.slot_pool import LoRASlotPool
from pagedllm.sampling_params import SamplingParams

ADAPTERS = [LoRARequest(f"a{i}", i, f"/adapters/a{i}") for i in range(1, 5)]
MAX_LORAS = 2


class FakeLoRAWorker:
    """Applies the step's loads to its slots and checks every chunk runs with its request's adapter."""

    def __init__(self):
        self.slots: dict[int, int] = {}  # slot -> lora_int_id loaded there
        self.evictions_seen = 0

    def execute(self, sched: Scheduler, out) -> None:
        pool = sched.lora_slots
        for slot, lora in out.lora_loads:
            holders = [r for r in sched.requests.values() if r.lora_slot == slot and r.lora_request != lora]
            assert not holders, f"slot {slot} reloaded under running requests {holders}"
            self.evictions_seen += slot in self.slots
            self.slots[slot] = lora.lora_int_id
        for c in out.chunks:
            req = sched.requests[c.request_id]
            if req.lora_request is None:
                assert c.lora_slot == -1
            else:
                assert self.slots.get(c.lora_slot) == req.lora_request.lora_int_id
                assert pool.adapter[c.lora_slot] == req.lora_request


class LoRASchedulerMachine(SchedulerMachine):
    def __init__(self):
        super().__init__()
        self.sched = Scheduler(
            SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=24, max_model_len=96,
                            preemption_mode=self.preemption_mode),
            CacheConfig(block_size=BLOCK, watermark=0.05), NUM_BLOCKS, self.num_cpu_blocks,
            lora=LoRAConfig(max_loras=MAX_LORAS))
        self.worker = FakeLoRAWorker()

    @rule(prompt_len=st.integers(1, 40), max_tokens=st.integers(1, 20), n=st.integers(1, 2),
          adapter=st.sampled_from([None, *ADAPTERS]))
    def add_with_adapter(self, prompt_len, max_tokens, n, adapter):
        prompt = [7] * prompt_len  # one prompt for all: the prefix cache must still keep adapters apart
        params = SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True, temperature=1.0)
        self.sched.add_request(Request(str(self.next_id), prompt, params, frozenset(), lora_request=adapter))
        self.next_id += 1

    @invariant()
    def lora_integrity(self):
        pool = self.sched.lora_slots
        pool.check_invariants()
        held = [0] * MAX_LORAS
        for req in self.sched.requests.values():
            if req.lora_slot >= 0:
                assert not req.is_finished and req.status.name in ("RUNNING", "SWAPPED")
                assert pool.adapter[req.lora_slot] == req.lora_request
                held[req.lora_slot] += 1
        assert held == pool.refs

    def teardown(self):
        super().teardown()
        pool = self.sched.lora_slots
        assert pool.refs == [0] * MAX_LORAS and pool.num_free_slots == MAX_LORAS


class LoRASwapMachine(LoRASchedulerMachine):
    preemption_mode = "swap"
    num_cpu_blocks = 16


TestLoRAScheduler = LoRASchedulerMachine.TestCase
TestLoRAScheduler.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestLoRASwap = LoRASwapMachine.TestCase
TestLoRASwap.settings = settings(max_examples=30, stateful_step_count=40, deadline=None)


def test_pool_evicts_least_recently_used_unreferenced_adapter():
    pool = LoRASlotPool(2)
    a, b, c = ADAPTERS[:3]
    sa, sb = pool.acquire(a), pool.acquire(b)
    assert not pool.can_acquire(c)  # both referenced: c waits
    pool.release(sb)
    pool.release(sa)  # a is now the most recently used
    assert pool.can_acquire(c) and pool.acquire(c) == sb  # b (least recent) is evicted
    assert pool.stats.evictions == 1 and pool.acquire(a) == sa and pool.stats.hits == 1
    assert [(s, r.lora_name) for s, r in pool.take_loads()] == [(sa, "a1"), (sb, "a2"), (sb, "a3")]
    assert not pool.remove(a.lora_int_id)  # referenced: stays
    pool.check_invariants()

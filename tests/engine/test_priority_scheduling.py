"""scheduling_policy="priority" (vLLM's): admission, budget and preemption by (priority, arrival).

Exact orders on hand-built schedules: which request is admitted first, which one is preempted
when blocks run out, and where a preempted request goes back in the waiting queue. The FCFS
run of the same schedule is asserted next to each, so a test fails if the policy changes nothing.
"""
from __future__ import annotations

import pytest

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.contracts.sampled_tokens import SampledTokens
from pagedllm.engine.request import Request
from pagedllm.engine.scheduler import Scheduler
from pagedllm.sampling_params import SamplingParams


def scheduler(policy: str, num_blocks: int = 16, block_size: int = 8, max_num_seqs: int = 8) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64, max_model_len=64,
                             scheduling_policy=policy)
    return Scheduler(config, CacheConfig(block_size=block_size, watermark=0.0), num_blocks)


def add(sched: Scheduler, rid: str, priority: int, arrival: float, prompt_len: int = 8, max_tokens: int = 2) -> None:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    prompt = [5 + len(sched.requests)] * prompt_len  # no two alike: no prefix-cache sharing
    sched.add_request(Request(rid, prompt, params, frozenset(), arrival, priority=priority))


def step(sched: Scheduler) -> list[str]:
    """One step with token 3 sampled for every request that samples; returns the ids scheduled."""
    out = sched.schedule()
    sched.update([SampledTokens(c.request_id, [3] * c.num_samples, [-1.0] * c.num_samples)
                  for c in out.chunks if c.num_samples])
    for pid in list(sched.sequences):
        if sched.is_done(pid):
            sched.release(pid)
    return [c.request_id for c in out.chunks]


def admission_order(policy: str) -> list[str]:
    sched = scheduler(policy, max_num_seqs=1)
    for rid, priority, arrival in (("a", 2, 1.0), ("b", 0, 2.0), ("c", 1, 3.0), ("d", 0, 4.0)):
        add(sched, rid, priority, arrival)
    order = []
    while sched.has_unfinished():
        order += [rid for rid in step(sched) if rid not in order]
    assert sched.kv.num_free_blocks == 16
    return order


def test_waiting_requests_are_admitted_by_priority_then_arrival():
    assert admission_order("priority") == ["b", "d", "c", "a"]
    assert admission_order("fcfs") == ["a", "b", "c", "d"]


def preemption(policy: str) -> tuple[list[str], list[str]]:
    """"low" is admitted first, "high" a step later; then both need a third block and one is free."""
    sched = scheduler(policy, num_blocks=5)
    add(sched, "low", priority=5, arrival=1.0, prompt_len=15, max_tokens=4)
    assert step(sched) == ["low"]
    add(sched, "high", priority=0, arrival=2.0, prompt_len=16, max_tokens=4)
    assert step(sched) == ["low", "high"]  # 4 of 5 blocks held
    add(sched, "mid", priority=1, arrival=3.0, prompt_len=16)  # waits: its 2 blocks are not free
    out = sched.schedule()
    return out.preempted_ids, [r.request_id for r in sched.waiting]


def test_the_lowest_priority_running_request_is_preempted_and_requeued_in_its_place():
    preempted, waiting = preemption("priority")
    assert preempted == ["low"]  # not the most recently admitted ("high"), as FCFS picks
    assert waiting == ["mid", "low"]  # back in (priority, arrival) order, not at the front
    preempted, waiting = preemption("fcfs")
    assert preempted == ["high"]
    assert waiting == ["high", "mid"]


def budget_split(policy: str) -> list[tuple[str, int]]:
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=12, max_model_len=64, scheduling_policy=policy)
    sched = Scheduler(config, CacheConfig(block_size=8, watermark=0.0), 16)
    add(sched, "early", priority=3, arrival=1.0, prompt_len=20)
    assert step(sched) == ["early"]  # 12 of its 20 prompt tokens
    add(sched, "late", priority=0, arrival=2.0, prompt_len=20)
    assert step(sched) == ["early", "late"]  # early's last 8, late's first 4
    return [(c.request_id, len(c.token_ids)) for c in sched.schedule().chunks]


def test_running_requests_get_the_token_budget_by_priority():
    assert budget_split("priority") == [("late", 12)]  # before early's decode token
    assert budget_split("fcfs") == [("early", 1), ("late", 11)]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_every_block_is_free_after_a_mixed_priority_run(policy):
    sched = scheduler(policy, num_blocks=6)
    for k in range(6):
        add(sched, f"r{k}", priority=k % 3 if policy == "priority" else 0, arrival=float(k),
            prompt_len=9 + 2 * k, max_tokens=12)
    for _ in range(200):
        if not sched.has_unfinished():
            break
        step(sched)
        sched.kv.check_integrity()
    assert not sched.has_unfinished() and sched.kv.num_free_blocks == 6
    assert sched.stats.num_preemptions > 0  # the small pool made it preempt


def test_scheduling_policy_is_checked():
    with pytest.raises(ValueError, match="scheduling_policy='lifo' must be one of"):
        SchedulerConfig(scheduling_policy="lifo")

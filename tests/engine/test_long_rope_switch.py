"""The scheduler's LongRoPE switch (engine/scheduler.py, layers/rotary_variants.py), step by step:
a request computes with the short factors while it holds at most ``long_rope_from`` tokens; on
the step after it grows past that, its blocks are freed and its whole sequence is computed again
with the long factors, under prefix hashes of their own."""
from __future__ import annotations

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.contracts.sampled_tokens import SampledTokens
from pagedllm.engine.request import Request
from pagedllm.engine.scheduler import Scheduler
from pagedllm.sampling_params import SamplingParams

LIMIT, BLOCK = 20, 8


def _step(sched: Scheduler, token: int = 5):
    out = sched.schedule()
    sched.update([SampledTokens(c.request_id, [token] * c.num_samples, [-1.0] * c.num_samples)
                  for c in out.chunks if c.num_samples])
    sched.kv.check_integrity()
    return [(c.start, c.num_new_tokens, c.long_rope) for c in out.chunks]


def _scheduler() -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                                     long_rope_from=LIMIT), CacheConfig(block_size=BLOCK, watermark=0.0), 32)


def test_a_request_switches_to_the_long_factors_by_recomputing_its_kv():
    sched = _scheduler()
    req = Request("a", list(range(3, 21)), SamplingParams(max_tokens=6, ignore_eos=True), frozenset())
    sched.add_request(req)
    assert _step(sched) == [(0, 18, False)]  # the prompt (18 tokens): short factors
    assert _step(sched) == [(18, 1, False)]  # 19 tokens
    assert _step(sched) == [(19, 1, False)]  # 20 = LIMIT tokens: still short
    assert _step(sched) == [(0, 21, True)]  # 21 tokens: all of them again, long
    assert req.long_rope and req.num_cached_tokens == 0  # its own two short full blocks were no prefix hit
    assert _step(sched) == [(21, 1, True)]
    assert sched.stats.num_preemptions == 0  # the switch is not a preemption


def test_long_prompts_start_long_and_hit_each_others_long_blocks():
    sched = _scheduler()
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    sched.add_request(Request("a", list(range(3, 28)), params, frozenset()))  # 25 tokens > LIMIT
    assert _step(sched) == [(0, 25, True)]
    sched.add_request(Request("b", list(range(3, 28)), params, frozenset()))
    assert _step(sched) == [(24, 1, True)]  # its 3 full blocks hit a's long ones
    sched.add_request(Request("c", list(range(3, 20)), params, frozenset()))  # the same 17 first tokens: short
    assert _step(sched) == [(0, 17, False)]  # no hit on the long blocks

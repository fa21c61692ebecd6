"""Engine counters and snapshots, and the metric objects returned by ``LLM.get_metrics()``."""
from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field


@dataclass
class Metric:
    """Like vLLM's metric reader objects: a name, labels and a value."""

    name: str
    value: float  # a histogram's: the sum of its observations
    labels: dict[str, str] = field(default_factory=dict)
    kind: str = "gauge"  # "gauge" | "counter" | "histogram" | "info" (a gauge of 1 whose labels describe)
    buckets: tuple[tuple[float, int], ...] = ()  # a histogram's (upper bound, cumulative count), +inf last


# vLLM's iteration_tokens_total buckets: tokens computed in one engine step
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass
class Histogram:
    """Counts per bucket (``bounds`` upper edges, then +inf) and the sum of what was observed."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self):
        self.counts = self.counts or [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # the first bucket with value <= bound
        self.total += value

    def cumulative(self) -> tuple[tuple[float, int], ...]:
        return tuple(zip((*self.bounds, float("inf")), itertools.accumulate(self.counts)))


@dataclass
class KVCacheStats:
    block_size: int
    num_blocks: int
    num_free_blocks: int
    num_used_blocks: int
    num_cached_blocks: int  # free, but still holding a reusable prefix
    usage: float  # used / total
    num_tokens_stored: int
    utilization: float  # tokens stored / (used blocks * block_size)
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_hit_rate: float
    num_cpu_blocks: int
    num_cpu_free_blocks: int
    cpu_usage: float
    num_preemptions: int
    preemptions_by_mode: dict[str, int]
    # KV tiers (kv_cache/offload/): per tier ("cpu", "disk", "remote") hits, misses, stored_blocks,
    # bytes_stored, bytes_loaded, loads, load_seconds (cumulative), disabled (1 once turned off for
    # failing) and errors ({op: failed filesystem calls}); the remote tier's also unreachable (calls
    # that found no server) and round_trips ({op: (cumulative buckets, seconds)}); empty without tiers
    offload: dict[str, dict] = field(default_factory=dict)


@dataclass(frozen=True)
class SchedulerSnapshot:
    """Queue sizes and block usage at one moment (``Scheduler.make_stats()``); cheap to take."""

    num_running: int
    num_waiting: int
    num_swapped: int
    num_used_blocks: int


@dataclass
class EngineCounters:
    prompt_tokens: int = 0  # prompt length of every request, counted at its first token (as vLLM)
    prompt_tokens_computed: int = 0  # prompt positions run through the model (no prefix hits, + recompute)
    generation_tokens: int = 0
    request_success: dict[str, int] = field(default_factory=lambda: {"stop": 0, "length": 0, "abort": 0,
                                                                     "constraint": 0})
    num_steps: int = 0
    iteration_tokens: Histogram = field(default_factory=lambda: Histogram(ITERATION_TOKEN_BUCKETS))
    peak_used_blocks: int = 0
    peak_running: int = 0


@dataclass
class StepTimes:
    """Cumulative seconds per phase of ``LLMEngine.step`` (to report engine overhead)."""

    schedule: float = 0.0
    prepare: float = 0.0  # building the flat batch and attention metadata
    forward: float = 0.0  # model forward + logits
    sample: float = 0.0
    update: float = 0.0  # scheduler update, detokenization, outputs
    steps: int = 0

    def add(self, **seconds: float) -> None:
        for phase, value in seconds.items():
            setattr(self, phase, getattr(self, phase) + value)

    @property
    def total(self) -> float:
        return self.schedule + self.prepare + self.forward + self.sample + self.update

    @property
    def overhead_share(self) -> float:
        """Everything but model math, as a share of step time."""
        return 1.0 - self.forward / self.total if self.total else 0.0


def offload_metrics(offload: dict[str, dict]) -> list[Metric]:
    """The KV tiers' counters (``KVCacheStats.offload``), labelled by tier (nothing without tiers)."""
    out = []
    for tier, t in offload.items():
        labels = {"tier": tier}
        out += [Metric("pagedllm:kv_offload_hits", t["hits"], labels, "counter"),
                Metric("pagedllm:kv_offload_misses", t["misses"], labels, "counter"),
                Metric("pagedllm:kv_offload_bytes", t["bytes_stored"], {**labels, "direction": "store"}, "counter"),
                Metric("pagedllm:kv_offload_bytes", t["bytes_loaded"], {**labels, "direction": "load"}, "counter"),
                Metric("pagedllm:kv_offload_loads", t["loads"], labels, "counter"),
                Metric("pagedllm:kv_offload_load_seconds", t["load_seconds"], labels, "counter"),
                Metric("pagedllm:kv_offload_disabled", t.get("disabled", 0), labels)]
        out += [Metric("pagedllm:kv_offload_errors", n, {**labels, "op": op}, "counter")
                for op, n in sorted(t.get("errors", {}).items())]
        if "round_trips" in t:  # a networked tier (remote)
            out.append(Metric("pagedllm:kv_offload_unreachable", t["unreachable"], labels, "counter"))
            out += [Metric("pagedllm:kv_offload_round_trip_seconds", total, {**labels, "op": op}, "histogram", buckets)
                    for op, (buckets, total) in t["round_trips"].items()]
    return out

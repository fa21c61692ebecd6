"""The engine's KV event feed: a snapshot of the block pool, block tables and request queues,
then one event per step with what changed (``kv_cache/events.py``), for ``/v1/kv_events``.

Runs on the engine thread. ``publish`` costs nothing but a truth test while nobody listens; with
a viewer, a step costs the blocks and tables it touched, plus one line per live request when the
queues are listed: whenever a queue's size changed, else at most every ``QUEUE_INTERVAL`` seconds
(listing 64 requests every step was most of the feed's cost at batch 64).
"""
from __future__ import annotations

import time

from pagedllm.contracts.scheduler_output import SchedulerOutput
from pagedllm.engine.scheduler import Scheduler
from pagedllm.kv_cache.events import KVEventHub, KVEventRecorder, Subscription

# requests listed per queue in an event (the page shows queue sizes beyond that)
MAX_LISTED_PER_QUEUE = 500
QUEUE_INTERVAL = 0.1  # seconds between two listings of unchanged-size queues (the page redraws them at 5 Hz)


class KVEventFeed:
    """Snapshots and per-step events of one scheduler's KV cache and queues (engine thread)."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.recorder = KVEventRecorder(scheduler.kv)
        self.hub = KVEventHub(self.recorder)
        self._listed: tuple[float, tuple[int, ...]] = (0.0, ())  # when the queues were last listed, their sizes

    @property
    def listening(self) -> bool:
        return self.hub.listening

    def subscribe(self, maxlen: int, step: int) -> tuple[Subscription, dict]:
        """A subscription and the snapshot its events start from (taken between two steps)."""
        sub = self.hub.subscribe(maxlen)
        return sub, self.snapshot(step)

    def attach(self, sub: Subscription, step: int) -> dict:
        """``subscribe`` for a subscription made by the caller; returns its snapshot."""
        self.hub.add(sub)
        return self.snapshot(step)

    def snapshot(self, step: int) -> dict:
        kv = self.scheduler.kv
        return {"type": "snapshot", "step": step, **self.recorder.snapshot(), "num_cpu_blocks": kv.num_cpu_blocks,
                **self._queues()}

    def publish(self, step: int, sched_out: SchedulerOutput | None = None) -> None:
        """Queues the changes since the previous event for every viewer: a step's (with its block
        moves and token count), or an operation's between steps (``sched_out`` None: an abort)."""
        if not self.hub.listening:
            return
        event = {"type": "step", "step": step, **self.recorder.take_diff()}
        if self._queues_due():
            event.update(self._queues())
        if sched_out is not None:
            event["moves"] = _moves(sched_out)
            event["num_tokens"] = sched_out.num_tokens
            event["preempted"] = list(sched_out.preempted_ids)
        self.hub.publish(event)

    def _queues_due(self) -> bool:
        s, (when, sizes) = self.scheduler, self._listed
        now_sizes = (len(s.running), len(s.waiting), len(s.swapped), len(s.loading))
        return now_sizes != sizes or time.monotonic() - when >= QUEUE_INTERVAL

    def _queues(self) -> dict:
        """``requests`` (up to MAX_LISTED_PER_QUEUE of each queue) and ``queue_sizes``."""
        s = self.scheduler
        queues = {"running": s.running, "waiting": s.waiting, "swapped": s.swapped, "loading": s.loading.values()}
        requests = []
        for name, reqs in queues.items():
            for i, req in enumerate(reqs):
                if i == MAX_LISTED_PER_QUEUE:
                    break
                requests.append(self._describe(req, name))
        sizes = {name: len(reqs) for name, reqs in queues.items()}
        self._listed = (time.monotonic(), tuple(sizes.values()))
        return {"requests": requests, "queue_sizes": sizes}

    def _describe(self, req, queue: str) -> dict:
        kv = self.scheduler.kv
        rid = req.request_id
        return {"id": rid, "parent": req.parent_id, "queue": queue, "tokens": req.num_tokens,
                "computed": req.num_computed_tokens, "prompt": req.num_prompt_tokens, "priority": req.priority,
                "preemptions": req.num_preemptions, "blocks": len(kv.tables.get(rid, ())),
                "cpu_blocks": len(kv.cpu_tables.get(rid, ()))}


def _moves(out: SchedulerOutput) -> dict:
    """The step's device blocks in motion: swapped out / in, copied (copy-on-write), loaded from a tier."""
    loads = [[item.device_block, item.tier] for job in (out.tier_ops.loads if out.tier_ops else ())
             for item in job.items]
    return {"swap_out": [d for d, _ in out.blocks_to_swap_out], "swap_in": [d for _, d in out.blocks_to_swap_in],
            "copy": [list(pair) for pair in out.blocks_to_copy], "load": loads}

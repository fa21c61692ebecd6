"""Grammar compilations on a few threads, in an order no single client can monopolise.

    submit(job) ──> per-owner FIFO queues          workers (threads)
                    owner A: [a1, a2, a3]   ──┐    general: take the next job of the owner with
                    owner B: [b1]           ──┼──>          the fewest running compiles (ties: the
                    owner C: [c1 (small)]   ──┘             owner served longest ago)
                                                   small lane: only small jobs, so a choice list or a
                                                   short schema never waits behind big compiles

The workers run at a lower CPU priority than the rest of the server (``COMPILE_NICE``, Linux: a
thread's own nice value): a spec at the size limit costs a second or more of native code, and at
the same priority two such compiles took two of a 2-core host's shares from the engine step (normal
traffic's p99 latency 6x while one client sent them); niced, they run on what the engine leaves.

xgrammar compiles in native code that cannot be interrupted, so a *running* compile always runs to
the end (its result is cached, so a retry of the same spec is a hit); what can be cancelled is a
job still queued: ``cancel`` drops it when no request wants it any more (the request was aborted
or its client left). The size limit on specs (``max_structured_output_bytes``) is what bounds the
cost of one running compile.
"""
from __future__ import annotations

import itertools
import os
import sys
import threading
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

SMALL_SPEC_BYTES = 4096  # a spec up to this size compiles in milliseconds: the small lane takes it
COMPILE_NICE = 10  # added to a compile worker's nice value (CFS weight ~1/10 of the engine thread's)


@dataclass(eq=False)
class CompileJob:
    """One compilation: ``run()`` produces the compiled grammar into ``future``."""

    run: Callable[[], object]
    owner: str
    small: bool
    future: Future = field(default_factory=Future)


class CompileQueue:
    """Runs CompileJobs on ``threads`` general workers plus one small-job lane (threads start on
    first use). Thread-safe: ``submit``/``cancel`` come from the engine thread, workers run beside it."""

    def __init__(self, threads: int = 2, name: str = "pagedllm-grammar"):
        self._threads = threads
        self._name = name
        self._cv = threading.Condition()
        self._queues: dict[str, deque[CompileJob]] = {}
        self._running: Counter[str] = Counter()
        self._last_served: dict[str, int] = {}
        self._ticks = itertools.count()
        self._workers: list[threading.Thread] = []
        self._closed = False

    def submit(self, job: CompileJob) -> Future:
        """Queues ``job`` behind its owner's earlier jobs; returns its future."""
        with self._cv:
            if self._closed:
                raise RuntimeError("the grammar compiler is shut down")
            self._queues.setdefault(job.owner, deque()).append(job)
            self._start_workers()
            self._cv.notify_all()
        return job.future

    def cancel(self, job: CompileJob) -> bool:
        """Drops ``job`` if it has not started (its future is cancelled); False once it runs."""
        with self._cv:
            queue = self._queues.get(job.owner)
            if queue is None or job not in queue:
                return False
            queue.remove(job)
            if not queue:
                del self._queues[job.owner]
        job.future.cancel()
        return True

    def depth(self) -> int:
        """Jobs queued, not yet running."""
        with self._cv:
            return sum(len(q) for q in self._queues.values())

    def num_running(self) -> int:
        with self._cv:
            return sum(self._running.values())

    def shutdown(self) -> None:
        """Cancels every queued job and lets the workers exit (a running compile finishes first)."""
        with self._cv:
            self._closed = True
            jobs = [job for q in self._queues.values() for job in q]
            self._queues.clear()
            self._cv.notify_all()
        for job in jobs:
            job.future.cancel()

    def _start_workers(self) -> None:
        if self._workers:
            return
        lanes = [False] * self._threads + [True]  # True: the small lane
        for i, small_only in enumerate(lanes):
            worker = threading.Thread(target=self._work, args=(small_only,), daemon=True,
                                      name=f"{self._name}-{'small' if small_only else i}")
            worker.start()
            self._workers.append(worker)

    def _work(self, small_only: bool) -> None:
        lower_thread_priority(COMPILE_NICE)
        while True:
            with self._cv:
                job = self._take(small_only)
                while job is None:
                    if self._closed:
                        return
                    self._cv.wait()
                    job = self._take(small_only)
                self._running[job.owner] += 1
            try:
                if job.future.set_running_or_notify_cancel():
                    _run_into(job)
            finally:
                with self._cv:
                    self._running[job.owner] -= 1
                    self._cv.notify_all()

    def _take(self, small_only: bool) -> CompileJob | None:
        """The next job for a worker (the lock is held): from the owner with the fewest running
        compiles, ties broken by who was served longest ago; the small lane only looks at each
        owner's first job and takes it if small (owners keep their FIFO order)."""
        owners = [o for o, q in self._queues.items() if q and (q[0].small or not small_only)]
        if not owners:
            return None
        owner = min(owners, key=lambda o: (self._running[o], self._last_served.get(o, -1)))
        queue = self._queues[owner]
        job = queue.popleft()
        if not queue:
            del self._queues[owner]
        self._last_served[owner] = next(self._ticks)
        if len(self._last_served) > 4096:  # owners come and go: forget the ones with nothing queued
            self._last_served = {o: t for o, t in self._last_served.items() if o in self._queues}
        return job


def lower_thread_priority(nice: int) -> bool:
    """Adds ``nice`` to the calling thread's nice value (Linux, where ``setpriority`` on a thread id
    reaches that thread alone; threads it starts inherit it). False where that is not available: on
    other systems the same call would renice the whole process."""
    if not sys.platform.startswith("linux"):
        return False
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError:  # a sandbox may refuse it: compiles then share the CPU equally, as before
        return False
    return True


def _run_into(job: CompileJob) -> None:
    try:
        result = job.run()
    except BaseException as exc:  # noqa: BLE001 - the failure belongs to the requests waiting for it
        job.future.set_exception(exc)
    else:
        job.future.set_result(result)

"""The grammar compile queue: per-client fairness, the small-job lane, cancellation of queued
compiles, and the manager's compile timeout and release."""
from __future__ import annotations

import os
import sys
import threading
import time

import pytest
from conftest import _tokenizer

from pagedllm import StructuredOutputsParams
from pagedllm.config import StructuredOutputConfig
from pagedllm.structured_output import StructuredOutputManager
from pagedllm.structured_output.compile_queue import CompileJob, CompileQueue

WAIT = 10.0  # generous: only a hang would take this long


class Recorder:
    """Jobs that log their name when they run; a ``gate`` keeps a job running until set."""

    def __init__(self):
        self.order: list[str] = []
        self.started = {}

    def job(self, name: str, owner: str, small: bool = False, gate: threading.Event | None = None) -> CompileJob:
        started = self.started[name] = threading.Event()

        def run():
            self.order.append(name)
            started.set()
            if gate is not None:
                assert gate.wait(WAIT)
            return name
        return CompileJob(run, owner, small)


@pytest.fixture
def queue():
    q = CompileQueue(threads=1)
    yield q
    q.shutdown()


def test_an_owner_with_queued_jobs_does_not_keep_the_others_waiting(queue):
    rec, gate = Recorder(), threading.Event()
    first = rec.job("a1", "A", gate=gate)
    queue.submit(first)
    assert rec.started["a1"].wait(WAIT)  # the only general worker is busy with A's first job
    jobs = [rec.job("a2", "A"), rec.job("a3", "A"), rec.job("b1", "B"), rec.job("c1", "C")]
    for job in jobs:
        queue.submit(job)
    assert queue.depth() == 4
    gate.set()
    for job in [first, *jobs]:
        job.future.result(WAIT)
    # B and C each get a turn before A's second job: A was served last
    assert rec.order == ["a1", "b1", "c1", "a2", "a3"]
    assert queue.depth() == 0 and queue.num_running() == 0


def test_a_small_job_compiles_while_the_general_workers_are_busy(queue):
    rec, gate = Recorder(), threading.Event()
    big = [rec.job("big1", "A", gate=gate), rec.job("big2", "A", gate=gate)]
    for job in big:
        queue.submit(job)
    assert rec.started["big1"].wait(WAIT)
    small = rec.job("small", "B", small=True)
    queue.submit(small)
    assert small.future.result(WAIT) == "small"  # did not wait for the gate
    assert not big[1].future.done()
    gate.set()
    assert [j.future.result(WAIT) for j in big] == ["big1", "big2"]


def test_cancel_drops_a_queued_job_but_not_a_running_one(queue):
    rec, gate = Recorder(), threading.Event()
    running, queued = rec.job("run", "A", gate=gate), rec.job("queued", "B")
    queue.submit(running)
    assert rec.started["run"].wait(WAIT)
    queue.submit(queued)
    assert queue.cancel(queued) and queued.future.cancelled()
    assert not queue.cancel(running)
    gate.set()
    assert running.future.result(WAIT) == "run"
    assert rec.order == ["run"] and queue.depth() == 0


def test_shutdown_cancels_what_is_queued(queue):
    rec, gate = Recorder(), threading.Event()
    running, queued = rec.job("run", "A", gate=gate), rec.job("queued", "A")
    queue.submit(running)
    assert rec.started["run"].wait(WAIT)
    queue.submit(queued)
    queue.shutdown()
    assert queued.future.cancelled()
    gate.set()
    assert running.future.result(WAIT) == "run"
    with pytest.raises(RuntimeError, match="shut down"):
        queue.submit(rec.job("late", "A"))


class GatedManager(StructuredOutputManager):
    """A manager whose compiles wait for ``gate`` (so tests can hold them queued or running)."""

    def __init__(self, **config):
        tok = _tokenizer()
        super().__init__(tok, len(tok), frozenset({tok.eos_token_id}), StructuredOutputConfig(**config))
        self.gate = threading.Event()

    def _compile(self, params):
        assert self.gate.wait(WAIT)
        return super()._compile(params)


def schema(i: int) -> StructuredOutputsParams:
    return StructuredOutputsParams(json={"type": "object", "properties": {f"p{i}": {"type": "integer"}},
                                         "required": [f"p{i}"], "x-pad": "x" * 5000})  # not small


def running(manager) -> float:
    return next(m.value for m in manager.metrics() if m.name == "pagedllm:structured_output_compiles_running")


def test_the_last_release_of_a_queued_compile_cancels_it():
    manager = GatedManager()
    try:
        busy = [manager.grammar_for(schema(i), owner="A") for i in range(2)]  # both general workers
        deadline = time.monotonic() + WAIT
        while running(manager) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        first, second = manager.grammar_for(schema(9), owner="B"), manager.grammar_for(schema(9), owner="C")
        assert first.compiled is second.compiled  # one compile per spec
        first.release()
        assert not first.compiled.cancelled()  # the second request still wants it
        second.release()
        second.release()  # idempotent
        assert first.compiled.cancelled() and manager.stats.num_cancelled == 1
        again = manager.grammar_for(schema(9), owner="B")  # a new request compiles it again
        manager.gate.set()
        again.compiled.result(WAIT)
        assert again.is_ready() and again.error is None
        for state in busy:
            state.compiled.result(WAIT)
    finally:
        manager.gate.set()
        manager.shutdown()


def test_a_grammar_not_ready_in_time_fails_its_request_naming_the_option():
    manager = GatedManager(compile_timeout=0.2)
    try:
        state = manager.grammar_for(schema(1), owner="A")
        assert not state.is_ready()
        time.sleep(0.3)
        assert state.is_ready() and "structured_output_compile_timeout" in state.error
        state.release()
        assert manager.stats.num_timed_out == 1
        manager.gate.set()
        state.compiled.result(WAIT)  # it ran to the end and is cached: the next request is a hit
        hit = manager.grammar_for(schema(1), owner="B")
        assert hit.is_ready() and hit.error is None
    finally:
        manager.gate.set()
        manager.shutdown()


@pytest.mark.parametrize("config, match", [(dict(max_spec_bytes=0), "max_structured_output_bytes=0"),
                                           (dict(compile_timeout=-1.0), "structured_output_compile_timeout=-1.0")])
def test_bad_limits_are_refused_by_name(config, match):
    with pytest.raises(ValueError, match=match):
        StructuredOutputConfig(**config)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's own nice value is Linux's")
def test_compile_workers_run_at_a_lower_cpu_priority(queue):
    """A size-limit compile takes seconds of CPU: it must take what the engine thread leaves."""
    from pagedllm.structured_output.compile_queue import COMPILE_NICE
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    job = CompileJob(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id()), "A", False)
    queue.submit(job)
    assert job.future.result(WAIT) == min(19, mine + COMPILE_NICE)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine  # the caller's is unchanged

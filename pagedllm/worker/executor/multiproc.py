"""Tensor parallelism: rank 0 in the engine's process, one spawned worker process per other rank.

Rank 0 drives. Every runner call (profile, cache set-up, execute) is a ``RankCall`` sent to each
worker over its own pipe, then run locally, so all ranks enter the same collectives (the
all-reduces of the row-parallel layers, the all-gather of the vocabulary-parallel LM head) in the
same order; only rank 0 samples. Workers answer nothing per call: a worker that fails sends its
traceback and exits, which closes its sockets and turns rank 0's next collective into an error.

Failure handling, so that nothing waits forever:

- start-up: rank 0 waits for each worker's "started" and "ready" messages together with the
  process sentinels, under ``PAGEDLLM_TP_STARTUP_TIMEOUT``; a worker that exits first is reported with
  its traceback or exit status (and, when the main script has no ``__main__`` guard, that cause).
- running: collectives time out after ``PAGEDLLM_TP_TIMEOUT``; a failed call collects the
  worker's cause, stops every rank and raises RuntimeError; a watchdog thread notices a worker
  that dies between steps, so the next call fails at once.
- lifecycle: ``shutdown()``, garbage collection of the executor and interpreter exit (a
  ``weakref.finalize``) stop the workers and destroy the group; workers exit on their own when
  rank 0's process goes away (their pipe reaches end-of-file).
"""
from __future__ import annotations

import ast
import logging
import multiprocessing as mp
import multiprocessing.connection as mpc
import pickle
import signal
import sys
import threading
import time
import traceback
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch

from pagedllm import envs
from pagedllm.config import EngineConfig, ParallelConfig
from pagedllm.distributed.parallel_state import RankGroups, create_store, init_groups, join_store
from pagedllm.distributed.pipeline import RankLayout
from pagedllm.worker.executor.base import (
    Executor,
    RankCall,
    Reply,
    answer,
    raise_dead,
    rank_config,
    seed_and_threads,
    unpicklable_reply,
)
from pagedllm.worker.executor.remote import RemoteRanks
from pagedllm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

_STOP = None  # the message that ends a worker's loop
_STARTED, _READY, _ERROR, _REPLY = "started", "ready", "error", "reply"
_CAUSE_GRACE_S = 3.0  # how long a failed call waits for a dying worker to report why
_STOP_GRACE_S = 10.0  # how long shutdown waits for workers to leave before killing them


@dataclass(frozen=True)
class Timeouts:
    """Seconds: workers to start (import, rendezvous, load weights; a worker that exits fails
    start-up at once anyway), and any collective to wait for the other ranks."""

    startup: float
    collective: float

    @classmethod
    def from_env(cls) -> Timeouts:
        return cls(envs.PAGEDLLM_TP_STARTUP_TIMEOUT, envs.PAGEDLLM_TP_TIMEOUT)


# ---------------------------------------------------------------------- the worker process
def _worker_main(config: EngineConfig, rank: int, port: int, timeouts: Timeouts, conn: mpc.Connection) -> None:
    """A worker rank: join the group, build the shard, then run rank 0's calls until told to stop."""
    group = None
    # Ctrl-C in a terminal reaches the whole process group: rank 0 decides what it means (the
    # server shuts down and stops us; an idle REPL keeps its engine), not each worker on its own.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        conn.send((_STARTED,))
        config = rank_config(config, rank)
        if config.device.type == "cuda":
            torch.cuda.set_device(config.device)
        seed_and_threads(config, rank)
        p = config.parallel
        store = join_store(p.master_addr, port, p.world_size, timeouts.startup, envs.TORCHELASTIC_USE_AGENT_STORE)
        group = init_groups(config.device, RankLayout.of(p, rank), store, timeouts.collective)
        runner = ModelRunner(config, group.tp, group.pp)
        conn.send((_READY,))
        while (call := conn.recv()) is not _STOP:
            if call.reply:
                _send_reply(conn, answer(call, runner))
            else:
                call.run(runner)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # rank 0's process is gone: nobody to report to, just leave
    except BaseException:
        _report(conn, traceback.format_exc())
        raise SystemExit(1) from None
    finally:
        if group is not None:
            group.destroy()


def _send_reply(conn: mpc.Connection, reply: Reply) -> None:
    try:
        conn.send((_REPLY, reply))
    except (pickle.PicklingError, TypeError, AttributeError) as exc:  # pickled before anything is written
        conn.send((_REPLY, unpicklable_reply(exc)))


def parallel_kind(parallel: ParallelConfig) -> str:
    """What the ranks split: "tensor-parallel", "pipeline-parallel" or both."""
    if parallel.pipeline_parallel_size == 1:
        return "tensor-parallel"
    return "pipeline-parallel" if parallel.tensor_parallel_size == 1 else "tensor- and pipeline-parallel"


def rank_label(parallel: ParallelConfig, rank: int) -> str:
    """``worker rank 3``, with its pipeline stage and tensor rank under pipeline parallelism."""
    if parallel.pipeline_parallel_size == 1:
        return f"worker rank {rank}"
    layout = RankLayout.of(parallel, rank)
    return f"worker rank {rank} [pipeline stage {layout.stage}, tensor rank {layout.tp_rank}]"


def _report(conn: mpc.Connection, text: str) -> None:
    try:
        conn.send((_ERROR, text))
    except OSError:  # rank 0 already gone
        pass


# ---------------------------------------------------------------------- rank 0's view of the workers
class WorkerProcesses:
    """The worker processes of one engine, their pipes, rank 0's group and a watchdog thread.

    It holds no reference to the executor, so the executor can be garbage-collected and its
    finalizer can still ``close()`` this. ``dead`` is set (by the watchdog or a failed call) to
    why a worker is gone.
    """

    def __init__(self, config: EngineConfig, port: int, timeouts: Timeouts):
        ctx = mp.get_context("spawn")  # fork would copy rank 0's threads and torch state
        self.timeout = timeouts.startup
        self.parallel = config.parallel
        self.kind = parallel_kind(config.parallel)
        self.procs, self.conns = [], []
        for rank in range(1, config.parallel.ranks_per_node):  # node 0's ranks; others: remote.py
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, args=(config, rank, port, timeouts, child),
                               name=f"pagedllm-tp-rank{rank}", daemon=True)
            proc.start()
            child.close()  # only the worker holds its end: its exit reads as end-of-file here
            self.procs.append(proc)
            self.conns.append(parent)
        self.group: RankGroups | None = None
        self.dead: str | None = None
        self._cause_lock = threading.Lock()
        self._closed = False
        self._wake_r, self._wake_w = ctx.Pipe(duplex=False)

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    # ------------------------------------------------------------------ start-up
    def await_all(self, what: str) -> None:
        """Waits until every worker has sent ``what``; raises RuntimeError naming the first
        worker that exits or fails first, or that is not there after ``timeout`` seconds."""
        pending = dict(enumerate(self.conns))
        deadline = time.monotonic() + self.timeout
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                ranks = sorted(i + 1 for i in pending)
                raise RuntimeError(f"{self.kind} worker rank(s) {ranks} did not report {what!r} within "
                                   f"{self.timeout:g} s (PAGEDLLM_TP_STARTUP_TIMEOUT)")
            ready = mpc.wait([*pending.values(), *(self.procs[i].sentinel for i in pending)], timeout=left)
            for i in list(pending):
                if (pending[i] in ready or self.procs[i].sentinel in ready) and self._take(i, what):
                    del pending[i]

    def _take(self, i: int, what: str) -> bool:
        """Reads worker i's next message if any; True when it is ``what``; raises on a failure."""
        conn, proc = self.conns[i], self.procs[i]
        try:
            if conn.poll():
                kind, *rest = conn.recv()
                if kind == _ERROR:
                    raise RuntimeError(f"{self.kind} {self.label(i + 1)} failed during start-up:\n{rest[0]}")
                return kind == what
            if proc.is_alive():
                return False
        except (EOFError, OSError):  # its end of the pipe closed: the worker is exiting
            pass
        raise RuntimeError(f"{self.kind} " + describe_exit(i + 1, proc, started=what != _STARTED,
                                                          label=self.label(i + 1)))

    def label(self, rank: int) -> str:
        return rank_label(self.parallel, rank)

    # ------------------------------------------------------------------ running
    def send(self, call: RankCall) -> None:
        for conn in self.conns:
            conn.send(call)

    def start_watchdog(self) -> None:
        threading.Thread(target=self._watch, name="pagedllm-tp-watchdog", daemon=True).start()

    def _watch(self) -> None:
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.procs, 1)}
        ready = mpc.wait([*sentinels, self._wake_r])
        if self._closed or self._wake_r in ready:
            return
        rank = next(sentinels[s] for s in ready if s in sentinels)
        if self.cause(0.5) is None:  # cannot happen once the sentinel fired; stay safe anyway
            with self._cause_lock:  # a failed call may be writing ``dead`` at the same moment
                self.dead = self.dead or describe_exit(rank, self.procs[rank - 1], started=True,
                                                       label=self.label(rank))
        logger.error("%s worker died: %s", self.kind, self.dead)

    def cause(self, grace: float) -> str | None:
        """Why a worker failed: its reported traceback or its exit (remembered in ``dead``); waits
        up to ``grace`` seconds for one to show; None if every worker is still running quietly."""
        with self._cause_lock:  # the watchdog and a failed call may both ask; one reads the pipes
            if self.dead is None and mpc.wait([*self.conns, *(p.sentinel for p in self.procs)], timeout=grace):
                self.dead = self._first_failure()
            return self.dead

    def _first_failure(self) -> str | None:
        for rank, (conn, proc) in enumerate(zip(self.conns, self.procs), 1):
            reported, closed = _read_report(conn)
            if reported:
                return f"{self.label(rank)} raised:\n{reported}"
            if closed or not proc.is_alive():  # its pipe closes a moment before it can be reaped
                return describe_exit(rank, proc, started=True, label=self.label(rank))
        return None

    def gather(self, timeout: float | None) -> list[Reply]:
        """Every worker's Reply to a ``reply`` call, in rank order. Raises TimeoutError when one has
        not answered within ``timeout`` seconds (None: no limit), RuntimeError when one failed or
        exited instead (``dead`` says why)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        return [self._reply(rank, deadline, timeout) for rank in range(1, len(self.procs) + 1)]

    def _reply(self, rank: int, deadline: float | None, timeout: float | None) -> Reply:
        conn, proc = self.conns[rank - 1], self.procs[rank - 1]
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not mpc.wait([conn, proc.sentinel], timeout=left):
            raise TimeoutError(f"{self.label(rank)} did not answer within {timeout:g} s")
        try:
            kind, payload = conn.recv()
        except (EOFError, OSError):  # it exited without a word: cause() describes how
            raise RuntimeError(f"{self.label(rank)} exited") from None
        if kind == _ERROR:  # it failed outside the call and is exiting
            with self._cause_lock:
                self.dead = self.dead or f"{self.label(rank)} raised:\n{payload}"
            raise RuntimeError(self.dead)
        return payload

    # ------------------------------------------------------------------ shutdown
    def close(self, graceful: bool = True) -> None:
        """Stops the workers (asks, then kills after a grace period) and destroys rank 0's group."""
        if self._closed:
            return
        self._closed = True
        self._wake_w.send(None)  # releases the watchdog
        if graceful:
            for conn in self.conns:
                _send_quietly(conn, _STOP)
        deadline = time.monotonic() + (_STOP_GRACE_S if graceful else 0.0)
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            _kill(proc, graceful)
        for conn in self.conns:
            conn.close()
        if self.group is not None:
            self.group.destroy()


def _send_quietly(conn: mpc.Connection, msg: Any) -> None:
    try:
        conn.send(msg)
    except OSError:  # the worker is already gone
        pass


def _kill(proc: mp.Process, graceful: bool) -> None:
    """SIGTERM, then SIGKILL; straight to SIGKILL when not ``graceful`` (a stopped or hung
    worker may never act on SIGTERM)."""
    if graceful and proc.is_alive():
        proc.terminate()
        proc.join(2.0)
    if proc.is_alive():
        proc.kill()
        proc.join(2.0)


def _read_report(conn: mpc.Connection) -> tuple[str | None, bool]:
    """(the traceback a worker sent, if any; whether its end of the pipe is closed)."""
    try:
        while conn.poll():
            kind, *rest = conn.recv()
            if kind == _ERROR:
                return rest[0], False
    except (EOFError, OSError):
        return None, True
    return None, False


def describe_exit(rank: int, proc: mp.Process, started: bool, label: str | None = None) -> str:
    """``worker rank 1 (pid 42) was killed by SIGKILL`` (``label``: how to name the rank, default
    ``worker rank N``); for a worker that never started, the likely cause."""
    code = _exit_code(proc, 5.0)
    if code is None:
        how = "closed its pipe but is still running"
    elif code < 0:
        how = f"was killed by {signal.Signals(-code).name}"
    else:
        how = f"exited with code {code}"
    text = f"{label or f'worker rank {rank}'} (pid {proc.pid}) {how}"
    if not started:
        text += " before it started. " + _spawn_hint()
    return text


def _exit_code(proc: mp.Process, timeout: float) -> int | None:
    """The worker's exit status, waiting up to ``timeout`` seconds: its pipe closes a moment before
    it can be reaped. Polled in short joins because one join can come back empty while the status
    exists: when another thread's ``is_alive()`` reaps the process first, this thread's
    ``waitpid`` fails with ECHILD and multiprocessing returns None; the next look reads the
    status that thread stored."""
    deadline = time.monotonic() + timeout
    while proc.exitcode is None and time.monotonic() < deadline:
        proc.join(0.1)
    return proc.exitcode


def _spawn_hint() -> str:
    script = unguarded_main_script()
    if script is not None:
        return (f"The script {script} builds the engine at import time without an "
                '`if __name__ == "__main__":` guard. Each worker is a fresh Python process (spawn) that '
                "re-imports that script and so tries to start an engine of its own; put the code that "
                'builds the engine under `if __name__ == "__main__":`.')
    return ("Its traceback is above (stderr). If the main script builds the engine at import time, it needs "
            'an `if __name__ == "__main__":` guard: each worker re-imports it (spawn).')


def unguarded_main_script() -> str | None:
    """The main script's path if it is a .py file with no top-level ``if __name__ == "__main__":``."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    if not path or not path.endswith(".py") or not Path(path).is_file():
        return None
    try:
        tree = ast.parse(Path(path).read_text(), path)
    except (SyntaxError, UnicodeDecodeError, OSError):
        return None
    return None if any(_is_main_guard(node) for node in tree.body) else path


def _is_main_guard(node: ast.stmt) -> bool:
    if not isinstance(node, ast.If) or not isinstance(node.test, ast.Compare):
        return False
    sides = [node.test.left, *node.test.comparators]
    names = {s.id for s in sides if isinstance(s, ast.Name)}
    consts = {s.value for s in sides if isinstance(s, ast.Constant)}
    return names == {"__name__"} and consts == {"__main__"}


# ---------------------------------------------------------------------- the executor
class MultiprocExecutor(Executor):
    """Rank 0 in this process plus the other ranks of node 0 as spawned worker processes, on
    groups of their own (a TCPStore on its own port; ``PAGEDLLM_PORT`` sets the first port tried
    unless ``master_port`` is given). With ``nnodes > 1`` the ranks of the other nodes join the
    same store from their own launches and get their calls through it (remote.py)."""

    def _start(self) -> ModelRunner:
        timeouts, p = Timeouts.from_env(), self.config.parallel
        store = self._open_store(timeouts.startup)
        self._workers = WorkerProcesses(self.config, self.port, timeouts)
        self._remote = RemoteRanks(store, self.config, list(range(p.ranks_per_node, p.world_size)), timeouts.startup)
        self._finalizer = weakref.finalize(self, _close, self._workers, self._remote)
        try:
            runner = self._start_rank0(store, timeouts.collective)
        except BaseException:
            self._stop(graceful=False)
            raise
        self._workers.start_watchdog()
        self._remote.start_watchdog()
        logger.info("%d ranks (tensor parallel %d x pipeline parallel %d) on %d node(s), store %s:%d (%s)",
                    p.world_size, p.tensor_parallel_size, p.pipeline_parallel_size, p.nnodes, p.master_addr,
                    self.port, "nccl" if self.config.device.type == "cuda" else "gloo")
        return runner

    def _open_store(self, timeout: float):
        """Rank 0's rendezvous store (``self.port``: its port): its own, or torchrun's agent's."""
        p = self.config.parallel
        if envs.TORCHELASTIC_USE_AGENT_STORE:  # torchrun's agent already hosts it on MASTER_PORT
            self.port = p.master_port
            return join_store(p.master_addr, p.master_port, p.world_size, timeout, agent_store=True)
        store = create_store(p.world_size, p.master_port or envs.PAGEDLLM_PORT, timeout, p.master_addr,
                             search=not p.master_port)
        self.port = store.port
        return store

    def _start_rank0(self, store, timeout: float) -> ModelRunner:
        config = rank_config(self.config, 0)
        if config.device.type == "cuda":
            torch.cuda.set_device(config.device)  # NCCL binds each rank to its current device
        self._workers.await_all(_STARTED)
        self._remote.await_all("joined")
        try:
            self._workers.group = init_groups(config.device, RankLayout.of(config.parallel, 0), store, timeout)
        except RuntimeError as exc:  # the rendezvous timed out: say which worker is missing, if one died
            cause = self._workers.cause(0.0) or self._remote.cause() or str(exc)
            raise RuntimeError(f"{self._workers.kind} rendezvous failed: {cause}") from exc
        seed_and_threads(config)
        runner = ModelRunner(config, self._workers.group.tp, self._workers.group.pp)
        self._workers.await_all(_READY)
        self._remote.await_all("ready")
        return runner

    def worker_pids(self) -> list[int]:
        """Process ids of ranks 1..N-1 (for monitoring)."""
        return self._workers.pids()

    def health_error(self) -> str | None:
        """Also a worker the watchdogs saw die between steps, before any call has failed on it."""
        return super().health_error() or self._workers.dead or self._remote.dead

    def check_health(self) -> None:
        dead = self._workers.dead or self._remote.dead
        if dead is not None and self._closed_reason is None:
            self._fail(dead)
        super().check_health()

    def _run(self, call: RankCall) -> Any:
        try:
            self._workers.send(call)
            self._remote.send(call)
            return call.run(self.runner)
        except BaseException as exc:
            self._die(exc)

    def _gather(self, call: RankCall, timeout: float | None) -> list[Reply]:
        """Sends the call, runs it here, then collects the other ranks' replies (so every pipe
        stays in step even when rank 0's own call raised, which is then raised as is)."""
        try:
            self._workers.send(call)
            self._remote.send(call)
        except BaseException as exc:
            self._die(exc)
        local, error = None, None
        try:
            local = call.run(self.runner)
        except Exception as exc:
            error = exc
        try:
            others = self._workers.gather(timeout) + self._remote.gather(timeout)
        except BaseException as exc:
            self._die(exc)
        if error is not None:
            raise error
        return [Reply(local), *others]

    def _die(self, exc: BaseException) -> NoReturn:
        """A call failed part-way: the ranks are out of step, so the engine stops; raises why."""
        reason = self._failure_reason(exc)
        self._fail(reason)
        raise_dead(self._workers.kind, reason, exc)

    def _failure_reason(self, exc: BaseException) -> str:
        local = self._workers.cause(_CAUSE_GRACE_S if self._workers.procs else 0.0)
        if local is not None:
            return local
        remote = self._remote_cause()
        if remote is not None:
            return remote
        where = "every worker on this node is still running" if self._remote.ranks else "every worker is still running"
        also = "; a rank on another node may have died or lost its connection" if self._remote.ranks else ""
        return (f"{where} but the call failed on rank 0 (a collective gives up after "
                f"PAGEDLLM_TP_TIMEOUT={envs.PAGEDLLM_TP_TIMEOUT:g} s){also}: {type(exc).__name__}: {exc}")

    def _remote_cause(self) -> str | None:
        """A remote rank's reported traceback; it may take a moment to arrive after the failure."""
        deadline = time.monotonic() + (_CAUSE_GRACE_S if self._remote.ranks else 0.0)
        while (cause := self._remote.cause()) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return cause

    def _stop(self, graceful: bool) -> None:
        if graceful:
            self._finalizer()
        elif self._finalizer.detach() is not None:
            _close(self._workers, self._remote, graceful=False)


def _close(workers: WorkerProcesses, remote: RemoteRanks, graceful: bool = True) -> None:
    """Stops node 0's workers and tells the remote ranks to stop (they also leave when this
    process's store goes away)."""
    if graceful and remote.ranks and remote.store is not None:
        try:
            remote.send(None)
        except RuntimeError:  # the store is already closed
            pass
    remote.close()
    workers.close(graceful)

"""Ranks as Ray actors (``distributed_executor_backend="ray"``): rank 0 in the engine's process,
ranks 1..N-1 as actors in one placement group, on the Ray cluster this process is pointed at
(``RAY_ADDRESS``, or the one ``ray start`` recorded) or, with none, on a local Ray instance it starts.

The same protocol as the multiprocessing executor (multiproc.py): every runner call is a
``RankCall`` sent to each actor (an actor runs its calls one at a time, in order) and then run
here, so every rank enters the same collectives in the same order; groups rendezvous on rank 0's
TCPStore (gloo on CPU, NCCL on CUDA). Placement: one bundle per actor (a GPU each on CUDA, one CPU
on CPU), ``STRICT_PACK`` for tensor parallelism (every rank on one node), ``PACK`` with pipeline
stages (they may spread when a node is full).

Failure handling, so that nothing waits forever:

- start-up: rank 0 waits for the actors' "ready" under ``PAGEDLLM_TP_STARTUP_TIMEOUT``; an actor
  that fails reports its traceback, with its node and rank.
- running: each actor also runs a ``watch`` method in a concurrency group of its own, which only
  returns when the actor stops; a watchdog thread waits on those, so an actor that dies (killed,
  its node lost) marks the engine dead within a second, naming the node and the rank; collectives
  time out after ``PAGEDLLM_TP_TIMEOUT``; a failed call stops every rank and raises RuntimeError.
- shutdown: every actor is killed and the placement group removed (``ray.kill``, no restarts);
  ``ray.shutdown()`` if this executor called ``ray.init`` (a local instance it started stops).
"""
from __future__ import annotations

import logging
import socket
import threading
import weakref
from typing import Any, NoReturn

import torch

from pagedllm import envs
from pagedllm.config import EngineConfig
from pagedllm.distributed.parallel_state import create_store, init_groups, join_store
from pagedllm.distributed.pipeline import RankLayout
from pagedllm.worker.executor.base import (
    Executor,
    RankCall,
    Reply,
    answer,
    raise_dead,
    rank_config,
    seed_and_threads,
)
from pagedllm.worker.executor.multiproc import Timeouts, parallel_kind, rank_label
from pagedllm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

INSTALL_HINT = "distributed_executor_backend='ray' needs Ray: pip install 'pagedllm[ray]'"
_CAUSE_GRACE_S = 3.0  # how long a failed call waits for a dying actor's error to show


def import_ray():
    """The ``ray`` module, or ``ValueError`` with the install hint."""
    try:
        import ray
    except ImportError as exc:
        raise ValueError(INSTALL_HINT) from exc
    return ray


class _RankActor:
    """One worker rank inside a Ray actor: joins the group, builds its shard, runs rank 0's calls."""

    def __init__(self, config: EngineConfig, rank: int, host: str, port: int, timeouts: Timeouts):
        import ray

        self.rank = rank
        self._stopped = threading.Event()
        config = rank_config(config, rank)
        if config.device.type == "cuda":  # Ray shows the actor its own GPU only, as device 0
            gpu = ray.get_gpu_ids()
            config = config if not gpu else _on_device(config, torch.device("cuda", 0))
            torch.cuda.set_device(config.device)
        seed_and_threads(config, rank)
        p = config.parallel
        store = join_store(host, port, p.world_size, timeouts.startup)
        self.group = init_groups(config.device, RankLayout.of(p, rank), store, timeouts.collective)
        self.runner = ModelRunner(config, self.group.tp, self.group.pp)

    def where(self) -> tuple[str, str, int]:
        """(node id, host name, process id) of this actor."""
        import os

        import ray
        return ray.get_runtime_context().get_node_id(), socket.gethostname(), os.getpid()

    def run(self, call: RankCall) -> Reply | None:
        if call.reply:
            return answer(call, self.runner)
        call.run(self.runner)
        return None

    def watch(self) -> None:
        """Returns when the actor is stopped; fails (RayActorError) when it dies."""
        self._stopped.wait()

    def stop(self) -> None:
        self._stopped.set()
        self.group.destroy()


def _on_device(config: EngineConfig, device: torch.device) -> EngineConfig:
    from dataclasses import replace
    return replace(config, device=device)


class RayActors:
    """The actors of one engine, their placement group and the watchdog; no reference to the
    executor (its finalizer closes this). ``dead`` is set to why an actor is gone."""

    def __init__(self, config: EngineConfig, host: str, port: int, timeouts: Timeouts, ray_inited: bool):
        self.ray = import_ray()
        self.ray_inited = ray_inited  # this engine called ray.init: ray.shutdown() too
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        p = config.parallel
        self.parallel, self.kind, self.timeouts = p, parallel_kind(p), timeouts
        self.dead: str | None = None
        self._closed = False
        gpu = config.device.type == "cuda"
        bundle = {"GPU": 1, "CPU": 1} if gpu else {"CPU": 1}
        strategy = "STRICT_PACK" if p.pipeline_parallel_size == 1 else "PACK"
        self.pg = placement_group([dict(bundle) for _ in range(1, p.world_size)], strategy=strategy)
        ready = self.pg.ready()
        if not self.ray.wait([ready], timeout=timeouts.startup)[0]:
            self.ray.util.remove_placement_group(self.pg)
            raise RuntimeError(f"Ray could not place {p.world_size - 1} worker rank(s) of {bundle} ({strategy}) "
                               f"within {timeouts.startup:g} s (PAGEDLLM_TP_STARTUP_TIMEOUT): "
                               f"the cluster has {self.ray.available_resources()} free")
        # calls run one at a time, in order (the default group); ``watch`` waits in a group of its own
        cls = self.ray.remote(concurrency_groups={"watch": 1})(_RankActor)
        def place(rank: int) -> PlacementGroupSchedulingStrategy:
            return PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=rank - 1)

        self.actors = [cls.options(num_cpus=1, num_gpus=1 if gpu else 0, max_restarts=0, max_task_retries=0,
                                   scheduling_strategy=place(rank)).remote(config, rank, host, port, timeouts)
                       for rank in range(1, p.world_size)]
        self.where: dict[int, str] = {}

    def label(self, rank: int) -> str:
        node = self.where.get(rank)
        return rank_label(self.parallel, rank) + (f" (Ray actor on {node})" if node else " (Ray actor)")

    # ------------------------------------------------------------------ start-up
    def await_ready(self) -> None:
        """Waits for every actor to be built (rank 0 joined the group meanwhile); raises
        RuntimeError naming the first that failed, or that is not there in time."""
        refs = {a.where.remote(): rank for rank, a in enumerate(self.actors, 1)}
        done, pending = self.ray.wait(list(refs), num_returns=len(refs), timeout=self.timeouts.startup)
        for ref in done:
            rank = refs[ref]
            try:
                node_id, host, pid = self.ray.get(ref)
            except Exception as exc:
                raise RuntimeError(f"{self.kind} {self.label(rank)} failed during start-up:\n{exc}") from None
            self.where[rank] = f"node {host} [{node_id[:12]}], pid {pid}"
        if pending:
            ranks = sorted(refs[r] for r in pending)
            raise RuntimeError(f"{self.kind} worker rank(s) {ranks} did not start within "
                               f"{self.timeouts.startup:g} s (PAGEDLLM_TP_STARTUP_TIMEOUT)")

    def start_watchdog(self) -> None:
        refs = {a.watch.options(concurrency_group="watch").remote(): rank for rank, a in enumerate(self.actors, 1)}
        threading.Thread(target=self._watch, args=(refs,), name="pagedllm-ray-watchdog", daemon=True).start()

    def _watch(self, refs: dict) -> None:
        done, _ = self.ray.wait(list(refs), num_returns=1)
        if self._closed:
            return
        rank = refs[done[0]]
        self.dead = self.dead or self._describe(rank, done[0])
        logger.error("%s worker died: %s", self.kind, self.dead)

    def _describe(self, rank: int, ref) -> str:
        try:
            self.ray.get(ref, timeout=1.0)
            return f"{self.label(rank)} stopped"
        except Exception as exc:
            return f"{self.label(rank)} died: {type(exc).__name__}: {exc}"

    # ------------------------------------------------------------------ running
    def send(self, call: RankCall) -> list:
        return [a.run.remote(call) for a in self.actors]

    def gather(self, refs: list, timeout: float | None) -> list[Reply]:
        done, pending = self.ray.wait(refs, num_returns=len(refs), timeout=timeout)
        if pending:
            rank = refs.index(pending[0]) + 1
            raise TimeoutError(f"{self.label(rank)} did not answer within {timeout:g} s")
        out = []
        for rank, ref in enumerate(refs, 1):
            try:
                out.append(self.ray.get(ref))
            except Exception as exc:
                self.dead = self.dead or f"{self.label(rank)} failed: {type(exc).__name__}: {exc}"
                raise RuntimeError(self.dead) from None
        return out

    def cause(self, refs: list, grace: float) -> str | None:
        """Why an actor failed: the watchdog's finding or the error of one of ``refs`` (the calls in
        flight), waiting up to ``grace`` seconds for one to show."""
        if self.dead is None and refs:
            done, _ = self.ray.wait(refs, num_returns=len(refs), timeout=grace)
            for ref in done:
                try:
                    self.ray.get(ref)
                except Exception as exc:
                    self.dead = f"{self.label(refs.index(ref) + 1)} failed: {type(exc).__name__}: {exc}"
                    break
        return self.dead

    # ------------------------------------------------------------------ shutdown
    def close(self) -> None:
        """Kills every actor, removes the placement group, and shuts down the Ray connection it made."""
        if self._closed:
            return
        self._closed = True
        for actor in self.actors:
            try:
                self.ray.kill(actor, no_restart=True)
            except Exception:  # already gone
                pass
        try:
            self.ray.util.remove_placement_group(self.pg)
        except Exception:
            pass
        if self.ray_inited:
            self.ray.shutdown()


def _connect(ray) -> bool:
    """Joins the Ray cluster this process is pointed at (``RAY_ADDRESS``, or the one ``ray start``
    recorded in Ray's temp dir, ``RAY_TMPDIR``), else starts a local instance: ``ray.init()`` with
    no address. Not ``address="auto"``: with neither of those, that joins whatever Ray it finds
    running on the machine by scanning processes, such as another program's private instance,
    which then stops under this one when that program ends. True when it called ``ray.init``: the
    caller undoes it with ``ray.shutdown()``, which stops a local instance it started and only
    disconnects from a cluster it joined."""
    if ray.is_initialized():
        return False
    ray.init(include_dashboard=False, log_to_driver=False)
    return True


class RayExecutor(Executor):
    """Rank 0 in this process, the other ranks as Ray actors (see the module docstring)."""

    def _start(self) -> ModelRunner:
        timeouts, p = Timeouts.from_env(), self.config.parallel
        if p.nnodes > 1:
            raise ValueError(f"nnodes={p.nnodes}: with distributed_executor_backend='ray' Ray places the ranks on "
                             "its cluster's nodes; launch one engine, without --nnodes")
        ray = import_ray()
        ray_inited = _connect(ray)
        host = ray.util.get_node_ip_address()  # the actors may be on other nodes: they dial this
        store = create_store(p.world_size, envs.PAGEDLLM_PORT, timeouts.startup, host)
        self._inflight: list = []
        try:
            self._actors = RayActors(self.config, host, store.port, timeouts, ray_inited)
        except BaseException:
            if ray_inited:
                ray.shutdown()
            raise
        self._finalizer = weakref.finalize(self, self._actors.close)
        try:
            config = rank_config(self.config, 0)
            if config.device.type == "cuda":
                torch.cuda.set_device(config.device)
            group = init_groups(config.device, RankLayout.of(p, 0), store, timeouts.collective)
            self._group = group
            seed_and_threads(config)
            runner = ModelRunner(config, group.tp, group.pp)
            self._actors.await_ready()
        except BaseException:
            self._stop(graceful=False)
            raise
        self._actors.start_watchdog()
        logger.info("%d ranks (tensor parallel %d x pipeline parallel %d) as Ray actors, store %s:%d",
                    p.world_size, p.tensor_parallel_size, p.pipeline_parallel_size, host, store.port)
        return runner

    def actor_locations(self) -> dict[int, str]:
        """Rank -> where its actor runs (node and process)."""
        return dict(self._actors.where)

    def health_error(self) -> str | None:
        return super().health_error() or self._actors.dead

    def check_health(self) -> None:
        if self._actors.dead is not None and self._closed_reason is None:
            self._fail(self._actors.dead)
        super().check_health()

    def _run(self, call: RankCall) -> Any:
        try:
            self._inflight = self._actors.send(call)
            return call.run(self.runner)
        except BaseException as exc:
            self._die(exc)

    def _gather(self, call: RankCall, timeout: float | None) -> list[Reply]:
        try:
            refs = self._actors.send(call)
        except BaseException as exc:
            self._die(exc)
        self._inflight = refs
        local, error = None, None
        try:
            local = call.run(self.runner)
        except Exception as exc:
            error = exc
        try:
            others = self._actors.gather(refs, timeout)
        except BaseException as exc:
            self._die(exc)
        if error is not None:
            raise error
        return [Reply(local), *others]

    def _die(self, exc: BaseException) -> NoReturn:
        kind = self._actors.kind
        reason = self._actors.cause(self._inflight, _CAUSE_GRACE_S) or (
            f"every Ray actor is still running but the call failed on rank 0 (a collective gives up after "
            f"PAGEDLLM_TP_TIMEOUT={envs.PAGEDLLM_TP_TIMEOUT:g} s): {type(exc).__name__}: {exc}")
        self._fail(reason)
        raise_dead(kind, reason, exc)

    def _stop(self, graceful: bool) -> None:
        if getattr(self, "_finalizer", None) is not None:
            self._finalizer()
        group = getattr(self, "_group", None)
        if group is not None:
            self._group = None
            group.destroy()

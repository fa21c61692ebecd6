"""``pagedllm serve MODEL --data-parallel-size N --data-parallel-backend ray``: the N replicas as
Ray actors (one CPU, or one GPU, each) instead of local processes, behind the same router.

Each actor runs the ordinary server (``serve``, on a thread: uvicorn leaves signals alone off the
main thread) on the replica's port on its node, and reports its node's address so the router can
reach it. An actor that dies is restarted by Ray (``max_restarts=-1``): its ``__init__`` starts
the server again, on the same port, and the router's health checks take it back once it answers
``GET /health``. Shutdown kills the actors (``ray.kill``) after the router stopped relaying.

:class:`RayReplica` gives ``wait_healthy`` / ``stop_replicas`` (data_parallel.py) the parts of a
``multiprocessing.Process`` they use.
"""
from __future__ import annotations

import argparse
import logging
import os
import threading
import traceback
from dataclasses import replace

logger = logging.getLogger(__name__)

_STATUS_TIMEOUT_S = 5.0  # a status call to an actor that does not answer in time: still starting


class _ReplicaActor:
    """One replica's server, run on a thread of this Ray actor."""

    def __init__(self, serve, args: argparse.Namespace):
        self._status: int | None = None
        threading.Thread(target=self._main, args=(serve, args), name="pagedllm-dp-replica", daemon=True).start()

    def _main(self, serve, args: argparse.Namespace) -> None:
        try:
            self._status = serve(args)
        except BaseException:
            traceback.print_exc()
            self._status = 1
        if self._status is None:
            self._status = 0

    def status(self) -> int | None:
        """The server's exit status, None while it runs."""
        return self._status

    def where(self) -> tuple[str, int]:
        """(this node's IP address, this process's id)."""
        import ray
        return ray.util.get_node_ip_address(), os.getpid()


class RayReplica:
    """Replica ``index`` as a Ray actor, with the ``exitcode`` / ``is_alive`` / ``terminate`` /
    ``join`` / ``kill`` / ``name`` of a process."""

    def __init__(self, ray, serve, args: argparse.Namespace, index: int, num_gpus: int):
        self.ray, self.name = ray, f"pagedllm-dp{index}"
        cls = ray.remote(_ReplicaActor)
        self.actor = cls.options(num_cpus=1, num_gpus=num_gpus, max_restarts=-1, max_task_retries=-1,
                                 name=self.name, namespace="pagedllm", lifetime=None).remote(serve, args)
        self._killed = False

    def address(self, timeout: float) -> tuple[str, int]:
        return self.ray.get(self.actor.where.remote(), timeout=timeout)

    @property
    def exitcode(self) -> int | None:
        if self._killed:
            return -9
        try:
            return self.ray.get(self.actor.status.remote(), timeout=_STATUS_TIMEOUT_S)
        except self.ray.exceptions.GetTimeoutError:
            return None
        except self.ray.exceptions.RayActorError:
            return -1

    def is_alive(self) -> bool:
        return self.exitcode is None

    def terminate(self) -> None:
        self.kill()

    def kill(self) -> None:
        if not self._killed:
            self._killed = True
            self.ray.kill(self.actor, no_restart=True)

    def join(self, timeout: float | None = None) -> None:
        pass  # ray.kill is final: nothing to wait for


def start_ray_replicas(serve, plans: list, replica_args: list[argparse.Namespace],
                       timeout: float) -> tuple[list[RayReplica], list, bool]:
    """One actor per plan (running ``serve`` with its ``replica_args``) on the Ray cluster this
    process is pointed at, or a local one (executor/ray.py's ``_connect``); the bool is True when
    this call ran ``ray.init`` (the caller then runs ``ray.shutdown()``); the plans come back with
    the address each replica's node has."""
    from pagedllm.worker.executor.ray import _connect, import_ray

    ray = import_ray()
    ray_inited = _connect(ray)
    replicas, placed = [], []
    for plan, rargs in zip(plans, replica_args):
        gpu = plan.device.startswith("cuda")
        rargs = argparse.Namespace(**vars(rargs))
        rargs.host = "0.0.0.0"  # the router may be on another node
        if gpu:
            rargs.device = "cuda:0"  # Ray shows the actor its own GPU only, as device 0
        replicas.append(RayReplica(ray, serve, rargs, plan.index, 1 if gpu else 0))
    for plan, replica in zip(plans, replicas):
        host, pid = replica.address(timeout=timeout)
        logger.warning("data-parallel replica %d: Ray actor on %s (pid %d), port %d", plan.index, host, pid, plan.port)
        placed.append(replace(plan, host=host))
    return replicas, placed, ray_inited

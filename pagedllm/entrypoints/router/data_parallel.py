"""``pagedllm serve MODEL --data-parallel-size N``: N replicas on this host behind one router.

Each replica is an ordinary ``serve`` process (its own engine, scheduler and KV pool) on an
internal 127.0.0.1 port, started with ``multiprocessing`` (spawn) from the parent's parsed flags;
the parent runs the router on ``--host``/``--port``. This reuses the whole server unchanged, and a
replica that crashes takes only its own requests with it (the router fails over). The server hands
in its own entry point (``serve``), so this module never imports the server that imports it.
The router takes the server's ``--api-key`` (and sends it to the replicas, which check it too), its
request body limits and the deployment flags clients see (TLS, CORS, ``--root-path``, middleware,
request ids and logging, ``--uds``); the replicas serve plain HTTP on 127.0.0.1 with those reset
(``CLIENT_FACING_HTTP_ARGS``): the router strips the root path and forwards what they understand.
The replicas split the machine: on CPU each gets ``cores // (N x TP)`` torch threads (unless ``--num-threads``
says otherwise) and ``1/N`` of ``--gpu-memory-utilization``; on CUDA replica i gets device i.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from pagedllm import platform
from pagedllm.engine.arg_utils import engine_args_from_cli
from pagedllm.entrypoints.http_common import HttpOptions, add_http_args
from pagedllm.entrypoints.openai.chat_features import load_chat_template
from pagedllm.utils import check_int

from .cli import ROUTING_DEFAULTS, add_routing_args, api_key_from_cli, config_from_cli, serve_router

logger = logging.getLogger(__name__)
# ``pagedllm serve``'s entry point (api_server.run_server): parsed flags in, exit status out
ServeFn = Callable[[argparse.Namespace], int]
# the deployment flags (add_http_args) that belong to the client-facing router only: a replica taking them
# would serve HTTPS (or a Unix socket) where the router calls http://127.0.0.1:PORT, or apply CORS, the
# user's middleware and request logging a second time. The replicas keep --api-key (the router sends
# them one), --disable-fastapi-docs (the router forwards /docs to them), and the log levels.
CLIENT_FACING_HTTP_ARGS = ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs", "ssl_cert_reqs", "ssl_ciphers",
                           "allowed_origins", "allowed_methods", "allowed_headers", "allow_credentials", "root_path",
                           "middleware", "enable_request_id_headers", "enable_log_requests", "disable_log_requests",
                           "max_log_len", "uds")


@dataclass(frozen=True)
class ReplicaPlan:
    """Where replica ``index`` runs: its internal port, torch threads, device and memory share."""

    index: int
    port: int
    num_threads: int | None
    device: str
    gpu_memory_utilization: float
    host: str = "127.0.0.1"  # where the router reaches it (a Ray replica: its node's address)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


class ReplicaStartupError(RuntimeError):
    """A replica exited or did not become healthy in time."""


def add_data_parallel_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("data parallel")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="engine replicas on this host behind one router (each on its own internal port)")
    g.add_argument("--data-parallel-backend", "-dpb", choices=("mp", "ray"), default="mp",
                   help="how the replicas run: mp (processes on this host) or ray (Ray actors on the reachable "
                        "Ray cluster, or a local one; restarted by Ray when they die; pip install 'pagedllm[ray]')")
    g.add_argument("--data-parallel-startup-timeout", type=float, default=600.0,
                   help="seconds the replicas may take to load the model and pass GET /health")
    add_routing_args(parser, "data-parallel routing (with --data-parallel-size > 1)")


def wants_data_parallel(args: argparse.Namespace) -> bool:
    """True for ``--data-parallel-size`` > 1; ValueError for a size < 1, or for routing flags
    given to a single replica (a single replica is served directly: they would be ignored)."""
    size = args.data_parallel_size
    check_int("data_parallel_size", size, 1)
    if getattr(args, "data_parallel_backend", "mp") == "ray":
        from pagedllm.worker.executor.ray import import_ray
        import_ray()  # ValueError with the install hint when Ray is missing
    if size == 1:
        given = [f"--{name.replace('_', '-')}" for name, default in ROUTING_DEFAULTS.items()
                 if getattr(args, name) != default]
        if getattr(args, "data_parallel_backend", "mp") != "mp":
            given.append("--data-parallel-backend")
        if given:
            raise ValueError(f"{', '.join(given)} only apply with --data-parallel-size > 1 (got 1)")
    return size > 1


def plan_replicas(args: argparse.Namespace, config) -> list[ReplicaPlan]:
    """One plan per replica, from the parsed flags and the EngineConfig they make (validated)."""
    # every rank of a replica (tensor x pipeline) takes cores, or a GPU
    n, ranks = args.data_parallel_size, config.parallel.world_size
    if config.device.type == "cuda":
        return _cuda_plans(args, config, n, ranks)
    threads = args.num_threads or max(1, platform.physical_cores() // (n * ranks))
    if args.num_threads is None and platform.physical_cores() < n * ranks:
        logger.warning("%d replicas x %d ranks on %d physical cores: each rank gets 1 thread (oversubscribed)",
                       n, ranks, platform.physical_cores())
    share = args.gpu_memory_utilization / n  # the replicas share this host's RAM
    return [ReplicaPlan(i, free_port(), threads, args.device, share) for i in range(n)]


def _cuda_plans(args: argparse.Namespace, config, n: int, ranks: int) -> list[ReplicaPlan]:
    import torch
    if ranks > 1:
        p = config.parallel
        raise ValueError(f"data_parallel_size={n} with tensor_parallel_size={p.tensor_parallel_size} x "
                         f"pipeline_parallel_size={p.pipeline_parallel_size} on CUDA is not supported: rank r takes "
                         "cuda:r in every replica; run one server per GPU group (CUDA_VISIBLE_DEVICES) behind "
                         "`pagedllm router` instead")
    if config.device.index is not None:
        raise ValueError(f"device={args.device!r} names one GPU; data_parallel_size={n} gives replica i cuda:i: "
                         "use --device cuda or auto")
    count = torch.cuda.device_count()
    if n > count:
        raise ValueError(f"data_parallel_size={n} needs {n} GPUs (replica i on cuda:i); this host has {count}")
    return [ReplicaPlan(i, free_port(), args.num_threads, f"cuda:{i}", args.gpu_memory_utilization)
            for i in range(n)]


def free_port() -> int:
    """A port free on 127.0.0.1 now (the replica binds it a moment later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def replica_args(args: argparse.Namespace, plan: ReplicaPlan) -> argparse.Namespace:
    """The flags of one replica: the parent's, on its internal port, threads, device and share, plain
    HTTP with the client-facing deployment flags at their defaults (the router applies them)."""
    values = vars(args) | {"host": "127.0.0.1", "port": plan.port, "num_threads": plan.num_threads,
                           "device": plan.device, "gpu_memory_utilization": plan.gpu_memory_utilization,
                           "data_parallel_size": 1, "data_parallel_backend": "mp"}
    return argparse.Namespace(**(values | ROUTING_DEFAULTS | _client_facing_defaults()))


def _client_facing_defaults() -> dict:
    """CLIENT_FACING_HTTP_ARGS at their parser defaults (add_http_args says what they are)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_http_args(parser, api_key=False)
    defaults = vars(parser.parse_args([]))
    return {name: defaults[name] for name in CLIENT_FACING_HTTP_ARGS}


def _replica_main(serve: ServeFn, args: argparse.Namespace, parent_pid: int, index: int) -> None:
    """A replica process: the ordinary server, which stops when the parent goes away."""
    logging.basicConfig(level=logging.WARNING, format=f"%(levelname)s dp{index} %(name)s: %(message)s")
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    try:
        sys.exit(serve(args))
    except (ValueError, TypeError) as exc:
        print(f"pagedllm serve (data-parallel replica {index}): error: {exc}", file=sys.stderr)
        sys.exit(2)


def _exit_with_parent(parent_pid: int) -> None:
    """SIGTERM to this replica (a graceful uvicorn shutdown) once its parent is gone."""
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGTERM)


def start_replicas(serve: ServeFn, args: argparse.Namespace, plans: list[ReplicaPlan]) -> list:
    """One spawned process per plan, running ``serve`` (a module-level function: spawn pickles it by name)."""
    ctx = multiprocessing.get_context("spawn")
    processes = []
    for plan in plans:
        p = ctx.Process(target=_replica_main, name=f"pagedllm-dp{plan.index}",
                        args=(serve, replica_args(args, plan), os.getpid(), plan.index))
        p.start()
        processes.append(p)
    return processes


def wait_healthy(plans: list[ReplicaPlan], processes: list, timeout: float) -> None:
    """Returns once every replica answers GET /health with 200; ReplicaStartupError when one exits
    first or ``timeout`` seconds pass."""
    deadline, pending = time.monotonic() + timeout, list(range(len(plans)))
    with httpx.Client(timeout=2.0) as client:
        while pending:
            for i in list(pending):
                if processes[i].exitcode is not None:
                    raise ReplicaStartupError(f"data-parallel replica {i} exited with code {processes[i].exitcode} "
                                              "while starting (its error is above)")
                if _is_healthy(client, plans[i].url):
                    pending.remove(i)
            if pending and time.monotonic() > deadline:
                raise ReplicaStartupError(f"data-parallel replicas {pending} not healthy after {timeout:g} s "
                                          "(--data-parallel-startup-timeout)")
            time.sleep(0.2 if pending else 0)


def _is_healthy(client: httpx.Client, url: str) -> bool:
    try:
        return client.get(f"{url}/health").status_code == 200
    except httpx.HTTPError:
        return False


def stop_replicas(processes: list, grace: float) -> None:
    """SIGTERM (each drains for ``grace`` seconds, as ``--shutdown-timeout``), then SIGKILL."""
    for p in processes:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + grace + 10
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            logger.warning("data-parallel replica %s did not stop: killing it", p.name)
            p.kill()
            p.join(5)


def run_data_parallel(args: argparse.Namespace, serve: ServeFn, http_options: HttpOptions) -> int:
    """Starts the replicas (each runs ``serve``), serves the router until interrupted, then stops the replicas.
    ``http_options``: serve's deployment flags (http_options_from_cli), applied by the router."""
    config = engine_args_from_cli(args).create_engine_config()  # bad flags fail here, before N processes start
    plans = plan_replicas(args, config)
    ray_inited = False
    if args.data_parallel_backend == "ray":
        from .ray_replicas import start_ray_replicas
        processes, plans, ray_inited = start_ray_replicas(serve, plans, [replica_args(args, p) for p in plans],
                                                           args.data_parallel_startup_timeout)
    else:
        processes = start_replicas(serve, args, plans)
    router_config = router_config_of(args, config, plans)
    try:
        wait_healthy(plans, processes, args.data_parallel_startup_timeout)
        logger.warning("data parallel: %d replicas at %s", len(plans), ", ".join(p.url for p in plans))
        # the keys are the RouterConfig's (with $PAGEDLLM_API_KEY), checked on the router's own set of paths
        serve_router(router_config, args.host, args.port, args.uvicorn_log_level,
                     dataclasses.replace(http_options, api_keys=()))
    except ReplicaStartupError as exc:
        print(f"pagedllm serve: error: {exc}", file=sys.stderr)
        return 1
    finally:
        stop_replicas(processes, args.shutdown_timeout)
        if ray_inited:
            import ray
            ray.shutdown()
    return 0


def router_config_of(args: argparse.Namespace, config, plans: list[ReplicaPlan]):
    """The parent's RouterConfig: the routing, limit and key flags of ``serve``; the replicas (same
    flags, same key) are sent that key, so the client's own header never has to match theirs."""
    return config_from_cli(args, tuple(p.url for p in plans), tokenizer=config.model.tokenizer,
                           trust_remote_code=args.trust_remote_code, block_size=args.block_size,
                           chat_template=load_chat_template(args.chat_template),
                           backend_api_key=_first(api_key_from_cli(args)))


def _first(key: str | tuple[str, ...] | None) -> str | None:
    """The key the router sends the replicas: they were given all of them, any one will do."""
    return key[0] if isinstance(key, tuple) else key

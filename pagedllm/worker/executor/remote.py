"""Ranks on other nodes (``--nnodes``): each gets rank 0's calls through the rendezvous store.

A rank on another host has no pipe to rank 0, so rank 0 publishes each ``RankCall`` (pickled,
as ``broadcast_object_list`` would) under ``call/<n>`` in its ``TCPStore``, the same store the
process groups rendezvous on; a remote rank waits for the next key, runs the call, and the last
reader deletes it. The store lives in rank 0's process: when rank 0 exits, a waiting rank's
connection closes and it leaves (as a local worker does at end-of-file on its pipe).

Start-up, all through the store: rank 0 publishes its parallel layout and model (``config``);
each remote rank checks it against its own command line (a mismatch, e.g. another world size, is
an error on both sides), reports ``joined/<rank>``, joins the process groups, loads its shard
and reports ``ready/<rank>``. A rank that fails reports ``error/<rank>`` (its traceback) before
it exits; rank 0 reads those to say why a step failed. A running rank bumps ``alive/<rank>``
every second over a connection of its own; rank 0's watchdog marks the engine dead when one
stops (a killed host), so ``/health`` turns 503 between steps too.
"""
from __future__ import annotations

import json
import logging
import multiprocessing as mp
import pickle
import signal
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from pagedllm import envs
from pagedllm.config import EngineConfig
from pagedllm.distributed.parallel_state import RankGroups, init_groups, join_store
from pagedllm.distributed.pipeline import RankLayout
from pagedllm.worker.executor.base import RankCall, Reply, answer, rank_config, seed_and_threads, unpicklable_reply
from pagedllm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

_CONFIG_KEY = "pagedllm/config"
_FIRST_ERROR = "error/first"  # the first failure any remote rank reported (start-up reads it)
_POLL_S = 0.05  # start-up: how often rank 0 looks for the remote ranks' reports
_IDLE_WAIT_S = 300.0  # a remote rank's wait for the next call, renewed while rank 0 is there
# a remote rank bumps its counter every _HEARTBEAT_S; rank 0 declares it dead after _SILENCE_S
# without a bump (counters, not clocks: the hosts' clocks need not agree)
_HEARTBEAT_S, _SILENCE_S = 1.0, 10.0


def signature(config: EngineConfig) -> dict:
    """What every node must agree on: the parallel layout, the model's shape and weights format,
    and what its KV pool holds (dtype, scales, CPU-tier slots rank 0 schedules moves into)."""
    p, m, c = config.parallel, config.model, config.cache
    return dict(tensor_parallel_size=p.tensor_parallel_size, pipeline_parallel_size=p.pipeline_parallel_size,
                world_size=p.world_size, nnodes=p.nnodes, architecture=m.architecture, num_layers=m.num_layers,
                hidden_size=m.hidden_size, vocab_size=m.vocab_size, dtype=str(m.dtype), quantization=m.quantization,
                block_size=c.block_size, max_model_len=m.max_model_len, cache_dtype=str(c.cache_dtype),
                calculate_kv_scales=c.calculate_kv_scales, kv_offload_cpu_bytes=c.kv_offload_cpu_bytes,
                kv_disk_tier=c.kv_offload_dir is not None, kv_remote_tier=c.kv_offload_remote is not None)


def node_of(rank: int, config: EngineConfig) -> int:
    return rank // config.parallel.ranks_per_node


def headless_command(config: EngineConfig, node: int) -> str:
    p = config.parallel
    return (f"pagedllm serve MODEL --headless --nnodes {p.nnodes} --node-rank {node} --master-addr {p.master_addr} "
            f"--master-port {p.master_port} --tensor-parallel-size {p.tensor_parallel_size} "
            f"--pipeline-parallel-size {p.pipeline_parallel_size}")


# ---------------------------------------------------------------------- rank 0's side
class RemoteRanks:
    """Rank 0's view of the ranks on other nodes: publishes calls, reads their reports."""

    def __init__(self, store: dist.TCPStore, config: EngineConfig, ranks: list[int], startup_timeout: float):
        self.store, self.config, self.ranks = store, config, ranks
        self.timeout = startup_timeout
        self._next = 0
        self.dead: str | None = None  # set by the watchdog: why a remote rank is gone
        self._stop = threading.Event()
        store.set(_CONFIG_KEY, json.dumps(signature(config)))

    def start_watchdog(self) -> None:
        if self.ranks:
            threading.Thread(target=self._watch, name="pagedllm-remote-watchdog", daemon=True).start()

    def _watch(self) -> None:
        """Marks ``dead`` when a remote rank's heartbeat counter stops moving for _SILENCE_S."""
        seen = {rank: (-1, time.monotonic()) for rank in self.ranks}
        while not self._stop.wait(_HEARTBEAT_S):
            store = self.store
            if store is None:
                return
            now = time.monotonic()
            for rank, (count, since) in seen.items():
                current = store.add(f"alive/{rank}", 0)
                if current != count:
                    seen[rank] = (current, now)
                elif now - since > _SILENCE_S:
                    self.dead = (f"rank {rank} (node {node_of(rank, self.config)}) sent no heartbeat for "
                                 f"{now - since:.0f} s: its host or process is gone")
                    logger.error("remote rank died: %s", self.dead)
                    return

    def await_all(self, what: str) -> None:
        """Waits until every remote rank has reported ``what`` ("joined", "ready"); raises
        RuntimeError with a rank's error, or naming the nodes not there after the timeout."""
        pending, deadline = set(self.ranks), time.monotonic() + self.timeout
        while pending:
            if self._has(_FIRST_ERROR):  # any rank, also one this layout does not expect
                raise RuntimeError(f"a remote rank failed during start-up:\n{self.store.get(_FIRST_ERROR).decode()}")
            for rank in sorted(pending):
                if self._has(f"{what}/{rank}"):
                    pending.discard(rank)
            if pending and time.monotonic() > deadline:
                raise RuntimeError(self._missing(pending, what))
            if pending:
                time.sleep(_POLL_S)

    def _missing(self, ranks: set[int], what: str) -> str:
        nodes = sorted({node_of(r, self.config) for r in ranks})
        p = self.config.parallel
        return (f"node(s) {nodes} (rank(s) {sorted(ranks)}) did not report {what!r} within {self.timeout:g} s "
                f"(PAGEDLLM_TP_STARTUP_TIMEOUT); start on each of them, with the same model and options: "
                f"{headless_command(self.config, nodes[0])} (--node-rank N for node N); they must reach "
                f"{p.master_addr}:{p.master_port}")

    def send(self, call: RankCall | None) -> None:
        """Publishes the next call (None: stop) for every remote rank (nothing without any)."""
        if not self.ranks:
            return
        self._next += 1
        self.store.set(f"call/{self._next}", pickle.dumps(call))

    def gather(self, timeout: float | None) -> list[Reply]:
        """Every remote rank's Reply to the last call (a ``reply`` one), in rank order; TimeoutError
        past ``timeout`` seconds (None: no limit), RuntimeError when a rank failed instead."""
        deadline = None if timeout is None else time.monotonic() + timeout
        replies = []
        for rank in self.ranks:
            key = f"reply/{self._next}/{rank}"
            while not self._has(key):
                failure = self.dead or self.cause()
                if failure is not None:
                    raise RuntimeError(failure)
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"rank {rank} (node {node_of(rank, self.config)}) did not answer within "
                                       f"{timeout:g} s")
                time.sleep(_POLL_S)
            replies.append(pickle.loads(self.store.get(key)))
            self.store.delete_key(key)
        return replies

    def cause(self) -> str | None:
        """The first traceback a remote rank reported, if any."""
        for rank in self.ranks if self.store is not None else ():
            try:
                if self._has(f"error/{rank}"):
                    return f"node {node_of(rank, self.config)} raised:\n{self.store.get(f'error/{rank}').decode()}"
            except RuntimeError:  # the store is gone (shut down)
                return None
        return None

    def _has(self, key: str) -> bool:
        return self.store.check([key])

    def close(self) -> None:
        """Stops the watchdog and drops rank 0's reference to the store (the last one frees its
        port); idempotent."""
        self._stop.set()
        self.store = None


# ---------------------------------------------------------------------- a remote rank
def check_signature(store: dist.TCPStore, config: EngineConfig, rank: int, timeout: float) -> None:
    """Raises ValueError when rank 0 runs another layout or model than this node's command line."""
    store.wait([_CONFIG_KEY], timedelta(seconds=timeout))
    master, mine = json.loads(store.get(_CONFIG_KEY)), signature(config)
    diff = {k: (mine[k], master.get(k)) for k in mine if mine[k] != master.get(k)}
    if diff:
        text = ", ".join(f"{k}={ours!r} here but {theirs!r} on node 0" for k, (ours, theirs) in diff.items())
        raise ValueError(f"rank {rank} does not match the engine on node 0: {text}; start every node with the "
                         "same model, --tensor-parallel-size, --pipeline-parallel-size and --nnodes")
    if rank >= master["world_size"]:
        raise ValueError(f"rank {rank} is outside node 0's world size {master['world_size']}")


def remote_rank_main(config: EngineConfig, rank: int, startup_timeout: float, collective_timeout: float) -> None:
    """One rank on a node other than rank 0's: join, load its shard, run rank 0's calls until told
    to stop or rank 0 goes away. Reports a failure to rank 0 and raises it."""
    p = config.parallel
    if rank % p.ranks_per_node:  # a spawned rank: Ctrl-C is for the node's first rank to act on
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        store = join_store(p.master_addr, p.master_port, p.world_size, startup_timeout,
                           envs.TORCHELASTIC_USE_AGENT_STORE)
    except dist.DistNetworkError as exc:
        raise RuntimeError(f"rank {rank} could not reach node 0's store at {p.master_addr}:{p.master_port} within "
                           f"{startup_timeout:g} s (PAGEDLLM_TP_STARTUP_TIMEOUT): is node 0 started with the same "
                           "--master-addr / --master-port, and is the port open?") from exc
    groups: RankGroups | None = None
    try:
        check_signature(store, config, rank, startup_timeout)
        store.set(f"joined/{rank}", "1")
        if config.device.type == "cuda":
            torch.cuda.set_device(config.device)
        seed_and_threads(config, rank)
        groups = init_groups(config.device, RankLayout.of(p, rank), store, collective_timeout)
        runner = ModelRunner(config, groups.tp, groups.pp)
        _start_heartbeat(config, rank, startup_timeout)
        store.set(f"ready/{rank}", "1")
        _serve_calls(store, runner, p.world_size - p.ranks_per_node, rank)
    except dist.DistNetworkError:
        logger.info("rank %d: rank 0's store closed; leaving", rank)
    except BaseException:
        _report(store, rank, traceback.format_exc())
        raise
    finally:
        if groups is not None:
            groups.destroy()


def _start_heartbeat(config: EngineConfig, rank: int, timeout: float) -> None:
    """Bumps ``alive/<rank>`` every _HEARTBEAT_S on a store connection of its own (the main
    thread's connection is held by its long wait for the next call)."""
    p = config.parallel
    store = join_store(p.master_addr, p.master_port, p.world_size, timeout, envs.TORCHELASTIC_USE_AGENT_STORE)

    def beat() -> None:
        try:
            while True:
                store.add(f"alive/{rank}", 1)
                time.sleep(_HEARTBEAT_S)
        except RuntimeError:  # rank 0's store is gone: the main thread leaves too
            pass

    threading.Thread(target=beat, name=f"pagedllm-heartbeat-{rank}", daemon=True).start()


def _serve_calls(store: dist.TCPStore, runner: ModelRunner, num_readers: int, rank: int) -> None:
    n = 0
    while True:
        n += 1
        call = _next_call(store, n, num_readers)
        if call is None:
            return
        if call.reply:
            _store_reply(store, f"reply/{n}/{rank}", answer(call, runner))
        else:
            call.run(runner)


def _store_reply(store: dist.TCPStore, key: str, reply: Reply) -> None:
    try:
        data = pickle.dumps(reply)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        data = pickle.dumps(unpicklable_reply(exc))
    store.set(key, data)


def _next_call(store: dist.TCPStore, n: int, num_readers: int) -> RankCall | None:
    key = f"call/{n}"
    while True:
        try:
            store.wait([key], timedelta(seconds=_IDLE_WAIT_S))
            break
        except dist.DistStoreError:  # an idle engine: rank 0 is still there, keep waiting
            continue
    call = pickle.loads(store.get(key))
    if store.add(f"read/{n}", 1) == num_readers:  # the last reader cleans up
        store.delete_key(key)
        store.delete_key(f"read/{n}")
    return call


def _report(store: dist.TCPStore, rank: int, text: str) -> None:
    text = f"rank {rank}: {text}"
    try:
        store.set(f"error/{rank}", text)
        if not store.check([_FIRST_ERROR]):
            store.set(_FIRST_ERROR, text)
    except RuntimeError:  # rank 0's store is gone
        pass


def run_node(config: EngineConfig, startup_timeout: float, collective_timeout: float) -> int:
    """A headless node: its ranks (the first in this process, the others spawned); returns the
    exit status (0 when rank 0 stopped them, 1 when one failed)."""
    p = config.parallel
    first = p.node_rank * p.ranks_per_node
    if first == 0:
        raise ValueError("node_rank=0 hosts the engine and the API; --headless is for nodes 1 to nnodes - 1")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=remote_rank_main, args=(rank_config(config, r), r, startup_timeout,
                                                        collective_timeout), name=f"pagedllm-rank{r}", daemon=True)
             for r in range(first + 1, first + p.ranks_per_node)]
    for proc in procs:
        proc.start()
    status = 0
    try:
        remote_rank_main(rank_config(config, first), first, startup_timeout, collective_timeout)
    except Exception:
        logger.exception("rank %d failed", first)
        status = 1
    for proc in procs:
        proc.join()
        status = status or int(proc.exitcode != 0)
    return status


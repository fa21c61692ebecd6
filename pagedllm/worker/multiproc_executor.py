"""Tensor parallelism: one process per rank on torch.distributed (gloo on CPU, NCCL on GPU).

Rank 0 lives in the engine's process and drives: every runner call (profile, cache set-up,
execute) is first broadcast to the worker ranks with ``broadcast_object_list``, then run
locally, so all ranks enter the same collectives (the all-reduces in the row-parallel layers,
the all-gather of the vocabulary-parallel LM head) in the same order. Only rank 0 samples.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import socket

import torch
import torch.distributed as dist

from pagedllm.config import EngineConfig
from pagedllm.distributed.parallel_state import set_tensor_parallel
from pagedllm.worker.executor import UniProcExecutor, num_threads_per_rank

logger = logging.getLogger(__name__)
_STOP = "__stop__"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(config: EngineConfig, rank: int, port: int) -> None:
    world = config.parallel.tensor_parallel_size
    backend = "nccl" if config.device.type == "cuda" else "gloo"
    if config.device.type == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    set_tensor_parallel(rank, world)


def _rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    from dataclasses import replace
    if config.device.type == "cuda":
        return replace(config, device=torch.device("cuda", rank))
    return config


def _worker_main(config: EngineConfig, rank: int, port: int) -> None:
    """A worker rank: build the shard, then run whatever rank 0 broadcasts until told to stop."""
    from pagedllm.worker.model_runner import ModelRunner
    config = _rank_config(config, rank)
    if config.device.type == "cpu":
        torch.set_num_threads(config.num_threads or num_threads_per_rank(config))
    init_distributed(config, rank, port)
    torch.manual_seed(config.model.seed)
    runner = ModelRunner(config)
    while True:
        msg = [None]
        dist.broadcast_object_list(msg, src=0)
        method, args = msg[0]
        if method == _STOP:
            break
        getattr(runner, method)(*args)
    dist.destroy_process_group()


class MultiprocExecutor(UniProcExecutor):
    """Rank 0 in this process plus ``tensor_parallel_size - 1`` spawned worker processes."""

    def _start_workers(self) -> None:
        if dist.is_initialized():
            raise ValueError("a tensor-parallel engine is already running in this process; shut it down first")
        port = _free_port()
        ctx = mp.get_context("spawn")
        world = self.config.parallel.tensor_parallel_size
        self.workers = [ctx.Process(target=_worker_main, args=(self.config, r, port), daemon=True)
                        for r in range(1, world)]
        for w in self.workers:
            w.start()
        init_distributed(_rank_config(self.config, 0), 0, port)
        logger.info("tensor parallel: %d ranks on %s", world, dist.get_backend())

    def collective(self, method: str, *args):
        dist.broadcast_object_list([(method, args)], src=0)
        return getattr(self.runner, method)(*args)

    def shutdown(self) -> None:
        if not dist.is_initialized():
            return
        dist.broadcast_object_list([(_STOP, ())], src=0)
        for w in self.workers:
            w.join(timeout=30)
        dist.destroy_process_group()
        set_tensor_parallel(0, 1)

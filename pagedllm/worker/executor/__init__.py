"""Executors: run the model for a SchedulerOutput, in this process or across TP x PP ranks (and nodes)."""
from __future__ import annotations

from pagedllm.config import EngineConfig
from pagedllm.worker.executor.base import Executor, RankCall
from pagedllm.worker.executor.multiproc import MultiprocExecutor
from pagedllm.worker.executor.uniproc import UniProcExecutor

__all__ = ["Executor", "MultiprocExecutor", "RankCall", "UniProcExecutor", "make_executor"]


def make_executor(config: EngineConfig) -> Executor:
    p = config.parallel
    if p.node_rank != 0:
        raise ValueError(f"node_rank={p.node_rank} hosts no engine: node 0 does; run this node as "
                         f"`pagedllm serve MODEL --headless --nnodes {p.nnodes} --node-rank {p.node_rank} ...`")
    if config.parallel.world_size == 1:
        return UniProcExecutor(config)
    if config.parallel.executor_backend == "ray":
        from pagedllm.worker.executor.ray import RayExecutor  # ray is an optional extra
        return RayExecutor(config)
    return MultiprocExecutor(config)

"""A CPU rank's OpenMP threads: how many and where at start-up, and how many while it runs.

The policy (what ``PAGEDLLM_CPU_OMP_THREADS_BIND`` means, when the machine counts as busy) is in
``pagedllm/cpu_threads.py``; this applies it through torch and the C library, in the thread that
runs the model (OpenMP's thread count is per calling thread).
"""
from __future__ import annotations

import logging

import torch

from pagedllm import cpu_threads, envs
from pagedllm.config import EngineConfig
from pagedllm.native import bindings
from pagedllm.platform import physical_cores

logger = logging.getLogger(__name__)


def ranks_on_host(config: EngineConfig) -> int:
    """The engine's ranks that share this host's cores (torchrun: its LOCAL_WORLD_SIZE)."""
    return envs.LOCAL_WORLD_SIZE or config.parallel.ranks_per_node


def num_threads_per_rank(config: EngineConfig) -> int:
    """Physical cores shared evenly between the ranks on this host, no more than the CPUs this
    process may run on (under ``taskset -c 0`` one thread, not one per core of the host)."""
    cores = min(physical_cores(), len(cpu_threads.allowed_cpus()))
    return max(1, cores // ranks_on_host(config))


def set_up_threads(config: EngineConfig, rank: int = 0) -> None:
    """Sets this rank's thread count (``num_threads``, else its share of the physical cores) or,
    with CPU lists in ``PAGEDLLM_CPU_OMP_THREADS_BIND``, pins one thread to each CPU of its list.
    ValueError for a list that does not fit (a CPU outside this process's mask, a count that
    contradicts ``num_threads``, not one list per rank)."""
    setup, runtimes = cpu_threads.configure_openmp(), cpu_threads.openmp_runtimes()
    logger.info("OpenMP wait policy %s (%s); runtime %s", setup.wait_policy or "default", setup.why,
                ", ".join(runtimes) or "unknown")
    if len(runtimes) > 1:
        logger.warning("%d OpenMP runtimes in this process (%s): each keeps its own thread pool, which slows "
                       "both when they take turns", len(runtimes), ", ".join(runtimes))
    hosts = ranks_on_host(config)
    local = envs.LOCAL_RANK if envs.LOCAL_RANK is not None else rank % hosts
    cpus = cpu_threads.threads_bind().rank_cpus(local, hosts)
    if cpus is None:
        torch.set_num_threads(config.num_threads or num_threads_per_rank(config))
        return
    if config.num_threads is not None and config.num_threads != len(cpus):
        raise ValueError(f"num_threads={config.num_threads} contradicts PAGEDLLM_CPU_OMP_THREADS_BIND, which pins "
                         f"{len(cpus)} thread(s) to CPUs {cpu_threads.format_cpu_list(list(cpus))}: leave "
                         "num_threads unset or make them agree")
    cpu_threads.check_cpus_allowed(cpus, cpu_threads.allowed_cpus())
    torch.set_num_threads(len(cpus))
    bindings.library().pin_threads(cpus)
    logger.info("rank %d: %d OpenMP thread(s) pinned to CPUs %s", rank, len(cpus),
                cpu_threads.format_cpu_list(list(cpus)))


def adaptive_threads(config: EngineConfig) -> cpu_threads.AdaptiveThreads | None:
    """The run-time thread governor of a CPU engine, or None where the count is fixed: a set
    ``num_threads``, ``PAGEDLLM_CPU_OMP_THREADS_BIND`` other than ``auto``, or several ranks on
    this host (each would count the others' threads as a neighbour's)."""
    if config.device.type != "cpu" or config.num_threads is not None or ranks_on_host(config) > 1:
        return None
    if cpu_threads.threads_bind().mode != cpu_threads.BIND_AUTO:
        return None
    return cpu_threads.AdaptiveThreads(torch.get_num_threads(), cpu_threads.allowed_cpus())


def follow_free_cores(governor: cpu_threads.AdaptiveThreads | None) -> None:
    """Once per step: the thread count the governor wants now, if it changed (a clock read otherwise)."""
    if governor is None:
        return
    threads = governor.check()
    if threads is not None:
        torch.set_num_threads(threads)
        logger.debug("%d OpenMP thread(s) now: other processes' use of the %d CPUs changed", threads,
                     governor.ncpus)

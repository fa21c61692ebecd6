"""Executors: run the model for a SchedulerOutput, in this process or across tensor-parallel ranks."""
from __future__ import annotations

import logging
import os
import resource

import torch

from pagedllm import envs
from pagedllm.config import EngineConfig
from pagedllm.kv_cache.planning import blocks_per_sequence
from pagedllm.utils import human_bytes
from pagedllm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)



class UniProcExecutor:
    """Holds the model runner in this process; sizes and allocates the KV cache at start-up."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self._start_workers()
        if config.device.type == "cpu":
            torch.set_num_threads(config.num_threads or num_threads_per_rank(config))
        torch.manual_seed(config.model.seed)
        self.runner = ModelRunner(config)
        self.num_blocks, self.num_cpu_blocks = self._size_cache()
        self.collective("init_cache", self.num_blocks, self.num_cpu_blocks)

    def _start_workers(self) -> None:
        """No other ranks in a single-process executor."""

    def collective(self, method: str, *args):
        """Calls ``method`` on the model runner of every rank (here: only this one)."""
        return getattr(self.runner, method)(*args)

    def execute(self, scheduler_output):
        return self.collective("execute", scheduler_output)

    def shutdown(self) -> None:
        """Nothing to release in a single process."""

    # ------------------------------------------------------------------ sizing
    def _size_cache(self) -> tuple[int, int]:
        cache, sched = self.config.cache, self.config.scheduler
        block_bytes = self.runner.block_bytes()
        if cache.num_gpu_blocks_override:
            num_blocks = cache.num_gpu_blocks_override
        else:
            budget = cache.kv_cache_memory if cache.kv_cache_memory is not None else self._profiled_budget()
            num_blocks = budget // block_bytes
            num_blocks = min(num_blocks, self._useful_blocks())
        self._check_fits(num_blocks, block_bytes)
        num_cpu_blocks = 0
        if sched.preemption_mode == "swap":
            num_cpu_blocks = min(cache.swap_space // block_bytes, self._useful_blocks())
        return int(num_blocks), int(num_cpu_blocks)

    def _useful_blocks(self) -> int:
        """More blocks than max_num_seqs full-length sequences can hold would never be used."""
        sched = self.config.scheduler
        return sched.max_num_seqs * blocks_per_sequence(sched.max_model_len, self.config.cache.block_size)

    def _profiled_budget(self) -> int:
        cache, sched = self.config.cache, self.config.scheduler
        device = self.config.device
        before = _peak_rss()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        self.collective("profile_run", sched.max_num_batched_tokens, sched.max_model_len)
        if device.type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
            # CUDA graphs (captured once during the profile) keep a memory pool of their own
            used = torch.cuda.max_memory_allocated(device) + self.collective("cuda_graph_memory")
            return int(total * cache.gpu_memory_utilization - used)
        activation = max(0, _peak_rss() - before)
        budget = cache.gpu_memory_utilization * available_ram() - activation
        # On CPU the KV pool is capped (like vLLM's VLLM_CPU_KVCACHE_SPACE) so that several engines in
        # one process or on one machine leave it usable: gpu_memory_utilization x available RAM, at
        # most PAGEDLLM_CPU_KVCACHE_SPACE GiB, further capped at what max_num_seqs sequences could use.
        return int(max(0, min(budget, envs.PAGEDLLM_CPU_KVCACHE_SPACE * 1024**3)))

    def _check_fits(self, num_blocks: int, block_bytes: int) -> None:
        bs, max_len = self.config.cache.block_size, self.config.scheduler.max_model_len
        per_seq = blocks_per_sequence(max_len, bs)
        logger.info("KV cache: %d blocks x %d tokens (%s) = %d tokens; %.1f sequences of max_model_len=%d",
                    num_blocks, bs, human_bytes(num_blocks * block_bytes), num_blocks * bs,
                    num_blocks / per_seq, max_len)
        if num_blocks < per_seq:
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks ({num_blocks * bs} tokens) but one max_model_len="
                f"{max_len} sequence needs {per_seq} blocks; raise kv_cache_memory or gpu_memory_utilization, "
                "or lower max_model_len")


def available_ram() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 8 * 1024**3


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def num_threads_per_rank(config: EngineConfig) -> int:
    """Physical cores shared evenly between the tensor-parallel ranks."""
    return max(1, _physical_cores() // config.parallel.tensor_parallel_size)


def _physical_cores() -> int:
    try:
        with open("/proc/cpuinfo") as f:
            cores = {line.split(":")[1].strip() for line in f if line.startswith("core id")}
        return max(1, len(cores)) if cores else os.cpu_count() or 1
    except OSError:
        return os.cpu_count() or 1


def make_executor(config: EngineConfig) -> UniProcExecutor:
    if config.parallel.tensor_parallel_size == 1:
        return UniProcExecutor(config)
    from pagedllm.worker.multiproc_executor import MultiprocExecutor
    return MultiprocExecutor(config)

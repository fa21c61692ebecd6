"""What every executor does: hold rank 0's ModelRunner, call runner methods on every rank,
size and allocate the KV cache at start-up, and shut down (idempotently, also from a finalizer)."""
from __future__ import annotations

import logging
import traceback
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, NoReturn

import cloudpickle
import torch

from pagedllm import envs
from pagedllm.config import EngineConfig
from pagedllm.contracts.scheduler_output import SchedulerOutput
from pagedllm.kv_cache import sizing
from pagedllm.kv_cache.offload.setup import prefetch_tier_fingerprints
from pagedllm.platform import available_ram, peak_rss
from pagedllm.worker.draft_memory import draft_memory
from pagedllm.worker.model_runner import ExecuteResult, ModelRunner
from pagedllm.worker.threads import set_up_threads

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankCall:
    """One ModelRunner method (the function object, e.g. ``ModelRunner.execute``) with its
    arguments, run on every rank. Pickles by the method's qualified name. With ``reply`` every
    rank sends back a ``Reply`` (collective_rpc); otherwise the ranks answer nothing and a rank
    that raises stops the engine."""

    method: Callable[..., Any]
    args: tuple = ()
    reply: bool = False

    def __post_init__(self):
        if getattr(ModelRunner, getattr(self.method, "__name__", ""), None) is not self.method:
            raise TypeError(f"method={self.method!r} must be a ModelRunner method, e.g. ModelRunner.execute")

    def run(self, runner: ModelRunner) -> Any:
        return self.method(runner, *self.args)


@dataclass(frozen=True)
class Reply:
    """One rank's answer to a ``reply`` call: its result, or the traceback of what it raised."""

    value: Any = None
    error: str | None = None


def answer(call: RankCall, runner: ModelRunner) -> Reply:
    """Runs a ``reply`` call on a worker rank; an exception becomes the reply (the rank keeps serving)."""
    try:
        return Reply(call.run(runner))
    except Exception:
        return Reply(error=traceback.format_exc())


def unpicklable_reply(exc: Exception) -> Reply:
    return Reply(error=f"the result cannot be sent to rank 0 (it does not pickle): {type(exc).__name__}: {exc}")


def results_of(replies: list[Reply]) -> list:
    """Every rank's result, in rank order; RuntimeError with the tracebacks if any rank raised."""
    failed = [f"rank {rank}:\n{r.error}" for rank, r in enumerate(replies) if r.error is not None]
    if failed:
        raise RuntimeError("collective_rpc failed on " + "\n".join(failed))
    return [r.value for r in replies]


class Executor(ABC):
    """Runs the model on every rank (TP x PP, on one node or several); rank 0's runner lives in
    this process.

    Built ready to execute, with the KV cache sized and allocated on every rank
    (``num_blocks`` / ``num_cpu_blocks``); ``tier_fingerprints``: every rank's KV disk-tier
    fingerprint, computed once here and shared with the ranks and the scheduler (() without a
    disk tier). ``shutdown()`` stops the ranks and frees the pool
    and the weights; after it (or after a rank failed) every call raises RuntimeError.
    """

    def __init__(self, config: EngineConfig):
        self.config = config
        self._closed_reason: str | None = None
        # hashes every weights file once (beside the weight loading) for each rank and the scheduler
        fingerprints = prefetch_tier_fingerprints(config)
        self.runner = self._start()
        try:
            size = self._size_cache()
            self.num_blocks, self.num_cpu_blocks = size.num_blocks, size.num_cpu_blocks
            self.tier_fingerprints = fingerprints.result()
            self.run_on_all_ranks(RankCall(ModelRunner.init_cache, (self.num_blocks, self.num_cpu_blocks, True,
                                                                    self.tier_fingerprints)))
        except BaseException:
            self.shutdown()
            raise

    @abstractmethod
    def _start(self) -> ModelRunner:
        """Starts the ranks; returns rank 0's runner."""

    @abstractmethod
    def _run(self, call: RankCall) -> Any:
        """Runs ``call`` on every rank; returns rank 0's result."""

    def _gather(self, call: RankCall, timeout: float | None) -> list[Reply]:
        """Runs a ``reply`` call on every rank; every rank's Reply (rank 0's exception is raised as is)."""
        return [Reply(call.run(self.runner))]

    @abstractmethod
    def _stop(self, graceful: bool) -> None:
        """Stops the other ranks (asking first when ``graceful``) and releases the group; idempotent."""

    # ------------------------------------------------------------------ calls
    def run_on_all_ranks(self, call: RankCall) -> Any:
        """Runs a ModelRunner method on every rank, in the same order everywhere; rank 0's result."""
        self.check_health()
        return self._run(call)

    def execute(self, scheduler_output: SchedulerOutput) -> ExecuteResult:
        """One forward for the step; the logits to sample and rank 0's input-preparation time."""
        return self.run_on_all_ranks(RankCall(ModelRunner.execute, (scheduler_output,)))

    def block_bytes(self) -> int:
        """Bytes of one KV block on one rank."""
        return self.runner.block_bytes()

    def sync_kv_tiers(self, clear_disk: bool = False) -> None:
        """Every rank's queued KV disk-tier writes land (and with ``clear_disk`` its entries go)."""
        self.run_on_all_ranks(RankCall(ModelRunner.sync_kv_tiers, (clear_disk,)))

    def persist_kv_tiers(self, ops) -> None:
        """Every rank writes ``ops``' blocks to its disk tier and waits for them (ModelRunner.persist_kv_tiers)."""
        self.run_on_all_ranks(RankCall(ModelRunner.persist_kv_tiers, (ops,)))

    def collective_rpc(self, method: str | Callable, timeout: float | None, args: tuple, kwargs: dict) -> list:
        """``method`` (a ModelRunner method name, or a callable taking the runner first) on every
        rank; every rank's result, in rank order. ``timeout``: seconds to wait for the other ranks'
        results (None: no limit); past it the engine stops (its ranks are out of step) and
        TimeoutError is raised. A rank's exception is raised (rank 0's as is, another's as
        RuntimeError with its traceback) and the engine keeps running."""
        payload = cloudpickle.dumps((method, tuple(args), dict(kwargs)))  # lambdas and closures too
        self.check_health()
        return results_of(self._gather(RankCall(ModelRunner.rpc, (payload,), reply=True), timeout))

    def sleep(self, level: int) -> None:
        self.run_on_all_ranks(RankCall(ModelRunner.sleep, (level,)))

    def wake_up(self, tags: tuple[str, ...]) -> None:
        self.run_on_all_ranks(RankCall(ModelRunner.wake_up, (tags,)))

    def start_profile(self, directory: str) -> None:
        self.run_on_all_ranks(RankCall(ModelRunner.start_profile, (directory,)))

    def stop_profile(self) -> None:
        self.run_on_all_ranks(RankCall(ModelRunner.stop_profile))

    def health_error(self) -> str | None:
        """Why the executor cannot run any more, or None; a read only, safe from any thread."""
        return self._closed_reason

    def check_health(self) -> None:
        """Raises RuntimeError if the executor was shut down or a rank failed."""
        if self._closed_reason is not None:
            raise RuntimeError(self._closed_reason)

    # ------------------------------------------------------------------ lifecycle
    def shutdown(self) -> None:
        """Stops every rank and frees rank 0's KV pool and weights; safe to call twice."""
        if self._closed_reason is None:
            self._closed_reason = "the engine has been shut down"
        self._release(graceful=True)

    def _fail(self, reason: str) -> None:
        """A rank failed: the ranks are out of step for good, so everything stops at once."""
        if self._closed_reason is None:
            self._closed_reason = f"the engine is dead: {reason}"
        self._release(graceful=False)

    def _release(self, graceful: bool) -> None:
        self._stop(graceful)
        runner = getattr(self, "runner", None)
        if runner is not None:
            runner.release()

    # ------------------------------------------------------------------ sizing
    def _size_cache(self) -> sizing.KVCacheSize:
        cache, sched = self.config.cache, self.config.scheduler
        draft = draft_memory(self.config)
        # a draft model's pool has as many blocks as the target's: each block costs both
        nbytes = self.runner.block_bytes() + draft.block_bytes
        budget = None
        if cache.kv_cache_memory is not None:
            budget = cache.kv_cache_memory
        elif not cache.num_gpu_blocks_override:
            # the draft loads after this measurement: its weights come out of what is left
            budget = max(0, self._profiled_budget() - draft.weight_bytes)
        size = sizing.plan_cache(cache, sched, nbytes, budget)
        logger.info(sizing.describe(size.num_blocks, nbytes, cache.block_size, sched.max_model_len)
                    + (" (target and draft KV)" if draft.block_bytes else ""))
        return size

    def _profiled_budget(self) -> int:
        """Runs one forward at the step's token budget and gives the KV pool what is left."""
        cache, sched, device = self.config.cache, self.config.scheduler, self.config.device
        before = peak_rss()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        self.run_on_all_ranks(RankCall(ModelRunner.profile_run, (sched.max_num_batched_tokens, sched.max_model_len)))
        if device.type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
            # CUDA graphs (captured once during the profile run) keep a memory pool of their own
            used = torch.cuda.max_memory_allocated(device) + self.run_on_all_ranks(
                RankCall(ModelRunner.cuda_graph_memory))
            return sizing.cuda_budget(cache.gpu_memory_utilization, total, used)
        activation = max(0, peak_rss() - before)
        cap = int(envs.PAGEDLLM_CPU_KVCACHE_SPACE * 1024**3)
        return sizing.cpu_budget(cache.gpu_memory_utilization, available_ram(), activation, cap)


def rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """The config one rank runs with: on CUDA, rank r owns its node's device ``r mod
    ranks_per_node`` (under torchrun, ``LOCAL_RANK``)."""
    if config.device.type != "cuda":
        return config
    local = envs.LOCAL_RANK
    index = local if local is not None else rank % config.parallel.ranks_per_node
    return replace(config, device=torch.device("cuda", index))


def seed_and_threads(config: EngineConfig, rank: int = 0) -> None:
    """Per-process set-up every rank does before building its runner (on CPU: its threads,
    ``worker/threads.py``)."""
    if config.device.type == "cpu":
        set_up_threads(config, rank)
    torch.manual_seed(config.model.seed)


def raise_dead(kind: str, reason: str, exc: BaseException) -> NoReturn:
    """Raises why a ``kind`` call left the engine dead (after the executor recorded ``reason``):
    a TimeoutError for a timeout, a RuntimeError for another failure, ``exc`` itself otherwise."""
    if isinstance(exc, TimeoutError):
        raise TimeoutError(f"{kind} call timed out, the engine is dead: {reason}") from exc
    if isinstance(exc, Exception):
        raise RuntimeError(f"{kind} step failed, the engine is dead: {reason}") from exc
    raise exc

"""The executor of a single-rank engine: the runner lives in this process."""
from __future__ import annotations

from typing import Any

from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.worker.executor.base import Executor, RankCall, seed_and_threads
from pagedllm.worker.model_runner import ModelRunner


class UniProcExecutor(Executor):
    """One rank, in this process: calls go straight to the runner."""

    def _start(self) -> ModelRunner:
        seed_and_threads(self.config)
        return ModelRunner(self.config, TensorParallelGroup())

    def _run(self, call: RankCall) -> Any:
        return call.run(self.runner)

    def _stop(self, graceful: bool) -> None:
        """No other rank; the runner's pool is freed by ``shutdown``."""

"""Pipeline parallelism: which layers a stage holds, where each rank sits, and the stage-to-stage
point-to-point transfers (torch.distributed send / recv on the engine's own world group).

Ranks are laid out stage-major: ``rank = stage * tp + tp_rank``. Tensor-parallel rank ``t`` of
stage ``s`` sends its hidden states (and residual) to rank ``t`` of stage ``s + 1``: after the
row-parallel all-reduce every rank of a stage holds the same full hidden states, so each rank
needs only its own peer's copy. The last stage's tensor-parallel rank 0 sends the logits to rank
0, which samples.

    stage:      0                 1                 2 (last)
              rank 0 ──hidden──▶ rank 2 ──hidden──▶ rank 4 ──logits──▶ rank 0
              rank 1 ──hidden──▶ rank 3 ──hidden──▶ rank 5              (tp = 2, pp = 3)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.config import ParallelConfig


@dataclass(frozen=True)
class PipelineStage:
    """The contiguous layers ``[start, end)`` one stage holds; the first also holds the
    embedding, the last the final norm and the LM head."""

    start: int
    end: int
    is_first: bool = True
    is_last: bool = True

    @classmethod
    def whole(cls, num_layers: int) -> PipelineStage:
        return cls(0, num_layers)

    @property
    def num_layers(self) -> int:
        return self.end - self.start

    def owns_layer(self, index: int) -> bool:
        return self.start <= index < self.end


def stage_of(num_layers: int, pp_size: int, stage: int) -> PipelineStage:
    """Stage ``stage`` of ``pp_size``: ``num_layers // pp_size`` layers each, the remainder on the
    last stages (``[s*L // pp, (s+1)*L // pp)``); raises ValueError when a stage would be empty."""
    check_layers(num_layers, pp_size)
    if not 0 <= stage < pp_size:
        raise ValueError(f"stage={stage} must be in [0, pipeline_parallel_size={pp_size})")
    start, end = stage * num_layers // pp_size, (stage + 1) * num_layers // pp_size
    return PipelineStage(start, end, stage == 0, stage == pp_size - 1)


def check_layers(num_layers: int, pp_size: int) -> None:
    if pp_size > num_layers:
        raise ValueError(f"pipeline_parallel_size={pp_size} exceeds the model's {num_layers} layers: every stage "
                         f"needs at least one decoder layer (allowed: 1 to {num_layers})")


@dataclass(frozen=True)
class RankLayout:
    """Where one rank sits in the TP x PP grid."""

    rank: int
    tp_size: int
    pp_size: int

    @classmethod
    def of(cls, parallel: ParallelConfig, rank: int) -> RankLayout:
        return cls(rank, parallel.tensor_parallel_size, parallel.pipeline_parallel_size)

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def stage(self) -> int:
        return self.rank // self.tp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    def peer(self, stage: int) -> int:
        """The rank with this rank's tensor-parallel index in ``stage``."""
        return stage * self.tp_size + self.tp_rank

    @property
    def sends_logits(self) -> bool:
        """The last stage's tensor-parallel rank 0 hands the logits to rank 0."""
        return self.stage == self.pp_size - 1 and self.tp_rank == 0


class PipelineGroup:
    """This rank's point-to-point link to the neighbouring stages, over the engine's world group
    (gloo / NCCL; every transfer times out with the backend). ``destroy()`` is idempotent."""

    _HIDDEN_TAG, _LOGITS_TAG = 1, 2

    def __init__(self, layout: RankLayout, backend):
        self.layout = layout
        self._backend = backend

    @property
    def is_first(self) -> bool:
        return self.layout.stage == 0

    @property
    def is_last(self) -> bool:
        return self.layout.stage == self.layout.pp_size - 1

    def send_hidden(self, tensors: list[torch.Tensor]):
        """Starts sending ``tensors`` to the next stage; returns the works to wait on."""
        dst = self.layout.peer(self.layout.stage + 1)
        return [self._live().send([t.contiguous()], dst, self._HIDDEN_TAG) for t in tensors]

    def recv_hidden(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Fills ``tensors`` (shaped by the caller) from the previous stage, in order."""
        src = self.layout.peer(self.layout.stage - 1)
        for t in tensors:
            self._live().recv([t], src, self._HIDDEN_TAG).wait()
        return tensors

    def send_logits(self, logits: torch.Tensor):
        return self._live().send([logits.contiguous()], 0, self._LOGITS_TAG)

    def recv_logits(self, out: torch.Tensor) -> torch.Tensor:
        """Rank 0: one micro-batch's logits from the last stage."""
        last_stage_tp0 = (self.layout.pp_size - 1) * self.layout.tp_size
        self._live().recv([out], last_stage_tp0, self._LOGITS_TAG).wait()
        return out

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """``[world, *x.shape]``: every rank's ``x``, in rank order (a few ints for reports)."""
        parts = [torch.empty_like(x) for _ in range(self.layout.world_size)]
        self._live().allgather([parts], [x.contiguous()]).wait()
        return torch.stack(parts)

    def destroy(self) -> None:
        backend, self._backend = self._backend, None
        if backend is not None and hasattr(backend, "shutdown"):
            try:
                backend.shutdown()
            except RuntimeError:  # a peer already gone
                pass

    def _live(self):
        if self._backend is None:
            raise RuntimeError(f"pipeline group (rank {self.layout.rank}) has been destroyed")
        return self._backend

"""One engine's tensor-parallel group: its rank, its size and the collectives its layers run.

Nothing here is process-global. ``dist.init_process_group`` would make one default group per
process, shared by every engine in it (a second engine then runs its all-reduces on the first
one's group and waits forever); instead each engine builds its own ``TCPStore`` on its own port
and a gloo (CPU) or NCCL (GPU) backend object over it, and the model's parallel layers keep a
reference to that engine's ``TensorParallelGroup``. Several engines can then live in one process,
one after another or side by side.

Every collective has a timeout (the backend's): a rank that stops answering turns into an error
on the others instead of a wait that never ends. A rank that dies closes its sockets, which the
others see at once.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from pagedllm.distributed.pipeline import PipelineGroup, RankLayout

logger = logging.getLogger(__name__)

_PORT_ATTEMPTS = 100  # ports tried upwards from a requested first port


class TensorParallelGroup:
    """The ranks of one engine; ``size == 1`` is a group of one that never communicates.

    ``destroy()`` releases the backend and (on rank 0) the store's port; a collective on a
    destroyed group raises RuntimeError.
    """

    def __init__(self, rank: int = 0, size: int = 1, backend=None, store: dist.Store | None = None):
        if not 0 <= rank < size:
            raise ValueError(f"rank={rank} must be in [0, size={size})")
        if size > 1 and backend is None:
            raise ValueError(f"a group of size={size} needs a backend")
        self.rank, self.size = rank, size
        self._backend, self._store = backend, store

    @property
    def is_destroyed(self) -> bool:
        return self.size > 1 and self._backend is None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums ``x`` across the ranks in place (no-op on one rank).

        Capturable in a CUDA graph on NCCL: ProcessGroupNCCL runs the collective on its own
        stream after an event wait on the current one, and ``wait()`` makes the current stream
        wait for it, so nothing blocks the host (unless TORCH_NCCL_BLOCKING_WAIT is set); torch
        keeps work issued during a capture away from its watchdog (pytorch#103503) and flushes
        the watchdog's pending work before a capture starts (#104487). The communicator must
        exist before the capture: the eager warm-up runs create it."""
        if self.size > 1:
            self._live().allreduce([x]).wait()
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenates each rank's shard of the last dimension, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self._live().allgather([parts], [x.contiguous()]).wait()
        return torch.cat(parts, dim=-1)

    def gather_ints(self, values: list[int], device: torch.device) -> list[list[int]]:
        """Every rank's ``values`` in rank order (a start-up check, not a per-step collective: it
        reads the result on the host). Every rank must pass as many values."""
        mine = torch.tensor([values], dtype=torch.int64, device=device)  # [1, n]
        return self.all_gather_last_dim(mine).view(self.size, len(values)).tolist()  # [size, n]

    def barrier(self) -> None:
        if self.size > 1:
            self._live().barrier().wait()

    def destroy(self) -> None:
        """Closes the backend's connections and the store; idempotent."""
        backend, self._backend, self._store = self._backend, None, None
        if backend is not None and hasattr(backend, "shutdown"):
            try:
                backend.shutdown()
            except RuntimeError as exc:  # a peer already gone: nothing left to close politely
                logger.debug("tensor-parallel backend shutdown: %s", exc)

    def _live(self):
        if self._backend is None:
            raise RuntimeError(f"tensor-parallel group (rank {self.rank} of {self.size}) has been destroyed")
        return self._backend


def create_store(world_size: int, first_port: int, timeout: float, host: str = "127.0.0.1",
                 search: bool = True) -> dist.TCPStore:
    """Rank 0's store: the first free port from ``first_port`` upwards (0: any), or exactly
    ``first_port`` when not ``search`` (other nodes were told that port)."""
    if not search:
        ports = [first_port]
    else:
        ports = [0] if first_port == 0 else range(first_port, min(first_port + _PORT_ATTEMPTS, 65536))
    error: Exception | None = None
    for port in ports:
        try:
            return dist.TCPStore(host, port, world_size, is_master=True,
                                 timeout=timedelta(seconds=timeout), wait_for_workers=False)
        except (RuntimeError, OSError) as exc:  # DistNetworkError: the port is taken
            error = exc
    last = first_port if not search else first_port + _PORT_ATTEMPTS
    raise RuntimeError(f"no free port for the distributed store in [{first_port}, {last}] on {host}: "
                       f"{error}") from error


def connect_store(port: int, world_size: int, timeout: float, host: str = "127.0.0.1") -> dist.TCPStore:
    """A worker rank's client of rank 0's store (retries until ``timeout`` while rank 0 starts)."""
    return dist.TCPStore(host, port, world_size, is_master=False, timeout=timedelta(seconds=timeout))


def join_store(host: str, port: int, world_size: int, timeout: float, agent_store: bool = False) -> dist.Store:
    """A rank's client of the rendezvous store; under torchrun's agent store (which rank 0 joins
    too, instead of hosting one), the keys go under a prefix of their own."""
    store = connect_store(port, world_size, timeout, host)
    return dist.PrefixStore("pagedllm", store) if agent_store else store


def init_group(device: torch.device, rank: int, size: int, store: dist.Store, timeout: float) -> TensorParallelGroup:
    """Joins the rendezvous (blocks until every rank has, at most ``timeout`` seconds) and
    returns this rank's group: NCCL on CUDA, gloo otherwise."""
    if size == 1:
        return TensorParallelGroup()
    return TensorParallelGroup(rank, size, _backend(device, rank, size, store, timeout), store)


def _backend(device: torch.device, rank: int, size: int, store: dist.Store, timeout: float):
    td = timedelta(seconds=timeout)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = td
        return dist.ProcessGroupNCCL(store, rank, size, options)
    return dist.ProcessGroupGloo(store, rank, size, td)


@dataclass
class RankGroups:
    """One rank's groups: its stage's tensor-parallel group and, with pipeline parallelism, its
    point-to-point link to the other stages (None on one stage)."""

    tp: TensorParallelGroup
    pp: PipelineGroup | None = None

    def destroy(self) -> None:
        self.tp.destroy()
        if self.pp is not None:
            self.pp.destroy()


def init_groups(device: torch.device, layout: RankLayout, store: dist.Store, timeout: float) -> RankGroups:
    """This rank's groups. One stage: the tensor-parallel group on the store itself (as before
    pipeline parallelism). Several: each stage's tensor-parallel group under its own key prefix,
    and a world group for the stage-to-stage transfers."""
    if layout.pp_size == 1:
        return RankGroups(init_group(device, layout.rank, layout.tp_size, store, timeout))
    tp_store = dist.PrefixStore(f"tp{layout.stage}", store)
    tp = init_group(device, layout.tp_rank, layout.tp_size, tp_store, timeout)
    world = _backend(device, layout.rank, layout.world_size, dist.PrefixStore("pp", store), timeout)
    return RankGroups(tp, PipelineGroup(layout, world))

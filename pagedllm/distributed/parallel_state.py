"""Tensor-parallel group state (one process per rank on torch.distributed)."""
from __future__ import annotations

import torch.distributed as dist

_TP_RANK = 0
_TP_SIZE = 1


def set_tensor_parallel(rank: int, size: int) -> None:
    global _TP_RANK, _TP_SIZE
    _TP_RANK, _TP_SIZE = rank, size


def get_tp_rank() -> int:
    return _TP_RANK


def get_tp_size() -> int:
    return _TP_SIZE


def all_reduce(x):
    """Sums ``x`` across tensor-parallel ranks in place (no-op on one rank)."""
    if _TP_SIZE > 1:
        dist.all_reduce(x)
    return x


def all_gather_last_dim(x):
    """Concatenates each rank's shard of the last dimension."""
    if _TP_SIZE == 1:
        return x
    import torch
    parts = [torch.empty_like(x) for _ in range(_TP_SIZE)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)

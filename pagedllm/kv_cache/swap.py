"""The CPU swap pool: blocks that hold preempted requests' KV in host memory.

No sharing or caching here: a swapped-out request owns its CPU blocks outright until it is
swapped back in (or aborted), so a plain LIFO free list is enough.
"""
from __future__ import annotations


class CpuBlockPool:
    """``num_blocks`` host blocks, handed out and returned whole."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2, ...

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise ValueError(f"cannot allocate {n} CPU blocks: only {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def free(self, block_ids: list[int]) -> None:
        self._free.extend(reversed(block_ids))

    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks if self.num_blocks else 0.0

    def free_ids(self) -> list[int]:
        return list(self._free)

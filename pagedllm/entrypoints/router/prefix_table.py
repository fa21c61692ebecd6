"""Which backend (probably) holds which prefix blocks: the router's own routing history.

A block hash names its whole prefix (``kv_cache/prefix_hash.py``), so a backend that was sent
blocks ``h0..hk`` of a prompt holds the first ``j`` blocks of a new prompt iff it holds ``h_{j-1}``
and, before it, ``h0..h_{j-2}``. The table maps each hash to the backends it was routed to and
forgets the least recently used hash beyond ``capacity``, roughly as the replicas' own caches
evict their least recently used free blocks. It cannot see a replica's evictions or traffic that
bypassed the router: a stale entry costs one routing choice, never a wrong answer.
"""
from __future__ import annotations

from collections import OrderedDict


class PrefixTable:
    """A bounded LRU map ``block hash -> backends routed that block``; O(blocks) per lookup."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"capacity={capacity!r} is invalid: must be >= 1")
        self.capacity = capacity
        self._holders: OrderedDict[bytes, set[str]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._holders)

    def match(self, hashes: list[bytes]) -> dict[str, int]:
        """Leading blocks of ``hashes`` each backend holds (backends holding none are left out)."""
        matched: dict[str, int] = {}
        alive: set[str] | None = None
        for i, h in enumerate(hashes):
            holders = self._holders.get(h)
            alive = set(holders or ()) if alive is None else alive & (holders or set())
            if not alive:
                break
            for backend in alive:
                matched[backend] = i + 1
        return matched

    def record(self, hashes: list[bytes], backend: str) -> None:
        """``backend`` was sent a prompt with these blocks: it holds them now (most recently used).

        The last block is touched first, so a prompt's leading blocks, which more prompts share,
        are the last of its blocks to be forgotten (as the engine frees a table tail first)."""
        for h in reversed(hashes):
            self._holders.setdefault(h, set()).add(backend)
            self._holders.move_to_end(h)
        while len(self._holders) > self.capacity:
            self._holders.popitem(last=False)

    def forget(self, backend: str) -> None:
        """``backend`` lost its cache (it failed, or restarted): drop it from every entry."""
        for h in [h for h, holders in self._holders.items() if backend in holders]:
            holders = self._holders[h]
            holders.discard(backend)
            if not holders:
                del self._holders[h]

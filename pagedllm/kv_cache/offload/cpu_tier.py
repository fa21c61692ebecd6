"""The CPU tier's bookkeeping (scheduler side): block hash -> slot in the ranks' CPU tier tensors.

Least recently used first; a slot pinned by a load in flight is never evicted::

    entries: h3:s0 <-> h9:s2 <-> h1:s1      (LRU ... MRU)
"""
from __future__ import annotations

from collections import Counter, OrderedDict


class CpuTierIndex:
    """``num_slots`` CPU slots holding evicted prefix blocks, keyed by block hash, LRU ordered."""

    def __init__(self, num_slots: int):
        if num_slots < 0:
            raise ValueError(f"num_slots={num_slots} must be >= 0")
        self.num_slots = num_slots
        self.entries: OrderedDict[bytes, int] = OrderedDict()
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        self._pins: Counter[int] = Counter()

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, block_hash: bytes) -> int | None:
        return self.entries.get(block_hash)

    def touch(self, block_hash: bytes) -> None:
        self.entries.move_to_end(block_hash)

    def insert(self, block_hash: bytes) -> tuple[int, tuple[bytes, int] | None] | None:
        """A slot for ``block_hash`` (must be absent): ``(slot, evicted (hash, slot) or None)``,
        or None when every slot is pinned."""
        evicted = None
        if not self._free:
            evicted = self._evict_lru()
            if evicted is None:
                return None
            self._free.append(evicted[1])
        slot = self._free.pop()
        self.entries[block_hash] = slot
        return slot, evicted

    def _evict_lru(self) -> tuple[bytes, int] | None:
        victim = next((h for h, s in self.entries.items() if not self._pins[s]), None)
        if victim is None:
            return None
        return victim, self.entries.pop(victim)

    def pin(self, slot: int) -> None:
        self._pins[slot] += 1

    def unpin(self, slot: int) -> None:
        self._pins[slot] -= 1
        if not self._pins[slot]:
            del self._pins[slot]

    def clear(self) -> None:
        """Forgets every entry (pinned slots too: only call with no load in flight)."""
        self.entries.clear()
        self._pins.clear()
        self._free = list(range(self.num_slots - 1, -1, -1))

    def check_integrity(self) -> None:
        """Every slot is free or holds exactly one hash; no pin outlives its load."""
        if self._pins:
            raise AssertionError(f"CPU tier slots still pinned: {dict(self._pins)}")
        held = list(self.entries.values())
        if sorted(held + self._free) != list(range(self.num_slots)):
            raise AssertionError(f"CPU tier slots: held {sorted(held)} + free {sorted(self._free)} "
                                 f"!= all {self.num_slots}")

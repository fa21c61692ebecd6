"""The scheduler's view of the adapter slots: which adapter sits in which of the ``max_loras``
device slots, reference counted by the requests that hold it, LRU eviction of unreferenced ones.

Like the KV block pool (DESIGN core idea 13): a request takes a reference on its adapter's slot
when it is admitted (loading the adapter into a free slot, or into the least recently used
unreferenced one, if it is not resident) and drops it when it finishes or is preempted by
recompute; a slot with references is never reassigned. The pool hands out ids only; the runner
performs the loads it lists (``take_loads``) before the step's forward.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from pagedllm.lora.request import LoRARequest


@dataclass
class LoRASlotStats:
    loads: int = 0  # adapters written into a slot
    hits: int = 0  # acquisitions that found their adapter resident
    evictions: int = 0  # resident adapters replaced by another


class LoRASlotPool:
    """``max_loras`` slots; ``can_acquire`` / ``acquire`` / ``retain`` / ``release`` by slot id."""

    def __init__(self, max_loras: int):
        self.num_slots = max_loras
        self.adapter: list[LoRARequest | None] = [None] * max_loras  # slot -> resident adapter
        self.refs = [0] * max_loras
        self.slot_of: dict[int, int] = {}  # lora_int_id -> slot
        self.free: list[int] = list(range(max_loras - 1, -1, -1))  # never used, popped from the end
        self.idle: OrderedDict[int, None] = OrderedDict()  # resident, unreferenced slots, least recent first
        self.loads: list[tuple[int, LoRARequest]] = []  # for the runner, this step
        self.stats = LoRASlotStats()

    def can_acquire(self, lora: LoRARequest) -> bool:
        """Its adapter is resident, or a slot is free or holds an unreferenced adapter."""
        return lora.lora_int_id in self.slot_of or bool(self.free) or bool(self.idle)

    def acquire(self, lora: LoRARequest) -> int:
        """A reference on ``lora``'s slot, loading it (evicting the LRU unreferenced adapter if no
        slot is free) when it is not resident; call ``can_acquire`` first."""
        slot = self.slot_of.get(lora.lora_int_id)
        if slot is not None:
            self.stats.hits += 1
            return self.retain(slot)
        if self.free:
            slot = self.free.pop()
        elif self.idle:
            slot, _ = self.idle.popitem(last=False)
            del self.slot_of[self.adapter[slot].lora_int_id]
            self.stats.evictions += 1
        else:
            raise RuntimeError(f"no LoRA slot for adapter {lora.lora_name!r}: every slot is referenced")
        self.adapter[slot] = lora
        self.slot_of[lora.lora_int_id] = slot
        self.loads.append((slot, lora))
        self.stats.loads += 1
        return self.retain(slot)

    def retain(self, slot: int) -> int:
        """One more reference on a resident slot (a forked sequence)."""
        if self.adapter[slot] is None:
            raise RuntimeError(f"LoRA slot {slot} holds no adapter")
        self.refs[slot] += 1
        self.idle.pop(slot, None)
        return slot

    def release(self, slot: int) -> None:
        """Drops one reference; the adapter stays resident (evictable) at zero."""
        if self.refs[slot] <= 0:
            raise RuntimeError(f"LoRA slot {slot} released more often than acquired")
        self.refs[slot] -= 1
        if self.refs[slot] == 0:
            self.idle[slot] = None

    def remove(self, lora_int_id: int) -> bool:
        """Forgets an unreferenced resident adapter (runtime unload); False while requests hold it."""
        slot = self.slot_of.get(lora_int_id)
        if slot is None:
            return True
        if self.refs[slot]:
            return False
        del self.slot_of[lora_int_id]
        self.idle.pop(slot, None)
        self.adapter[slot] = None
        self.free.append(slot)
        return True

    def take_loads(self) -> list[tuple[int, LoRARequest]]:
        loads, self.loads = self.loads, []
        return loads

    @property
    def num_free_slots(self) -> int:
        """Slots an adapter could be loaded into now (empty or unreferenced)."""
        return len(self.free) + len(self.idle)

    def resident(self) -> list[LoRARequest]:
        return [a for a in self.adapter if a is not None]

    def check_invariants(self) -> None:
        """For tests: free, idle and referenced slots partition the slots; ids map both ways."""
        referenced = {s for s in range(self.num_slots) if self.refs[s] > 0}
        assert not referenced & set(self.idle) and not referenced & set(self.free)
        assert not set(self.idle) & set(self.free)
        assert len(referenced) + len(self.idle) + len(self.free) == self.num_slots
        assert all(self.adapter[s] is None for s in self.free)
        assert {a.lora_int_id: s for s, a in enumerate(self.adapter) if a is not None} == self.slot_of
        assert all(r >= 0 for r in self.refs)

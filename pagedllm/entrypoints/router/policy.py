"""Which backend gets a request: the routing policies (pure functions of the backends' state)."""
from __future__ import annotations

from dataclasses import dataclass

from .backends import Backend


@dataclass(frozen=True)
class Choice:
    """The picked backend; ``matched_blocks``: the prompt blocks it already holds (by the table);
    ``affinity``: picked because of them (not for its load or its turn); ``adapter_affinity``:
    picked because it holds the request's LoRA adapter."""

    backend: Backend
    matched_blocks: int = 0
    affinity: bool = False
    adapter_affinity: bool = False


class Picker:
    """Applies one policy; keeps the turn counter that spreads ties (and round-robin) evenly."""

    def __init__(self, policy: str, balance_threshold: int):
        self.policy, self.balance_threshold = policy, balance_threshold
        self._turn = 0

    def pick(self, candidates: list[Backend], matched: dict[str, int],
             holders: set[str] | frozenset[str] = frozenset()) -> Choice | None:
        """``candidates``: the healthy backends not yet tried for this request, in config order;
        ``matched``: leading prompt blocks each backend holds; ``holders``: the backends holding the
        request's LoRA adapter. None when there is no candidate."""
        if not candidates:
            return None
        rotated = self._rotation(candidates)
        if self.policy == "round_robin":
            return Choice(rotated[0], matched.get(rotated[0].url, 0))
        least = min(rotated, key=lambda b: b.load)  # the first of the least loaded in this turn's order
        near = [b for b in rotated if b.url in holders]
        if near:
            return self._by_adapter(near, matched, least)
        if self.policy == "prefix":
            return self._by_prefix(rotated, matched, least)
        return Choice(least, matched.get(least.url, 0))

    def _rotation(self, candidates: list[Backend]) -> list[Backend]:
        start = self._turn % len(candidates)
        self._turn += 1
        return candidates[start:] + candidates[:start]

    def _by_prefix(self, rotated: list[Backend], matched: dict[str, int], least: Backend) -> Choice:
        """The longest match (the least loaded among equals), unless it is more than
        ``balance_threshold`` requests busier than the least loaded backend."""
        best = max(matched.get(b.url, 0) for b in rotated)
        if best == 0:
            return Choice(least)
        holder = min((b for b in rotated if matched.get(b.url, 0) == best), key=lambda b: b.load)
        if holder.load - least.load > self.balance_threshold:
            return Choice(least, matched.get(least.url, 0))
        return Choice(holder, best, affinity=True)

    def _by_adapter(self, near: list[Backend], matched: dict[str, int], least: Backend) -> Choice:
        """A backend holding the adapter (the longest prefix match among them, then the least loaded),
        unless it is more than ``balance_threshold`` requests busier than the least loaded backend,
        which then loads the adapter (evicting its least recently used one)."""
        holder = min(near, key=lambda b: (-matched.get(b.url, 0), b.load))
        if holder.load - least.load > self.balance_threshold:
            return Choice(least, matched.get(least.url, 0))
        return Choice(holder, matched.get(holder.url, 0), affinity=matched.get(holder.url, 0) > 0,
                      adapter_affinity=True)

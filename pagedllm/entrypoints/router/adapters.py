"""LoRA adapters behind the router: which backends serve an adapter, and which (probably) hold it.

A request names an adapter with ``model=``. Each backend's ``GET /v1/models`` lists the adapters
it serves (cards with a ``parent``), so the router sends an adapter's requests only to backends
that serve it. Among those it prefers one that holds the adapter in a device slot already (no
load, no eviction of another adapter there): the ``AdapterTable`` remembers, per backend, the
adapters routed to it most recently, as many as the backend's slots (``max_lora`` of its
``lora_requests_info`` metric), the way the backend's slot pool keeps the most recently used ones;
the adapters of its running and waiting requests (the same metric) are held for certain. Like
the prefix table it cannot see traffic that bypassed the router: a stale entry costs one routing
choice, never a wrong answer.

``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` go to every healthy backend
(``ADMIN_PATHS``), so all replicas serve the same adapters.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

ADMIN_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
_INFO_SUFFIX = ":lora_requests_info"


def lora_state(metrics_text: str) -> tuple[frozenset[str], int | None]:
    """The adapters of a backend's running and waiting requests, and its slot count (``max_lora``),
    from ``lora_requests_info`` (pagedllm's and vLLM's name); (empty, None) when it exports none."""
    for family in text_string_to_metric_families(metrics_text):
        if family.name.endswith(_INFO_SUFFIX) and family.samples:
            labels = family.samples[-1].labels
            names = {n for key in ("running_lora_adapters", "waiting_lora_adapters")
                     for n in labels.get(key, "").split(",") if n}
            slots = labels.get("max_lora", "")
            return frozenset(names), int(slots) if slots.isdigit() and int(slots) > 0 else None
    return frozenset(), None


def served_adapters(models: Any) -> frozenset[str]:
    """The adapter names in a ``/v1/models`` answer (cards with a ``parent``: base models have none)."""
    data = models.get("data") if isinstance(models, dict) else None
    return frozenset(card["id"] for card in data or () if isinstance(card, dict) and card.get("parent")
                     and isinstance(card.get("id"), str))


def adapter_of(data: Any, served: set[str]) -> str | None:
    """The adapter a parsed request body names with ``model=`` (None: a base model, or no model)."""
    model = data.get("model") if isinstance(data, dict) else None
    return model if isinstance(model, str) and model in served else None


class AdapterTable:
    """Per backend, an LRU of the adapters routed to it, bounded by its slot count."""

    def __init__(self):
        self._recent: dict[str, OrderedDict[str, None]] = {}

    def holders(self, adapter: str) -> set[str]:
        """The backends that probably hold ``adapter`` in a slot now."""
        return {url for url, recent in self._recent.items() if adapter in recent}

    def record(self, adapter: str, backend: str, slots: int) -> None:
        """``adapter`` was routed to (or is running on) ``backend``: it is the most recently used there;
        beyond ``slots`` adapters, the least recently used one is forgotten (the backend evicts it)."""
        recent = self._recent.setdefault(backend, OrderedDict())
        recent[adapter] = None
        recent.move_to_end(adapter)
        while len(recent) > slots:
            recent.popitem(last=False)

    def observe(self, backend: str, active: frozenset[str], slots: int) -> None:
        """A scrape: the adapters of its running and waiting requests are held for certain."""
        for adapter in sorted(active):
            self.record(adapter, backend, slots)

    def forget(self, backend: str) -> None:
        """The backend failed or restarted: its slots are assumed empty."""
        self._recent.pop(backend, None)

"""The router's view of its backends: health, load, and the probes that keep them current."""
from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from .adapters import lora_state, served_adapters

logger = logging.getLogger(__name__)

# queue depth is read from any server's Prometheus names: pagedllm:..., vllm:..., sglang:...
_QUEUE_SUFFIXES = (":num_requests_running", ":num_requests_waiting")
PROBE_TIMEOUT = 5.0  # seconds a /health or /metrics probe may take


@dataclass
class Backend:
    """One OpenAI-compatible server. ``in_flight``: this router's requests on it now; ``queued``:
    running + waiting requests its last ``/metrics`` reported (any client's), 0 if it exports none;
    ``adapters``: the LoRA adapters its ``/v1/models`` lists; ``active_adapters``: those of its running
    and waiting requests and ``lora_slots`` its adapter slots, by its last ``/metrics``;
    ``remote_kv``: its remote KV tier's block hits and misses (``kv_offload_*{tier="remote"}``: blocks
    it loaded from the pool the replicas share, and prefix walks that found the pool short), by its
    last ``/metrics``."""

    url: str
    healthy: bool = True
    in_flight: int = 0
    queued: int = 0
    error: str | None = None
    adapters: frozenset[str] = frozenset()
    active_adapters: frozenset[str] = frozenset()
    lora_slots: int = 1
    remote_kv: tuple[float, float] = (0.0, 0.0)

    @property
    def load(self) -> int:
        """Requests on the backend: the scrape counts other clients' too, our count is never stale."""
        return max(self.in_flight, self.queued)


def queue_depth(metrics_text: str) -> int:
    """Running + waiting requests in a Prometheus text exposition (0 when it has neither), under
    any server's prefix; a server exporting the same requests under two (pagedllm's default
    ``--metrics-names both``: ``pagedllm:`` and ``vllm:``) counts once, by its largest."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.name.endswith(_QUEUE_SUFFIXES):
            prefix = family.name.split(":", 1)[0]
            totals[prefix] = totals.get(prefix, 0.0) + sum(sample.value for sample in family.samples)
    return int(max(totals.values(), default=0.0))


def remote_kv_counts(metrics_text: str) -> tuple[float, float]:
    """A pagedllm server's remote KV tier ``(hits, misses)`` (blocks) in a Prometheus text exposition,
    (0, 0) without a remote tier."""
    out = {"pagedllm:kv_offload_hits_total": 0.0, "pagedllm:kv_offload_misses_total": 0.0}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:  # by sample name: families are named with or without _total
            if sample.name in out and sample.labels.get("tier") == "remote":
                out[sample.name] += sample.value
    return out["pagedllm:kv_offload_hits_total"], out["pagedllm:kv_offload_misses_total"]


class BackendPool:
    """The backends, in the order given; ``on_down`` is called with a URL when one fails, ``on_scrape``
    with a Backend after each probe of a healthy one."""

    def __init__(self, urls: tuple[str, ...], client: httpx.AsyncClient, on_down=None, on_scrape=None):
        self.backends = {url: Backend(url) for url in urls}
        self.client, self.on_down, self.on_scrape = client, on_down, on_scrape

    def healthy(self) -> list[Backend]:
        return [b for b in self.backends.values() if b.healthy]

    def mark_down(self, url: str, reason: str) -> None:
        """Takes a backend out until a health check passes again; its cache is assumed lost."""
        backend = self.backends[url]
        if backend.healthy:
            logger.warning("backend %s taken out: %s", url, reason)
            if self.on_down is not None:
                self.on_down(url)
        backend.healthy, backend.error, backend.queued = False, reason, 0

    def mark_up(self, url: str) -> None:
        backend = self.backends[url]
        if not backend.healthy:
            logger.warning("backend %s is back", url)
        backend.healthy, backend.error = True, None

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(url) for url in self.backends))

    async def check(self, url: str) -> None:
        """``GET /health`` (200 = up), then ``GET /metrics`` for its queue depth and adapters, and
        ``GET /v1/models`` for the adapters it serves."""
        reason = await self.health_error(url)
        if reason is not None:
            self.mark_down(url, reason)
            return
        self.mark_up(url)
        backend = self.backends[url]
        metrics_text = await self._scraped_text(url, "/metrics")
        try:
            backend.queued = queue_depth(metrics_text)
            backend.active_adapters, slots = lora_state(metrics_text)
            backend.remote_kv = remote_kv_counts(metrics_text)
        except ValueError:  # unparsable metrics: our own in-flight count stands
            backend.queued, backend.active_adapters, slots = 0, frozenset(), None
        backend.lora_slots = slots or backend.lora_slots
        backend.adapters = served_adapters(await self._scraped_json(url, "/v1/models"))
        if self.on_scrape is not None:
            self.on_scrape(backend)

    def all_adapters(self) -> set[str]:
        """Every LoRA adapter name some backend serves."""
        return {name for b in self.backends.values() for name in b.adapters}

    async def health_error(self, url: str) -> str | None:
        """Why ``GET /health`` on the backend fails now, or None when it answers 200."""
        try:
            response = await self.client.get(f"{url}/health", timeout=PROBE_TIMEOUT)
        except httpx.HTTPError as exc:
            return f"unreachable ({type(exc).__name__}: {exc})"
        if response.status_code != 200:
            return f"GET /health answered {response.status_code}: {response.text[:200]}"
        return None

    async def _scraped_text(self, url: str, path: str) -> str:
        """The body of ``GET path`` ("" when it fails: the probe's other findings stand)."""
        try:
            response = await self.client.get(f"{url}{path}", timeout=PROBE_TIMEOUT)
        except httpx.HTTPError:
            return ""
        return response.text if response.status_code == 200 else ""

    async def _scraped_json(self, url: str, path: str):
        text = await self._scraped_text(url, path)
        try:
            return json.loads(text) if text else None
        except ValueError:
            return None

    async def watch(self, interval: float) -> None:
        """Probes every backend every ``interval`` seconds, until cancelled."""
        while True:
            await asyncio.sleep(interval)
            await self.check_all()

    async def wait_reachable(self, timeout: float) -> None:
        """Waits up to ``timeout`` seconds for every backend to pass a health check; ValueError names
        the ones that did not, and why."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            await self.check_all()
            down = [b for b in self.backends.values() if not b.healthy]
            if not down or loop.time() >= deadline:
                break
            await asyncio.sleep(min(0.5, max(0.0, deadline - loop.time())))
        if down:
            detail = "; ".join(f"{b.url}: {b.error}" for b in down)
            raise ValueError(f"backend not healthy after {timeout:g} s (--startup-timeout): {detail}")

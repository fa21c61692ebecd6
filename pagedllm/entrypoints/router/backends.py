"""The router's view of its backends: health, load, and the probes that keep them current."""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger(__name__)

# queue depth is read from any server's Prometheus names: pagedllm:..., vllm:..., sglang:...
_QUEUE_SUFFIXES = (":num_requests_running", ":num_requests_waiting")
PROBE_TIMEOUT = 5.0  # seconds a /health or /metrics probe may take


@dataclass
class Backend:
    """One OpenAI-compatible server. ``in_flight``: this router's requests on it now; ``queued``:
    running + waiting requests its last ``/metrics`` reported (any client's), 0 if it exports none."""

    url: str
    healthy: bool = True
    in_flight: int = 0
    queued: int = 0
    error: str | None = None

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


class BackendPool:
    """The backends, in the order given; ``on_down`` is called with a URL when one fails."""

    def __init__(self, urls: tuple[str, ...], client: httpx.AsyncClient, on_down=None):
        self.backends = {url: Backend(url) for url in urls}
        self.client, self.on_down = client, on_down

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
        """``GET /health`` (200 = up), then ``GET /metrics`` for its queue depth."""
        reason = await self.health_error(url)
        if reason is not None:
            self.mark_down(url, reason)
            return
        self.mark_up(url)
        self.backends[url].queued = await self._scraped_queue(url)

    async def health_error(self, url: str) -> str | None:
        """Why ``GET /health`` on the backend fails now, or None when it answers 200."""
        try:
            response = await self.client.get(f"{url}/health", timeout=PROBE_TIMEOUT)
        except httpx.HTTPError as exc:
            return f"unreachable ({type(exc).__name__}: {exc})"
        if response.status_code != 200:
            return f"GET /health answered {response.status_code}: {response.text[:200]}"
        return None

    async def _scraped_queue(self, url: str) -> int:
        try:
            response = await self.client.get(f"{url}/metrics", timeout=PROBE_TIMEOUT)
            return queue_depth(response.text) if response.status_code == 200 else 0
        except (httpx.HTTPError, ValueError):  # no (parsable) metrics: our own in-flight count stands
            return 0

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

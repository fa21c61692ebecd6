"""The router's own ``/metrics`` (``pagedllm:router_*``); each replica keeps its engine metrics."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from .backends import BackendPool


class _BackendStateCollector(Collector):
    """Health, in-flight count, scraped queue depth and remote KV tier counts of each backend, read at
    scrape time."""

    def __init__(self, pool: BackendPool):
        self.pool = pool

    def collect(self):
        families = {
            "healthy": GaugeMetricFamily("pagedllm:router_backend_healthy", "1 when the backend is in rotation.",
                                         labels=["backend"]),
            "in_flight": GaugeMetricFamily("pagedllm:router_backend_in_flight",
                                           "Requests this router has on the backend now.", labels=["backend"]),
            "queued": GaugeMetricFamily("pagedllm:router_backend_queue_depth",
                                        "Running + waiting requests the backend's /metrics last reported.",
                                        labels=["backend"]),
            "remote_hits": GaugeMetricFamily(
                "pagedllm:router_backend_remote_kv_hits", "KV blocks the backend loaded from the remote tier the "
                "replicas share (its kv_offload_hits{tier=\"remote\"}, by its last /metrics).", labels=["backend"]),
            "remote_misses": GaugeMetricFamily(
                "pagedllm:router_backend_remote_kv_misses", "Prefix walks the backend found short in the remote tier "
                "(its kv_offload_misses{tier=\"remote\"}: it recomputed from there), by its last /metrics.",
                labels=["backend"]),
        }
        for b in self.pool.backends.values():
            families["healthy"].add_metric([b.url], float(b.healthy))
            families["in_flight"].add_metric([b.url], b.in_flight)
            families["queued"].add_metric([b.url], b.queued)
            families["remote_hits"].add_metric([b.url], b.remote_kv[0])
            families["remote_misses"].add_metric([b.url], b.remote_kv[1])
        yield from families.values()
        yield GaugeMetricFamily("pagedllm:router_remote_kv_hits", "KV blocks all backends loaded from the shared "
                                "remote tier: prefixes one replica computed and another reused (a replica's reloads "
                                "of its own evicted blocks count too).",
                                value=sum(b.remote_kv[0] for b in self.pool.backends.values()))


class RouterMetrics:
    """Counters by backend: requests sent, prefix- and adapter-affinity hits, failovers, times taken out,
    broken streams."""

    def __init__(self, pool: BackendPool):
        self.registry = CollectorRegistry()
        self.registry.register(_BackendStateCollector(pool))
        self.requests = self._counter("requests", "Requests sent to each backend (retries included).")
        self.affinity_hits = self._counter("prefix_affinity_hits",
                                           "Requests sent to a backend because it held a prefix of the prompt.")
        self.adapter_hits = self._counter("lora_affinity_hits",
                                          "Requests sent to a backend because it held their LoRA adapter.")
        self.matched_tokens = self._counter("prefix_matched_tokens",
                                            "Prompt tokens the chosen backend held by the router's table.")
        self.failovers = self._counter("failovers", "Requests moved away from a backend before output (it failed, "
                                       "or it dropped this request's connection while healthy).")
        self.taken_out = self._counter("backend_taken_out", "Times the backend was taken out of rotation (its own "
                                       "failure: a failed health check, or a failed request confirmed by one).")
        self.stream_errors = self._counter("stream_errors",
                                           "Streams that broke after output began (ended with an error event).")
        # prefill/decode disaggregation (RouterConfig.prefill_backends)
        self.pd_prefills = self._counter("pd_prefills", "Prompts this prefill backend computed (max_tokens=1) for "
                                         "a decode backend to load from the shared KV pool.")
        self.pd_handoffs = self._counter("pd_handoffs", "Requests this decode backend got after a prefill backend "
                                         "computed their prompt (cross-replica: it loads the prefix from the pool).")
        self.pd_prefill_skipped = self._counter("pd_prefill_skipped", "Requests this decode backend got with no "
                                                "completed prefill (no prefill backend could take it): it recomputes.")
        for url in pool.backends:  # every series exists from the start, at 0
            for counter in (self.requests, self.affinity_hits, self.adapter_hits, self.matched_tokens, self.failovers,
                            self.taken_out, self.stream_errors, self.pd_prefills, self.pd_handoffs,
                            self.pd_prefill_skipped):
                counter.labels(backend=url)

    def _counter(self, name: str, doc: str) -> Counter:
        return Counter(f"pagedllm:router_{name}", doc, ["backend"], registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)

"""Prometheus glue: vLLM's metric set under the ``pagedllm:`` prefix and under vLLM's own
``vllm:`` names, one registry per server.

Gauges and counters are a snapshot of ``LLMEngine.get_metrics()`` taken (on the engine thread)
just before each scrape and exposed through a custom collector, so the engine's own counters
stay the single source of truth. Latency histograms are observed as outputs leave the engine.

``--metrics-names`` (a server flag: it changes what ``/metrics`` shows, not what the engine does):

* ``both`` (default): every ``pagedllm:*`` metric, and each one vLLM also defines again under
  vLLM 0.32's name (``VLLM_METRICS``), type and buckets, with vLLM's labels (``model_name`` and
  ``engine``, always ``"0"``: one engine per server). vLLM's Grafana dashboards and autoscaling
  rules keyed on ``vllm:num_requests_waiting`` work with no flag, and so do ours; the cost is a
  second copy of those series in each scrape.
* ``vllm``: what vLLM exports under ``vllm:*`` only, plus our metrics vLLM has no name for (the
  KV tiers', swapped requests, preemptions by mode) under ``pagedllm:*``: a ``vllm:`` name vLLM
  does not define would mean nothing to its dashboards and could clash with a later vLLM metric.
* ``pagedllm``: only ``pagedllm:*``.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric as PromMetric
from prometheus_client.registry import Collector

from pagedllm.metrics.stats import Metric
from pagedllm.outputs import RequestMetrics, RequestOutput

__all__ = ["PrometheusMetrics", "CONTENT_TYPE_LATEST", "METRICS_NAMES", "add_metrics_args"]

METRICS_NAMES = ("both", "vllm", "pagedllm")  # --metrics-names
# our metrics that vLLM 0.32 exports too (vllm/v1/metrics/loggers.py, spec_decode/metrics.py): the
# same name after the prefix, type, labels (plus ``engine``) and buckets
VLLM_METRICS = frozenset({
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries",
    "prefix_cache_hits", "num_preemptions", "prompt_tokens", "generation_tokens", "request_success",
    "iteration_tokens_total", "cache_config_info", "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens_per_pos", "time_to_first_token_seconds",
    "inter_token_latency_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
    "request_inference_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
    "request_time_per_output_token_seconds", "request_prompt_tokens", "request_generation_tokens",
    "request_max_num_generation_tokens", "request_params_n", "request_params_max_tokens",
})
ENGINE_INDEX = "0"  # vLLM's ``engine`` label: the data-parallel engine's index; a server here runs one

# vLLM's buckets: latency in seconds from sub-millisecond decode steps to minute-long requests
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                   120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
N_BUCKETS = (1, 2, 5, 10, 20)


def buckets_1_2_5(limit: int) -> tuple[int, ...]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to ``limit``."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(out)
            out.append(m * scale)
        scale *= 10

_HELP = {
    "pagedllm:num_requests_running": "Number of sequences in the running batch.",
    "pagedllm:num_requests_waiting": "Number of requests waiting to be scheduled.",
    "pagedllm:num_requests_swapped": "Number of requests swapped to CPU.",
    "pagedllm:kv_cache_usage_perc": "KV-cache usage: 1 means 100 percent of blocks in use.",
    "pagedllm:cpu_kv_cache_usage_perc": "CPU (swap) KV-cache usage: 1 means 100 percent.",
    "pagedllm:prefix_cache_queries": "Prompt tokens looked up in the prefix cache.",
    "pagedllm:prefix_cache_hits": "Prompt tokens served by the prefix cache.",
    "pagedllm:num_preemptions": "Cumulative number of preemptions.",
    "pagedllm:prompt_tokens": "Number of prefill tokens processed.",
    "pagedllm:generation_tokens": "Number of generation tokens processed.",
    "pagedllm:request_success": "Count of finished sequences by finish reason.",
    "pagedllm:kv_offload_hits": "KV blocks found in an offload tier and loaded back, by tier.",
    "pagedllm:kv_offload_misses": "KV block lookups an offload tier could not serve, by tier.",
    "pagedllm:kv_offload_bytes": "KV bytes moved into (store) or out of (load) an offload tier.",
    "pagedllm:kv_offload_loads": "Requests that loaded KV blocks from an offload tier.",
    "pagedllm:kv_offload_load_seconds": "Seconds spent loading KV blocks from an offload tier.",
    "pagedllm:kv_offload_errors": "Failed filesystem (disk) or network (remote) calls of an offload tier "
                                  "(each a miss), by tier and operation.",
    "pagedllm:kv_offload_disabled": "1 once an offload tier was turned off for failing, by tier.",
    "pagedllm:kv_offload_unreachable": "Calls to a networked offload tier (remote: Redis/Valkey) that failed for "
                                       "want of the server (connection refused or lost, timeout): each a miss.",
    "pagedllm:kv_offload_round_trip_seconds": "Seconds per call to a networked offload tier (remote: one MGET of "
                                              "a request's blocks, one pipelined write, one presence check), by op.",
    "pagedllm:spec_decode_num_drafts": "Speculative runs verified (one per request per step).",
    "pagedllm:spec_decode_num_draft_tokens": "Draft tokens proposed and verified.",
    "pagedllm:spec_decode_num_accepted_tokens": "Draft tokens accepted.",
    "pagedllm:spec_decode_num_accepted_tokens_per_pos": "Draft tokens accepted, by position in the run.",
    "pagedllm:cache_config_info": "Information of the KV cache's configuration (the labels; value 1).",
    "pagedllm:iteration_tokens_total": "Tokens computed per engine step.",
    "pagedllm:mm_images_encoded": "Images run through the vision tower, or given as image_embeds (each once while "
                                   "cached).",
    "pagedllm:mm_videos_encoded": "Videos run through the vision tower, or given as video_embeds (each once while "
                                   "cached).",
    "pagedllm:mm_video_frames_encoded": "Frames of the videos run through the vision tower (video_embeds: none).",
    "pagedllm:mm_encoder_cache_hits": "Images and videos a request needed that the encoder cache already held.",
    "pagedllm:mm_encoder_seconds": "Seconds the vision tower ran (over mm_encoder_steps: the time per encoding step).",
    "pagedllm:mm_encoder_steps": "Engine steps that ran the vision tower on at least one image or video.",
    "pagedllm:mm_encoder_cache_images": "Images whose embeddings the encoder cache holds.",
    "pagedllm:mm_encoder_cache_videos": "Videos whose embeddings the encoder cache holds.",
    "pagedllm:mm_encoder_cache_usage_perc": "Encoder-cache usage: 1 means 100 percent of its embedding rows.",
    "pagedllm:mm_processor_cache_hits": "Images and videos whose processor output the processor cache held.",
    "pagedllm:mm_processor_cache_misses": "Images and videos the model's HF processor ran for.",
    "pagedllm:mm_processor_cache_usage_perc": "Processor-cache usage: 1 means 100 percent of mm_processor_cache_gb.",
}


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(float(bound))


class _EngineSnapshotCollector(Collector):
    """Exposes the last engine metric snapshot as gauge (and info), counter and histogram families."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.snapshot: list[Metric] = []

    def collect(self):
        by_name: dict[str, list[Metric]] = defaultdict(list)
        for m in self.snapshot:
            by_name[m.name].append(m)
        for name, metrics in by_name.items():
            yield self._family(name, metrics)

    def _family(self, name: str, metrics: list[Metric]):
        label_names = ["model_name", *sorted(metrics[0].labels)]
        kind = metrics[0].kind
        cls = {"counter": CounterMetricFamily, "histogram": HistogramMetricFamily}.get(kind, GaugeMetricFamily)
        family = cls(name, _HELP.get(name, name), labels=label_names)
        for m in metrics:
            labels = [self.model_name, *(str(m.labels[k]) for k in label_names[1:])]
            if kind == "histogram":
                family.add_metric(labels, [(_le(b), c) for b, c in m.buckets], sum_value=m.value)
            else:
                family.add_metric(labels, m.value)
        return family


class _NamedCollector(Collector):
    """What ``source`` collects, under the names ``--metrics-names`` asks for (module docstring)."""

    def __init__(self, source: CollectorRegistry, owner: PrometheusMetrics):
        self.source, self.owner = source, owner

    def collect(self):
        names = self.owner.names
        for family in self.source.collect():
            suffix = family.name.removeprefix("pagedllm:")
            in_vllm = suffix in VLLM_METRICS
            if names == "pagedllm" or names == "both" or not in_vllm:
                yield family
            if names != "pagedllm" and in_vllm:
                yield _as_vllm(family, suffix)


def _as_vllm(family: PromMetric, suffix: str) -> PromMetric:
    """``family`` under vLLM's name and labels: ``engine`` added; vLLM's cache_config_info carries
    the cache configuration and ``engine`` only (no ``model_name``)."""
    out = PromMetric(f"vllm:{suffix}", family.documentation, family.type, family.unit)
    for s in family.samples:
        labels = {**s.labels, "engine": ENGINE_INDEX}
        if suffix == "cache_config_info":
            labels.pop("model_name", None)
        out.add_sample("vllm:" + s.name.removeprefix("pagedllm:"), labels, s.value, s.timestamp, s.exemplar)
    return out


def add_metrics_args(parser) -> None:
    """The server's ``--metrics-names`` flag (see the module docstring)."""
    parser.add_argument("--metrics-names", default="both", choices=METRICS_NAMES,
                        help="names /metrics exports: pagedllm:* and vLLM's vllm:* (both), vLLM's where vLLM has "
                             "one (vllm), or pagedllm:* only (pagedllm)")


class PrometheusMetrics:
    """The ``/metrics`` registry of one server; also an AsyncLLMEngine output observer.

    ``names``: ``--metrics-names`` (``both``, ``vllm`` or ``pagedllm``); may be changed later."""

    def __init__(self, model_name: str, max_model_len: int = 8192, names: str = "both"):
        self.model_name = model_name
        self.names = names
        self._source = CollectorRegistry()  # every metric, as pagedllm:*
        self._engine = _EngineSnapshotCollector(model_name)
        self._source.register(self._engine)
        self.registry = CollectorRegistry()  # what /metrics shows
        self.registry.register(_NamedCollector(self._source, self))
        hist = self._histogram
        self.ttft = hist("time_to_first_token_seconds", "Time to first token in seconds.", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Inter-token latency in seconds.", ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end request latency in seconds.", REQUEST_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Time spent waiting before the first schedule.",
                          REQUEST_BUCKETS)
        self.inference = hist("request_inference_time_seconds", "Time from the first schedule to the finish.",
                              REQUEST_BUCKETS)
        self.prefill = hist("request_prefill_time_seconds", "Time from the first schedule to the first token.",
                            REQUEST_BUCKETS)
        self.decode = hist("request_decode_time_seconds", "Time from the first token to the finish.",
                           REQUEST_BUCKETS)
        self.tpot = hist("request_time_per_output_token_seconds",
                         "Mean time per output token after the first, per request.", ITL_BUCKETS)
        sizes = buckets_1_2_5(max_model_len)
        self.prompt_tokens = hist("request_prompt_tokens", "Number of prefill tokens processed, per request.", sizes)
        self.generation_tokens = hist("request_generation_tokens",
                                      "Number of generation tokens processed, per request.", sizes)
        self.max_generation_tokens = hist("request_max_num_generation_tokens",
                                          "Generation tokens of the request's longest sequence.", sizes)
        self.params_n = hist("request_params_n", "The n request parameter.", N_BUCKETS)
        self.params_max_tokens = hist("request_params_max_tokens", "The max_tokens request parameter.", sizes)

    @property
    def names(self) -> str:
        return self._names

    @names.setter
    def names(self, value: str) -> None:
        if value not in METRICS_NAMES:
            raise ValueError(f"metrics_names={value!r} is not one of {', '.join(METRICS_NAMES)}")
        self._names = value

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]):
        hist = Histogram(f"pagedllm:{name}", doc, ["model_name"], buckets=buckets, registry=self._source)
        return hist.labels(model_name=self.model_name)

    def observe(self, out: RequestOutput) -> None:
        """Records latencies of one output: time to first token with the request's first output,
        every step gap it carries (a final-only output carries all of them)."""
        m = out.metrics
        if m is None:
            return
        if m.is_first_output and m.first_token_time is not None:
            self.ttft.observe(max(0.0, m.first_token_time - m.arrival_time))
        for gap in m.inter_token_latencies:
            self.itl.observe(gap)
        if out.finished and m.finished_time is not None:
            self.e2e.observe(max(0.0, m.finished_time - m.arrival_time))
            self._observe_finished(m)

    def _observe_finished(self, m: RequestMetrics) -> None:
        """The per-request histograms, from a finished request's final output (vLLM's set)."""
        self.prompt_tokens.observe(m.num_prompt_tokens)
        self.generation_tokens.observe(m.num_generation_tokens)
        self.max_generation_tokens.observe(m.max_num_generation_tokens)
        self.params_n.observe(m.n)
        if m.max_tokens is not None:
            self.params_max_tokens.observe(m.max_tokens)
        if m.first_scheduled_time is not None:
            self.queue.observe(max(0.0, m.first_scheduled_time - m.arrival_time))
            self.inference.observe(max(0.0, m.finished_time - m.first_scheduled_time))
            if m.first_token_time is not None:
                self.prefill.observe(max(0.0, m.first_token_time - m.first_scheduled_time))
        if m.first_token_time is not None:
            decode = max(0.0, m.finished_time - m.first_token_time)
            self.decode.observe(decode)
            if m.max_num_generation_tokens > 1:
                self.tpot.observe(decode / (m.max_num_generation_tokens - 1))

    def render(self, engine_metrics: list[Metric], engine_running: bool = True) -> bytes:
        """Prometheus text exposition, with gauges/counters taken from ``engine_metrics``.

        A stopped or dead engine runs, queues and holds nothing any more (its streams were failed),
        though its scheduler still lists what it had when it stopped: every gauge then reads 0,
        and the counters keep their totals.
        """
        if not engine_running:  # (info metrics describe the configuration: they stay)
            engine_metrics = [replace(m, value=0.0) if m.kind == "gauge" else m for m in engine_metrics]
        self._engine.snapshot = engine_metrics
        return generate_latest(self.registry)

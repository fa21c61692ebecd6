"""/metrics under vLLM's names (``--metrics-names``): vLLM 0.32's names, types, label sets and
buckets, moving with traffic like ours; and docs/grafana/pagedllm.json names only metrics the
server exports."""
from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from live_server import server_model_dir, start_server  # noqa: F401 - fixtures
from prometheus_client.parser import text_string_to_metric_families
from test_api_server import slow_engine  # noqa: F401 - fixture (10 ms more per engine step)

from pagedllm.metrics.prometheus import VLLM_METRICS, PrometheusMetrics

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "pagedllm.json"
LABELS = (("engine", "0"), ("model_name", "tiny"))  # vLLM's label set: model_name, engine
# vLLM 0.32 (vllm/v1/metrics/loggers.py, buckets.py): the names its dashboards and autoscalers use,
# with their types and, for histograms, their bucket bounds
VLLM_TYPES = {
    "vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge", "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter", "vllm:request_success": "counter",
    "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter", "vllm:num_preemptions": "counter",
    "vllm:time_to_first_token_seconds": "histogram", "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram", "vllm:request_queue_time_seconds": "histogram",
    "vllm:iteration_tokens_total": "histogram", "vllm:request_prompt_tokens": "histogram",
    "vllm:cache_config_info": "gauge",
}
VLLM_BUCKETS = {
    "vllm:time_to_first_token_seconds": (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                                         5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),
    "vllm:e2e_request_latency_seconds": (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                                         60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0),
    "vllm:inter_token_latency_seconds": (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                                         5.0, 7.5, 10.0, 20.0, 40.0, 80.0),
    "vllm:iteration_tokens_total": (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384),
    "vllm:request_prompt_tokens": (1, 2, 5, 10, 20, 50, 100),  # 1-2-5 up to max_model_len (128)
}


@pytest.fixture(scope="module")
def live_server(server_model_dir, tmp_path_factory):  # noqa: F811
    """Two sequences at a time (so requests wait), with KV tiers (so the dashboard's tier panels
    have their metrics)."""
    srv = start_server(server_model_dir, max_num_seqs=2, kv_offload_cpu_gb=0.001,
                       kv_offload_dir=str(tmp_path_factory.mktemp("tier")), kv_offload_disk_gb=0.01)
    yield srv
    srv.stop()


@pytest.fixture
def server(live_server):
    return live_server


@pytest.fixture
def names(server):
    """Restores the default (``both``) after a test switches it."""
    yield server.app.state.metrics
    server.app.state.metrics.names = "both"


def wait_for(url: str, at_least: dict[str, float], timeout: float = 30) -> dict:
    """The first scrape where each gauge in ``at_least`` reads at least its value (or the last one)."""
    deadline = time.time() + timeout
    while ((families := scrape(url)) and any(value(families, f, f) < v for f, v in at_least.items())
           and time.time() < deadline):
        time.sleep(0.02)
    return families


def scrape(url: str) -> dict[str, object]:
    return {f.name: f for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)}


def value(families: dict, family: str, sample: str, labels: tuple = LABELS) -> float:
    return next(s.value for s in families[family].samples if s.name == sample and tuple(sorted(s.labels.items()))
                == tuple(sorted(labels)))


def test_vllm_names_types_labels_and_buckets_move_with_traffic(server, names, slow_engine):  # noqa: F811
    before = scrape(server.url)
    prompts = ("hello world", "the quick brown fox", "a block table", "paged attention")
    with (openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60) as client,
          ThreadPoolExecutor(len(prompts)) as pool):
        replies = [pool.submit(client.completions.create, model="tiny", prompt=p, max_tokens=60, temperature=0,
                               extra_body={"ignore_eos": True}) for p in prompts]
        # max_num_seqs=2: two run and two wait (waiting alone can read 4 before the first step schedules)
        during = wait_for(server.url, {"vllm:num_requests_running": 2, "vllm:num_requests_waiting": 1})
        assert value(during, "vllm:num_requests_waiting", "vllm:num_requests_waiting") >= 1
        assert value(during, "vllm:num_requests_running", "vllm:num_requests_running") == 2
        assert value(during, "vllm:kv_cache_usage_perc", "vllm:kv_cache_usage_perc") > 0
        assert all(r.result().usage.completion_tokens == 60 for r in replies)
    server.wait_idle()
    after = scrape(server.url)
    for name, kind in VLLM_TYPES.items():
        assert after[name].type == kind, name
        labels = {tuple(sorted(s.labels)) for s in after[name].samples}
        if name == "vllm:request_success":
            assert labels == {("engine", "finished_reason", "model_name")}
        elif name == "vllm:cache_config_info":  # vLLM's: the cache configuration and engine, no model_name
            assert all("engine" in ls and "model_name" not in ls and "block_size" in ls for ls in labels)
        elif kind == "histogram":
            assert labels == {("engine", "le", "model_name"), ("engine", "model_name")}, name
        else:
            assert labels == {("engine", "model_name")}, name
    for name, bounds in VLLM_BUCKETS.items():
        les = [float(s.labels["le"]) for s in after[name].samples if s.name == f"{name}_bucket"]
        assert les == [*map(float, bounds), float("inf")], name
    moved = {"vllm:prompt_tokens": "vllm:prompt_tokens_total", "vllm:generation_tokens": "vllm:generation_tokens_total",
             "vllm:time_to_first_token_seconds": "vllm:time_to_first_token_seconds_count",
             "vllm:e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds_count",
             "vllm:inter_token_latency_seconds": "vllm:inter_token_latency_seconds_count"}
    for family, sample in moved.items():
        old = value(before, family, sample) if family in before else 0
        assert value(after, family, sample) > old, sample
    length = LABELS + (("finished_reason", "length"),)
    assert (value(after, "vllm:request_success", "vllm:request_success_total", length)
            >= value(before, "vllm:request_success", "vllm:request_success_total", length) + 4)
    for family in after:  # each vllm: copy reads what its pagedllm: original reads
        if family.startswith("vllm:"):
            ours = after[family.replace("vllm:", "pagedllm:", 1)]
            strip = lambda s: (s.name.split(":", 1)[1], tuple(sorted((k, v) for k, v in s.labels.items()  # noqa: E731
                                                                     if k not in ("engine", "model_name"))))
            assert {strip(s): s.value for s in after[family].samples} == {strip(s): s.value for s in ours.samples}


def test_the_names_switch(server, names):
    families = scrape(server.url)
    assert "pagedllm:num_requests_waiting" in families and "vllm:num_requests_waiting" in families  # default: both
    exported = {f.removeprefix("vllm:") for f in families if f.startswith("vllm:") and not f.endswith("_created")}
    assert exported == VLLM_METRICS - {
        "spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
        "spec_decode_num_accepted_tokens_per_pos"}  # (no speculative decoding here)
    names.names = "vllm"
    families = scrape(server.url)
    assert "vllm:num_requests_waiting" in families and "pagedllm:num_requests_waiting" not in families
    assert "pagedllm:kv_offload_hits" in families and "vllm:kv_offload_hits" not in families  # vLLM has no name
    names.names = "pagedllm"
    assert not any(f.startswith("vllm:") for f in scrape(server.url))
    with pytest.raises(ValueError, match="metrics_names='grafana'"):
        names.names = "grafana"


def test_metrics_names_flag(monkeypatch):
    import argparse

    from pagedllm.entrypoints.openai.api_server import make_arg_parser
    parser = make_arg_parser(argparse.ArgumentParser())
    assert parser.parse_args(["--model", "m"]).metrics_names == "both"
    assert parser.parse_args(["--model", "m", "--metrics-names", "vllm"]).metrics_names == "vllm"
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--metrics-names", "grafana"])
    assert PrometheusMetrics("m", names="pagedllm").names == "pagedllm"


def test_grafana_dashboard_names_only_exported_metrics(server):
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    assert len(dashboard["panels"]) >= 10 and len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    used = {name for e in exprs for name in re.findall(r"\b(?:pagedllm|vllm):[A-Za-z0-9_]+", e)}
    exported = {s.name for f in scrape(server.url).values() for s in f.samples}
    assert used and used <= exported, sorted(used - exported)
    assert any("kv_offload_errors_total" in e for e in exprs)

"""The dashboard's routes on a live server: the page (public, offline), /v1/kv_snapshot and the
/v1/kv_events stream (behind the API key), whose step events replayed onto its first snapshot
equal a later snapshot exactly; its metrics are /metrics' own numbers."""
from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
from live_server import server_model_dir, start_server  # noqa: F401 - fixtures
from prometheus_client.parser import text_string_to_metric_families

from pagedllm.kv_cache.events import apply_diff

KEY = "dash-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(server_model_dir):  # noqa: F811
    srv = start_server(server_model_dir, api_key=KEY, num_gpu_blocks_override=64, max_num_seqs=8)
    yield srv
    srv.stop()


def _complete(server, prompt: str, max_tokens: int = 6, n: int = 1):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    return client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0, n=n)


class EventReader:
    """Reads ``event:``/``data:`` messages off a streaming httpx response."""

    def __init__(self, response: httpx.Response):
        self.lines = response.iter_lines()

    def next(self) -> tuple[str, object]:
        name, data = None, None
        for line in self.lines:
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
            elif not line and name is not None:
                return name, data
        raise AssertionError("the stream ended")

    def until(self, wanted: str) -> object:
        while True:
            name, data = self.next()
            if name == wanted:
                return data


def test_the_page_is_public_self_contained_and_the_data_needs_the_key(server):
    page = httpx.get(f"{server.url}/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    html = page.text
    assert "class Panel" in html and "--bg" in html  # script and styles inlined
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", html), "the page must not load anything remote"
    for path in ("/v1/kv_snapshot", "/v1/kv_events"):
        assert httpx.get(f"{server.url}{path}").status_code == 401


def test_snapshot_describes_the_pool_and_the_config_card(server):
    body = httpx.get(f"{server.url}/v1/kv_snapshot", headers=AUTH).json()
    assert body["num_blocks"] == 64 == len(body["ref_cnt"]) and body["block_size"] == 8
    card = body["config"]
    assert card["num_gpu_blocks"] == 64 and card["block_size"] == 8 and card["max_model_len"] == 128
    # pagedllm plan's arithmetic on config.json gives the bytes the engine measured
    assert card["plan"]["bytes_per_block"] == card["bytes_per_block"]
    assert card["plan"]["num_blocks_for_budget"] == 64
    names = {s[0] for s in body["metrics"]}
    assert {"kv_cache_usage_perc", "num_requests_running", "prefix_cache_hits_total"} <= names


def test_events_replayed_onto_the_snapshot_equal_the_next_snapshot(server):
    with httpx.stream("GET", f"{server.url}/v1/kv_events?interval=0.02", headers=AUTH, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = EventReader(r)
        model = events.until("snapshot")
        assert model["dropped"] == 0 and model["config"]["num_gpu_blocks"] == 64
        prefix = "one two three four five six seven eight "
        _complete(server, prefix + "alpha", n=2)  # a fork: shared blocks, then copy-on-write
        _complete(server, prefix + "beta")  # a prefix hit on the first one's cached blocks
        server.wait_idle()
        fresh = httpx.get(f"{server.url}/v1/kv_snapshot", headers=AUTH).json()
        last, saw = model["step"], {"shared": False, "running": False}
        while last < fresh["step"]:
            for ev in events.until("steps"):
                apply_diff(model, ev)
                last = ev["step"]
                saw["shared"] |= any(ref >= 2 for _, ref, _ in ev["blocks"])
                saw["running"] |= any(q["queue"] == "running" for q in ev.get("requests", ()))
        for key in ("ref_cnt", "tables"):
            assert model[key] == fresh[key]
        assert {int(k): v for k, v in model["hashes"].items()} == {int(k): v for k, v in fresh["hashes"].items()}
        assert saw == {"shared": True, "running": True}
        assert fresh["tables"] == {} and sum(fresh["ref_cnt"]) == 0 and fresh["hashes"]  # all cached-free now


def test_metrics_events_are_the_numbers_metrics_exports(server):
    _complete(server, "hello there")
    server.wait_idle()
    with httpx.stream("GET", f"{server.url}/v1/kv_events", headers=AUTH, timeout=60) as r:
        samples = {(n, tuple(sorted(lb.items()))): v for n, lb, v in EventReader(r).until("metrics")["samples"]}
    scraped = {}
    for family in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text):
        for s in family.samples:
            if s.name.startswith("pagedllm:"):
                labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
                scraped[(s.name.removeprefix("pagedllm:"), labels)] = s.value
    for name in ("generation_tokens_total", "prefix_cache_queries_total", "num_requests_running"):
        assert samples[(name, ())] == scraped[(name, ())]
    assert samples[("generation_tokens_total", ())] > 0


def test_bad_intervals_are_refused_by_name(server):
    r = httpx.get(f"{server.url}/v1/kv_events?interval=0", headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "interval"
    assert "interval=0.0 must be between" in r.json()["error"]["message"]


def test_disable_dashboard_answers_404(server):
    server.app.state.dashboard = False  # what --disable-dashboard sets
    try:
        assert httpx.get(f"{server.url}/dashboard").status_code == 404
        assert httpx.get(f"{server.url}/v1/kv_snapshot", headers=AUTH).status_code == 404
    finally:
        server.app.state.dashboard = True


@pytest.fixture(scope="module")
def router_url(server):
    """A router over two "replicas": the same server under two host names (the router needs distinct URLs)."""
    from test_router import _router_in_thread
    port = server.url.rsplit(":", 1)[1]
    with _router_in_thread([server.url, f"http://localhost:{port}"], api_key=KEY) as url:
        yield url


def test_the_router_page_has_one_panel_per_replica_and_relays_their_feeds(router_url, server):
    page = httpx.get(f"{router_url}/dashboard")  # public, as on a server
    assert page.status_code == 200
    assert '"base": "router/replicas/0/"' in page.text and '"base": "router/replicas/1/"' in page.text
    assert httpx.get(f"{router_url}/router/replicas/0/v1/kv_snapshot").status_code == 401
    for index in (0, 1):
        body = httpx.get(f"{router_url}/router/replicas/{index}/v1/kv_snapshot", headers=AUTH).json()
        assert body["num_blocks"] == 64 and body["config"]["num_gpu_blocks"] == 64
    with httpx.stream("GET", f"{router_url}/router/replicas/1/v1/kv_events", headers=AUTH, timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        assert EventReader(r).until("snapshot")["num_blocks"] == 64
    missing = httpx.get(f"{router_url}/router/replicas/2/v1/kv_snapshot", headers=AUTH)
    assert missing.status_code == 404 and "replicas are 0..1" in missing.json()["error"]["message"]


def test_a_slow_viewer_gets_a_fresh_snapshot_with_the_dropped_count(server, monkeypatch):
    from pagedllm.entrypoints.openai import dashboard
    monkeypatch.setattr(dashboard, "MAX_QUEUED_EVENTS", 2)  # a queue of 2 steps: any request overflows it
    with httpx.stream("GET", f"{server.url}/v1/kv_events?interval=3", headers=AUTH, timeout=60) as r:
        events = EventReader(r)
        assert events.until("snapshot")["dropped"] == 0
        _complete(server, "overflow", max_tokens=8)  # 8+ steps while the viewer sleeps
        again = events.until("snapshot")
    assert again["dropped"] >= 7 and again["num_blocks"] == 64

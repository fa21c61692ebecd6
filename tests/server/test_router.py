"""Data parallelism: ``pagedllm serve --data-parallel-size 2`` (two replicas behind the prefix-aware
router) against a round-robin router over the same replicas, driven by the real ``openai`` client.

One module-scoped launch (the parent process and its two replicas); the test that kills a replica
runs last. Replicas run with ``--max-num-seqs 2`` so a burst queues (requests stay pending).
Routers started in this process over the same replicas check abuse (huge and stalled bodies) and
the router's API key.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import random
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import psutil
import pytest
from live_server import free_port, raw_http, serve_process, server_model_dir, wait_for
from prometheus_client.parser import text_string_to_metric_families

from pagedllm.entrypoints.cli import main as cli_main
from pagedllm.entrypoints.http_guards import ServerLimits
from pagedllm.entrypoints.router.app import build_router_app
from pagedllm.entrypoints.router.config import RouterConfig
from pagedllm.entrypoints.router.prompt_hasher import PromptHasher

BLOCK_SIZE = 8
MAX_TOKENS = 180  # a long stream (the prompts are ~65 tokens of max_model_len 256)
WORDS = "the quick brown fox jumps over lazy dog paged attention keeps a block table hello world".split()


@dataclass
class DataParallelServer:
    url: str
    backends: list[str]
    proc: subprocess.Popen
    log: Path


@pytest.fixture(scope="module")
def dp_server(server_model_dir, tmp_path_factory):
    flags = ["--data-parallel-size", "2", "--block-size", str(BLOCK_SIZE), "--num-gpu-blocks-override", "256",
             "--max-model-len", "256", "--max-num-seqs", "2", "--served-model-name", "tiny",
             "--health-check-interval", "0.5", "--uvicorn-log-level", "warning", "--shutdown-timeout", "2"]
    with serve_process(server_model_dir, tmp_path_factory.mktemp("dp") / "server.log", flags, startup_timeout=240,
                       stop_timeout=60) as server:
        backends = [b["url"] for b in httpx.get(f"{server.url}/router/backends").json()["backends"]]
        yield DataParallelServer(server.url, backends, server.proc, server.log)


@contextlib.contextmanager
def _router_in_thread(backends: list[str], **options):
    """A round-robin router in this process over ``backends``; yields its URL."""
    import uvicorn
    config = RouterConfig(tuple(backends), policy="round_robin", health_check_interval=0.5, **options)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_router_app(config), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, 30, "the in-process router")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="module")
def round_robin_url(dp_server):
    """A round-robin router (in this process) over the same two replicas: the baseline."""
    with _router_in_thread(dp_server.backends) as url:
        yield url


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def _metrics(url: str) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{url}/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def _replica_total(backends: list[str], name: str) -> float:
    return sum(v for url in backends for (n, _), v in _metrics(url).items() if n == name)


def _system_prompt(tag: str, i: int) -> str:
    """A long system prompt (about 8 blocks), distinct per tag and index from its first words (the
    chat template's own opening is shorter than a block, so different prompts share no block)."""
    rng = random.Random(f"{tag}-{i}")
    return " ".join(rng.choice(WORDS) for _ in range(24)) + f" ({tag} {i})"


def _chat(client: openai.OpenAI, system: str, user: str, max_tokens: int = 2, **kwargs):
    return client.chat.completions.create(model="tiny", messages=[{"role": "system", "content": system},
                                                                  {"role": "user", "content": user}],
                                          max_tokens=max_tokens, temperature=0, **kwargs)


def _second_wave_hit_rate(url: str, backends: list[str], tag: str) -> float:
    """Wave 1: one request per system prompt; wave 2: each system prompt twice more. Returns the
    replicas' prefix-cache hit rate (hit / looked-up prompt tokens) over wave 2."""
    client, systems = _client(url), [_system_prompt(tag, i) for i in range(4)]
    for s in systems:
        _chat(client, s, "first question")
    hits, queries = (_replica_total(backends, f"pagedllm:prefix_cache_{k}_total") for k in ("hits", "queries"))
    for s in systems:
        for user in ("second question", "third one"):
            _chat(client, s, user)
    new_hits = _replica_total(backends, "pagedllm:prefix_cache_hits_total") - hits
    return new_hits / (_replica_total(backends, "pagedllm:prefix_cache_queries_total") - queries)


# ---------------------------------------------------------------------- routing
def test_prefix_routing_beats_round_robin(dp_server, round_robin_url):
    before = _metrics(dp_server.url)
    prefix_rate = _second_wave_hit_rate(dp_server.url, dp_server.backends, "prefix-run")
    round_robin_rate = _second_wave_hit_rate(round_robin_url, dp_server.backends, "round-robin-run")
    # every wave-2 request finds its system prompt on its replica: about 3/4 of its tokens
    assert prefix_rate > 0.6
    assert prefix_rate >= round_robin_rate + 0.2, (prefix_rate, round_robin_rate)
    after = _metrics(dp_server.url)

    def delta(name: str) -> float:
        return sum(v - before.get(k, 0.0) for k, v in after.items() if k[0] == name)
    assert delta("pagedllm:router_requests_total") == 12
    assert delta("pagedllm:router_prefix_affinity_hits_total") >= 8  # all of wave 2
    assert delta("pagedllm:router_prefix_matched_tokens_total") >= 8 * 3 * BLOCK_SIZE


def test_router_hashes_the_prompts_the_replicas_see(dp_server, server_model_dir):
    """The router's token ids equal the replica's own tokenization (its /tokenize), for a chat and a
    completion prompt, so its block hashes are the replica's prefix-cache keys."""
    hasher = PromptHasher.load(server_model_dir, BLOCK_SIZE)
    messages = [{"role": "system", "content": _system_prompt("hash", 0)}, {"role": "user", "content": "hi"}]
    chat = {"model": "tiny", "messages": messages}
    completion = {"model": "tiny", "prompt": _system_prompt("hash", 1)}
    backend = dp_server.backends[0]
    for path, body in (("/v1/chat/completions", chat), ("/v1/completions", completion)):
        tokenize_body = {"model": "tiny", "messages": messages} if "messages" in body else dict(body)
        expected = httpx.post(f"{backend}/tokenize", json=tokenize_body).json()["tokens"]
        assert hasher.prompt_ids(path, body) == expected
        assert len(hasher.block_hashes(path, body)) == len(expected) // BLOCK_SIZE


def test_streams_pass_through(dp_server):
    """A stream through the router carries the same tokens as one straight from a replica."""
    system = _system_prompt("stream", 0)

    def streamed(url: str) -> str:
        stream = _chat(_client(url), system, "say something", max_tokens=12, stream=True,
                       extra_body={"ignore_eos": True})
        return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert streamed(dp_server.url) == streamed(dp_server.backends[0])


def test_other_routes_are_forwarded(dp_server):
    assert _client(dp_server.url).models.list().data[0].id == "tiny"
    response = httpx.post(f"{dp_server.url}/v1/completions", json={"model": "nope", "prompt": "x"})
    assert response.status_code in (400, 404)  # the replica's own refusal, passed on
    assert "nope" in response.json()["error"]["message"]


def test_every_block_is_free_on_each_replica(dp_server):
    for url in dp_server.backends:
        wait_for(lambda u=url: _replica_total([u], "pagedllm:num_requests_running") == 0, 10, "idle replicas")
        assert _replica_total([url], "pagedllm:num_requests_waiting") == 0
        assert _replica_total([url], "pagedllm:kv_cache_usage_perc") == 0


# ---------------------------------------------------------------------- abuse: bodies and keys
def _head(path: str, framing: bytes, extra: bytes = b"") -> bytes:
    return (b"POST " + path.encode() + b" HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n" + framing
            + b"\r\n" + extra + b"\r\n")


def _chunked(piece: bytes, count: int):
    """``count`` chunks of ``piece``, made as they are sent (the test holds one piece, not the body)."""
    for _ in range(count):
        yield b"%x\r\n%s\r\n" % (len(piece), piece)
    yield b"0\r\n\r\n"


def _all_healthy(url: str, **headers) -> bool:
    """Every backend in rotation, and none ever taken out by this router."""
    taken_out = sum(v for (name, _), v in _metrics(url).items() if name == "pagedllm:router_backend_taken_out_total")
    backends = httpx.get(f"{url}/router/backends", headers=headers).json()["backends"]
    return taken_out == 0 and all(b["healthy"] for b in backends)


def _small_completions(url: str, count: int, **headers) -> list[int]:
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
    return [httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=120).status_code
            for _ in range(count)]


def test_router_refuses_huge_bodies_itself_without_growing(dp_server):
    """A 20 MB body is refused from its Content-Length, a 200 MB chunked one once 4 MiB (the default
    --max-request-body-bytes, as the replicas') are read: it used to be read whole and tokenized
    (+129 MB of router memory), then sent on to the replicas. Measured: +5 MiB."""
    router = psutil.Process(dp_server.proc.pid)
    rss_before = router.memory_info().rss
    piece = b"x" * 2**20
    sized = raw_http(dp_server.url, _head("/v1/completions", b"Content-Length: %d" % (20 * 2**20)), [piece] * 20)
    chunked = raw_http(dp_server.url, _head("/v1/completions", b"Transfer-Encoding: chunked"), _chunked(piece, 200))
    for big in (sized, chunked):
        status, reply = big.finish(60)
        assert status == 413, big.response[:300]
        assert "limit is 4194304 bytes (--max-request-body-bytes)" in json.loads(reply)["error"]["message"]
    assert chunked.sent < 20 * 2**20  # the router stopped reading: the client could not send it all
    grown = router.memory_info().rss - rss_before
    assert grown < 24 * 2**20, f"the router grew by {grown / 2**20:.0f} MiB"
    assert _all_healthy(dp_server.url)


@pytest.fixture(scope="module")
def lenient_router(dp_server):
    """A router that lets bodies up to 64 MiB through (the replicas allow 4 MiB) and gives each piece
    of a body 1 s."""
    with _router_in_thread(dp_server.backends, limits=ServerLimits(max_request_body_bytes=64 * 2**20,
                                                                   request_body_timeout=1.0)) as url:
        yield url


def test_a_body_a_replica_refuses_is_413_and_leaves_both_replicas_in(dp_server, lenient_router):
    """The replicas refuse a 20 MB body (413, then they close the connection, which loses that
    answer): it is the client's error, not the replicas'. It used to take both replicas out and
    answer 503 to everyone until the next health check."""
    body = json.dumps({"model": "tiny", "prompt": "hello " * (20 * 2**20 // 6), "max_tokens": 2}).encode()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        normal = [pool.submit(_small_completions, lenient_router, 4) for _ in range(3)]
        bigs = [httpx.post(f"{lenient_router}/v1/completions", content=body, timeout=60) for _ in range(3)]
        statuses = [code for f in normal for code in f.result(timeout=300)]
    assert statuses == [200] * 12
    for big in bigs:
        assert big.status_code == 413, big.text[:300]
        assert "--max-request-body-bytes" in big.json()["error"]["message"]
    assert _all_healthy(lenient_router)


def test_a_stalled_body_gets_408_within_the_timeout(lenient_router):
    """Content-Length 30, 10 bytes sent, then nothing: the connection used to stay open > 70 s."""
    start = time.time()
    status, reply = raw_http(lenient_router, _head("/v1/completions", b"Content-Length: 30"), [b'{"prompt":']).finish()
    assert status == 408 and time.time() - start < 6  # request_body_timeout=1.0
    assert "--request-body-timeout" in json.loads(reply)["error"]["message"]
    assert _all_healthy(lenient_router)


def test_a_client_leaving_mid_upload_is_no_error(lenient_router, caplog):
    """The client's own broken upload reaches no backend and logs nothing (it used to be a traceback)."""
    import logging
    import socket
    caplog.set_level(logging.WARNING)
    uvicorn_log = logging.getLogger("uvicorn.error")  # it does not propagate to the root logger
    uvicorn_log.addHandler(caplog.handler)
    host, port = lenient_router.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(_head("/v1/completions", b"Content-Length: 1000") + b'{"prompt": "hel')
        time.sleep(0.3)
    time.sleep(0.5)  # the router notices the disconnect
    uvicorn_log.removeHandler(caplog.handler)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    assert _all_healthy(lenient_router)


def test_a_replicas_client_error_is_relayed_unchanged(dp_server, lenient_router):
    bad = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "temperature": -1}
    direct = httpx.post(f"{dp_server.backends[0]}/v1/completions", json=bad)
    routed = httpx.post(f"{lenient_router}/v1/completions", json=bad)
    assert direct.status_code == routed.status_code == 400
    assert routed.json() == direct.json() and routed.json()["error"]["param"] == "temperature"
    assert _all_healthy(lenient_router)


@pytest.mark.parametrize("metrics_public", [False, True])
def test_router_api_key(dp_server, metrics_public):
    """Every route but /health needs the key; the status routes too, unless --metrics-public."""
    key = {"Authorization": "Bearer router-key"}
    with _router_in_thread(dp_server.backends, api_key="router-key", metrics_public=metrics_public) as url:
        assert httpx.get(f"{url}/health").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            refused = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "hi"}, headers=headers)
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
            assert httpx.get(f"{url}/v1/models", headers=headers).status_code == 401
        assert _small_completions(url, 1, **key) == [200]
        assert _client(url).with_options(api_key="router-key").models.list().data[0].id == "tiny"
        for path in ("/metrics", "/router/backends"):
            assert httpx.get(f"{url}{path}").status_code == (200 if metrics_public else 401)
            assert httpx.get(f"{url}{path}", headers=key).status_code == 200


# ---------------------------------------------------------------------- bad input
def test_unreachable_backend_is_a_clear_error(capsys):
    url = f"http://127.0.0.1:{free_port()}"
    code = cli_main(["router", "--backend", url, "--routing-policy", "round_robin", "--startup-timeout", "0.5"])
    err = capsys.readouterr().err
    assert code == 2
    assert f"{url}: unreachable" in err and "--startup-timeout" in err


def test_bad_backend_url_is_a_clear_error(capsys):
    assert cli_main(["router", "--backend", "127.0.0.1:8000", "--routing-policy", "round_robin"]) == 2
    assert "backend='127.0.0.1:8000' is invalid" in capsys.readouterr().err


def test_metrics_public_without_a_key_is_a_clear_error(capsys, monkeypatch):
    monkeypatch.delenv("PAGEDLLM_API_KEY", raising=False)
    url = f"http://127.0.0.1:{free_port()}"
    assert cli_main(["router", "--backend", url, "--routing-policy", "round_robin", "--metrics-public"]) == 2
    assert "metrics_public=True applies only with an api_key" in capsys.readouterr().err
    assert cli_main(["router", "--backend", url, "--routing-policy", "round_robin", "--request-body-timeout", "0"]) == 2
    assert "request_body_timeout=0.0 is invalid" in capsys.readouterr().err


# ---------------------------------------------------------------------- failover (last: kills a replica)
def _replica_pid(dp_server: DataParallelServer, url: str) -> int:
    port = int(url.rsplit(":", 1)[1])
    for child in psutil.Process(dp_server.proc.pid).children():
        try:
            if any(c.laddr.port == port and c.status == psutil.CONN_LISTEN for c in child.net_connections("tcp")):
                return child.pid
        except psutil.NoSuchProcess:
            continue
    raise LookupError(f"no replica process listens on {url}")


class _KillOnFirstChunk(threading.Event):
    """Set by the first stream chunk any thread receives; once armed with a pid, that chunk's
    thread kills it at once (waking the main thread first took seconds on a loaded host, long
    enough for streams to finish before the kill)."""

    def __init__(self):
        super().__init__()
        self._lock, self._pid = threading.Lock(), None

    def arm(self, pid: int) -> None:
        with self._lock:
            self._pid = pid
            if self.is_set():
                self._kill()

    def set(self) -> None:
        with self._lock:
            if not self.is_set():
                super().set()
                if self._pid is not None:
                    self._kill()

    def _kill(self) -> None:
        os.kill(self._pid, signal.SIGKILL)
        self._pid = None


def _run_stream(client: openai.OpenAI, system: str, user: str, started: threading.Event) -> tuple[str, int]:
    """("done", completion tokens) for a stream that ended normally; ("error", chunks received before
    the error) otherwise."""
    chunks, usage = 0, None
    try:
        stream = _chat(client, system, user, max_tokens=MAX_TOKENS, stream=True, extra_body={"ignore_eos": True},
                       stream_options={"include_usage": True})
        for chunk in stream:
            usage = chunk.usage or usage
            # any choice chunk: the first (the role) comes with the first token, so the request runs;
            # a random model's tokens often decode to no text, and waiting for text let the first
            # streams finish before the kill (CI: 2 failovers where 4 requests had been pending)
            if chunk.choices:
                chunks += 1
                started.set()
    except openai.APIError:
        return "error", chunks
    return "done", usage.completion_tokens


def test_killed_backend_pending_requests_complete_on_the_other(dp_server):
    client, system = _client(dp_server.url), _system_prompt("failover", 0)
    before_warm = _metrics(dp_server.url)
    _chat(client, system, "warm")  # the prefix table now sends this system prompt to one replica
    before = _metrics(dp_server.url)
    holder = next(url for url in dp_server.backends if before[("pagedllm:router_requests_total", (("backend", url),))]
                  > before_warm[("pagedllm:router_requests_total", (("backend", url),))])
    holder_pid, started = _replica_pid(dp_server, holder), _KillOnFirstChunk()
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(_run_stream, client, system, f"user {i}", started) for i in range(6)]
        started.arm(holder_pid)  # killed while 2 streams run on it and the rest wait there
        assert started.wait(60)
        results = [f.result(timeout=120) for f in futures]
    done = [r for r in results if r[0] == "done"]
    broken = [r for r in results if r[0] == "error"]
    # at most max_num_seqs=2 streams had begun on the killed replica; the pending ones moved over
    assert len(broken) <= 2 and len(done) >= 4, results
    assert all(tokens == MAX_TOKENS for _, tokens in done)
    assert all(tokens > 0 for _, tokens in broken)  # an error only for a stream that had begun
    after = _metrics(dp_server.url)

    def delta(name: str) -> float:
        return after[(name, (("backend", holder),))] - before[(name, (("backend", holder),))]
    routed = {k[1][0][1]: v - before.get(k, 0.0) for k, v in after.items() if k[0] == "pagedllm:router_requests_total"}
    survivor = next(url for url in dp_server.backends if url != holder)
    # the burst follows the prefix to the holder (6 requests; one full-suite run under heavy load
    # saw it split 2/4, cause not found); every request there that had not begun moved over. A
    # done stream ran on the survivor (moved or sent there) or ended on the holder before the kill:
    # on a loaded host the first chunk can reach the client after a whole stream was produced
    assert delta("pagedllm:router_requests_total") >= 2, (routed, results)
    ended_on_holder = len(done) - routed.get(survivor, 0.0)
    assert delta("pagedllm:router_failovers_total") == (delta("pagedllm:router_requests_total") - len(broken)
                                                        - ended_on_holder), (routed, results)
    assert delta("pagedllm:router_failovers_total") >= 1, (routed, results)
    assert after[("pagedllm:router_backend_healthy", (("backend", holder),))] == 0
    assert delta("pagedllm:router_backend_taken_out_total") == 1
    assert httpx.get(f"{dp_server.url}/health").status_code == 200
    wait_for(lambda: _replica_total([survivor], "pagedllm:num_requests_running") == 0, 10, "the survivor to idle")
    assert _replica_total([survivor], "pagedllm:kv_cache_usage_perc") == 0

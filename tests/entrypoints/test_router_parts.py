"""The router's parts without servers: prefix table, policies, config checks, metrics parsing."""
from __future__ import annotations

import argparse

import pytest

from pagedllm.entrypoints.router.backends import Backend, queue_depth
from pagedllm.entrypoints.router.config import RouterConfig
from pagedllm.entrypoints.router.data_parallel import plan_replicas, wants_data_parallel
from pagedllm.entrypoints.router.policy import Picker
from pagedllm.entrypoints.router.prefix_table import PrefixTable
from pagedllm.entrypoints.router.proxy import sse_events
from pagedllm.kv_cache.prefix_hash import extend_block_hashes

A, B, C = "http://a:1", "http://b:1", "http://c:1"


def _hashes(token_ids: list[int], block_size: int = 4) -> list[bytes]:
    hashes: list[bytes] = []
    extend_block_hashes(hashes, token_ids, block_size)
    return hashes


# ---------------------------------------------------------------------- prefix table
def test_match_counts_leading_blocks_per_backend():
    table = PrefixTable(capacity=100)
    shared = list(range(8))
    table.record(_hashes(shared + [50, 51, 52, 53]), A)  # 3 blocks on A
    table.record(_hashes(shared), B)  # 2 blocks on B
    assert table.match(_hashes(shared + [50, 51, 52, 53, 9, 9, 9, 9])) == {A: 3, B: 2}
    assert table.match(_hashes(shared[:4] + [7, 7, 7, 7])) == {A: 1, B: 1}
    assert table.match(_hashes([9] * 8)) == {}
    assert table.match([]) == {}


def test_capacity_forgets_least_recently_used_tail_first():
    table = PrefixTable(capacity=3)
    first = _hashes(list(range(12)))  # 3 blocks
    table.record(first, A)
    table.record(_hashes([100, 101, 102, 103]), B)  # 1 block: pushes out first's last block
    assert len(table) == 3
    assert table.match(first) == {A: 2}  # the leading blocks survive, the tail went first


def test_forget_drops_a_backend_everywhere():
    table = PrefixTable(capacity=100)
    h = _hashes(list(range(8)))
    table.record(h, A)
    table.record(h, B)
    table.forget(A)
    assert table.match(h) == {B: 2}
    table.forget(B)
    assert len(table) == 0


def test_capacity_must_be_positive():
    with pytest.raises(ValueError, match="capacity=0"):
        PrefixTable(0)


# ---------------------------------------------------------------------- policies
def _backends(*loads: int) -> list[Backend]:
    return [Backend(url, in_flight=load) for url, load in zip((A, B, C), loads)]


def test_round_robin_takes_turns():
    picker, backends = Picker("round_robin", 8), _backends(0, 0, 0)
    assert [picker.pick(backends, {}).backend.url for _ in range(4)] == [A, B, C, A]


def test_least_loaded_spreads_ties():
    picker = Picker("least_loaded", 8)
    assert picker.pick(_backends(3, 1, 2), {}).backend.url == B
    ties = _backends(0, 0, 5)
    assert {picker.pick(ties, {}).backend.url for _ in range(4)} == {A, B}


def test_prefix_prefers_the_longest_match():
    picker = Picker("prefix", 8)
    choice = picker.pick(_backends(2, 0, 0), {A: 3, B: 1})
    assert (choice.backend.url, choice.matched_blocks, choice.affinity) == (A, 3, True)


def test_prefix_yields_to_load_beyond_the_threshold():
    picker = Picker("prefix", 2)
    assert picker.pick(_backends(2, 0, 1), {A: 5}).backend.url == A  # 2 busier: still within the threshold
    choice = picker.pick(_backends(3, 0, 1), {A: 5})
    assert (choice.backend.url, choice.affinity) == (B, False)


def test_prefix_without_a_match_is_least_loaded():
    choice = Picker("prefix", 8).pick(_backends(1, 0, 4), {})
    assert (choice.backend.url, choice.affinity) == (B, False)


def test_load_counts_the_scraped_queue():
    assert Backend(A, in_flight=1, queued=5).load == 5
    assert Backend(A, in_flight=3, queued=0).load == 3


def test_no_candidate_means_no_choice():
    assert Picker("prefix", 8).pick([], {A: 1}) is None


# ---------------------------------------------------------------------- config and flags
@pytest.mark.parametrize("kwargs, match", [
    (dict(backends=()), "at least one --backend"),
    (dict(backends=("localhost:8000",)), "backend='localhost:8000' is invalid"),
    (dict(backends=("http://h:8000/v1",)), "root URL"),
    (dict(backends=("http://h:99999",)), "port"),
    (dict(backends=(A, A)), "twice"),
    (dict(backends=(A,), policy="round_robin", prefill_backends=(B, B)), "prefill_backends=.* twice"),
    (dict(backends=(A,), policy="round_robin", prefill_backends=("h:1",)), "backend='h:1' is invalid"),
    (dict(backends=(A,), policy="random"), "routing_policy='random'"),
    (dict(backends=(A,), policy="prefix"), "needs the replicas' tokenizer"),
    (dict(backends=(A,), policy="round_robin", block_size=5), "block_size=5"),
    (dict(backends=(A,), policy="round_robin", prefix_table_size=0), "prefix_table_size=0"),
    (dict(backends=(A,), policy="round_robin", balance_threshold=-1), "balance_threshold=-1"),
    (dict(backends=(A,), policy="round_robin", health_check_interval=0), "health_check_interval=0"),
    (dict(backends=(A,), policy="round_robin", prefix_table_size=10), "applies only to routing_policy='prefix'"),
    (dict(backends=(A,), policy="least_loaded", prefix_table_size=10), "applies only to routing_policy='prefix'"),
    (dict(backends=(A,), policy="round_robin", balance_threshold=2), "'prefix' and 'least_loaded'"),
])
def test_bad_router_config_is_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RouterConfig(**kwargs)


def _serve_args(**overrides) -> argparse.Namespace:
    from pagedllm.entrypoints.openai.api_server import make_arg_parser
    args = make_arg_parser(argparse.ArgumentParser()).parse_args([])
    return argparse.Namespace(**(vars(args) | overrides))


def test_data_parallel_flags():
    assert not wants_data_parallel(_serve_args())
    assert wants_data_parallel(_serve_args(data_parallel_size=2))
    with pytest.raises(ValueError, match="data_parallel_size=0"):
        wants_data_parallel(_serve_args(data_parallel_size=0))
    with pytest.raises(ValueError, match="--routing-policy only apply with --data-parallel-size > 1"):
        wants_data_parallel(_serve_args(routing_policy="round_robin"))


# ---------------------------------------------------------------------- metrics text and streams
def test_queue_depth_reads_any_servers_names():
    text = ('# TYPE pagedllm:num_requests_running gauge\npagedllm:num_requests_running{model_name="m"} 2.0\n'
            '# TYPE pagedllm:num_requests_waiting gauge\npagedllm:num_requests_waiting{model_name="m"} 3.0\n'
            '# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name="m"} 1.0\n'
            '# TYPE pagedllm:kv_cache_usage_perc gauge\npagedllm:kv_cache_usage_perc{model_name="m"} 0.5\n')
    assert queue_depth(text) == 5  # one server under two prefixes: its requests count once
    assert queue_depth(text.replace("pagedllm:", "sglang:")) == 5
    ours, theirs = text.split("# TYPE vllm")
    assert queue_depth(ours) == 5 and queue_depth("# TYPE vllm" + theirs) == 1
    assert queue_depth("") == 0


async def _collect(chunks):
    async def source():
        for c in chunks:
            yield c
    return [e async for e in sse_events(source())]


def test_sse_events_are_regrouped_whole():
    import asyncio
    events = asyncio.run(_collect([b"data: {\"a\"", b": 1}\n\ndata: [DO", b"NE]\n\n"]))
    assert events == [b"data: {\"a\": 1}\n\n", b"data: [DONE]\n\n"]
    crlf = asyncio.run(_collect([b"data: 1\r\n\r\ndata: ", b"2\r\n\r\n", b"tail"]))
    assert crlf == [b"data: 1\r\n\r\n", b"data: 2\r\n\r\n", b"tail"]


def test_data_parallel_launch_checks_flags_before_starting_replicas(capsys, tmp_path):
    from pagedllm.entrypoints.cli import main
    missing = str(tmp_path / "no-model")
    assert main(["serve", missing, "--data-parallel-size", "2"]) == 2
    assert f"model={missing!r} does not exist" in capsys.readouterr().err
    assert main(["serve", missing, "--data-parallel-size", "0"]) == 2
    assert "data_parallel_size=0 is invalid" in capsys.readouterr().err


@pytest.mark.parametrize("tp, pp, threads", [(1, 1, 4), (2, 1, 2), (1, 2, 2), (2, 2, 1)])
def test_cpu_replicas_share_the_cores_between_all_their_ranks(monkeypatch, tp, pp, threads):
    """8 cores, 2 replicas: each rank (tensor x pipeline) of each replica gets 8 / (2 * ranks) threads."""
    import torch

    from pagedllm.config import ParallelConfig
    monkeypatch.setattr("pagedllm.platform.physical_cores", lambda: 8)
    args = argparse.Namespace(data_parallel_size=2, num_threads=None, device="cpu", gpu_memory_utilization=0.8)
    config = argparse.Namespace(parallel=ParallelConfig(tp, pipeline_parallel_size=pp), device=torch.device("cpu"))
    plans = plan_replicas(args, config)
    assert [p.num_threads for p in plans] == [threads, threads]


def test_cuda_replicas_with_pipeline_ranks_are_refused():
    import torch

    from pagedllm.config import ParallelConfig
    args = argparse.Namespace(data_parallel_size=2, num_threads=None, device="cuda", gpu_memory_utilization=0.8)
    config = argparse.Namespace(parallel=ParallelConfig(1, pipeline_parallel_size=2),
                                device=torch.device("cuda"))
    with pytest.raises(ValueError, match="pipeline_parallel_size=2"):
        plan_replicas(args, config)


# ---------------------------------------------------------------------- forwarding
class _CharTokenizer:
    """One token per character: enough for the hasher's completion path."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]


def test_forward_parses_the_body_once(monkeypatch):
    """The stream check and the prompt hasher share one ``json.loads`` of the request body."""
    import asyncio
    import json

    import httpx

    from pagedllm.entrypoints.router.prompt_hasher import PromptHasher
    from pagedllm.entrypoints.router.proxy import Router

    body = json.dumps({"model": "m", "prompt": "x" * 40, "stream": False}).encode()
    parses, real_loads = [], json.loads
    monkeypatch.setattr(json, "loads", lambda s, *a, **k: (parses.append(s), real_loads(s, *a, **k))[1])

    config = RouterConfig((A,), policy="prefix", tokenizer="chars", block_size=8)
    router = Router(config, PromptHasher(_CharTokenizer(), 8))
    router.client = httpx.AsyncClient(transport=httpx.MockTransport(lambda r: httpx.Response(200, json={})))

    async def run() -> int:
        try:
            return (await router.forward("POST", "/v1/completions", {}, body)).status_code
        finally:
            await router.close()
    assert asyncio.run(run()) == 200
    assert router.describe()["prefix_table_entries"] == 5  # the prompt's 40 characters, hashed in blocks of 8
    assert parses.count(body) == 1


def test_prompt_hasher_keys_salted_prompts_as_the_replica_does():
    """A request's cache_salt is in every block hash of the replica's prefix cache: the router's
    keys for it must be the KV manager's own, and differ from the unsalted prompt's."""
    from pagedllm.engine.request import Request
    from pagedllm.entrypoints.router.prompt_hasher import PromptHasher
    from pagedllm.kv_cache.kv_cache_manager import KVCacheManager
    from pagedllm.sampling_params import SamplingParams

    hasher, prompt = PromptHasher(_CharTokenizer(), 8), "y" * 20 + "z" * 20
    for salt in (None, "tenant-a"):
        body = {"model": "m", "prompt": prompt, **({"cache_salt": salt} if salt else {})}
        req = Request("r", [ord(c) for c in prompt], SamplingParams(max_tokens=1), frozenset(), cache_salt=salt)
        assert hasher.block_hashes("/v1/completions", body) == KVCacheManager(8, 8, True)._request_hashes(req)
    plain = hasher.block_hashes("/v1/completions", {"prompt": prompt})
    salted = hasher.block_hashes("/v1/completions", {"prompt": prompt, "cache_salt": "tenant-a"})
    assert len(plain) == len(salted) == 5 and not set(plain) & set(salted)
    assert hasher.block_hashes("/v1/embeddings", {"input": [prompt, "x"]}) == plain  # keyed on its first input


# ---------------------------------------------------------------------- what takes a backend out
def _mock_router(handler, backends=(A, B), **options):
    """A round-robin router over ``backends`` whose HTTP client (forwarding and health probes) is ``handler``.

    Unlike httpx.MockTransport, which reads every request body first, the handler reads a body only
    if it wants to, as a server refusing a body does not."""
    import httpx

    from pagedllm.entrypoints.router.proxy import Router

    class Transport(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            return await handler(request)
    router = Router(RouterConfig(backends, policy="round_robin", **options))
    router.client = router.pool.client = httpx.AsyncClient(transport=Transport())
    return router


def _forward(router, body: bytes = b'{"prompt": "hi"}', headers: dict | None = None):
    """(status, JSON body, {url: healthy}) of one POST /v1/completions through ``router``."""
    import asyncio
    import json

    async def run():
        try:
            return await router.forward("POST", "/v1/completions", headers or {}, body)
        finally:
            await router.close()
    response = asyncio.run(run())
    return response.status_code, json.loads(response.body), {b.url: b.healthy for b in router.pool.backends.values()}


async def _answer_b(request):
    import httpx
    await request.aread()
    return httpx.Response(200, json={"from": "B"})


def _backends_that(healthy: set[str], answer, answer_b=_answer_b):
    """A mock handler: ``GET /health`` is 200 for the URLs in ``healthy`` and refused for the others;
    requests to ``/v1/...`` on A go to ``answer(request)``, on B to ``answer_b`` (200 ``{"from": "B"}``)."""
    import httpx

    async def handler(request: httpx.Request) -> httpx.Response:
        url = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        if request.url.path == "/health":
            if url not in healthy:
                raise httpx.ConnectError("connection refused")
            return httpx.Response(200)
        return await (answer if url == A else answer_b)(request)
    return handler


async def _drop_after_reading(request):
    import httpx
    await request.aread()
    raise httpx.RemoteProtocolError("Server disconnected without sending a response.")


async def _drop_without_reading(request):
    import httpx
    raise httpx.ReadError("[Errno 104] Connection reset by peer")


def test_a_dropped_connection_takes_a_backend_out_only_if_its_health_check_fails():
    router = _mock_router(_backends_that({B}, _drop_after_reading))
    status, body, healthy = _forward(router)
    assert (status, body, healthy) == (200, {"from": "B"}, {A: False, B: True})  # A died: out, B answered
    assert router.metrics.taken_out.labels(backend=A)._value.get() == 1
    router = _mock_router(_backends_that({A, B}, _drop_after_reading))
    status, body, healthy = _forward(router)
    assert (status, body, healthy) == (200, {"from": "B"}, {A: True, B: True})  # A lives: skipped, not out
    assert router.metrics.taken_out.labels(backend=A)._value.get() == 0
    assert router.metrics.failovers.labels(backend=A)._value.get() == 1


def test_a_healthy_backend_that_stops_reading_the_body_refused_it():
    """A server refusing a body over its limit answers 413 and closes; the reset loses the answer.
    The client gets 413, the request is not sent to another backend, and no backend goes out."""
    router = _mock_router(_backends_that({A, B}, _drop_without_reading))
    status, body, healthy = _forward(router, b'{"prompt": "' + b"x" * 5000 + b'"}')
    assert status == 413 and "stopped reading the 5014-byte request body" in body["error"]["message"]
    assert healthy == {A: True, B: True}
    assert router.metrics.requests.labels(backend=B)._value.get() == 0


def test_every_healthy_backend_dropping_a_request_is_502_and_none_goes_out():
    status, body, healthy = _forward(_mock_router(_backends_that({A, B}, _drop_after_reading, _drop_after_reading)))
    assert status == 502 and "closed the connection without answering" in body["error"]["message"]
    assert healthy == {A: True, B: True}


@pytest.mark.parametrize("a_healthy", [True, False])
def test_a_500_is_relayed_unless_the_backends_health_check_fails(a_healthy):
    import httpx

    async def error_500(request):
        await request.aread()
        return httpx.Response(500, json={"error": {"message": "boom", "code": 500}})
    status, body, healthy = _forward(_mock_router(_backends_that({A, B} if a_healthy else {B}, error_500)))
    if a_healthy:  # a request-specific failure: relayed as it came, A stays in
        assert (status, body, healthy) == (500, {"error": {"message": "boom", "code": 500}}, {A: True, B: True})
    else:  # A's engine died: out, and the request moves to B
        assert (status, body, healthy) == (200, {"from": "B"}, {A: False, B: True})


@pytest.mark.parametrize("status_code", [400, 404, 413, 422, 429])
def test_a_client_error_is_relayed_unchanged_and_the_backend_stays(status_code):
    import httpx

    async def refuse(request):
        await request.aread()
        return httpx.Response(status_code, json={"error": {"message": f"no ({status_code})"}})
    status, body, healthy = _forward(_mock_router(_backends_that({A, B}, refuse)))
    assert (status, body, healthy) == (status_code, {"error": {"message": f"no ({status_code})"}}, {A: True, B: True})


@pytest.mark.parametrize("backend_api_key, sent", [(None, "Bearer client"), ("replicas", "Bearer replicas")])
def test_backend_api_key_replaces_the_clients_authorization(backend_api_key, sent):
    import httpx
    seen = []

    async def record(request):
        seen.append(request.headers.get("authorization"))
        await request.aread()
        return httpx.Response(200, json={})
    router = _mock_router(_backends_that({A, B}, record), backend_api_key=backend_api_key)
    assert _forward(router, headers={"Authorization": "Bearer client"})[0] == 200
    assert seen == [sent]


def test_data_parallel_router_takes_the_servers_key_limits_and_flags(monkeypatch):
    from pagedllm.entrypoints.router.data_parallel import ReplicaPlan, router_config_of
    monkeypatch.delenv("PAGEDLLM_API_KEY", raising=False)
    args = _serve_args(data_parallel_size=2, api_key=["k", "k2"], metrics_public=True, max_request_body_bytes=1000,
                       request_body_timeout=2.5, routing_policy="round_robin")
    plans = [ReplicaPlan(i, 9000 + i, 1, "cpu", 0.4) for i in range(2)]
    config = router_config_of(args, argparse.Namespace(model=argparse.Namespace(tokenizer="t")), plans)
    # serve's --api-key takes several keys (nargs="+"): the router accepts each, sends the replicas one
    assert (config.api_keys, config.backend_api_key, config.metrics_public) == (("k", "k2"), "k", True)
    assert (config.limits.max_request_body_bytes, config.limits.request_body_timeout) == (1000, 2.5)
    assert config.backends == ("http://127.0.0.1:9000", "http://127.0.0.1:9001")
    monkeypatch.setenv("PAGEDLLM_API_KEY", "from-env")  # as the replicas read it
    config = router_config_of(_serve_args(data_parallel_size=2, routing_policy="round_robin"),
                              argparse.Namespace(model=argparse.Namespace(tokenizer="t")), plans)
    assert (config.api_key, config.backend_api_key, config.metrics_public) == ("from-env", "from-env", False)


@pytest.mark.parametrize("kwargs, match", [
    (dict(metrics_public=True), "metrics_public=True applies only with an api_key"),
    (dict(api_key=""), "api_key is invalid"),
    (dict(api_key=("k", "")), "api_key is invalid"),
    (dict(backend_api_key="a\nb"), "backend_api_key is invalid"),
    (dict(limits=4096), "limits=4096 is invalid"),
])
def test_bad_router_keys_and_limits_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RouterConfig((A,), policy="round_robin", **kwargs)


# ---------------------------------------------------------------------- prefill/decode disaggregation
def _pd_backends(prefill_answer, seen: list):
    """A mock handler: A is the prefill backend (``prefill_answer(request)``), B the decode one (200
    ``{"from": "B"}``); every forwarded request's (backend, JSON body) goes to ``seen``."""
    import json

    async def prefill(request):
        seen.append((A, json.loads(await request.aread())))
        return await prefill_answer(request)

    async def decode(request):
        seen.append((B, json.loads(await request.aread())))
        return await _answer_b(request)
    return _backends_that({A, B}, prefill, decode)


async def _prefilled(request):
    import httpx
    return httpx.Response(200, json={"choices": [{"text": "x"}]})


def test_pd_prefills_a_one_token_copy_then_decodes_the_request_whole():
    import json
    seen: list = []
    router = _mock_router(_pd_backends(_prefilled, seen), backends=(B,), prefill_backends=(A,))
    body = {"prompt": "hi", "max_tokens": 50, "n": 2, "min_tokens": 3, "logprobs": 2, "stream": False,
            "cache_salt": "s"}
    status, answer, _ = _forward(router, json.dumps(body).encode())
    assert (status, answer) == (200, {"from": "B"})
    assert seen == [(A, {"prompt": "hi", "max_tokens": 1, "cache_salt": "s"}), (B, body)]
    assert router.metrics.pd_prefills.labels(backend=A)._value.get() == 1
    assert router.metrics.pd_handoffs.labels(backend=B)._value.get() == 1
    assert router.metrics.pd_prefill_skipped.labels(backend=B)._value.get() == 0
    assert [b["role"] for b in router.describe()["backends"]] == ["decode", "prefill"]


def test_pd_relays_the_prefills_client_error_and_never_decodes():
    import httpx
    seen: list = []

    async def refuse(request):
        return httpx.Response(400, json={"error": {"message": "prompt too long"}})
    status, answer, healthy = _forward(_mock_router(_pd_backends(refuse, seen), backends=(B,), prefill_backends=(A,)))
    assert (status, answer, healthy) == (400, {"error": {"message": "prompt too long"}}, {A: True, B: True})
    assert [url for url, _ in seen] == [A]


def test_pd_without_a_prefill_backend_decodes_alone():
    seen: list = []
    router = _mock_router(_backends_that({B}, _drop_after_reading, _answer_b), backends=(B,), prefill_backends=(A,))
    status, answer, healthy = _forward(router)
    assert (status, answer, healthy) == (200, {"from": "B"}, {A: False, B: True})  # A died: out, B recomputes
    assert router.metrics.pd_prefill_skipped.labels(backend=B)._value.get() == 1
    assert router.metrics.pd_handoffs.labels(backend=B)._value.get() == 0
    assert not seen


def test_remote_kv_counts_read_a_pagedllm_servers_tier_metrics():
    from pagedllm.entrypoints.router.backends import remote_kv_counts
    text = ('# TYPE pagedllm:kv_offload_hits counter\n'
            'pagedllm:kv_offload_hits_total{model_name="m",tier="cpu"} 7.0\n'
            'pagedllm:kv_offload_hits_total{model_name="m",tier="remote"} 12.0\n'
            '# TYPE pagedllm:kv_offload_misses counter\n'
            'pagedllm:kv_offload_misses_total{model_name="m",tier="remote"} 3.0\n')
    assert remote_kv_counts(text) == (12.0, 3.0)
    assert remote_kv_counts("") == (0.0, 0.0)


def test_router_cli_takes_prefill_and_decode_replicas(monkeypatch):
    from pagedllm.entrypoints.router import cli
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    args = parser.parse_args(["router", "--decode-replicas", A, "--prefill-replicas", B, "--routing-policy",
                              "round_robin"])
    seen = {}

    async def reachable(config) -> None:  # no backend runs: what the router would probe is enough
        seen["config"] = config
    monkeypatch.setattr(cli, "check_reachable", reachable)
    monkeypatch.setattr(cli, "serve_router", lambda config, *rest: None)
    assert cli.run_router(args) == 0
    assert (seen["config"].backends, seen["config"].prefill_backends) == ((A,), (B,))
    assert seen["config"].all_backends == (A, B)


def test_replicas_serve_plain_http_with_the_key_and_the_router_takes_the_deployment_flags(monkeypatch, tmp_path):
    """`serve -dp 2 --ssl-keyfile ... --root-path /llm ...`: those flags are the router's; a replica gets
    them at their defaults (plain HTTP on 127.0.0.1, no root path, CORS, middleware, logging or socket)
    but keeps the key the router sends it and the docs switch (the router forwards /docs)."""
    from pagedllm.entrypoints.http_common import HttpOptions, http_options_from_cli
    from pagedllm.entrypoints.router.data_parallel import ReplicaPlan, replica_args
    monkeypatch.delenv("PAGEDLLM_API_KEY", raising=False)
    key, cert, ca = (tmp_path / name for name in ("key.pem", "cert.pem", "ca.pem"))
    for path in (key, cert, ca):
        path.write_text("pem")  # checked for existence only
    deployed = dict(ssl_keyfile=str(key), ssl_certfile=str(cert), ssl_ca_certs=str(ca), ssl_cert_reqs=2,
                    ssl_ciphers="ECDHE", allowed_origins=["https://a.example"], allowed_methods=["POST"],
                    allowed_headers=["X-A"], allow_credentials=True, root_path="/llm", middleware=["m.M"],
                    enable_request_id_headers=True, enable_log_requests=True, disable_log_requests=True,
                    max_log_len=10, uds="/tmp/s.sock")
    args = _serve_args(data_parallel_size=2, host="0.0.0.0", api_key=["k", "k2"], disable_fastapi_docs=True,
                       uvicorn_log_level="debug", **deployed)
    replica = replica_args(args, ReplicaPlan(1, 9001, 1, "cpu", 0.4))
    assert (replica.host, replica.port, args.root_path, args.ssl_keyfile) == ("127.0.0.1", 9001, "/llm", str(key))
    assert http_options_from_cli(replica) == HttpOptions(api_keys=("k", "k2"), disable_fastapi_docs=True,
                                                         uvicorn_log_level="debug")
    # the router: every deployment flag as given (its keys come from the RouterConfig, see router_config_of)
    router = http_options_from_cli(args)
    assert (router.ssl_certfile, router.root_path, router.allowed_origins, router.uds) == \
        (str(cert), "/llm", ("https://a.example",), "/tmp/s.sock")


def test_every_deployment_flag_is_either_client_facing_or_kept_by_replicas():
    """A new add_http_args flag must be sorted: reset on the replicas (CLIENT_FACING_HTTP_ARGS) or kept."""
    from pagedllm.entrypoints.http_common import add_http_args
    from pagedllm.entrypoints.router.data_parallel import CLIENT_FACING_HTTP_ARGS
    parser = argparse.ArgumentParser()
    add_http_args(parser)
    kept = {"api_key", "disable_fastapi_docs", "uvicorn_log_level", "disable_uvicorn_access_log",
            "disable_access_log_for_endpoints", "h11_max_incomplete_event_size"}
    assert set(vars(parser.parse_args([]))) - set(CLIENT_FACING_HTTP_ARGS) == kept

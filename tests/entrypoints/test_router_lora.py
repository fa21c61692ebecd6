"""The router and LoRA adapters: which backends serve an adapter (their /v1/models), which hold it
(routing history bounded by their slots, their lora_requests_info), the policy's preference for a
holder, and load/unload sent to every backend. The forwarding tests run the real Router against
backends made with httpx.MockTransport (no servers)."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from pagedllm.entrypoints.router.adapters import AdapterTable, adapter_of, lora_state, served_adapters
from pagedllm.entrypoints.router.backends import Backend
from pagedllm.entrypoints.router.config import RouterConfig
from pagedllm.entrypoints.router.policy import Picker
from pagedllm.entrypoints.router.proxy import Router

A, B, C = "http://a:1", "http://b:1", "http://c:1"
INFO = ('# TYPE pagedllm:lora_requests_info gauge\n'
        'pagedllm:lora_requests_info{max_lora="%s",running_lora_adapters="%s",waiting_lora_adapters="%s"} 1.7e9\n')


def test_lora_state_reads_running_and_waiting_adapters_and_slots():
    assert lora_state(INFO % ("4", "sql,chat", "math")) == (frozenset({"sql", "chat", "math"}), 4)
    assert lora_state(INFO % ("2", "", "")) == (frozenset(), 2)
    assert lora_state("# TYPE x gauge\nx 1\n") == (frozenset(), None)


def test_served_adapters_are_the_cards_with_a_parent():
    models = {"data": [{"id": "base", "parent": None}, {"id": "sql", "parent": "base"}, {"id": "chat",
                                                                                          "parent": "base"}]}
    assert served_adapters(models) == {"sql", "chat"}
    assert served_adapters(None) == frozenset() and served_adapters({"data": "x"}) == frozenset()
    assert adapter_of({"model": "sql"}, {"sql"}) == "sql"
    assert adapter_of({"model": "base"}, {"sql"}) is None and adapter_of(None, {"sql"}) is None


def test_adapter_table_keeps_the_most_recent_per_backend_slots():
    table = AdapterTable()
    for name in ("a", "b", "c"):
        table.record(name, A, slots=2)  # A has 2 slots: "a" was evicted there
    table.record("a", B, slots=1)
    assert table.holders("a") == {B} and table.holders("b") == {A} and table.holders("c") == {A}
    table.record("b", A, slots=2)  # used again: now "c" is the least recently used on A
    table.record("d", A, slots=2)
    assert table.holders("c") == set() and table.holders("b") == {A}
    table.observe(B, frozenset({"x", "y"}), slots=2)  # running there: held for certain
    assert table.holders("x") == {B} and table.holders("a") == set()
    table.forget(A)
    assert table.holders("b") == set()


def _backends(*loads: int) -> list[Backend]:
    return [Backend(url, in_flight=load) for url, load in zip((A, B, C), loads)]


@pytest.mark.parametrize("policy", ["prefix", "least_loaded"])
def test_a_holder_of_the_adapter_is_preferred_within_the_threshold(policy):
    picker = Picker(policy, 2)
    choice = picker.pick(_backends(0, 2, 0), {}, {B})
    assert (choice.backend.url, choice.adapter_affinity) == (B, True)
    choice = picker.pick(_backends(0, 3, 0), {}, {B})  # 3 busier than the least loaded: it loads elsewhere
    assert choice.backend.url != B and not choice.adapter_affinity
    choice = picker.pick(_backends(1, 1, 0), {B: 2, C: 1}, {B, C})  # among holders, the longest prefix
    assert (choice.backend.url, choice.matched_blocks, choice.affinity) == (B, 2, True)


def test_round_robin_ignores_adapters():
    picker = Picker("round_robin", 8)
    assert [picker.pick(_backends(0, 0, 0), {}, {C}).backend.url for _ in range(3)] == [A, B, C]


# ---------------------------------------------------------------------- the Router over mock backends
class MockReplicas:
    """Three replicas with ``max_lora`` slots: A and B serve "sql" and "chat", C serves none; each
    answers a completion with its own URL; load/unload change what it serves."""

    def __init__(self, slots: int = 1):
        self.serves = {A: {"sql", "chat"}, B: {"sql", "chat"}, C: set()}
        self.slots, self.calls = slots, []

    def handle(self, request: httpx.Request) -> httpx.Response:
        url, path = f"{request.url.scheme}://{request.url.host}:{request.url.port}", request.url.path
        self.calls.append((url, path))
        if path == "/health":
            return httpx.Response(200)
        if path == "/metrics":
            return httpx.Response(200, text=INFO % (self.slots, "", ""))
        if path == "/v1/models":
            cards = [{"id": "base", "parent": None}] + [{"id": n, "parent": "base"} for n in sorted(self.serves[url])]
            return httpx.Response(200, json={"object": "list", "data": cards})
        body = json.loads(request.content or b"{}")
        if path == "/v1/load_lora_adapter":
            self.serves[url].add(body["lora_name"])
            return httpx.Response(200, json="Success")
        if path == "/v1/unload_lora_adapter":
            if body["lora_name"] not in self.serves[url]:
                return httpx.Response(404, json={"error": {"message": f"{body['lora_name']} not found on {url}"}})
            self.serves[url].discard(body["lora_name"])
            return httpx.Response(200, json="Success")
        return httpx.Response(200, json={"backend": url, "model": body.get("model")})


def _router(replicas: MockReplicas, policy: str = "least_loaded") -> Router:
    router = Router(RouterConfig((A, B, C), policy=policy))
    router.client = router.pool.client = httpx.AsyncClient(transport=httpx.MockTransport(replicas.handle))
    return router


async def _complete(router: Router, model: str) -> str:
    response = await router.forward("POST", "/v1/completions", {}, json.dumps({"model": model,
                                                                                "prompt": "hi"}).encode())
    return json.loads(response.body)["backend"]


def test_requests_go_to_replicas_serving_the_adapter_and_stay_where_it_is_held():
    async def run():
        replicas = MockReplicas(slots=1)
        router = _router(replicas)
        await router.pool.check_all()
        assert router.pool.all_adapters() == {"sql", "chat"}
        first = await _complete(router, "sql")
        assert first in (A, B)  # C does not serve it
        assert [await _complete(router, "sql") for _ in range(4)] == [first] * 4  # it holds "sql"
        other = await _complete(router, "chat")
        assert other in (A, B)
        if other == first:  # one slot each: "chat" took the slot of "sql" there, which is no longer preferred
            assert router.adapters.holders("sql") == set()
        base = {await _complete(router, "base") for _ in range(6)}
        assert base == {A, B, C}  # base-model requests are spread by load alone
        assert router.metrics.adapter_hits.labels(backend=first)._value.get() == 4
        described = {b["url"]: b for b in router.describe()["backends"]}
        assert described[first]["lora_adapters_held"] == ["sql"] and described[C]["lora_adapters"] == []
        await router.close()
    asyncio.run(run())


def test_load_and_unload_go_to_every_healthy_replica():
    async def run():
        replicas = MockReplicas()
        router = _router(replicas)
        await router.pool.check_all()
        body = json.dumps({"lora_name": "math", "lora_path": "/adapters/math"}).encode()
        response = await router.forward("POST", "/v1/load_lora_adapter", {}, body)
        assert response.status_code == 200 and all("math" in s for s in replicas.serves.values())
        assert router.pool.all_adapters() == {"sql", "chat", "math"}  # routed by it at once
        assert await _complete(router, "math") in (A, B, C)
        unload = json.dumps({"lora_name": "sql"}).encode()  # C never served it: its 404 is relayed
        response = await router.forward("POST", "/v1/unload_lora_adapter", {}, unload)
        assert response.status_code == 404 and C in json.loads(response.body)["error"]["message"]
        await router.close()
    asyncio.run(run())

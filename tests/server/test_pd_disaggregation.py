"""Prefill/decode disaggregation through the router: a ``--kv-role producer`` replica and a
``--kv-role consumer`` replica (separate processes) share a real redis-server; the router
(``prefill_backends``) prefills each request on the first with max_tokens=1 and decodes it on the
second, which loads the prompt's blocks from the pool. Outputs equal transformers' (completions)
and one replica's (a streamed chat); the decode replica's remote-tier hits are counted, and so are
the router's handoffs; a pool miss and a missing prefill replica are recomputed, with the same output.
"""
from __future__ import annotations

import contextlib

import httpx
import pytest
import torch
from conftest import hf_greedy, random_prompts
from live_server import free_port, serve_process, server_model_dir, start_server, wait_for  # noqa: F401 - fixture
from redis_server import RedisServer
from test_router import _client, _metrics, _router_in_thread

BLOCK = 8
MAX_TOKENS = 6
PROMPTS = random_prompts(3, seed=90, lo=41, hi=60)  # 5-7 full blocks each


@pytest.fixture(scope="module")
def redis():
    with RedisServer() as server:
        yield server


def _replica_flags(redis_url: str, role: str) -> list[str]:
    return ["--block-size", str(BLOCK), "--num-gpu-blocks-override", "128", "--max-model-len", "256",
            "--served-model-name", "tiny", "--num-threads", "1", "--kv-offload-remote", redis_url, "--kv-role", role,
            "--uvicorn-log-level", "warning", "--shutdown-timeout", "2"]


@pytest.fixture(scope="module")
def replicas(server_model_dir, redis, tmp_path_factory):  # noqa: F811 - the fixture
    """(prefill URL, decode URL): a producer and a consumer replica."""
    logs = tmp_path_factory.mktemp("pd")
    with contextlib.ExitStack() as stack:
        urls = [stack.enter_context(serve_process(server_model_dir, logs / f"{role}.log",
                                                  _replica_flags(redis.url, role), 240, 30)).url
                for role in ("producer", "consumer")]
        yield urls[0], urls[1]


@pytest.fixture(scope="module")
def pd_router(replicas):
    prefill, decode = replicas
    with _router_in_thread([decode], prefill_backends=(prefill,)) as url:
        yield url


@pytest.fixture(scope="module")
def hf_model(server_model_dir):  # noqa: F811 - the fixture
    import transformers as tf
    return tf.AutoModelForCausalLM.from_pretrained(server_model_dir, torch_dtype=torch.float32).eval()


def _total(url: str, name: str, **labels: str) -> float:
    return sum(v for (n, lab), v in _metrics(url).items() if n == name and labels.items() <= dict(lab).items())


def _complete(url: str, prompt: list[int]) -> list[int]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def test_prefill_then_decode_equals_transformers(replicas, pd_router, hf_model):
    prefill, decode = replicas
    hits = _total(decode, "pagedllm:kv_offload_hits_total", tier="remote")
    for prompt in PROMPTS:
        assert _complete(pd_router, prompt) == hf_greedy(hf_model, prompt, MAX_TOKENS)
    # the decode replica loaded every full prompt block but the last token's from the pool
    assert _total(decode, "pagedllm:kv_offload_hits_total", tier="remote") - hits == \
        sum((len(p) - 1) // BLOCK for p in PROMPTS)
    assert _total(decode, "pagedllm:kv_offload_misses_total", tier="remote") == 0
    assert _total(decode, "pagedllm:kv_offload_bytes_total", tier="remote", direction="store") == 0  # a consumer
    assert _total(prefill, "pagedllm:generation_tokens_total") == len(PROMPTS)  # one token each
    assert _total(decode, "pagedllm:kv_offload_round_trip_seconds_count", tier="remote", op="read") == len(PROMPTS)
    router = _metrics(pd_router)
    assert sum(v for (n, _), v in router.items() if n == "pagedllm:router_pd_prefills_total") == len(PROMPTS)
    assert router[("pagedllm:router_pd_handoffs_total", (("backend", decode),))] == len(PROMPTS)


def test_streamed_chat_equals_one_replica(replicas, pd_router):
    prefill, _ = replicas
    messages = [{"role": "system", "content": "paged attention keeps a block table " * 6},
                {"role": "user", "content": "and then?"}]

    def chat(url: str, stream: bool) -> str:
        out = _client(url).chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                                   stream=stream, extra_body={"ignore_eos": True})
        if not stream:
            return out.choices[0].message.content
        return "".join(chunk.choices[0].delta.content or "" for chunk in out if chunk.choices)
    assert chat(pd_router, stream=True) == chat(prefill, stream=False)  # the producer alone, whole


def test_router_shows_roles_and_remote_hits(replicas, pd_router):
    prefill, decode = replicas
    seen = {}

    def settled() -> bool:  # two reads, between which a scrape may land (CI: 18 then 27): read until they agree
        seen["backends"] = {b["url"]: b for b in httpx.get(f"{pd_router}/router/backends").json()["backends"]}
        hits = seen["backends"][decode]["remote_kv_hits"]
        return hits > 0 and hits == _total(pd_router, "pagedllm:router_remote_kv_hits")
    wait_for(settled, 20, "the router's remote hits to show the decode replica's")
    backends = seen["backends"]
    assert backends[prefill]["role"] == "prefill" and backends[decode]["role"] == "decode"


def test_pool_miss_recomputes(replicas, pd_router, redis, hf_model):
    """Redis lost the blocks (flushed) after the producer published them: the producer's prefill is a
    device hit and writes nothing new; the decode replica misses, recomputes and answers the same."""
    prefill, decode = replicas
    prompt = random_prompts(1, seed=92, lo=40, hi=41)[0]
    _complete(prefill, prompt)  # the producer alone: it holds and published the prompt's blocks
    redis.client().flushdb()
    misses = _total(decode, "pagedllm:kv_offload_misses_total", tier="remote")
    assert _complete(pd_router, prompt) == hf_greedy(hf_model, prompt, MAX_TOKENS)
    assert _total(decode, "pagedllm:kv_offload_misses_total", tier="remote") == misses + 1


def test_no_prefill_replica_decodes_alone(replicas, hf_model):
    _, decode = replicas
    nowhere = f"http://127.0.0.1:{free_port()}"  # nothing listens: the prefill half is skipped
    with _router_in_thread([decode], prefill_backends=(nowhere,)) as url:
        prompt = random_prompts(1, seed=91, lo=30, hi=31)[0]
        assert _complete(url, prompt) == hf_greedy(hf_model, prompt, MAX_TOKENS)
        assert _total(url, "pagedllm:router_pd_prefill_skipped_total", backend=decode) == 1
        assert _total(url, "pagedllm:router_pd_handoffs_total") == 0


def test_an_idle_server_publishes_at_once(server_model_dir, redis):  # noqa: F811 - the fixture
    """Write-through (no role): a finished request's blocks reach the pool when the engine goes idle,
    not at its next step (the other replicas would miss them until this one got more work)."""
    redis.client().flushdb()
    server = start_server(server_model_dir, kv_offload_remote=redis.url)
    try:
        prompt = random_prompts(1, seed=93, lo=40, hi=41)[0]
        _complete(server.url, prompt)
        wait_for(lambda: len(redis.keys()) >= len(prompt) // BLOCK, 10, "the blocks in Redis")
    finally:
        server.stop()

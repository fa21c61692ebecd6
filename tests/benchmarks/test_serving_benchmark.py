"""Tests for benchmarks/serving.py against a tiny fake OpenAI-compatible streaming server."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import random
import socket
import sys
import threading
import time
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "serving.py"
_spec = importlib.util.spec_from_file_location("pagedllm_bench_serving", _PATH)
serving = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = serving
_spec.loader.exec_module(serving)

CHUNK_SLEEP = 0.003


# --------------------------------------------------------------------------- fake server


class FakeState:
    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.in_flight = 0
        self.max_in_flight = 0


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def make_app(state: FakeState) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    async def stream(body: dict, chat: bool):
        state.in_flight += 1
        state.max_in_flight = max(state.max_in_flight, state.in_flight)
        try:
            n = body["max_tokens"]
            if chat:  # role-only first chunk: must not count as the first token
                yield _sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            for i in range(n):
                await asyncio.sleep(CHUNK_SLEEP)
                piece = {"delta": {"content": f" t{i}"}} if chat else {"text": f" t{i}"}
                yield _sse({"choices": [{"index": 0, **piece, "finish_reason": None}]})
            yield _sse({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
            if body.get("stream_options", {}).get("include_usage"):
                prompt_tokens = len(body.get("prompt") or body["messages"][0]["content"]) // 4
                yield _sse({"choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                                                     "total_tokens": prompt_tokens + n}})
            yield "data: [DONE]\n\n"
        finally:
            state.in_flight -= 1

    async def handle(request: Request, chat: bool):
        body = await request.json()
        state.bodies.append(body)
        if body.get("model") == "broken":
            return JSONResponse({"error": {"message": "no such model"}}, status_code=404)
        return StreamingResponse(stream(body, chat), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app


@pytest.fixture(scope="module")
def fake_server():
    state = FakeState()
    # proto=IPPROTO_TCP matters: asyncio only sets TCP_NODELAY on such sockets, and with
    # Nagle left on, small SSE writes are held back ~40 ms and arrive in one batch.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(make_app(state), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 20
    while not server.started and time.time() < deadline:
        time.sleep(0.02)
    assert server.started, "fake server did not start"
    yield f"http://127.0.0.1:{port}", state
    server.should_exit = True
    thread.join(timeout=10)
    sock.close()


def _args(base_url: str, *extra: str):
    return serving.parse_args(["--base-url", base_url, "--no-save", "--random-input-len", "16",
                               "--random-output-len", "6", *extra])


# --------------------------------------------------------------------------- end to end


def test_completions_end_to_end(fake_server):
    base_url, state = fake_server
    state.bodies.clear()
    args = _args(base_url, "--num-prompts", "5", "--goodput", "ttft:10000", "e2el:10000")
    result = asyncio.run(serving.benchmark(args))
    m = result["metrics"]
    assert result["model"] == "fake-model"  # resolved from /v1/models
    assert m["completed"] == 5 and m["failed"] == 0 and m["usage_reported"] == 5
    assert m["total_output_tokens"] == 5 * 6
    assert m["output_throughput"] > 0 and m["total_token_throughput"] > m["output_throughput"]
    assert m["good_requests"] == 5 and math.isclose(m["request_goodput"], m["request_throughput"])
    for r in result["requests"]:
        assert 0 < r["ttft"] < r["e2el"]
        assert len(r["itl"]) == 5  # 6 text chunks -> 5 gaps
        assert r["tpot"] == pytest.approx((r["e2el"] - r["ttft"]) / 5)
    assert m["ttft_ms"]["mean"] < m["e2el_ms"]["mean"]
    assert m["tpot_ms"]["median"] >= CHUNK_SLEEP * 1000 * 0.5  # chunks really were streamed apart
    assert len(state.bodies) == 5  # bounded: exactly num-prompts requests
    body = state.bodies[0]
    assert body["stream"] and body["ignore_eos"] and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 6 and body["model"] == "fake-model"
    assert "Serving Benchmark Result" in serving.format_table(m)


def test_chat_with_rate_and_concurrency(fake_server):
    base_url, state = fake_server
    state.max_in_flight = 0
    args = _args(base_url, "--endpoint", "/v1/chat/completions", "--num-prompts", "6",
                 "--request-rate", "500", "--max-concurrency", "2", "--random-range-ratio", "0.5",
                 "--model", "fake-model")
    result = asyncio.run(serving.benchmark(args))
    assert result["metrics"]["completed"] == 6
    assert state.max_in_flight <= 2
    outs = [r["output_tokens"] for r in result["requests"]]
    assert all(3 <= o <= 9 for o in outs)
    for r in result["requests"]:
        assert len(r["itl"]) == r["output_tokens"] - 1  # role-only chunk not counted


def test_failed_requests_are_counted(fake_server):
    base_url, _ = fake_server
    result = asyncio.run(serving.benchmark(_args(base_url, "--num-prompts", "3", "--model", "broken")))
    m = result["metrics"]
    assert m["completed"] == 0 and m["failed"] == 3
    assert "HTTP 404" in result["requests"][0]["error"]
    assert math.isnan(m["ttft_ms"]["mean"])


def test_main_saves_json(fake_server, tmp_path, capsys):
    base_url, _ = fake_server
    out = tmp_path / "res.json"
    rc = serving.main(["--base-url", base_url, "--num-prompts", "2", "--dataset", "fixed",
                       "--random-input-len", "8", "--random-output-len", "3", "--result-file", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["metrics"]["completed"] == 2 and data["config"]["request_rate"] == "inf"
    assert "Mean TTFT (ms):" in capsys.readouterr().out


# --------------------------------------------------------------------------- pure functions


def _result(ttft_ms: float, e2el_ms: float, tokens: int, success: bool = True):
    return serving.RequestResult(success=success, prompt_len=10, output_tokens=tokens,
                                 ttft=ttft_ms / 1000, e2el=e2el_ms / 1000)


def test_goodput_logic():
    samples = [
        _result(100, 1000, 10),   # tpot = 100 ms: good only if tpot SLO >= 100
        _result(600, 700, 11),    # ttft too slow for ttft:500; tpot 10 ms
        _result(50, 150, 11),     # good everywhere; tpot 10 ms
        _result(50, 60, 1),       # single token: no TPOT -> meets the tpot SLO
        _result(10, 20, 5, success=False),  # failures never count
    ]
    slos = serving.parse_goodput(["ttft:500", "tpot:50"])
    assert slos == {"ttft": 500.0, "tpot": 50.0}
    assert [serving.meets_slos(r, slos) for r in samples] == [False, False, True, True, False]
    assert serving.goodput(samples, slos, duration=2.0) == 1.0
    assert serving.goodput(samples, {"e2el": 200}, duration=4.0) == 0.5
    assert serving.goodput(samples, {}, duration=1.0) == 4  # no SLOs: every success counts
    m = serving.compute_metrics(samples, 2.0, slos)
    assert m["good_requests"] == 2 and m["completed"] == 4 and m["failed"] == 1
    assert m["tpot_ms"]["median"] == pytest.approx(10.0)


@pytest.mark.parametrize("bad", ["ttft", "foo:10", "ttft:abc", "tpot:-1"])
def test_parse_goodput_rejects(bad):
    with pytest.raises(ValueError, match="--goodput"):
        serving.parse_goodput([bad])


def test_sse_parsing_and_chunk_text():
    assert serving.parse_sse_line("") is None
    assert serving.parse_sse_line(": keep-alive") is None
    assert serving.parse_sse_line("data: [DONE]") is serving.SSE_DONE
    chunk = serving.parse_sse_line('data: {"choices": [{"text": "hi"}]}')
    assert serving.chunk_text(chunk) == "hi"
    assert serving.chunk_text({"choices": [{"delta": {"content": "yo"}}]}) == "yo"
    assert serving.chunk_text({"choices": [], "usage": {"completion_tokens": 3}}) == ""


def test_requests_and_arrivals_are_seeded():
    args = serving.parse_args(["--num-prompts", "20", "--random-input-len", "100",
                               "--random-output-len", "50", "--random-range-ratio", "0.2"])
    a, b = serving.build_requests(args), serving.build_requests(args)
    assert a == b and len(a) == 20
    assert all(80 <= r.prompt_len <= 120 and 40 <= r.output_len <= 60 for r in a)
    assert all(len(r.prompt.split()) == r.prompt_len for r in a)
    assert serving.arrival_delays(math.inf, 3, random.Random(0)) == [0.0] * 3
    delays = serving.arrival_delays(100.0, 2000, random.Random(0))
    assert sum(delays) / len(delays) == pytest.approx(0.01, rel=0.1)
    fixed = serving.build_requests(serving.parse_args(["--dataset", "fixed", "--num-prompts", "3",
                                                       "--random-input-len", "7"]))
    assert len({r.prompt for r in fixed}) == 1 and fixed[0].prompt_len == 7


def test_token_id_prompts_with_tokenizer():
    """With a tokenizer, prompts are decoded random non-special token ids of the requested length."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "[EOS]": 1, **{f"w{i}": i + 2 for i in range(50)}}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]", eos_token="[EOS]")
    args = serving.parse_args(["--num-prompts", "4", "--random-input-len", "12", "--random-output-len", "5"])
    specs = serving.build_requests(args, tok)
    assert [s.prompt_len for s in specs] == [12] * 4
    assert all("[UNK]" not in s.prompt and "[EOS]" not in s.prompt for s in specs)


def test_prefix_dataset_shares_a_few_prefixes():
    args = serving.parse_args(["--dataset", "prefix", "--num-prompts", "12", "--num-prefixes", "3",
                               "--prefix-len", "20", "--random-input-len", "5"])
    reqs = serving.build_requests(args)
    assert reqs == serving.build_requests(args)  # seeded
    assert len({" ".join(r.prompt.split()[:20]) for r in reqs}) == 3
    assert len({r.prompt for r in reqs}) == 12
    assert all(r.prompt_len == 25 == len(r.prompt.split()) for r in reqs)


def test_prefix_metrics_are_rates_over_the_run():
    names = serving.PREFIX_COUNTERS + serving.ROUTER_COUNTERS
    before = dict(zip(names, (10.0, 100.0, 4.0, 1.0)))
    after = dict(zip(names, (70.0, 200.0, 14.0, 9.0)))
    assert serving.prefix_metrics(before, after) == {"prefix_cache_hit_rate": 0.6, "router_affinity_rate": 0.8}
    no_router = serving.prefix_metrics(dict.fromkeys(names, 0.0), dict(zip(names, (1.0, 2.0, 0.0, 0.0))))
    assert no_router["prefix_cache_hit_rate"] == 0.5 and math.isnan(no_router["router_affinity_rate"])

"""The OpenAI-compatible server, driven by the real ``openai`` client against a live uvicorn."""
from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from conftest import make_model_dir
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from live_server import live_server, raw_http, server_model_dir, start_server  # noqa: F401 - fixtures
from prometheus_client.parser import text_string_to_metric_families

from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.openai.api_server import ServerLimits

PROMPTS = ["hello world", "the quick brown fox", "paged attention keeps", "a block table",
           "héllo wörld", "tiny tokenizer for tests", "jumps over the lazy dog", "this is a"]


@pytest.fixture(scope="module")
def client(live_server):  # noqa: F811
    with openai.OpenAI(base_url=f"{live_server.url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def offline(server_model_dir):  # noqa: F811
    """The same model offline: the oracle for greedy text and token ids."""
    return LLM(server_model_dir, block_size=8, num_gpu_blocks_override=64, max_model_len=128)


def greedy(offline, prompt: str, max_tokens: int, **kw):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, **kw)
    return offline.generate([prompt], params, use_tqdm=False)[0].outputs[0]


def metric_values(url: str) -> dict[tuple, float]:
    """``{(sample name, sorted labels): value}`` of a /metrics scrape (parsed by prometheus_client)."""
    text = httpx.get(f"{url}/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def gauge(values: dict, name: str) -> float:
    return values[(f"pagedllm:{name}", (("model_name", "tiny"),))]


# ---------------------------------------------------------------------- happy paths
def test_models_health_tokenize(live_server, client):  # noqa: F811
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(f"{live_server.url}/health").status_code == 200
    toks = httpx.post(f"{live_server.url}/tokenize", json={"prompt": "hello world"}).json()
    assert toks["count"] == len(toks["tokens"]) > 0 and toks["max_model_len"] == 128
    text = httpx.post(f"{live_server.url}/detokenize", json={"tokens": toks["tokens"]}).json()["prompt"]
    assert "hello world" in text


def test_tokenize_messages_is_one_tokenizer_thread_job(live_server, monkeypatch):  # noqa: F811
    """/tokenize with messages renders the template and encodes in one job (it took two hops)."""
    from transformers import AutoTokenizer
    jobs, real = [], live_server.engine.with_tokenizer

    async def counting(fn):
        jobs.append(fn)
        return await real(fn)
    monkeypatch.setattr(live_server.engine, "with_tokenizer", counting)
    messages = [{"role": "user", "content": "hello world"}]
    toks = httpx.post(f"{live_server.url}/tokenize", json={"messages": messages}).json()["tokens"]
    tokenizer = AutoTokenizer.from_pretrained(live_server.engine.model_config.tokenizer)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert len(jobs) == 1 and toks == tokenizer.encode(text, add_special_tokens=False)


def test_completion_matches_offline_and_stream(client, offline):
    ref = greedy(offline, "hello world", 10)
    out = client.completions.create(model="tiny", prompt="hello world", max_tokens=10, temperature=0)
    assert out.choices[0].text == ref.text and out.choices[0].finish_reason == ref.finish_reason
    assert out.usage.completion_tokens == len(ref.token_ids) and out.usage.prompt_tokens > 0
    chunks = list(client.completions.create(model="tiny", prompt="hello world", max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids) and not chunks[-1].choices


def test_token_prompts_batch_and_echo(client, offline):
    ids = offline.get_tokenizer().encode("the quick brown fox")
    out = client.completions.create(model="tiny", prompt=[ids, ids[:2]], max_tokens=4, temperature=0, n=2)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.usage.prompt_tokens == len(ids) + 2 and out.usage.completion_tokens == 16
    out = client.completions.create(model="tiny", prompt=["x", "hello world"], max_tokens=4, temperature=0)
    assert out.choices[1].text == greedy(offline, "hello world", 4).text
    echo = client.completions.create(model="tiny", prompt="hello world", max_tokens=3, temperature=0, echo=True)
    assert echo.choices[0].text.startswith("hello world")


def test_chat_stream_equals_non_stream(client):
    msgs = [{"role": "user", "content": "hello there"}]
    full = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0)
    assert full.choices[0].message.role == "assistant" and full.usage.completion_tokens > 0
    chunks = list(client.chat.completions.create(model="tiny", messages=msgs, max_completion_tokens=8,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_n_seed_and_logprobs(client):
    kw = dict(model="tiny", prompt="paged attention", max_tokens=6, temperature=1.0, seed=7, n=3)
    a, b = client.completions.create(**kw, logprobs=2), client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    texts = ["", "", ""]
    for chunk in client.completions.create(**kw, stream=True):
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts == [c.text for c in b.choices]
    lp = a.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert all(x <= 0 for x in lp.token_logprobs) and all(1 <= len(t) <= 3 for t in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=3, n=2)
    content = chat.choices[1].logprobs.content
    assert len(chat.choices) == 2 and len(content) == 4 and all(len(t.top_logprobs) == 3 for t in content)


def test_seeds_that_share_low_bits_sample_differently(client):
    """-1, 2**32 - 1 and 2**63 - 1 used to reach the same 32-bit torch seed: the same text."""
    kw = dict(model="tiny", prompt="paged attention", max_tokens=12, temperature=1.0, extra_body={"ignore_eos": True})
    texts = [client.completions.create(**kw, seed=seed).choices[0].text for seed in (-1, 2**32 - 1, 2**63 - 1)]
    assert len(set(texts)) == 3, texts
    assert client.completions.create(**kw, seed=-1).choices[0].text == texts[0]


def test_stop_strings_and_vllm_extras(client, offline):
    ref = greedy(offline, "the quick brown fox", 16, ignore_eos=True)
    stop = ref.text[4:6]
    out = client.completions.create(model="tiny", prompt="the quick brown fox", max_tokens=16, temperature=0,
                                    stop=[stop], extra_body={"ignore_eos": True})
    assert out.choices[0].text == ref.text[:ref.text.find(stop)] and out.choices[0].finish_reason == "stop"
    stop_id = ref.token_ids[3]
    out = client.completions.create(model="tiny", prompt="the quick brown fox", max_tokens=16, temperature=0,
                                    extra_body={"stop_token_ids": [stop_id], "top_k": 5, "min_p": 0.01,
                                                "repetition_penalty": 1.0, "min_tokens": 1, "ignore_eos": True})
    assert out.choices[0].finish_reason == "stop" and out.choices[0].model_extra["stop_reason"] == stop_id
    assert out.usage.completion_tokens == ref.token_ids.index(stop_id) + 1


def test_logit_bias_and_allowed_token_ids(client, offline):
    ref = greedy(offline, "the quick brown fox", 6, ignore_eos=True)
    banned = {str(t): -100 for t in set(ref.token_ids)}  # OpenAI's JSON shape: string keys
    out = client.completions.create(model="tiny", prompt="the quick brown fox", max_tokens=6, temperature=0,
                                    logit_bias=banned, extra_body={"ignore_eos": True})
    want = greedy(offline, "the quick brown fox", 6, ignore_eos=True, logit_bias=banned)
    assert out.choices[0].text == want.text and not set(want.token_ids) & set(ref.token_ids)
    allowed = sorted(set(ref.token_ids))[:2]
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                          temperature=1.0, seed=1, extra_body={"allowed_token_ids": allowed})
    want = offline.chat([{"role": "user", "content": "hi"}],
                        SamplingParams(temperature=1.0, seed=1, max_tokens=5, allowed_token_ids=allowed),
                        use_tqdm=False)[0].outputs[0]
    assert chat.choices[0].message.content == want.text and set(want.token_ids) <= set(allowed)


def test_echo_with_logprobs_scores_the_prompt(client, offline):
    prompt = "the quick brown fox"
    ref = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=3, logprobs=2, prompt_logprobs=2),
                           use_tqdm=False)[0]
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=2)
    lp, n_prompt = out.choices[0].logprobs, len(ref.prompt_token_ids)
    assert out.choices[0].text == prompt + ref.outputs[0].text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == n_prompt + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = [ref.prompt_logprobs[p][t].logprob for p, t in enumerate(ref.prompt_token_ids) if p > 0]
    assert lp.token_logprobs[1:n_prompt] == pytest.approx(want, abs=1e-5)
    assert all(len(t) >= 1 for t in lp.top_logprobs[1:]) and lp.text_offset == sorted(lp.text_offset)
    assert "".join(lp.tokens[:n_prompt]) == prompt
    streamed = [c.choices[0].logprobs for c in client.completions.create(
        model="tiny", prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=2, stream=True)]
    tokens = [t for chunk in streamed for t in chunk.tokens]
    assert tokens == lp.tokens and streamed[0].token_logprobs[0] is None


def test_legacy_generate(live_server, offline):  # noqa: F811
    body = {"prompt": "hello world", "max_tokens": 6, "temperature": 0}
    full = httpx.post(f"{live_server.url}/generate", json=body).json()
    assert full == {"text": ["hello world" + greedy(offline, "hello world", 6).text]}
    with httpx.stream("POST", f"{live_server.url}/generate", json={**body, "stream": True}) as r:
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert lines[-1] == full and len(lines) >= 2


@pytest.fixture
def slow_engine(live_server, monkeypatch):  # noqa: F811
    """Adds 10 ms to every engine step, so a 100-token request is still running when a test
    looks at it or drops it, however fast the engine is on this machine."""
    engine = live_server.engine.engine
    real_step = engine.step

    def slow_step():
        time.sleep(0.01)
        return real_step()

    monkeypatch.setattr(engine, "step", slow_step)


# ---------------------------------------------------------------------- metrics
def test_metrics_parse_and_gauges_move(live_server, client, slow_engine):  # noqa: F811
    before = metric_values(live_server.url)
    streams = [client.completions.create(model="tiny", prompt=p, max_tokens=100, temperature=0, stream=True,
                                         extra_body={"ignore_eos": True}) for p in PROMPTS[:4]]
    for s in streams:
        next(iter(s))  # every request is running now
    during = metric_values(live_server.url)
    assert gauge(during, "num_requests_running") >= 1 and gauge(during, "kv_cache_usage_perc") > 0
    for s in streams:
        s.close()
    live_server.wait_idle()
    client.completions.create(model="tiny", prompt="hi", max_tokens=3)  # aborted requests have no e2e latency
    after = metric_values(live_server.url)
    assert gauge(after, "num_requests_running") == 0 and gauge(after, "kv_cache_usage_perc") == 0
    for name in ("prompt_tokens_total", "generation_tokens_total", "time_to_first_token_seconds_count",
                 "inter_token_latency_seconds_count", "e2e_request_latency_seconds_count",
                 "request_queue_time_seconds_count", "prefix_cache_queries_total"):
        key = (f"pagedllm:{name}", (("model_name", "tiny"),))
        assert after[key] > before.get(key, 0), name
    abort = ("pagedllm:request_success_total", (("finished_reason", "abort"), ("model_name", "tiny")))
    assert after[abort] >= before[abort] + 4
    names = {k[0] for k in after}
    for metric in ("num_requests_waiting", "num_requests_swapped", "cpu_kv_cache_usage_perc",
                   "prefix_cache_hits_total", "num_preemptions_total"):
        assert f"pagedllm:{metric}" in names


@pytest.mark.parametrize("stream", [False, True])
def test_request_histograms_count_each_finished_request(live_server, client, stream):  # noqa: F811
    """vLLM's per-request histograms; a streamed request's final output holds only its last delta,
    so the sizes must come from the request, not from that output."""
    key = lambda name: (f"pagedllm:{name}", (("model_name", "tiny"),))  # noqa: E731
    before = metric_values(live_server.url)
    reply = client.completions.create(model="tiny", prompt="count these tokens", max_tokens=5, n=2, temperature=0.8,
                                      seed=1, stream=stream, stream_options={"include_usage": True} if stream else None,
                                      extra_body={"ignore_eos": True})
    usage = list(reply)[-1].usage if stream else reply.usage
    after = metric_values(live_server.url)
    delta = lambda name: after[key(name)] - before.get(key(name), 0)  # noqa: E731
    assert delta("request_prompt_tokens_count") == 1 and delta("request_prompt_tokens_sum") == usage.prompt_tokens
    assert delta("request_generation_tokens_sum") == usage.completion_tokens == 10
    assert delta("request_max_num_generation_tokens_sum") == 5
    assert delta("request_params_n_sum") == 2 and delta("request_params_max_tokens_sum") == 5
    for name in ("request_inference_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
                 "request_time_per_output_token_seconds", "request_queue_time_seconds"):
        assert delta(f"{name}_count") == 1, name
    assert delta("request_decode_time_seconds_sum") >= delta("request_time_per_output_token_seconds_sum") * 4
    info = [labels for (name, labels), v in after.items() if name == "pagedllm:cache_config_info" and v == 1]
    assert len(info) == 1 and ("block_size", "8") in info[0] and ("num_gpu_blocks", "256") in info[0]


# ---------------------------------------------------------------------- load and disconnects
async def _one_stream(aclient, i: int, expected: dict[str, str]) -> str:
    prompt = PROMPTS[i % len(PROMPTS)]
    disconnect = i % 4 == 0
    stream = await aclient.completions.create(model="tiny", prompt=prompt, temperature=0, stream=True,
                                              max_tokens=100 if disconnect else 8,
                                              extra_body={"ignore_eos": disconnect})
    text = ""
    async for chunk in stream:
        text += chunk.choices[0].text
        if disconnect:
            await stream.close()  # drops the connection mid-stream
            return "disconnected"
    assert text == expected[prompt]
    return "ok"


def test_64_concurrent_streams_with_disconnects(live_server, offline, slow_engine):  # noqa: F811
    expected = {p: greedy(offline, p, 8).text for p in PROMPTS}
    before = metric_values(live_server.url)

    async def run():
        async with openai.AsyncOpenAI(base_url=f"{live_server.url}/v1", api_key="x", max_retries=0,
                                      timeout=60) as aclient:
            return await asyncio.gather(*(_one_stream(aclient, i, expected) for i in range(64)))
    results = asyncio.run(run())
    assert results.count("ok") == 48 and results.count("disconnected") == 16
    stats = live_server.wait_idle()
    assert stats.num_used_blocks == 0 and live_server.engine.num_in_flight == 0
    assert not live_server.engine.engine.has_unfinished_requests()
    abort = ("pagedllm:request_success_total", (("finished_reason", "abort"), ("model_name", "tiny")))
    assert metric_values(live_server.url)[abort] >= before[abort] + 16


def test_prompts_of_one_request_reach_the_engine_together(live_server, slow_engine, monkeypatch):  # noqa: F811
    """16 prompts in one request are added in one pass of the engine thread, not one per step
    (each used to wait for the step in progress, so the last one started 16 steps late)."""
    engine = live_server.engine.engine
    real_add, real_step, steps, added_at = engine.add_processed_request, engine.step, [0], []

    def counting_step():
        steps[0] += 1
        return real_step()

    def recording_add(processed):
        added_at.append(steps[0])
        return real_add(processed)
    monkeypatch.setattr(engine, "step", counting_step)
    monkeypatch.setattr(engine, "add_processed_request", recording_add)
    background = threading.Thread(target=httpx.post, args=(f"{live_server.url}/v1/completions",), kwargs=dict(
        json={"prompt": "hello", "max_tokens": 100, "ignore_eos": True}, timeout=60))
    background.start()  # keeps the engine stepping while the batch arrives
    time.sleep(0.2)
    out = httpx.post(f"{live_server.url}/v1/completions", json={"prompt": PROMPTS * 2, "max_tokens": 2}, timeout=60)
    assert out.status_code == 200 and len(out.json()["choices"]) == 16
    background.join()
    assert len(added_at) == 17 and added_at[-1] - added_at[1] <= 1, added_at


def test_non_streaming_disconnect_aborts(live_server, slow_engine):  # noqa: F811
    before = metric_values(live_server.url)
    body = {"prompt": "hello world", "max_tokens": 110, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{live_server.url}/v1/completions", json=body, timeout=0.3)
    assert live_server.wait_idle().num_used_blocks == 0
    abort = ("pagedllm:request_success_total", (("finished_reason", "abort"), ("model_name", "tiny")))
    assert metric_values(live_server.url)[abort] == before[abort] + 1


SLOW_IDS = [5, 6, 7, 8, 9, 10, 11, 12, 13]


@pytest.fixture
def slow_tokenizer(server_model_dir, monkeypatch):  # noqa: F811
    """Tokenizer calls on a "SLOW" text (or SLOW_IDS) take 1.5 s; returns the names of the threads
    they ran on."""
    from transformers import AutoTokenizer
    cls, threads = type(AutoTokenizer.from_pretrained(server_model_dir)), []

    def slowed(name, is_slow):
        real = getattr(cls, name)

        def method(self, arg, *args, **kw):
            if is_slow(arg):
                threads.append(threading.current_thread().name)
                time.sleep(1.5)
            return real(self, arg, *args, **kw)
        monkeypatch.setattr(cls, name, method)
    slowed("encode", lambda text: isinstance(text, str) and "SLOW" in text)
    slowed("decode", lambda ids: list(ids) == SLOW_IDS)
    slowed("apply_chat_template", lambda messages: "SLOW" in str(messages))
    return threads


@pytest.mark.parametrize("path, body", [
    ("/tokenize", {"prompt": "SLOW hello"}),
    ("/tokenize", {"messages": [{"role": "user", "content": "SLOW hello"}]}),
    ("/detokenize", {"tokens": SLOW_IDS}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "SLOW hello"}], "max_tokens": 2}),
])
def test_tokenizer_work_does_not_hold_the_event_loop(live_server, slow_tokenizer, path, body):  # noqa: F811
    """/tokenize, /detokenize and chat templates run on the tokenizer threads: a 4 MiB body takes
    seconds to tokenize, and /health and every stream used to wait for it."""
    slow = threading.Thread(target=httpx.post, args=(f"{live_server.url}{path}",), kwargs=dict(json=body, timeout=30))
    slow.start()
    time.sleep(0.3)
    t0 = time.perf_counter()
    assert httpx.get(f"{live_server.url}/health", timeout=30).status_code == 200
    assert time.perf_counter() - t0 < 1.0
    slow.join()
    assert slow_tokenizer and all(name.startswith("pagedllm-tokenize") for name in slow_tokenizer), slow_tokenizer


# ---------------------------------------------------------------------- bad input
BAD = [
    ("/v1/completions", '{"prompt": "x", ', None),
    ("/v1/completions", '[1, 2]', None),
    ("/v1/completions", '{"max_tokens": 5}', "prompt"),
    ("/v1/completions", '{"prompt": "x", "max_tokens": "5"}', "max_tokens"),
    ("/v1/completions", '{"prompt": "x", "temperature": "hot"}', "temperature"),
    ("/v1/completions", '{"prompt": "x", "stream": "yes"}', "stream"),
    ("/v1/completions", '{"prompt": 5}', "prompt"),
    ("/v1/completions", '{"prompt": "x", "temperature": -1}', "temperature"),
    ("/v1/completions", '{"prompt": "x", "top_p": 1.5}', "top_p"),
    ("/v1/completions", '{"prompt": "x", "top_k": -2}', "top_k"),
    ("/v1/completions", '{"prompt": "x", "n": 0}', "n"),
    ("/v1/completions", '{"prompt": "x", "max_tokens": 0}', "max_tokens"),
    ("/v1/completions", '{"prompt": "x", "logprobs": 50}', "logprobs"),
    ("/v1/completions", '{"prompt": "x", "presence_penalty": 3}', "presence_penalty"),
    ("/v1/completions", '{"prompt": "x", "temperature": NaN}', "temperature"),
    ("/v1/completions", '{"prompt": "x", "seed": 100000000000000000000000}', "seed"),
    ("/v1/completions", '{"prompt": "x", "seed": 9223372036854775808}', "seed"),
    ("/v1/completions", '{"prompt": "x", "spaces_between_special_tokens": false}', "spaces_between_special_tokens"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], '
                             '"spaces_between_special_tokens": false}', "spaces_between_special_tokens"),
    ("/generate", '{"prompt": "x", "spaces_between_special_tokens": false}', "spaces_between_special_tokens"),
    ("/generate", '{"prompt": "x", "seed": -9223372036854775809}', "seed"),
    ("/v1/completions", '{"prompt": "x", "stop_token_ids": [99999]}', "stop_token_ids"),
    ("/v1/completions", '{"prompt": "x", "logit_bias": {"5": 101}}', "logit_bias"),
    ("/v1/completions", '{"prompt": "x", "logit_bias": {"abc": 1}}', "logit_bias"),
    ("/v1/completions", '{"prompt": "x", "logit_bias": {"99999": 1}}', "logit_bias"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "allowed_token_ids": []}',
     "allowed_token_ids"),
    ("/v1/completions", '{"prompt": "x", "model": "gpt-4"}', "model"),
    ("/v1/completions", '{"prompt": "x", "max_tokens": 1000}', "prompt"),
    ("/v1/completions", '{"prompt": "' + "hello " * 200 + '"}', "prompt"),
    ("/v1/completions", '{"prompt": [1, 99999]}', "prompt"),
    ("/v1/completions", '{"prompt": ""}', "prompt"),
    ("/v1/completions", '{"prompt": []}', "prompt"),
    ("/v1/completions", '{"prompt": "\\ud800"}', "prompt"),  # a lone surrogate: the field is named
    ("/v1/completions", '{"prompt": ["ok", "a\\udc00b"]}', "prompt"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages"),
    ("/v1/completions", '{"prompt": "x", "stream": true, "best_of": 3}', "best_of"),
    ("/v1/completions", '{"prompt": "x", "stream_options": {"include_usage": true}}', "stream_options"),
    ("/v1/chat/completions", '{"messages": "hi"}', "messages"),
    ("/v1/chat/completions", '{"messages": []}', "messages"),
    ("/v1/chat/completions", '{"messages": [{"content": "hi"}]}', "messages"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}',
     "top_logprobs"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "model": "nope"}', "model"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 500}', "messages"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}',
     "max_completion_tokens"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "logprobs": true, '
                             '"top_logprobs": 21}', "top_logprobs"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', "messages"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}',
     "tools"),
    ("/generate", '{"prompt": "x", "bogus": 1}', "bogus"),
    ("/generate", '{"prompt": "x", "logprobs": 2}', "logprobs"),  # its reply has no place for them
    ("/generate", '{"prompt": "x", "best_of": 3, "stream": true}', "best_of"),
    ("/generate", '{"prompt": "x", "top_k": 1.5}', "top_k"),
    ("/tokenize", '{}', "prompt"),
    ("/detokenize", '{"tokens": [-1]}', "tokens"),
]


@pytest.mark.parametrize("path, body, param", BAD)
def test_bad_input_is_400_and_server_keeps_serving(live_server, path, body, param):  # noqa: F811
    r = httpx.post(f"{live_server.url}{path}", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param, err
    ok = httpx.post(f"{live_server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200



def test_lone_surrogate_says_what_is_wrong(live_server):  # noqa: F811
    for path, body in [("/v1/completions", '{"prompt": "x\\ud800"}'),
                       ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\udfff"}]}')]:
        r = httpx.post(f"{live_server.url}{path}", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400 and "lone surrogate" in r.json()["error"]["message"], r.text

def test_missing_chat_template_is_400(tmp_path):
    srv = start_server(make_model_dir(tmp_path, "llama"))  # the test tokenizer has no chat template
    try:
        with openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0) as bare:
            with pytest.raises(openai.BadRequestError, match="chat-template"):
                bare.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
    finally:
        srv.stop()


# ---------------------------------------------------------------------- request bodies
def _post_head(path: str, framing: bytes) -> bytes:
    return (b"POST " + path.encode() + b" HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            + framing + b"\r\n\r\n")


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_huge_body_is_refused_while_a_small_request_runs(live_server, framing):  # noqa: F811
    """A 20 MB prompt used to be read whole and tokenized on the engine thread, stalling a
    2-token request for 36 s; now it gets 413 from its Content-Length (or once 4 MiB of a
    chunked body are read) and the small request is served as usual."""
    body = b'{"prompt": "' + b"hello " * (20 * 2**20 // 6) + b'", "max_tokens": 2}'  # ~20 MB
    parts = [body[i:i + 2**20] for i in range(0, len(body), 2**20)]
    if framing == "chunked":
        head = _post_head("/v1/completions", b"Transfer-Encoding: chunked")
        parts = [b"%x\r\n%s\r\n" % (len(p), p) for p in parts] + [b"0\r\n\r\n"]
    else:
        head = _post_head("/v1/completions", b"Content-Length: %d" % len(body))
    big = raw_http(live_server.url, head, parts)
    big.sender.join(60)  # everything sent, or cut off by the refusal
    start = time.time()
    small = httpx.post(f"{live_server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
    elapsed = time.time() - start
    status, reply = big.finish()
    assert small.status_code == 200 and elapsed < 1.0, elapsed
    assert status == 413, big.response[:300]
    error = json.loads(reply)["error"]
    assert "--max-request-body-bytes" in error["message"] and error["code"] == 413
    assert big.sent < len(body)  # the server stopped reading: the client could not send it all


def test_stalled_body_gets_408_and_limits_are_configurable(server_model_dir):  # noqa: F811
    srv = start_server(server_model_dir, limits=ServerLimits(max_request_body_bytes=1000, request_body_timeout=1.0))
    try:
        start = time.time()  # Content-Length 30, 5 bytes sent: used to stay open for good
        status, reply = raw_http(srv.url, _post_head("/v1/completions", b"Content-Length: 30"), [b'{"pro']).finish()
        assert status == 408 and time.time() - start < 6
        assert "--request-body-timeout" in json.loads(reply)["error"]["message"]
        body = b'{"prompt": "hi", "max_tokens": 2}'  # each piece in time: the timeout is per piece
        head = _post_head("/v1/completions", b"Content-Length: %d\r\nConnection: close" % len(body))
        trickle = raw_http(srv.url, head, _trickle([body[:10], body[10:20], body[20:]], 0.4))
        assert trickle.finish()[0] == 200
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x" * 1000, "max_tokens": 2})
        assert r.status_code == 413 and "limit is 1000 bytes" in r.json()["error"]["message"]
        chunked = httpx.post(f"{srv.url}/generate", content=iter([b'{"prompt": "' + b"x" * 600, b"x" * 600 + b'"}']))
        assert chunked.status_code == 413 and chunked.json()["error"]["code"] == 413  # read in the handler
        assert httpx.post(f"{srv.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    finally:
        srv.stop()


def _trickle(parts: list[bytes], pause: float):
    for part in parts:
        time.sleep(pause)
        yield part


def test_server_limits_refuse_bad_values():
    for kwargs, name in [(dict(max_request_body_bytes=0), "max_request_body_bytes"),
                         (dict(request_body_timeout=0), "request_body_timeout"),
                         (dict(shutdown_timeout=-1), "shutdown_timeout"),
                         (dict(shutdown_timeout=float("inf")), "shutdown_timeout")]:
        with pytest.raises(ValueError, match=name):
            ServerLimits(**kwargs)


# ---------------------------------------------------------------------- fuzz
_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-3, 40), st.integers(), st.floats(-5, 5),
                     st.text(max_size=8))
_VALUES = st.recursive(_SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                         st.dictionaries(st.text(max_size=5), inner, max_size=3)),
                       max_leaves=6)
_FIELDS = ["model", "prompt", "messages", "n", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
           "stream", "logprobs", "top_logprobs", "echo", "presence_penalty", "frequency_penalty",
           "repetition_penalty", "ignore_eos", "min_tokens", "stop_token_ids", "best_of", "stream_options",
           "tokens", "add_special_tokens"]
_GOOD = {"prompt": st.sampled_from(["hi", "hello world", [5, 6, 7]]), "model": st.just("tiny"),
         "messages": st.just([{"role": "user", "content": "hi"}])}
_BODIES = st.fixed_dictionaries(
    {"max_tokens": st.one_of(st.integers(-2, 4), _SCALARS)},
    optional={f: st.one_of(_GOOD.get(f, _VALUES), _VALUES) for f in _FIELDS})
_PATHS = st.sampled_from(["/v1/completions", "/v1/chat/completions", "/generate", "/tokenize", "/detokenize"])


@settings(max_examples=100, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(path=_PATHS, body=st.one_of(_BODIES, _VALUES))
def test_fuzz_never_500(live_server, path, body):  # noqa: F811
    r = httpx.post(f"{live_server.url}{path}", json=body, timeout=30)
    assert r.status_code in (200, 400), (r.status_code, r.text)
    if r.status_code == 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_fuzz_left_nothing_behind(live_server):  # noqa: F811
    assert live_server.wait_idle().num_used_blocks == 0


# ---------------------------------------------------------------------- separate servers
def test_api_key_and_chat_template_flag(server_model_dir, tmp_path):  # noqa: F811
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    srv = start_server(server_model_dir, api_key="sekret", chat_template=str(template))
    try:
        body = {"prompt": "hi", "max_tokens": 2}
        assert httpx.post(f"{srv.url}/v1/completions", json=body).status_code == 401
        r = httpx.post(f"{srv.url}/v1/completions", json=body, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        with openai.OpenAI(base_url=f"{srv.url}/v1", api_key="wrong", max_retries=0) as bad:
            with pytest.raises(openai.AuthenticationError):
                bad.models.list()
        with openai.OpenAI(base_url=f"{srv.url}/v1", api_key="sekret", max_retries=0) as good:
            assert good.completions.create(model="tiny", prompt="hi", max_tokens=2).usage.completion_tokens == 2
        assert httpx.get(f"{srv.url}/health").status_code == 200  # probes need no key
        toks = httpx.post(f"{srv.url}/tokenize", json={"messages": [{"role": "user", "content": "ab"}]},
                          headers={"Authorization": "Bearer sekret"}).json()["tokens"]
        assert httpx.post(f"{srv.url}/detokenize", json={"tokens": toks},
                          headers={"Authorization": "Bearer sekret"}).json()["prompt"] == "[ab]"
    finally:
        srv.stop()


def test_engine_death_gives_500_and_health_503(server_model_dir, request):  # noqa: F811
    srv = start_server(server_model_dir)
    try:
        def boom():
            raise RuntimeError("simulated step failure")
        srv.engine.engine.step = boom
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=10)
        request.addfinalizer(client.close)
        with pytest.raises(openai.InternalServerError, match="simulated step failure"):
            client.completions.create(model="tiny", prompt="hi", max_tokens=4)
        health = httpx.get(f"{srv.url}/health")
        assert health.status_code == 503 and "simulated step failure" in health.json()["error"]["message"]
        with pytest.raises(openai.InternalServerError):
            list(client.completions.create(model="tiny", prompt="hi", max_tokens=4, stream=True))
        assert httpx.get(f"{srv.url}/metrics").status_code == 200
    finally:
        start = time.time()
        srv.stop()
        assert not srv.thread.is_alive() and time.time() - start < 15


def test_engine_death_mid_stream_sends_error_event(server_model_dir, request):  # noqa: F811
    srv = start_server(server_model_dir)
    try:
        real_step, calls = srv.engine.engine.step, []

        def dies_on_twentieth():
            calls.append(1)
            if len(calls) >= 20:
                raise RuntimeError("died mid-stream")
            return real_step()
        srv.engine.engine.step = dies_on_twentieth
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=10)
        request.addfinalizer(client.close)
        stream = client.completions.create(model="tiny", prompt="hi", max_tokens=50, stream=True,
                                           extra_body={"ignore_eos": True})
        received = []
        with pytest.raises(openai.APIError, match="died mid-stream"):
            for chunk in stream:
                received.append(chunk.choices[0].text)
        assert received  # the 200 and some text were already sent: the error arrives as an SSE event
        # the scheduler still lists the request it was running when the engine died; nothing runs now
        dead = metric_values(srv.url)
        for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
            assert gauge(dead, name) == 0, name
        assert dead[("pagedllm:generation_tokens_total", (("model_name", "tiny"),))] >= len(received)
    finally:
        srv.stop()


# ---------------------------------------------------------------------- command line
def test_module_help_lists_flags():
    out = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.openai.api_server", "--help"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for flag in ("--host", "--port", "--block-size", "--swap-space", "--gpu-memory-utilization",
                 "--kv-cache-memory", "--max-model-len", "--max-num-seqs", "--max-num-batched-tokens",
                 "--tensor-parallel-size", "--dtype", "--enable-prefix-caching", "--no-enable-prefix-caching",
                 "--preemption-mode", "--served-model-name", "--chat-template", "--api-key",
                 "--uvicorn-log-level", "--model", "--max-request-body-bytes", "--request-body-timeout",
                 "--shutdown-timeout"):
        assert flag in out.stdout, flag
    assert "127.0.0.1" in out.stdout and "(default: 16)" in out.stdout


# every engine step takes >= 0.1 s, so a 110-token request would keep a draining server up for 11 s
_SLOW_SERVER = """
import sys, time
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.openai.api_server import main
real_step = LLMEngine.step
def slow_step(self):
    time.sleep(0.1)
    return real_step(self)
LLMEngine.step = slow_step
sys.exit(main(sys.argv[1:]))
"""


def _stream_until_cut(url: str, started: threading.Event, lines: list) -> None:
    body = {"prompt": "hello world", "max_tokens": 110, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line:
                lines.append(line)
                started.set()


def test_sigint_under_load_exits_within_shutdown_timeout(server_model_dir, tmp_path):  # noqa: F811
    """SIGINT used to drain for as long as the longest request (26 s seen), with no deadline, then
    cut the streams mid-body. Past --shutdown-timeout each stream now ends with a server_shutdown
    error event and [DONE], and the process exits within the timeout + 1 s (bound: 3x that, for a
    loaded machine)."""
    from live_server import free_port
    timeout = 1.0
    port, log = free_port(), open(tmp_path / "server.log", "w+")  # a file: a full pipe would block the server
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_SERVER, "--model", server_model_dir, "--port", str(port),
                             "--shutdown-timeout", str(timeout), "--max-model-len", "128", "--block-size", "8",
                             "--num-gpu-blocks-override", "128", "--uvicorn-log-level", "warning"],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, url, log)
        events = [threading.Event() for _ in range(4)]
        lines: list[list[str]] = [[] for _ in range(4)]
        threads = [threading.Thread(target=_stream_until_cut, args=(url, e, got), daemon=True)
                   for e, got in zip(events, lines)]
        for t in threads:
            t.start()
        assert all(e.wait(60) for e in events)  # four requests are streaming
        start = time.time()
        proc.send_signal(signal.SIGINT)
        returncode = proc.wait(timeout=60)
        elapsed = time.time() - start
        assert returncode == 0 and elapsed < 3 * (timeout + 1), (elapsed, _tail(log))
        for t in threads:
            t.join(10)
        for got in lines:
            assert got[-1] == "data: [DONE]", got[-3:]
            assert json.loads(got[-2].removeprefix("data: "))["error"]["type"] == "server_shutdown"
    finally:
        proc.kill()
        proc.wait()
        log.close()


def _tail(log) -> str:
    log.seek(0)
    return log.read()[-2000:]


def _wait_healthy(proc: subprocess.Popen, url: str, log, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, _tail(log)
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    raise AssertionError("the server did not start")


def test_pagedllm_serve_parses_positional_model(capsys):
    from pagedllm.engine.arg_utils import engine_args_from_cli
    from pagedllm.entrypoints.cli import build_parser
    args = build_parser().parse_args(["serve", "some/model", "--swap-space", "16GiB", "--port", "9000",
                                      "--no-enable-prefix-caching", "--served-model-name", "a", "b"])
    assert args.model_tag == "some/model" and args.port == 9000 and args.served_model_name == ["a", "b"]
    engine_args = engine_args_from_cli(args)
    assert engine_args.swap_space == "16GiB" and engine_args.enable_prefix_caching is False
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["serve", "--help"])
    assert exc.value.code == 0 and "--api-key" in capsys.readouterr().out


@pytest.mark.parametrize("echo", [False, True])
def test_text_offsets_rise_and_agree_between_stream_and_not(client, echo):
    """Tokens that split a multi-byte character decode alone to U+FFFD: the offsets count the
    characters of the tokens before each one, streamed or not (they used to go backwards with echo,
    and to restart at the text length in every streamed chunk)."""
    kw = dict(model="tiny", prompt="日本語 ✓ héllo", max_tokens=12, temperature=1.0, seed=3, logprobs=1, echo=echo,
              extra_body={"ignore_eos": True})
    lp = client.completions.create(**kw).choices[0].logprobs
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    streamed = [c.choices[0].logprobs for c in client.completions.create(**kw, stream=True) if c.choices]
    assert [o for chunk in streamed for o in chunk.text_offset] == lp.text_offset
    assert [t for chunk in streamed for t in chunk.tokens] == lp.tokens

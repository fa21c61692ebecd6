"""Soak / chaos run of the OpenAI-compatible server with the real ``openai`` client: does it stay up?

    python benchmarks/soak.py --duration 300        # starts `pagedllm serve` on a tiny random Llama
    python benchmarks/soak.py --base-url http://127.0.0.1:8000 --model NAME --max-model-len N

Async workers (``openai.AsyncOpenAI`` and raw ``httpx``) and sync workers (``openai.OpenAI``) send a
random mix for ``--duration`` seconds: completions and chat, streamed and not, ``n`` and
``best_of``, logprobs / top_logprobs / echo, stop strings, seeds, structured outputs and forced tool
calls, ``max_tokens`` up to ``max_model_len``, ``n`` that overflows the KV pool, an invalid value of
each field, malformed bodies, unknown models, and clients that cancel, time out or close the
connection mid-stream. Every answer is checked (a stop string is never in the text, a seeded sample
is the same streamed or not, a schema-constrained reply is JSON, a refused field is a 400 naming
it). After the storm the server must answer /health, show 0 running, 0 waiting and every KV block
free on /metrics, and give the same greedy tokens as before. The started server's log must hold no
traceback. Exit status 1 if any check failed.

The baseline is the server itself before the storm (the greedy reply it must still give).
``tests/server/test_soak.py`` runs a short storm of the same scenarios in CI.

    python benchmarks/soak.py --scenario router-abuse --duration 600

starts ``pagedllm serve --data-parallel-size 2 --api-key soak`` (the router in front of two
replicas) and sends plain completions from ``--workers`` clients: for the first half of the run
alone, for the second half beside ``--abusers`` rude clients (20 MB bodies, 200 MB chunked bodies,
bodies that stop after 10 bytes, requests without the key). It reports the normal requests lost
(anything but 200), the times the router took a backend out (``router_backend_taken_out_total``;
a replica is never restarted, so each is an outage), and the p99 latency of normal traffic during the abuse against
without it (target: at most 1.5x). Exit status 1 if a request was lost or a backend taken out.

    python benchmarks/soak.py --scenario mixed --duration 600

starts ``pagedllm serve --api-key soak abuse --request-body-timeout 5 --kv-offload-dir TMP`` and sends
plain completions from ``--workers`` clients (key ``soak``): alone for the first half, then beside
``--abusers`` clients (key ``abuse``, so another client to the compile queue) that deal every kind
of MIXED_ABUSES in turn: 20 MB bodies (413), bodies that stall (408), no key (401), schemas at the
size limit with fresh names that the client gives up on after 0.2-2 s, schemas over the limit (400),
streams closed after a few events, an invalid field (400) and a disk-tier block file overwritten with
random bytes. It reports, as a table: normal requests lost (anything but 200; target 0), engine
restarts (the server exiting, or /health, polled every 0.5 s, going down; target 0), the p99 latency
of normal traffic during the abuse against without it (target at most 1.5x) and abuse answers other
than expected; then the after-storm checks (idle, every block free, the same greedy reply, no
traceback in the log). Exit status 1 if any of these fails (the latency ratio is reported only).
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import functools
import json
import multiprocessing
import os
import random
import re
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["hello world", "the quick brown fox", "paged attention keeps", "a block table", "héllo wörld",
           "tiny tokenizer for tests", "jumps over the lazy dog", "this is a", "日本語 ✓"]
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}}}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 5}},
          "required": ["a", "b"], "additionalProperties": False}
CHOICES = ["yes", "no", "maybe"]


class Bad(Exception):
    """A wrong answer (the scenario's check failed)."""


def check(cond: object, message: str) -> None:
    if not cond:
        raise Bad(message)


@dataclass
class Ctx:
    """What a scenario needs: the clients, the served model and its max_model_len."""

    url: str
    model: str
    max_model_len: int
    client: openai.AsyncOpenAI
    http: httpx.AsyncClient
    # False under speculative decoding: a seeded sample depends on the drafts verified, i.e. on load (README)
    seeded_reproducible: bool = True


@dataclass
class Book:
    """Counts per scenario and the first few failures of each (thread-safe)."""

    counts: collections.Counter = field(default_factory=collections.Counter)
    failures: dict = field(default_factory=lambda: collections.defaultdict(list))
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, name: str, error: str | None) -> None:
        with self.lock:
            self.counts[name, "ok" if error is None else "FAIL"] += 1
            if error is not None and len(self.failures[name]) < 5:
                self.failures[name].append(error)

    @property
    def num_failed(self) -> int:
        return sum(k for (_, status), k in self.counts.items() if status == "FAIL")


# ---------------------------------------------------------------------- random request pieces
def prompt(r: random.Random) -> str:
    return " ".join(r.choice(PROMPTS) for _ in range(r.randint(1, 3)))


def messages(r: random.Random) -> list[dict]:
    msgs = [{"role": "user", "content": prompt(r)}]
    if r.random() < 0.3:
        msgs.insert(0, {"role": "system", "content": "be brief"})
    if r.random() < 0.2:
        msgs += [{"role": "assistant", "content": "sure"},
                 {"role": "user", "content": [{"type": "text", "text": "go"}]}]
    return msgs


def check_completion_logprobs(lp, echo: bool, k: int) -> None:
    check(lp is not None, "logprobs missing")
    check(len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset), "logprobs lengths")
    check(lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))], "text_offset")
    check(not echo or lp.token_logprobs[0] is None, "echo: the first prompt token has a logprob")
    check(all(top is None or len(top) <= k + 1 for top in lp.top_logprobs), "too many top_logprobs")


# ---------------------------------------------------------------------- valid requests
async def completion(ctx: Ctx, r: random.Random) -> None:
    n, max_tokens, echo = r.choice([1, 1, 2, 3]), r.randint(1, 40), r.random() < 0.2
    kw = dict(model=ctx.model, prompt=prompt(r), max_tokens=max_tokens, n=n, echo=echo,
              temperature=r.choice([0, 1.0]) if n == 1 else 1.0, seed=r.randint(0, 999))
    if r.random() < 0.4:
        kw["logprobs"] = r.randint(0, 5)
    if r.random() < 0.3:
        kw["stop"] = r.sample([" ", "e", "the", "o w", "\n", "ö"], r.randint(1, 3))
    if n == 1 and r.random() < 0.3:
        kw["best_of"] = r.randint(1, 3)
    out = await ctx.client.completions.create(**kw)
    check(sorted(c.index for c in out.choices) == list(range(n)), f"{len(out.choices)} choices for n={n}")
    check(out.usage.completion_tokens <= n * max_tokens, f"usage {out.usage}")
    for c in out.choices:
        check(c.finish_reason in ("stop", "length"), f"finish_reason {c.finish_reason}")
        check(not echo or c.text.startswith(kw["prompt"]), "echo: the text does not start with the prompt")
        generated = c.text[len(kw["prompt"]):] if echo else c.text
        check(not any(s in generated for s in kw.get("stop", [])), f"a stop string in {generated!r}")
        if "logprobs" in kw:
            check_completion_logprobs(c.logprobs, echo, kw["logprobs"])


async def streamed_texts(stream, chat: bool = False) -> tuple[dict[int, str], dict[int, str], object]:
    """Joins a stream's choices: (texts by index, finish_reason by index, the last chunk)."""
    texts, finishes, last = collections.defaultdict(str), {}, None
    async for chunk in stream:
        last = chunk
        for c in chunk.choices:
            texts[c.index] += (c.delta.content or "") if chat else c.text
            if c.finish_reason:
                check(c.index not in finishes, f"choice {c.index} finished twice")
                finishes[c.index] = c.finish_reason
    return texts, finishes, last


async def completion_stream(ctx: Ctx, r: random.Random) -> None:
    """A stream joins to the same text as the same request unstreamed (greedy or seeded)."""
    n = r.choice([1, 2, 3])
    kw = dict(model=ctx.model, prompt=prompt(r), max_tokens=r.randint(1, 40), n=n, seed=r.randint(0, 10**6),
              temperature=r.choice([0, 1.0]) if n == 1 else 1.0, extra_body={"ignore_eos": r.random() < 0.5})
    if r.random() < 0.3:
        kw["stop"] = r.sample([" ", "e", "the", "o w", "ab", "🙂"], r.randint(1, 3))
    texts, finishes, last = await streamed_texts(await ctx.client.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}))
    check(sorted(finishes) == list(range(n)), f"finishes {finishes} for n={n}")
    check(last.usage is not None and not last.choices, "no usage chunk at the end")
    full = await ctx.client.completions.create(**kw)
    want = {c.index: c.text for c in full.choices}
    if ctx.seeded_reproducible or kw["temperature"] == 0:
        check(all(texts[i] == want[i] for i in range(n)), f"streamed {dict(texts)!r} != {want!r}")
    check(not any(s in t for s in kw.get("stop", []) for t in texts.values()), "a stop string in a stream")


async def chat(ctx: Ctx, r: random.Random) -> None:
    n, max_tokens = r.choice([1, 1, 2]), r.randint(1, 30)
    kw = dict(model=ctx.model, messages=messages(r), n=n, temperature=1.0, seed=r.randint(0, 999))
    kw["max_completion_tokens" if r.random() < 0.5 else "max_tokens"] = max_tokens
    top = r.randint(0, 5) if r.random() < 0.4 else None
    if top is not None:
        kw.update(logprobs=True, top_logprobs=top)
    out = await ctx.client.chat.completions.create(**kw)
    check(len(out.choices) == n, f"{len(out.choices)} choices for n={n}")
    for c in out.choices:
        check(c.message.role == "assistant" and c.finish_reason in ("stop", "length"), f"{c}")
        check(top is None or all(len(t.top_logprobs) == top for t in c.logprobs.content), "top_logprobs size")


async def chat_stream(ctx: Ctx, r: random.Random) -> None:
    n = r.choice([1, 2])
    kw = dict(model=ctx.model, messages=messages(r), max_tokens=r.randint(1, 30), n=n, seed=r.randint(0, 999),
              temperature=1.0)
    texts, finishes, last = await streamed_texts(await ctx.client.chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}), chat=True)
    check(sorted(finishes) == list(range(n)) and last.usage is not None, f"finishes {finishes}, usage")
    full = await ctx.client.chat.completions.create(**kw)
    check(not ctx.seeded_reproducible or [texts[i] for i in range(n)] == [c.message.content for c in full.choices],
          "chat stream != non-stream")


async def structured(ctx: Ctx, r: random.Random) -> None:
    """A constrained reply that finished by itself satisfies its constraint."""
    base = dict(model=ctx.model, max_tokens=48, temperature=1.0, seed=r.randint(0, 999), n=r.choice([1, 2]))
    kind = r.choice(["schema", "choice", "json_object"])
    if kind == "choice":
        out = await ctx.client.completions.create(prompt=prompt(r), **base, extra_body={"guided_choice": CHOICES})
        check(all(c.text in CHOICES for c in out.choices), f"choice {[c.text for c in out.choices]}")
        return
    fmt = ({"type": "json_object"} if kind == "json_object"
           else {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}})
    out = await ctx.client.chat.completions.create(messages=messages(r), **base, response_format=fmt)
    for c in out.choices:
        if c.finish_reason == "stop":
            try:
                doc = json.loads(c.message.content)
            except ValueError:
                raise Bad(f"{kind}: not JSON: {c.message.content!r}") from None
            check(kind == "json_object" or set(doc) == {"a", "b"}, f"schema: {doc}")


async def forced_tool_call(ctx: Ctx, r: random.Random) -> None:
    choice = r.choice(["required", {"type": "function", "function": {"name": "get_weather"}}])
    out = await ctx.client.chat.completions.create(model=ctx.model, messages=messages(r), max_tokens=40,
                                                   temperature=1.0, seed=r.randint(0, 999), tools=[WEATHER],
                                                   tool_choice=choice)
    c = out.choices[0]
    if c.finish_reason in ("stop", "tool_calls"):
        check(c.message.tool_calls, f"forced call missing: {c.message}")
        for call in c.message.tool_calls:
            check(call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments), dict),
                  f"call {call}")


async def up_to_max_model_len(ctx: Ctx, r: random.Random) -> None:
    text = prompt(r)
    num_prompt = (await ctx.http.post(f"{ctx.url}/tokenize", json={"prompt": text})).json()["count"]
    max_tokens = ctx.max_model_len - num_prompt - r.choice([0, 0, 1, 5])
    out = await ctx.client.completions.create(model=ctx.model, prompt=text, max_tokens=max_tokens, temperature=1.0,
                                              extra_body={"ignore_eos": True})
    check(out.usage.completion_tokens == max_tokens and out.choices[0].finish_reason == "length",
          f"{out.usage.completion_tokens} tokens for max_tokens={max_tokens}")


async def pool_sized_n(ctx: Ctx, r: random.Random) -> None:
    """n sequences that together need more KV blocks than the pool has (each fits alone)."""
    n, max_tokens = r.choice([6, 8, 12]), r.randint(ctx.max_model_len // 2, ctx.max_model_len - 20)
    kw = dict(model=ctx.model, prompt=r.choice(PROMPTS), max_tokens=max_tokens, n=n, temperature=1.0,
              seed=r.randint(0, 999), extra_body={"ignore_eos": True})
    if r.random() < 0.5:
        texts, finishes, _ = await streamed_texts(await ctx.client.completions.create(**kw, stream=True))
        check(sorted(finishes) == list(range(n)), f"finishes {finishes}")
        return
    out = await ctx.client.completions.create(**kw)
    check(len(out.choices) == n and out.usage.completion_tokens == n * max_tokens, f"usage {out.usage}")


async def token_prompts(ctx: Ctx, r: random.Random) -> None:
    ids = [[r.randint(3, 499) for _ in range(r.randint(1, 20))] for _ in range(r.randint(1, 3))]
    n = r.choice([1, 2])
    out = await ctx.client.completions.create(model=ctx.model, prompt=ids if len(ids) > 1 else ids[0], max_tokens=5,
                                              temperature=1.0, n=n)
    check(sorted(c.index for c in out.choices) == list(range(n * len(ids))), f"{len(out.choices)} choices")
    check(out.usage.prompt_tokens == sum(map(len, ids)), f"usage {out.usage}")


async def echo_stream_n(ctx: Ctx, r: random.Random) -> None:
    n, prompts = r.choice([2, 3]), [prompt(r) for _ in range(r.randint(1, 3))]
    texts, finishes, last = await streamed_texts(await ctx.client.completions.create(
        model=ctx.model, prompt=prompts, max_tokens=8, n=n, echo=True, temperature=1.0, stream=True,
        stream_options={"include_usage": True}))
    check(sorted(finishes) == list(range(n * len(prompts))), f"finishes {finishes}")
    check(all(texts[i].startswith(prompts[i // n]) for i in texts), "echo: a choice does not start with its prompt")


async def legacy_generate(ctx: Ctx, r: random.Random) -> None:
    body = {"prompt": prompt(r), "max_tokens": r.randint(1, 30), "temperature": 1.0, "n": r.choice([1, 2])}
    if r.random() < 0.5:
        resp = await ctx.http.post(f"{ctx.url}/generate", json=body)
        check(resp.status_code == 200 and len(resp.json()["text"]) == body["n"], f"/generate {resp.text[:200]}")
        return
    async with ctx.http.stream("POST", f"{ctx.url}/generate", json={**body, "stream": True}) as resp:
        check(resp.status_code == 200, f"/generate stream {resp.status_code}")
        async for line in resp.aiter_lines():
            if line:
                json.loads(line)
            if r.random() < 0.2:
                break  # and close the connection


async def one_bad_prompt(ctx: Ctx, r: random.Random) -> None:
    """One invalid prompt among valid ones: a 400 naming the prompt, nothing left running."""
    prompts = [prompt(r) for _ in range(r.randint(1, 3))]
    prompts.insert(r.randint(0, len(prompts)), r.choice(["", "hello " * 300]))
    try:
        await ctx.client.completions.create(model=ctx.model, prompt=prompts, max_tokens=50, stream=r.random() < 0.5,
                                            extra_body={"ignore_eos": True})
    except openai.BadRequestError as exc:
        check(exc.body.get("param") == "prompt", f"param {exc.body.get('param')!r}")
        return
    raise Bad("a batch with an invalid prompt was accepted")


async def dead_end_constraints(ctx: Ctx, r: random.Random) -> None:
    """Constraints that leave no token: never a forbidden token; the sequence ends "constraint" (or
    "stop" once its grammar is complete); masked at the first step: a 400 naming allowed_token_ids.
    "a" is one token and "aa" two, so allowed ["a"] with the bad word "aa" allows one "a"."""
    a = (await ctx.http.post(f"{ctx.url}/tokenize", json={"prompt": "a", "add_special_tokens": False})).json()["tokens"]
    kw = dict(model=ctx.model, prompt=prompt(r), max_tokens=8, n=r.choice([1, 2]), temperature=r.choice([0, 1.0]),
              seed=r.randint(0, 999))
    kind = r.choice(["bad_words", "grammar", "grammar_done", "refused"])
    body = {"allowed_token_ids": a, **{"bad_words": {"bad_words": ["aa"]}, "refused": {"bad_words": ["a"]},
                                       "grammar": {"guided_choice": ["yes"]},
                                       "grammar_done": {"guided_choice": ["a"]}}[kind]}
    if kind == "refused":
        try:
            await ctx.client.completions.create(**kw, extra_body=body, stream=r.random() < 0.5)
        except openai.BadRequestError as exc:
            check(exc.body.get("param") == "allowed_token_ids", f"param {exc.body.get('param')!r}")
            return
        raise Bad("allowed_token_ids that bad_words mask whole were accepted")
    want = {"bad_words": ("a", "constraint"), "grammar": ("", "constraint"), "grammar_done": ("a", "stop")}[kind]
    if r.random() < 0.5:
        texts, finishes, _ = await streamed_texts(await ctx.client.completions.create(**kw, extra_body=body,
                                                                                     stream=True))
        got = [(texts[i], finishes.get(i)) for i in range(kw["n"])]
    else:
        out = await ctx.client.completions.create(**kw, extra_body=body)
        got = [(c.text, c.finish_reason) for c in sorted(out.choices, key=lambda c: c.index)]
    check(got == [want] * kw["n"], f"{kind}: {got}, want {want}")


async def many_prompts(ctx: Ctx, r: random.Random) -> None:
    """A list of a few hundred prompts answers each; past the server's limit (1024) a 400 naming prompt."""
    if r.random() < 0.3:
        resp = await ctx.http.post(f"{ctx.url}/v1/completions",
                                   json={"model": ctx.model, "prompt": ["hi"] * 1025, "max_tokens": 1})
        expect_400(resp, "prompt", "1025 prompts")
        return
    num = r.randint(50, 400)
    ids = [[r.randint(3, 499) for _ in range(r.randint(1, 4))] for _ in range(num)]
    out = await ctx.client.completions.create(model=ctx.model, prompt=ids, max_tokens=r.randint(1, 3),
                                              temperature=1.0, seed=r.randint(0, 999))
    check(sorted(c.index for c in out.choices) == list(range(num)), f"{len(out.choices)} choices for {num}")
    check(out.usage.prompt_tokens == sum(map(len, ids)), f"usage {out.usage}")


# ---------------------------------------------------------------------- rude clients
async def cancel(ctx: Ctx, r: random.Random) -> None:
    """The client task is cancelled mid-request (the HTTP connection is closed)."""
    kw = dict(model=ctx.model, prompt=prompt(r), max_tokens=100, temperature=1.0, n=r.choice([1, 2, 4]),
              extra_body={"ignore_eos": True})

    async def request():
        if r.random() < 0.5:
            async for _ in await ctx.client.completions.create(**kw, stream=True):
                pass
        else:
            await ctx.client.completions.create(**kw)
    task = asyncio.ensure_future(request())
    await asyncio.sleep(r.choice([0, 0.001, 0.005, 0.02, r.uniform(0.0, 0.5)]))
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, openai.APIError):
        pass


async def disconnect_stream(ctx: Ctx, r: random.Random) -> None:
    """Reads a few server-sent events, then closes the connection."""
    body = {"model": ctx.model, "max_tokens": 40, "stream": True, "n": r.choice([1, 3]), "ignore_eos": True}
    path = "/v1/completions"
    if r.random() < 0.5:
        body["prompt"] = prompt(r)
    else:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt(r)}]
    async with ctx.http.stream("POST", ctx.url + path, json=body) as resp:
        check(resp.status_code == 200, f"status {resp.status_code}")
        events = r.randint(0, 5)
        async for _ in resp.aiter_lines():
            events -= 1
            if events < 0:
                break


# ---------------------------------------------------------------------- refused input
# (field, value, the param the 400 must name)
BAD_COMPLETION_FIELDS = [
    ("temperature", -1, "temperature"), ("temperature", "hot", "temperature"), ("top_p", 0, "top_p"),
    ("top_p", 1.5, "top_p"), ("n", 0, "n"), ("n", 1000, "n"), ("max_tokens", 0, "max_tokens"),
    ("max_tokens", 10**6, "prompt"), ("logprobs", -2, "logprobs"), ("logprobs", 1000, "logprobs"),
    ("seed", "abc", "seed"), ("seed", 2**70, "seed"), ("stop", 5, "stop"), ("stop", [""], "stop"),
    ("presence_penalty", 5, "presence_penalty"), ("frequency_penalty", -9, "frequency_penalty"),
    ("logit_bias", {"abc": 1}, "logit_bias"), ("logit_bias", {"99999": 1}, "logit_bias"), ("best_of", 0, "best_of"),
    ("top_k", -5, "top_k"), ("min_p", 2, "min_p"), ("repetition_penalty", 0, "repetition_penalty"),
    ("stop_token_ids", [10**6], "stop_token_ids"), ("allowed_token_ids", [], "allowed_token_ids"),
    ("echo", "yes", "echo"), ("suffix", "x", "suffix"), ("truncate_prompt_tokens", -7, "truncate_prompt_tokens"),
    ("response_format", {"type": "xml"}, "response_format"), ("response_format", {"type": "json_schema"},
                                                              "response_format"),
    ("response_format", {"type": "json_object", "schema": {}}, "response_format"),
    ("guided_regex", "([a-", "guided_regex"), ("guided_choice", [], "guided_choice"),
    ("guided_json", "{not json", "guided_json"), ("structured_outputs", {"nope": 1}, "structured_outputs"),
    ("use_beam_search", "yes", "use_beam_search"), ("prompt_logprobs", -2, "prompt_logprobs"),
    ("length_penalty", 2.0, "length_penalty"), ("cache_salt", "", "cache_salt"),
    ("frobnicate", 1, "frobnicate"), ("stream_options", {"include_usage": True}, "stream_options"),
    ("bad_words", [5], "bad_words"), ("min_tokens", 50, "min_tokens"), ("logprobs", True, "logprobs"),
    ("max_tokens", 1.5, "max_tokens"), ("n", True, "n"),
]
BAD_CHAT_FIELDS = [
    ("messages", [], "messages"), ("messages", [{"content": "x"}], "messages"), ("messages", "hi", "messages"),
    ("messages", [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "messages"),
    ("messages", [{"role": "user", "content": "x", "bogus": 1}], "messages"),
    ("messages", [{"role": "user", "content": 5}], "messages"),
    ("messages", [{"role": "user", "content": "x " * 2000}], "messages"),
    ("top_logprobs", 3, "top_logprobs"), ("logprobs", 3, "logprobs"), ("tools", [{"type": "function"}], "tools"),
    ("tool_choice", "maybe", "tool_choice"), ("max_completion_tokens", 0, "max_completion_tokens"),
    ("chat_template_kwargs", {"messages": 1}, "chat_template_kwargs"), ("temperature", -9, "temperature"),
    ("continue_final_message", True, "continue_final_message"),
    ("response_format", {"type": "json_schema", "json_schema": {}}, "response_format"),
]


async def bad_field(ctx: Ctx, r: random.Random) -> None:
    """An invalid value of one field: a 400 with OpenAI's error body, naming that field."""
    if r.random() < 0.65:
        path, (name, value, param) = "/v1/completions", r.choice(BAD_COMPLETION_FIELDS)
        body = {"model": ctx.model, "prompt": prompt(r), "max_tokens": 5, name: value}
    else:
        path, (name, value, param) = "/v1/chat/completions", r.choice(BAD_CHAT_FIELDS)
        body = {"model": ctx.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, name: value}
    if name not in ("stream_options",) and r.random() < 0.3:
        body["stream"] = True
    resp = await ctx.http.post(ctx.url + path, json=body)
    expect_400(resp, param, f"{path} {name}={str(value)[:40]}")


def expect_400(resp: httpx.Response, param: str | None, what: str) -> None:
    try:
        err = resp.json().get("error")
    except ValueError:
        raise Bad(f"{what}: {resp.status_code} with a non-JSON body {resp.text[:200]!r}") from None
    check(resp.status_code == 400, f"{what}: status {resp.status_code} {resp.text[:200]}")
    check(isinstance(err, dict) and set(err) == {"message", "type", "param", "code"} and err["message"],
          f"{what}: error body {resp.text[:200]}")
    check(param is None or err["param"] == param, f"{what}: param {err['param']!r}, want {param!r}: {err['message']}")


BAD_BODIES = [  # (path, raw body, the param the 400 must name)
    ("/v1/completions", b'{"model": "M", "prompt": "x", ', None), ("/v1/chat/completions", b"[1, 2]", None),
    ("/v1/completions", b"null", None), ("/v1/completions", b"", None),
    ("/v1/completions", b'{"prompt": "\xff\xfe x"}', None), ("/v1/completions", b"[" * 50000, None),
    ("/v1/completions", b'{"model": "gpt-4", "prompt": "x"}', "model"),
    ("/v1/chat/completions", b'{"model": "nope", "messages": [{"role": "user", "content": "x"}]}', "model"),
    ("/v1/completions", b'{"model": "M", "prompt": [5, 99999]}', "prompt"),
    ("/v1/completions", b'{"model": "M", "prompt": [[5, 6], []]}', "prompt"),
    ("/v1/completions", b'{"model": "M", "prompt": "' + b"hello " * 400 + b'"}', "prompt"),
    ("/generate", b'{"prompt": "x", "temperature": -1}', "temperature"),
    ("/generate", b'{"prompt": "x", "logprobs": 2}', "logprobs"),
    ("/tokenize", b'{"model": "M"}', "prompt"),
]


async def bad_body(ctx: Ctx, r: random.Random) -> None:
    path, body, param = r.choice(BAD_BODIES)
    body = body.replace(b'"M"', json.dumps(ctx.model).encode())
    resp = await ctx.http.post(ctx.url + path, content=body, headers={"content-type": "application/json"})
    expect_400(resp, param, f"{path} {body[:40]!r}")


SCENARIOS = [completion, completion, completion_stream, completion_stream, chat, chat_stream, structured,
             forced_tool_call, up_to_max_model_len, pool_sized_n, token_prompts, echo_stream_n, legacy_generate,
             one_bad_prompt, dead_end_constraints, many_prompts, cancel, disconnect_stream, disconnect_stream,
             bad_field, bad_field, bad_field, bad_body, bad_body]


# ---------------------------------------------------------------------- the storm
async def run_scenario(ctx: Ctx, scenario, r: random.Random, book: Book, timeout: float) -> None:
    try:
        await asyncio.wait_for(scenario(ctx, r), timeout)
        book.record(scenario.__name__, None)
    except Bad as exc:
        book.record(scenario.__name__, str(exc))
    except asyncio.TimeoutError:
        book.record(scenario.__name__, f"no answer within {timeout:g} s")
    except Exception as exc:  # noqa: BLE001 - any other error is a failed check, reported with the rest
        book.record(scenario.__name__, f"{type(exc).__name__}: {exc}"[:400])


async def storm(url: str, model: str, max_model_len: int, book: Book, *, workers: int, seed: int,
                duration: float | None = None, requests: int | None = None, timeout: float = 300,
                seeded_reproducible: bool = True) -> None:
    """``workers`` async clients send scenarios until ``duration`` seconds pass or ``requests`` are
    done; with ``requests``, every scenario runs at least once (they are dealt in order first)."""
    deck = iter(range(requests if requests is not None else 10**12))
    stop_at = time.time() + duration if duration is not None else float("inf")
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="soak", max_retries=0, timeout=timeout) as client, \
            httpx.AsyncClient(timeout=timeout) as http:
        ctx = Ctx(url, model, max_model_len, client, http, seeded_reproducible)

        async def worker(w: int) -> None:
            r = random.Random(seed * 1000 + w)
            for i in deck:
                if time.time() > stop_at:
                    return
                scenario = SCENARIOS[i] if requests is not None and i < len(SCENARIOS) else r.choice(SCENARIOS)
                await run_scenario(ctx, scenario, r, book, timeout)
        await asyncio.gather(*(worker(w) for w in range(workers)))


def sync_worker(url: str, model: str, stop_at: float, seed: int, book: Book) -> None:
    """The sync client: plain requests, streams, and requests given up by a client-side timeout."""
    r = random.Random(seed)
    with openai.OpenAI(base_url=f"{url}/v1", api_key="soak", max_retries=0, timeout=120) as client:
        while time.time() < stop_at:
            name, error = r.choice(["sync_completion", "sync_chat_stream", "sync_timeout"]), None
            try:
                sync_request(client, model, name, r)
            except Bad as exc:
                error = str(exc)
            except Exception as exc:  # noqa: BLE001 - reported with the other failures
                error = f"{type(exc).__name__}: {exc}"[:400]
            book.record(name, error)


def sync_request(client: openai.OpenAI, model: str, name: str, r: random.Random) -> None:
    if name == "sync_completion":
        out = client.completions.create(model=model, prompt=prompt(r), max_tokens=r.randint(1, 20), temperature=0)
        check(len(out.choices) == 1 and out.usage.completion_tokens <= 20, f"{out}")
    elif name == "sync_chat_stream":
        chunks = list(client.chat.completions.create(model=model, messages=messages(r), max_tokens=20, stream=True,
                                                     temperature=1.0))
        check(chunks and chunks[-1].choices[0].finish_reason in ("stop", "length"), "no finish")
    else:
        try:
            client.with_options(timeout=r.uniform(0.05, 0.4)).completions.create(
                model=model, prompt=prompt(r), max_tokens=80, temperature=1.0, extra_body={"ignore_eos": True})
        except openai.APITimeoutError:
            pass


# ---------------------------------------------------------------------- before and after
def greedy_reply(url: str, model: str) -> list[str]:
    with openai.OpenAI(base_url=f"{url}/v1", api_key="soak", max_retries=0, timeout=60) as client:
        out = client.completions.create(model=model, prompt="the quick brown fox", max_tokens=24, temperature=0,
                                        logprobs=1, extra_body={"ignore_eos": True})
    return out.choices[0].logprobs.tokens


def engine_gauges(url: str) -> dict[str, float]:
    """running / waiting / swapped requests and KV usage from /metrics."""
    names = "num_requests_running|num_requests_waiting|num_requests_swapped|kv_cache_usage_perc"
    found = re.findall(rf"^pagedllm:({names})\{{[^}}]*\}} (\S+)$", httpx.get(f"{url}/metrics").text, re.M)
    return {name: float(value) for name, value in found}


def settle(url: str, timeout: float = 30) -> dict[str, float]:
    """Waits until nothing runs, waits or holds a KV block; returns the last gauges."""
    deadline = time.time() + timeout
    while True:
        gauges = engine_gauges(url)
        if not any(gauges.values()) or time.time() > deadline:
            return gauges
        time.sleep(0.2)


def preemptions(url: str) -> float:
    found = re.findall(r"^pagedllm:num_preemptions_total\{[^}]*\} (\S+)$", httpx.get(f"{url}/metrics").text, re.M)
    return float(found[0]) if found else float("nan")


def after_storm(url: str, model: str, greedy_before: list[str]) -> dict[str, object]:
    """The checks after the storm: {name: (ok, what was seen)}."""
    gauges = settle(url)
    health = httpx.get(f"{url}/health").status_code
    greedy_after = greedy_reply(url, model)
    return {"health": (health == 200, health), "idle and every block free": (not any(gauges.values()), gauges),
            "same greedy reply": (greedy_after == greedy_before, "".join(greedy_after)[:60]),
            "preemptions so far (information)": (True, preemptions(url))}


# ---------------------------------------------------------------------- router abuse
ABUSES = ("huge_body", "huge_chunked_body", "stalled_body", "no_key")
_PIECE = b"x" * 2**20


def _abuse_request(kind: str, key: str) -> tuple[bytes, list[bytes] | object]:
    """The head and the body pieces of one rude request (pieces made as they are sent)."""
    auth = f"Authorization: Bearer {key}\r\n".encode() if kind != "no_key" else b""
    head = b"POST /v1/completions HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n" + auth
    if kind == "huge_body":
        return head + b"Content-Length: %d\r\n\r\n" % (20 * len(_PIECE)), [_PIECE] * 20
    if kind == "huge_chunked_body":
        chunks = (b"%x\r\n%s\r\n" % (len(_PIECE), _PIECE) for _ in range(200))
        return head + b"Transfer-Encoding: chunked\r\n\r\n", chunks
    if kind == "stalled_body":  # 10 of 30 bytes, then nothing: the router must answer 408
        return head + b"Content-Length: 30\r\n\r\n", [b'{"prompt":']
    body = b'{"model": "tiny", "prompt": "hi", "max_tokens": 2}'
    return head + b"Content-Length: %d\r\n\r\n" % len(body), [body]


def abuse_once(url: str, kind: str, key: str, timeout: float = 90) -> str:
    """Sends one rude request over a plain socket, stopping as soon as an answer arrives; returns its
    status ("reset" when the connection was reset before a status could be read)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    head, pieces = _abuse_request(kind, key)
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        try:
            sock.sendall(head)
            for piece in pieces:
                if select.select([sock], [], [], 0)[0]:  # answered already: stop sending
                    break
                sock.sendall(piece)
            answer = sock.recv(64)
        except OSError:
            return "reset"
    return answer.split(b" ", 2)[1].decode() if answer.startswith(b"HTTP/1.1 ") else "no answer"


def abuser(url: str, key: str, stop_at: float, seed: int, counts: collections.Counter, lock: threading.Lock) -> None:
    r = random.Random(seed)
    while time.time() < stop_at:
        kind = r.choice(ABUSES)
        status = abuse_once(url, kind, key)
        with lock:
            counts[kind, status] += 1


async def normal_traffic(url: str, model: str, key: str, stop_at: float, workers: int) -> list[tuple[float, int]]:
    """(latency s, status) of plain short completions from ``workers`` clients until ``stop_at``."""
    results: list[tuple[float, int]] = []
    headers = {"Authorization": f"Bearer {key}"}

    async def worker(w: int) -> None:
        r = random.Random(w)
        async with httpx.AsyncClient(timeout=120, headers=headers) as http:
            while time.time() < stop_at:
                body = {"model": model, "prompt": prompt(r), "max_tokens": r.randint(1, 8), "temperature": 0}
                t0 = time.perf_counter()
                try:
                    status = (await http.post(f"{url}/v1/completions", json=body)).status_code
                except httpx.HTTPError:
                    status = 0
                results.append((time.perf_counter() - t0, status))
    await asyncio.gather(*(worker(w) for w in range(workers)))
    return results


def p99(latencies: list[float]) -> float:
    ordered = sorted(latencies)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else float("nan")


def router_total(url: str, key: str, name: str) -> float:
    """A ``pagedllm:router_<name>_total`` counter of the router, summed over backends."""
    text = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {key}"}).text
    return sum(float(v) for v in re.findall(rf"^pagedllm:router_{name}_total\{{[^}}]*\}} (\S+)$", text, re.M))


def router_abuse(args: argparse.Namespace, url: str) -> bool:
    """Normal traffic alone for half of ``--duration``, then beside ``--abusers`` rude clients."""
    half, key = args.duration / 2, args.api_key
    taken_out_before = router_total(url, key, "backend_taken_out")
    calm = asyncio.run(normal_traffic(url, args.model, key, time.time() + half, args.workers))
    counts, lock, stop_at = collections.Counter(), threading.Lock(), time.time() + half
    threads = [threading.Thread(target=abuser, args=(url, key, stop_at, args.seed + i, counts, lock))
               for i in range(args.abusers)]
    for t in threads:
        t.start()
    stormy = asyncio.run(normal_traffic(url, args.model, key, stop_at, args.workers))
    for t in threads:
        t.join()
    lost = sum(status != 200 for _, status in calm + stormy)
    taken_out = router_total(url, key, "backend_taken_out") - taken_out_before
    backends = httpx.get(f"{url}/router/backends", headers={"Authorization": f"Bearer {key}"}).json()["backends"]
    calm_p99, stormy_p99 = p99([t for t, _ in calm]), p99([t for t, _ in stormy])
    print(f"normal traffic: {len(calm)} requests alone, {len(stormy)} beside {args.abusers} abusers")
    print(f"  p99 latency alone {calm_p99 * 1000:.0f} ms, during abuse {stormy_p99 * 1000:.0f} ms "
          f"({stormy_p99 / calm_p99:.2f}x, target <= 1.5x)")
    print(f"  requests lost: {lost}; backends taken out: {taken_out:g}; healthy after: "
          f"{sum(b['healthy'] for b in backends)}/{len(backends)}")
    for (kind, status), k in sorted(counts.items()):
        print(f"  abuse {kind:18s} -> {status}: {k}")
    return lost == 0 and taken_out == 0 and all(b["healthy"] for b in backends)


# ---------------------------------------------------------------------- mixed abuse of one server
MIXED_ABUSES = ("huge_body", "stalled_body", "no_key", "huge_schema", "oversized_schema", "disconnect_stream",
                "bad_field", "corrupt_tier_file")
# the answers of a server that holds; anything else is counted as unexpected (huge_body: the server
# answers 413 and closes while the client still sends, which may reset the connection before the answer
# is read; huge_schema: the client gives up first, or the compile made it in time; a tier file can be
# gone, evicted meanwhile)
MIXED_EXPECTED = {"huge_body": {"413", "reset"}, "stalled_body": {"408"}, "no_key": {"401"},
                  "huge_schema": {"timeout", "200"}, "oversized_schema": {"400"}, "disconnect_stream": {"200"},
                  "bad_field": {"400"}, "corrupt_tier_file": {"corrupted", "no file", "gone"}}
SCHEMA_LIMIT = 64 * 2**10  # the server's default --max-structured-output-bytes
ABUSER_NICE = 10  # the abuser processes' CPU priority below the server's (one host stands in for remote clients)


def huge_schema(r: random.Random, limit: int = SCHEMA_LIMIT) -> dict:
    """A schema of fresh property names (never a cache hit) filling ``limit`` bytes: the most
    expensive compile the server accepts (about a second with the tiny model's vocabulary)."""
    names = [f"k{r.getrandbits(40):010x}_{i}" for i in range(_schema_names(limit))]
    return _names_schema(names)


def _names_schema(names: list[str]) -> dict:
    return {"type": "object", "properties": {n: {"type": "integer"} for n in names}, "required": names[::2]}


@functools.cache
def _schema_names(limit: int) -> int:
    """How many names fit ``limit`` bytes (the server's size is of its own serialisation)."""
    n = limit // 40  # over the limit: a name costs ~45 bytes
    while len(json.dumps(_names_schema([f"k{0:010x}_{i}" for i in range(n)])).encode()) > limit - 64:
        n -= max(1, n // 50)
    return n


def corrupt_tier_file(tier_dir: str | None, r: random.Random) -> str:
    """Overwrites 64 random bytes of a random disk-tier block file (header or payload)."""
    files = sorted(Path(tier_dir).rglob("*.kv")) if tier_dir else []
    if not files:
        return "no file"
    try:
        with open(r.choice(files), "r+b") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(r.randrange(max(size - 64, 1)))
            f.write(r.randbytes(64))
    except OSError:
        return "gone"
    return "corrupted"


def mixed_abuse_once(url: str, model: str, kind: str, key: str, r: random.Random, tier_dir: str | None) -> str:
    """One abuse of ``kind`` (MIXED_ABUSES) as client ``key``; returns what came back."""
    if kind in ("huge_body", "stalled_body", "no_key"):
        return abuse_once(url, kind, key)
    if kind == "corrupt_tier_file":
        return corrupt_tier_file(tier_dir, r)
    headers, path = {"Authorization": f"Bearer {key}"}, f"{url}/v1/completions"
    body = {"model": model, "prompt": prompt(r), "max_tokens": 4}
    if kind == "huge_schema":  # the client gives up after 0.2-2 s: its queued compile must be dropped
        body["structured_outputs"] = {"json": huge_schema(r)}
        try:
            return str(httpx.post(path, json=body, headers=headers, timeout=r.uniform(0.2, 2.0)).status_code)
        except httpx.TimeoutException:
            return "timeout"
    if kind == "oversized_schema":
        body["structured_outputs"] = {"json": huge_schema(r, 2 * SCHEMA_LIMIT)}
    elif kind == "bad_field":
        name, value, _ = r.choice(BAD_COMPLETION_FIELDS)
        body[name] = value
    else:  # disconnect_stream: a few events, then the connection is closed
        body.update(stream=True, max_tokens=40, ignore_eos=True)
        with httpx.stream("POST", path, json=body, headers=headers, timeout=60) as resp:
            for i, _ in enumerate(resp.iter_lines()):
                if i >= r.randint(0, 5):
                    break
            return str(resp.status_code)
    return str(httpx.post(path, json=body, headers=headers, timeout=60).status_code)


def mixed_abuser(url: str, model: str, key: str, start_at: float, stop_at: float, seed: int,
                 tier_dir: str | None, kinds: tuple[str, ...] = MIXED_ABUSES) -> collections.Counter:
    """From ``start_at`` to ``stop_at``, deals ``kinds`` in turn from offset ``seed`` (so a few
    abusers cover every kind at once); returns {(kind, answer): count}."""
    r, counts = random.Random(seed), collections.Counter()
    time.sleep(max(0.0, start_at - time.time()))
    for turn in range(10**9):
        if time.time() >= stop_at:
            return counts
        kind = kinds[(seed + turn) % len(kinds)]
        try:
            counts[kind, mixed_abuse_once(url, model, kind, key, r, tier_dir)] += 1
        except httpx.HTTPError as exc:
            counts[kind, type(exc).__name__] += 1
    return counts


def health_watch(url: str, stop: threading.Event, seen: collections.Counter) -> None:
    """Polls /health every 0.5 s: ``seen["down"]`` counts the times it went from 200 to anything else."""
    up = True
    while not stop.wait(0.5):
        try:
            ok = httpx.get(f"{url}/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            ok = False
        seen["polls"] += 1
        seen["down"] += up and not ok
        up = ok


@dataclass
class MixedResult:
    calm: list[tuple[float, int]]
    stormy: list[tuple[float, int]]
    abuses: collections.Counter
    health: collections.Counter

    @property
    def lost(self) -> int:
        return sum(status != 200 for _, status in self.calm + self.stormy)

    @property
    def unexpected(self) -> int:
        return sum(k for (kind, status), k in self.abuses.items() if status not in MIXED_EXPECTED[kind])

    @property
    def p99_ratio(self) -> float:
        return p99([t for t, _ in self.stormy]) / p99([t for t, _ in self.calm])


def mixed_abuse(url: str, model: str, key: str, abuse_key: str, duration: float, *, workers: int, abusers: int,
                seed: int = 0, tier_dir: str | None = None, kinds: tuple[str, ...] = MIXED_ABUSES,
                processes: bool = True) -> MixedResult:
    """Normal completions from ``workers`` clients (key ``key``) alone for half of ``duration``, then
    beside ``abusers`` clients (key ``abuse_key``) dealing ``kinds``; /health polled throughout.
    ``processes``: each abuser in a process of its own (forked now, before any thread here starts, and
    asleep until the abuse begins) at nice ``ABUSER_NICE``: building 64 KiB schemas and pushing 20 MB
    bodies then neither holds this process's GIL nor takes the server's CPU, as remote clients would
    not, so the normal clients' latencies are the server's; False: threads (a test with the server in
    this process)."""
    half = duration / 2
    start_at = time.time() + half
    stop_at = start_at + half
    pool = (ProcessPoolExecutor(abusers, mp_context=multiprocessing.get_context("fork"), initializer=os.nice,
                                initargs=(ABUSER_NICE,)) if processes else ThreadPoolExecutor(abusers))
    with pool:
        jobs = [pool.submit(mixed_abuser, url, model, abuse_key, start_at, stop_at, seed + i, tier_dir, kinds)
                for i in range(abusers)]
        health, stop = collections.Counter(), threading.Event()
        watcher = threading.Thread(target=health_watch, args=(url, stop, health), daemon=True)
        watcher.start()
        calm = asyncio.run(normal_traffic(url, model, key, start_at, workers))
        stormy = asyncio.run(normal_traffic(url, model, key, stop_at, workers))
        counts = sum((job.result() for job in jobs), collections.Counter())
    stop.set()
    watcher.join()
    return MixedResult(calm, stormy, counts, health)


def report_mixed(result: MixedResult, process_exits: int, args: argparse.Namespace) -> bool:
    calm_p99, stormy_p99 = p99([t for t, _ in result.calm]), p99([t for t, _ in result.stormy])
    rows = [("normal requests alone / beside the abuse", f"{len(result.calm)} / {len(result.stormy)}", ""),
            ("normal requests lost (not 200)", result.lost, "0"),
            ("engine restarts (server exits + /health going down)",
             f"{process_exits + result.health['down']} ({result.health['polls']} polls)", "0"),
            ("p99 latency of normal traffic alone", f"{calm_p99 * 1000:.0f} ms", ""),
            ("p99 latency of normal traffic during abuse", f"{stormy_p99 * 1000:.0f} ms", ""),
            ("ratio", f"{result.p99_ratio:.2f}x", "<= 1.5x"),
            ("abuses sent / unexpected answers", f"{sum(result.abuses.values())} / {result.unexpected}", "- / 0")]
    print(f"mixed abuse: {args.duration:g} s, {args.workers} normal clients, {args.abusers} abusers ({args.abuses})")
    print("| measure | value | target |\n|---|---|---|")
    for name, value, target in rows:
        print(f"| {name} | {value} | {target} |")
    for (kind, status), k in sorted(result.abuses.items()):
        flag = "" if status in MIXED_EXPECTED[kind] else "  UNEXPECTED"
        print(f"  abuse {kind:18s} -> {status}: {k}{flag}")
    return result.lost == 0 and process_exits + result.health["down"] == 0 and result.unexpected == 0


# ---------------------------------------------------------------------- the server under test
def tiny_model(path: Path) -> str:
    """A tiny random Llama with a byte-level BPE tokenizer (multi-byte characters split across
    tokens) and a chat template; built once."""
    if (path / "config.json").exists():
        return str(path)
    import torch
    import transformers as tf
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(PROMPTS * 50, trainers.BpeTrainer(vocab_size=500, special_tokens=["<pad>", "<s>", "</s>"],
                                                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = tf.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                           chat_template=CHAT_TEMPLATE)
    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                            bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    tf.LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace, log) -> tuple[subprocess.Popen, str]:
    """``pagedllm serve`` on the tiny model, small KV pool (preemption), tool calling on."""
    model_dir = tiny_model(Path(args.model_dir))
    port = free_port()
    cmd = [sys.executable, "-m", "pagedllm", "serve", model_dir, "--port", str(port), "--served-model-name",
           args.model, "--block-size", "8", "--num-gpu-blocks-override", str(args.blocks), "--max-model-len",
           str(args.max_model_len), "--max-num-seqs", "16", "--enable-auto-tool-choice", "--tool-call-parser",
           "hermes", "--uvicorn-log-level", "warning", *args.server_args.split()]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180
    while time.time() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.3)
    proc.kill()
    raise SystemExit(f"the server did not start; its log: {log.name}")


@dataclass
class Served:
    """A server ``served`` started: its process, URL and log file (kept after the run)."""
    proc: subprocess.Popen
    url: str
    log_path: str

    def log_text(self) -> str:
        return Path(self.log_path).read_text()


@contextlib.contextmanager
def served(args: argparse.Namespace, prefix: str, stop_timeout: float = 60):
    """``start_server`` with its output in a kept temp log file (``prefix``...``.log``); terminated on exit."""
    with tempfile.NamedTemporaryFile("w+", suffix=".log", prefix=prefix, delete=False) as log:
        proc, url = start_server(args, log)
        try:
            yield Served(proc, url, log.name)
        finally:
            proc.terminate()
            proc.wait(stop_timeout)


def run(args: argparse.Namespace, url: str) -> tuple[Book, dict, float]:
    greedy_before, book, t0 = greedy_reply(url, args.model), Book(), time.time()
    stop_at = t0 + args.duration
    threads = [threading.Thread(target=sync_worker, args=(url, args.model, stop_at, 10**6 + i, book))
               for i in range(args.sync_workers)]
    for t in threads:
        t.start()
    asyncio.run(storm(url, args.model, args.max_model_len, book, workers=args.workers, seed=args.seed,
                      duration=args.duration, seeded_reproducible="--speculative-config" not in args.server_args))
    for t in threads:
        t.join()
    return book, after_storm(url, args.model, greedy_before), time.time() - t0


def report(book: Book, checks: dict, elapsed: float, log_text: str | None) -> bool:
    total = sum(book.counts.values())
    print(f"storm: {elapsed:.0f} s, {total} requests ({total / elapsed:.1f}/s), {book.num_failed} failed checks")
    for (name, status), k in sorted(book.counts.items()):
        print(f"  {name:22s} {status:4s} {k}")
    for name, errors in book.failures.items():
        print(f"FAILED {name}:\n    " + "\n    ".join(errors))
    return report_checks(checks, log_text) and book.num_failed == 0


def report_checks(checks: dict, log_text: str | None) -> bool:
    """Prints the after-storm ``checks`` (name -> (ok, what was seen)), with "no traceback" in ``log_text``
    when there is a server log; True when all passed."""
    if log_text is not None:
        checks["no traceback in the server log"] = ("Traceback" not in log_text, log_text.count("Traceback"))
    for name, (ok, seen) in checks.items():
        print(f"after: {name:32s} {'ok' if ok else 'FAILED'}  ({seen})")
    return all(ok for ok, _ in checks.values())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=float, default=120, help="seconds of storm")
    ap.add_argument("--workers", type=int, default=12, help="concurrent async clients")
    ap.add_argument("--sync-workers", type=int, default=2, help="concurrent sync clients (threads)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--base-url", default=None, help="soak a running server instead of starting one")
    ap.add_argument("--model", default="tiny", help="the served model name")
    ap.add_argument("--max-model-len", type=int, default=128)
    ap.add_argument("--blocks", type=int, default=24, help="KV blocks of 8 tokens for the started server")
    ap.add_argument("--model-dir", default=str(Path(tempfile.gettempdir()) / "pagedllm-soak-model"))
    ap.add_argument("--server-args", default="", help="more flags for the started server")
    ap.add_argument("--scenario", default="storm", choices=["storm", "router-abuse", "mixed"],
                    help="storm: every scenario against one server; router-abuse: huge and stalled bodies and "
                         "keyless requests beside normal traffic, through `serve --data-parallel-size 2`; mixed: "
                         "every abuse of MIXED_ABUSES beside normal traffic against one server with a disk tier")
    ap.add_argument("--abusers", type=int, default=4, help="router-abuse, mixed: concurrent rude clients")
    ap.add_argument("--api-key", default="soak", help="router-abuse, mixed: the key normal clients send")
    ap.add_argument("--abuse-key", default="abuse", help="mixed: the abusers' key (another client to the server)")
    ap.add_argument("--abuses", default=",".join(MIXED_ABUSES),
                    help="mixed: the kinds of abuse dealt, comma-separated (default: all of MIXED_ABUSES)")
    args = ap.parse_args()
    if args.scenario == "router-abuse":
        return run_router_abuse(args)
    if args.scenario == "mixed":
        return run_mixed(args)
    if args.base_url:
        return 0 if report(*run(args, args.base_url.rstrip("/")), None) else 1
    with served(args, "soak-server-", stop_timeout=30) as server:
        result = run(args, server.url)
    print(f"server log: {server.log_path}")
    return 0 if report(*result, server.log_text()) else 1


def abuse_kinds(args: argparse.Namespace) -> tuple[str, ...]:
    kinds = tuple(k.strip() for k in args.abuses.split(",") if k.strip())
    unknown = sorted(set(kinds) - set(MIXED_ABUSES))
    if unknown or not kinds:
        raise SystemExit(f"--abuses={args.abuses!r}: unknown {unknown}; choose from {', '.join(MIXED_ABUSES)}")
    return kinds


def run_mixed(args: argparse.Namespace) -> int:
    if args.base_url:
        result = mixed_abuse(args.base_url.rstrip("/"), args.model, args.api_key, args.abuse_key, args.duration,
                             workers=args.workers, abusers=args.abusers, seed=args.seed, kinds=abuse_kinds(args))
        return 0 if report_mixed(result, 0, args) else 1
    tier_dir = tempfile.mkdtemp(prefix="soak-tier-")
    args.server_args += (f" --api-key {args.api_key} {args.abuse_key} --request-body-timeout 5"
                         f" --kv-offload-dir {tier_dir} --kv-offload-disk-gb 1")
    with served(args, "soak-mixed-") as server:
        greedy_before = greedy_reply(server.url, args.model)
        result = mixed_abuse(server.url, args.model, args.api_key, args.abuse_key, args.duration, workers=args.workers,
                             abusers=args.abusers, seed=args.seed, tier_dir=tier_dir, kinds=abuse_kinds(args))
        exits = int(server.proc.poll() is not None)
        checks = {} if exits else after_storm(server.url, args.model, greedy_before)
    ok = report_mixed(result, exits, args)
    ok = report_checks(checks, server.log_text()) and ok
    print(f"server log: {server.log_path}")
    return 0 if ok else 1


def run_router_abuse(args: argparse.Namespace) -> int:
    if args.base_url:
        return 0 if router_abuse(args, args.base_url.rstrip("/")) else 1
    args.server_args += f" --data-parallel-size 2 --api-key {args.api_key} --request-body-timeout 5"
    with served(args, "soak-router-") as server:
        ok = router_abuse(args, server.url)
    text = server.log_text()
    print(f"server log: {server.log_path} ({text.count('Traceback')} tracebacks)")
    return 0 if ok and "Traceback" not in text else 1


if __name__ == "__main__":
    sys.exit(main())

"""Every field of vLLM's completion and chat request schemas is honoured (a behavioural check)
or refused with a 400 naming it; a field vLLM does not know is refused too. Never accepted and
dropped: a client that sends ``guided_json`` must not believe its output is constrained when the
server ignored it.

Sampling fields are checked against the offline ``LLM`` with the same SamplingParams (and chat
against a completion of the same rendered prompt); template fields against the template rendered
offline; output constraints by validating outputs of a random model at temperature 1.0.
"""
from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest
from chat_server import TOOL_TEMPLATE, WEATHER_TOOL, script_engine
from conftest import make_model_dir
from live_server import start_server

from pagedllm import LLM, SamplingParams
from pagedllm.entrypoints.openai.chat_features import ChatOptions
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagedllm.sampling_params import BeamSearchParams

# vLLM's CompletionRequest and ChatCompletionRequest fields (vllm/entrypoints/openai/protocol.py)
VLLM_SHARED = {
    "model", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n", "presence_penalty", "seed", "stop",
    "stream", "stream_options", "temperature", "top_p", "user", "best_of", "use_beam_search", "top_k", "min_p",
    "repetition_penalty", "length_penalty", "stop_token_ids", "include_stop_str_in_output", "ignore_eos",
    "min_tokens", "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens",
    "allowed_token_ids", "prompt_logprobs", "add_special_tokens", "response_format", "structured_outputs",
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
    "guided_whitespace_pattern", "priority", "request_id", "logits_processors", "return_tokens_as_token_ids",
    "return_token_ids", "cache_salt", "kv_transfer_params", "vllm_xargs", "bad_words", "echo"}
VLLM_COMPLETION_FIELDS = VLLM_SHARED | {"prompt", "prompt_embeds", "suffix"}
VLLM_CHAT_FIELDS = VLLM_SHARED | {
    "messages", "top_logprobs", "max_completion_tokens", "tools", "tool_choice", "parallel_tool_calls",
    "reasoning_effort", "include_reasoning", "add_generation_prompt", "continue_final_message", "documents",
    "chat_template", "chat_template_kwargs", "mm_processor_kwargs", "media_io_kwargs"}

BASE = dict(max_tokens=8, temperature=1.0, seed=5, ignore_eos=True)
PROMPT = "hello world"
USER = [{"role": "user", "content": "hi there"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Llama whose tokenizer adds a BOS (so add_special_tokens shows) and renders tools."""
    from tokenizers import processors
    from transformers import AutoTokenizer
    path = make_model_dir(tmp_path_factory.mktemp("fields-llama"), "llama")
    tok = AutoTokenizer.from_pretrained(path)
    tok._tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.chat_template = TOOL_TEMPLATE
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def ctx(model_dir):
    srv = start_server(model_dir, chat_options=ChatOptions(True, "hermes", "qwen3", trust_request_chat_template=True),
                       max_model_len=256)
    llm = LLM(model_dir, block_size=8, num_gpu_blocks_override=64, max_model_len=256)
    yield Ctx(srv, llm)
    srv.stop()


class Ctx:
    def __init__(self, srv, llm):
        self.srv, self.llm, self.tok = srv, llm, llm.get_tokenizer()

    def post(self, path: str, body: dict) -> httpx.Response:
        return httpx.post(f"{self.srv.url}/v1/{path}", json=body, timeout=60)

    def ok(self, path: str, body: dict) -> dict:
        r = self.post(path, body)
        assert r.status_code == 200, r.text
        return r.json()

    def offline(self, prompt=PROMPT, **params):
        params = {**BASE, **params}
        return self.llm.generate([prompt], SamplingParams(**params), use_tqdm=False)[0].outputs

    def baseline(self, path: str):
        """The offline output of the endpoint's base request (chat: its rendered prompt)."""
        prompt = PROMPT if path == "completions" else {"prompt_token_ids": self.render()}
        return self.offline(prompt)[0]

    def render(self, messages=USER, **kwargs) -> list[int]:
        kwargs.setdefault("add_generation_prompt", True)
        text = self.tok.apply_chat_template(messages, tokenize=False, **kwargs)
        return self.tok.encode(text, add_special_tokens=False)


def texts(body: dict) -> list[str]:
    return [c["text"] if "text" in c else c["message"]["content"] for c in body["choices"]]


# ---------------------------------------------------------------------- checks (one per kind of field)
def refused(ctx, path, field, value):
    body = {**_base(path), field: value}
    r = ctx.post(path, body)
    assert r.status_code == 400, (field, r.text)
    err = r.json()["error"]
    assert err["param"] == field and err["message"], err
    assert ctx.post(path, _base(path)).status_code == 200  # and the server keeps serving


def like_offline(params_of, extra: dict | None = None, changes: bool = True):
    """The completion equals the offline LLM's with SamplingParams ``params_of(value)`` (and differs
    from the baseline where ``changes``); ``extra`` goes into both the request and the offline params."""
    def check(ctx, path, field, value):
        if path != "completions":
            return chat_like_completion(ctx, path, field, value, extra)
        got = texts(ctx.ok(path, {**_base(path), **(extra or {}), field: value}))
        params = params_of(value) if callable(params_of) else params_of
        assert got == [c.text for c in ctx.offline(**{**(extra or {}), **params})], field
        if changes:
            assert got != [c.text for c in ctx.offline(**(extra or {}))], f"{field}={value!r} changed nothing"
    return check


def chat_like_completion(ctx, path, field, value, extra: dict | None = None):
    """Chat passes the field exactly as completions do: same text on the same rendered prompt."""
    chat = ctx.ok("chat/completions", {**_base("chat/completions"), **(extra or {}), field: value})
    cmpl = ctx.ok("completions", {**BASE, **(extra or {}), "prompt": ctx.render(), field: value})
    assert texts(chat) == texts(cmpl) and chat["usage"] == cmpl["usage"], field


def prompt_tokens_of(**render_kwargs):
    """A template input: the prompt the server built is the template rendered offline with it."""
    def check(ctx, path, field, value):
        usage = ctx.ok(path, {**_base(path), field: value})["usage"]
        expected = ctx.render(**render_kwargs(value) if callable(render_kwargs) else render_kwargs)
        assert usage["prompt_tokens"] == len(expected) != len(ctx.render()), field
    return check


def accepted_no_output_change(ctx, path, field, value):
    """Labels (``user``) and no-op values of refused fields: accepted, the output is the baseline's."""
    assert texts(ctx.ok(path, {**_base(path), field: value})) == texts(ctx.ok(path, _base(path)))


def _base(path: str) -> dict:
    return {**BASE, "prompt": PROMPT} if path == "completions" else {**BASE, "messages": USER}


# ---------------------------------------------------------------------- custom behavioural checks
def check_model(ctx, path, field, value):
    assert ctx.ok(path, {**_base(path), "model": "tiny"})["model"] == "tiny"
    assert ctx.post(path, {**_base(path), "model": "gpt-4"}).status_code == 400


def check_prompt(ctx, path, field, value):
    assert texts(ctx.ok(path, {**BASE, "prompt": "the quick"})) == [ctx.offline("the quick")[0].text]


def check_messages(ctx, path, field, value):
    assert ctx.ok(path, {**BASE, "messages": USER})["usage"]["prompt_tokens"] == len(ctx.render())


def check_echo(ctx, path, field, value):
    if path == "completions":
        assert texts(ctx.ok(path, {**_base(path), "echo": True}))[0] == PROMPT + ctx.offline()[0].text
        return
    msgs = [*USER, {"role": "assistant", "content": "Once upon"}]
    body = {**BASE, "messages": msgs, "echo": True, "add_generation_prompt": False, "continue_final_message": True}
    assert texts(ctx.ok(path, body))[0].startswith("Once upon")


def check_stream(ctx, path, field, value):
    full = texts(ctx.ok(path, _base(path)))[0]
    with httpx.stream("POST", f"{ctx.srv.url}/v1/{path}", json={**_base(path), "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    pieces = [c.get("text") or c.get("delta", {}).get("content") or "" for e in events for c in e["choices"]]
    assert "".join(pieces) == full


def stream_events(ctx, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{ctx.srv.url}/v1/{path}", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def check_stream_options(ctx, path, field, value):
    body = {**_base(path), "stream_options": {"include_usage": True}}
    events = stream_events(ctx, path, body)
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 8
    assert all(e["usage"] is None for e in events[:-1])
    # continuous_usage_stats: each chunk carries its choice's usage so far (vLLM's)
    events = stream_events(ctx, path, {**_base(path), "n": 2, "stream_options": {"continuous_usage_stats": True}})
    counts = {0: [], 1: []}
    for e in events:
        counts[e["choices"][0]["index"]].append(e["usage"]["completion_tokens"])
        assert e["usage"]["prompt_tokens"] == events[0]["usage"]["prompt_tokens"] > 0
    for seen in counts.values():
        assert seen == sorted(seen) and seen[-1] == 8, seen
    r = ctx.post(path, {**body, "stream_options": {"include_usage": True, "per_chunk": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"


def check_prompt_logprobs(ctx, path, field, value):
    """Per prompt position the offline engine's prompt logprobs (the first null), keyed by token id."""
    prompt_ids = ctx.tok.encode(PROMPT) if path == "completions" else ctx.render()
    ref = ctx.llm.generate([{"prompt_token_ids": prompt_ids}], SamplingParams(**BASE, prompt_logprobs=value),
                           use_tqdm=False)[0].prompt_logprobs
    body = ctx.ok(path, {**_base(path), field: value})
    got = body["choices"][0]["prompt_logprobs"] if path == "completions" else body["prompt_logprobs"]
    assert len(got) == len(prompt_ids) and got[0] is None and ref[0] is None
    for pos, (entry, want) in enumerate(zip(got[1:], ref[1:]), start=1):
        assert str(prompt_ids[pos]) in entry and len(entry) >= value
        assert {int(t) for t in entry} == set(want)
        for t, e in want.items():
            assert entry[str(t)]["logprob"] == pytest.approx(e.logprob, abs=1e-4)
            assert entry[str(t)]["rank"] == e.rank and entry[str(t)]["decoded_token"] == e.decoded_token
    assert texts(body) == texts(ctx.ok(path, _base(path)))  # and the output is unchanged
    r = ctx.post(path, {**_base(path), field: value, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == field


def check_return_token_ids(ctx, path, field, value):
    body = ctx.ok(path, {**_base(path), field: True, "n": 2})
    prompt_ids = ctx.tok.encode(PROMPT) if path == "completions" else ctx.render()
    offline = [c.token_ids for c in ctx.offline(PROMPT if path == "completions" else {"prompt_token_ids": prompt_ids},
                                                n=2)]
    assert [c["token_ids"] for c in body["choices"]] == offline
    prompts = [c["prompt_token_ids"] for c in body["choices"]] if path == "completions" else [body["prompt_token_ids"]]
    assert all(p == prompt_ids for p in prompts)
    # streamed: the chunks' token ids join to the same; the prompt's come once per choice
    events = stream_events(ctx, path, {**_base(path), field: True, "n": 2})
    streamed, prompt_seen = {0: [], 1: []}, []
    for e in events:
        choice = e["choices"][0]
        streamed[choice["index"]] += choice.get("token_ids") or []
        prompt_seen += [p for p in (choice.get("prompt_token_ids"), e.get("prompt_token_ids")) if p]
    assert list(streamed.values()) == offline and prompt_seen == [prompt_ids, prompt_ids]
    assert "token_ids" not in ctx.ok(path, _base(path))["choices"][0] or \
        ctx.ok(path, _base(path))["choices"][0]["token_ids"] is None


def check_tokens_as_ids(ctx, path, field, value):
    if path == "completions":
        lp = ctx.ok(path, {**_base(path), "logprobs": 2, field: True})["choices"][0]["logprobs"]
        ids = ctx.offline(logprobs=2)[0].token_ids
        assert lp["tokens"] == [f"token_id:{t}" for t in ids]
        assert all(k.startswith("token_id:") for top in lp["top_logprobs"] for k in top)
        return
    content = ctx.ok(path, {**_base(path), "logprobs": True, "top_logprobs": 2, field: True})["choices"][0]["logprobs"]
    ids = ctx.baseline(path).token_ids
    assert [t["token"] for t in content["content"]] == [f"token_id:{t}" for t in ids]
    assert content["content"][0]["bytes"] == list(f"token_id:{ids[0]}".encode())
    assert all(top["token"].startswith("token_id:") for t in content["content"] for top in t["top_logprobs"])


def beams_offline(ctx, path, **params):
    prompt = PROMPT if path == "completions" else {"prompt_token_ids": ctx.render()}
    beam = BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True, **params)
    return ctx.llm.beam_search([prompt], beam)[0].sequences


def check_beam_search(ctx, path, field, value):
    """n beams, best first, as the offline LLM.beam_search finds them; streamed too; other
    sampling fields refused."""
    body = {**_base(path), "n": 3, "max_tokens": 6, "temperature": 0, field: value, "return_token_ids": True}
    del body["seed"]
    got = ctx.ok(path, body)
    want = beams_offline(ctx, path)
    assert [c["token_ids"] for c in got["choices"]] == [b.output_token_ids for b in want]
    assert texts(got) == [b.text for b in want]
    assert got["usage"]["completion_tokens"] == sum(len(b.output_token_ids) for b in want)
    streamed = {}
    for e in stream_events(ctx, path, body):
        choice = e["choices"][0]
        streamed[choice["index"]] = streamed.get(choice["index"], "") + (
            choice["text"] if path == "completions" else choice["delta"].get("content") or "")
    assert [streamed[k] for k in sorted(streamed)] == texts(got)
    for name, bad in (("top_p", 0.5), ("seed", 3), ("temperature", 0.7), ("stop", ["x"])):
        r = ctx.post(path, {**body, name: bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == name, (name, r.text)
    r = ctx.post(path, {**body, "logprobs": 1 if path == "completions" else True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
    assert ctx.srv.wait_idle().num_used_blocks == 0


def check_length_penalty(ctx, path, field, value):
    """Reaches the beam search (with ignore_eos every beam has the same length, so the texts alone
    could not show it: the params the engine gets are checked too)."""
    body = {**_base(path), "n": 3, "max_tokens": 6, "use_beam_search": True, field: value}
    del body["seed"], body["temperature"]
    engine, seen = ctx.srv.engine, []
    real = engine.add_beam_searches

    async def spy(requests, params, *args, **kwargs):
        seen.append(params)
        return await real(requests, params, *args, **kwargs)
    engine.add_beam_searches = spy
    try:
        assert texts(ctx.ok(path, body)) == [b.text for b in beams_offline(ctx, path, length_penalty=value)]
    finally:
        del engine.add_beam_searches
    assert [p.length_penalty for p in seen] == [value]
    r = ctx.post(path, {**_base(path), field: value})  # without beam search it would do nothing
    assert r.status_code == 400 and r.json()["error"]["param"] == field


def check_priority(ctx, path, field, value):
    """This server schedules FCFS: a priority other than 0 is a 400 naming it (test_priority_server.py
    runs --scheduling-policy priority)."""
    r = ctx.post(path, {**_base(path), field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field
    assert "scheduling_policy='priority'" in r.json()["error"]["message"]
    r = ctx.post(path, {**_base(path), field: True})
    assert r.status_code == 400 and r.json()["error"]["param"] == field  # strict: an integer, not a bool


def check_cache_salt(ctx, path, field, value):
    """Only requests with the same salt share prefix-cache blocks (the server's prefix-cache hits count)."""
    long_prompt = " ".join(["salted words"] * 12)
    base = ({**BASE, "prompt": long_prompt} if path == "completions" else
            {**BASE, "messages": [{"role": "user", "content": long_prompt}]})

    def hits_of(body: dict) -> float:
        before = ctx.srv.on_loop(ctx.srv.engine.get_kv_cache_stats()).prefix_cache_hits
        ctx.ok(path, body)
        return ctx.srv.on_loop(ctx.srv.engine.get_kv_cache_stats()).prefix_cache_hits - before

    salt = f"{value}-{path}"
    assert hits_of({**base, field: salt}) == 0
    assert hits_of({**base, field: salt}) >= 16  # same salt: its full blocks are shared
    assert hits_of({**base, field: salt + "-other"}) == 0
    r = ctx.post(path, {**base, field: ""})
    assert r.status_code == 400 and r.json()["error"]["param"] == field


def check_logprobs(ctx, path, field, value):
    if path == "completions":
        lp = ctx.ok(path, {**_base(path), "logprobs": 2})["choices"][0]["logprobs"]
        ref = ctx.offline(logprobs=2)[0]
        want = [e[t].logprob for t, e in zip(ref.token_ids, ref.logprobs)]
        assert lp["token_logprobs"] == pytest.approx(want, abs=1e-4)
        return
    out = ctx.ok(path, {**_base(path), "logprobs": True, "top_logprobs": 3})["choices"][0]["logprobs"]["content"]
    assert len(out) == 8 and all(len(t["top_logprobs"]) == 3 for t in out)
    assert ctx.ok(path, {**_base(path), "logprobs": True})["choices"][0]["logprobs"]["content"][0]["top_logprobs"] == []


def check_max_completion_tokens(ctx, path, field, value):
    assert ctx.ok(path, {**_base(path), "max_completion_tokens": 3})["usage"]["completion_tokens"] == 3


def check_add_special_tokens(ctx, path, field, value):
    n = len(ctx.tok.encode(PROMPT, add_special_tokens=False))
    if path == "completions":  # default true: the tokenizer's BOS is added
        assert ctx.ok(path, {**_base(path)})["usage"]["prompt_tokens"] == n + 1
        assert ctx.ok(path, {**_base(path), field: False})["usage"]["prompt_tokens"] == n
        return
    body = ctx.ok(path, {**_base(path), field: True})  # default false: the template wrote its own
    assert body["usage"]["prompt_tokens"] == len(ctx.render()) + 1


def check_request_id(ctx, path, field, value):
    prefix = "cmpl" if path == "completions" else "chatcmpl"
    assert ctx.ok(path, {**_base(path), "request_id": "my-id-7"})["id"] == f"{prefix}-my-id-7"


def check_best_of(ctx, path, field, value):
    if path == "completions":
        like_offline(dict(best_of=3))(ctx, path, field, value)
    else:
        chat_like_completion(ctx, path, field, value)
    r = ctx.post(path, {**_base(path), "best_of": 1, "n": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of"


def check_tools(ctx, path, field, value):
    body = {**_base(path), "tools": [WEATHER_TOOL], "tool_choice": "none"}
    assert ctx.ok(path, body)["usage"]["prompt_tokens"] == len(ctx.render(tools=[WEATHER_TOOL]))


def check_tool_choice(ctx, path, field, value):
    check_tools(ctx, path, field, value)  # "none": tools shown, calls not parsed
    city = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": city}}
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):  # constrained
        body = {**_base(path), "tools": [tool], "tool_choice": choice, "max_tokens": 100}
        calls = ctx.ok(path, body)["choices"][0]["message"]["tool_calls"]
        assert calls and {c["function"]["name"] for c in calls} == {"get_weather"}
        jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), city)
    scripted_tool_calls(ctx, path, field, value)


def scripted_tool_calls(ctx, path, field, value):
    """With the engine's text scripted: calls parsed (auto), the first kept (parallel_tool_calls=false)."""
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "%s"}}</tool_call>'
    mp = pytest.MonkeyPatch()
    try:
        script_engine(mp, ctx.srv, [call % "Paris", call % "Rome"])
        body = {**_base(path), "tools": [WEATHER_TOOL]}
        calls = ctx.ok(path, body)["choices"][0]["message"]["tool_calls"]
        assert [json.loads(c["function"]["arguments"])["city"] for c in calls] == ["Paris", "Rome"]
        calls = ctx.ok(path, {**body, "parallel_tool_calls": False})["choices"][0]["message"]["tool_calls"]
        assert [json.loads(c["function"]["arguments"])["city"] for c in calls] == ["Paris"]
    finally:
        mp.undo()


def check_include_reasoning(ctx, path, field, value):
    mp = pytest.MonkeyPatch()
    try:
        script_engine(mp, ctx.srv, ["<think>hm</think>", "4"])
        shown = ctx.ok(path, _base(path))["choices"][0]["message"]
        hidden = ctx.ok(path, {**_base(path), "include_reasoning": False})["choices"][0]["message"]
        assert (shown["reasoning_content"], shown["content"]) == ("hm", "4")
        assert (hidden["reasoning_content"], hidden["content"]) == (None, "4")
    finally:
        mp.undo()


def check_continue_final_message(ctx, path, field, value):
    msgs = [*USER, {"role": "assistant", "content": "Once upon"}]
    body = {**BASE, "messages": msgs, "add_generation_prompt": False, "continue_final_message": True}
    expected = ctx.render(msgs, add_generation_prompt=False, continue_final_message=True)
    assert ctx.ok(path, body)["usage"]["prompt_tokens"] == len(expected)
    assert len(expected) < len(ctx.render(msgs, add_generation_prompt=False))  # the turn is left open


def check_chat_template(ctx, path, field, value):
    usage = ctx.ok(path, {**_base(path), "chat_template": "{{ messages[0].content }}!"})["usage"]
    assert usage["prompt_tokens"] == len(ctx.tok.encode("hi there!", add_special_tokens=False))


ENUM_SCHEMA = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"]}


def constrained(valid):
    """An output constraint: a random model at temperature 1.0 satisfies it at every seed (free JSON
    whitespace makes its documents long: hence the token budget)."""
    def check(ctx, path, field, value):
        for seed in range(3):
            out = texts(ctx.ok(path, {**_base(path), "seed": seed, "max_tokens": 150, field: value}))[0]
            assert valid(out), (field, out)
    return check


def _schema_ok(text: str) -> bool:
    jsonschema.validate(json.loads(text), ENUM_SCHEMA)
    return True


def check_response_format(ctx, path, field, value):
    accepted_no_output_change(ctx, path, field, {"type": "text"})  # the default: free text
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": ENUM_SCHEMA}}
    constrained(_schema_ok)(ctx, path, field, fmt)


def check_guided_decoding_backend(ctx, path, field, value):
    body = {**_base(path), "guided_choice": ["yes", "no"], "max_tokens": 10}
    assert texts(ctx.ok(path, {**body, field: "xgrammar"}))[0] in ("yes", "no")
    r = ctx.post(path, {**body, field: "outlines"})
    assert r.status_code == 400 and r.json()["error"]["param"] == field


def check_truncate_prompt_tokens(ctx, path, field, value):
    assert ctx.ok(path, {**_base(path), field: 2})["usage"]["prompt_tokens"] == 2


def check_skip_special_tokens(ctx, path, field, value):
    extra = dict(allowed_token_ids=[1, 2, 300])
    kept = texts(ctx.ok(path, {**_base(path), **extra, "skip_special_tokens": False}))[0]
    dropped = texts(ctx.ok(path, {**_base(path), **extra}))[0]
    assert ("<s>" in kept or "</s>" in kept) and "<s>" not in dropped and "</s>" not in dropped
    like_offline(dict(skip_special_tokens=False), extra, changes=False)(ctx, path, field, False)


def check_stop(ctx, path, field, value):
    stop = ctx.baseline(path).text[3:5]
    like_offline(lambda v: dict(stop=[v]))(ctx, path, "stop", stop)
    like_offline(dict(stop=[stop], include_stop_str_in_output=True), {"stop": stop})(
        ctx, path, "include_stop_str_in_output", True)


def check_stop_token_ids(ctx, path, field, value):
    stop_id = ctx.baseline(path).token_ids[2]
    like_offline(dict(stop_token_ids=[stop_id]))(ctx, path, field, [stop_id])


def check_min_tokens(ctx, path, field, value):
    stop_id = ctx.baseline(path).token_ids[0]  # stops at once without min_tokens
    like_offline(dict(stop_token_ids=[stop_id], min_tokens=4), {"stop_token_ids": [stop_id]})(ctx, path, field, 4)


def check_ignore_eos(ctx, path, field, value):
    eos_only = {**_base(path), "logit_bias": {"2": 100}, "ignore_eos": False}
    assert ctx.ok(path, eos_only)["usage"]["completion_tokens"] == 1
    assert ctx.ok(path, {**eos_only, "ignore_eos": True})["usage"]["completion_tokens"] == 8


# greedy and long enough to repeat itself, so the penalties change the text
LOOPING = dict(temperature=0, max_tokens=24)
SAMPLING = [
    ("n", 2, like_offline(dict(n=2))), ("temperature", 0, like_offline(dict(temperature=0))),
    ("top_p", 0.05, like_offline(dict(top_p=0.05))), ("top_k", 1, like_offline(dict(top_k=1))),
    ("top_k", 0, like_offline(dict(top_k=0), changes=False)),  # vLLM: 0 = off (part A)
    ("min_p", 0.9, like_offline(dict(min_p=0.9))),
    ("presence_penalty", 2.0, like_offline(dict(presence_penalty=2.0), LOOPING)),
    ("frequency_penalty", 2.0, like_offline(dict(frequency_penalty=2.0), LOOPING)),
    ("repetition_penalty", 3.0, like_offline(dict(repetition_penalty=3.0), LOOPING)),
    ("seed", 123, like_offline(dict(seed=123))), ("max_tokens", 3, like_offline(dict(max_tokens=3))),
    ("allowed_token_ids", [10, 11, 12], like_offline(dict(allowed_token_ids=[10, 11, 12]))),
    ("logit_bias", {"300": 100}, like_offline(dict(logit_bias={300: 100}))),
    ("stop", None, check_stop), ("include_stop_str_in_output", True, check_stop),
    ("stop_token_ids", None, check_stop_token_ids), ("min_tokens", 4, check_min_tokens),
    ("ignore_eos", False, check_ignore_eos),
]
REFUSED = [("logits_processors", ["my.module:fn"]), ("kv_transfer_params", {"a": 1}), ("vllm_xargs", {"a": 1}),
           ("spaces_between_special_tokens", False)]
YES_NO = constrained(lambda t: t in ("yes", "no"))
CONSTRAINTS = [  # issue 12 part A's fields
    ("structured_outputs", {"choice": ["yes", "no"]}, YES_NO), ("guided_json", ENUM_SCHEMA, constrained(_schema_ok)),
    ("guided_regex", "[a-c]{3}", constrained(lambda t: re.fullmatch("[a-c]{3}", t))),
    ("guided_choice", ["yes", "no"], YES_NO), ("guided_grammar", 'root ::= "yes" | "no"', YES_NO),
    ("guided_decoding_backend", None, check_guided_decoding_backend), ("guided_whitespace_pattern", " ", refused),
    ("bad_words", ["the"], like_offline(dict(bad_words=["the"]), changes=False)),
    ("truncate_prompt_tokens", 2, check_truncate_prompt_tokens)]
SHARED = [("model", "tiny", check_model), ("stream", True, check_stream),
          ("stream_options", None, check_stream_options), ("user", "user-1", accepted_no_output_change),
          ("logprobs", None, check_logprobs),
          ("add_special_tokens", None, check_add_special_tokens), ("request_id", None, check_request_id),
          ("best_of", 3, check_best_of), ("echo", True, check_echo), ("response_format", None, check_response_format),
          ("skip_special_tokens", False, check_skip_special_tokens),
          ("prompt_logprobs", 2, check_prompt_logprobs), ("return_token_ids", True, check_return_token_ids),
          ("return_tokens_as_token_ids", True, check_tokens_as_ids), ("priority", 1, check_priority),
          ("cache_salt", "salt", check_cache_salt), ("use_beam_search", True, check_beam_search),
          ("length_penalty", 0.5, check_length_penalty)]
COMPLETION_ONLY = [("prompt", None, check_prompt), ("suffix", "!", refused), ("prompt_embeds", "AAAA", refused)]
CHAT_ONLY = [
    ("messages", None, check_messages), ("max_completion_tokens", 3, check_max_completion_tokens),
    ("top_logprobs", 3, check_logprobs), ("tools", None, check_tools), ("tool_choice", "none", check_tool_choice),
    ("parallel_tool_calls", False, scripted_tool_calls), ("include_reasoning", False, check_include_reasoning),
    ("add_generation_prompt", False, prompt_tokens_of(add_generation_prompt=False)),
    ("continue_final_message", True, check_continue_final_message),
    ("documents", [{"title": "t", "text": "a doc"}], prompt_tokens_of(documents=[{"title": "t", "text": "a doc"}])),
    ("chat_template", None, check_chat_template),
    ("chat_template_kwargs", {"enable_thinking": False}, prompt_tokens_of(enable_thinking=False)),
    ("reasoning_effort", "low", refused), ("mm_processor_kwargs", {"a": 1}, refused),
    ("media_io_kwargs", {"a": 1}, refused)]


def rows():
    for path in ("completions", "chat/completions"):
        yield from ((path, f, v, c) for f, v, c in SAMPLING)
        yield from ((path, f, v, refused) for f, v in REFUSED)
        yield from ((path, f, v, c) for f, v, c in CONSTRAINTS)
        yield from ((path, f, v, c) for f, v, c in SHARED)
        yield from ((path, f, v, c) for f, v, c in (COMPLETION_ONLY if path == "completions" else CHAT_ONLY))


ROWS = list(rows())


@pytest.mark.parametrize("path, field, value, check", [pytest.param(*r, id=f"{r[0]}:{r[1]}") for r in ROWS])
def test_field_is_honoured_or_refused(ctx, path, field, value, check):
    check(ctx, path, field, value)


def test_every_vllm_field_has_a_row_and_every_declared_field_is_a_vllm_one():
    for path, vllm, model in (("completions", VLLM_COMPLETION_FIELDS, CompletionRequest),
                              ("chat/completions", VLLM_CHAT_FIELDS, ChatCompletionRequest)):
        covered = {f for p, f, _, _ in ROWS if p == path}
        assert vllm <= covered, sorted(vllm - covered)
        assert set(model.model_fields) <= vllm, sorted(set(model.model_fields) - vllm)


@pytest.mark.parametrize("path", ["completions", "chat/completions"])
@pytest.mark.parametrize("field, value", [("functions", []), ("guided_jsn", {}), ("max_new_tokens", 4),
                                          ("metadata", {"a": "b"})])
def test_unknown_fields_are_refused_by_name(ctx, path, field, value):
    r = ctx.post(path, {**_base(path), field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field
    assert "unknown field" in r.json()["error"]["message"]


@pytest.mark.parametrize("path", ["completions", "chat/completions"])
def test_no_op_values_of_refused_fields_are_accepted(ctx, path):
    for field, value in [("use_beam_search", False), ("length_penalty", 1.0), ("priority", 0),
                         ("prompt_logprobs", None), ("guided_json", None), ("return_token_ids", False)]:
        accepted_no_output_change(ctx, path, field, value)


def test_nested_objects_refuse_unknown_keys(ctx):
    msg = [{"role": "user", "content": "hi", "bogus": 1}]
    r = ctx.post("chat/completions", {**BASE, "messages": msg})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    sdk_echo = [{"role": "user", "content": "hi", "refusal": None, "audio": None, "function_call": None}]
    assert ctx.post("chat/completions", {**BASE, "messages": sdk_echo}).status_code == 200  # nulls: no-ops
    r = ctx.post("chat/completions", {**BASE, "messages": [{**sdk_echo[0], "refusal": "no"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = ctx.post("chat/completions", {**BASE, "messages": USER, "tools": [{**WEATHER_TOOL, "x": 1}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"

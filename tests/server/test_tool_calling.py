"""Tool calling and reasoning through the server and the real ``openai`` client.

The model's text is scripted (``script_engine``) where the test is about parsing a known output;
a random tiny model does not write tool calls by itself.
"""
from __future__ import annotations

import argparse
import json

import httpx
import jsonschema
import openai
import pytest
from chat_server import WEATHER_TOOL, script_engine, tools_server  # noqa: F401 - fixture
from live_server import live_server, server_model_dir  # noqa: F401 - fixtures

from pagedllm.entrypoints.openai.api_server import _chat_options_from_cli, make_arg_parser
from pagedllm.entrypoints.openai.chat_features import ChatOptions

USER = {"role": "user", "content": "weather in Paris?"}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def client(tools_server):  # noqa: F811
    with openai.OpenAI(base_url=f"{tools_server.url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def test_tool_call_round_trip(tools_server, client, monkeypatch):  # noqa: F811
    prompts = script_engine(monkeypatch, tools_server, ["<think>I need the weather.</think>\n", CALL_TEXT])
    first = client.chat.completions.create(model="tiny", messages=[USER], tools=[WEATHER_TOOL])
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.reasoning_content == "I need the weather."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER_TOOL["function"]["parameters"])
    assert '<s>system: You may call: get_weather{"type": "object"' in prompts[0]["prompt"]

    prompts = script_engine(monkeypatch, tools_server, ["It is 18 C in Paris."])
    history = [USER, choice.message.model_dump(exclude_none=True, exclude={"reasoning_content"}),
               {"role": "tool", "tool_call_id": call.id, "content": "18 C"}]
    final = client.chat.completions.create(model="tiny", messages=history, tools=[WEATHER_TOOL])
    assert final.choices[0].message.content == "It is 18 C in Paris." and not final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason == "stop"
    rendered = prompts[0]["prompt"]  # the call and its reply reach the template
    assert '<s>assistant: <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in rendered
    assert f"<s>tool: <tool_response>{call.id} 18 C</tool_response>" in rendered


def test_streamed_tool_call_as_openai_sends_it(tools_server, client, monkeypatch):  # noqa: F811
    text = "<think>need weather</think>Checking. " + CALL_TEXT
    cuts = [0, 3, 9, 15, 30, 36, 44, 60, 70, len(text) - 5, len(text)]  # boundaries inside every tag
    script_engine(monkeypatch, tools_server, [text[a:b] for a, b in zip(cuts, cuts[1:])])
    chunks = list(client.chat.completions.create(model="tiny", messages=[USER], tools=[WEATHER_TOOL], stream=True))
    deltas = [c.choices[0].delta for c in chunks]
    assert deltas[0].role == "assistant"
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    assert reasoning == "need weather" and content == "Checking. "
    head, *fragments = calls
    assert head.index == 0 and head.id.startswith("call_") and head.type == "function"
    assert head.function.name == "get_weather" and head.function.arguments == ""
    assert all(f.index == 0 and f.id is None and f.function.name is None for f in fragments)
    assert json.loads("".join(f.function.arguments for f in fragments)) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_choice_none_and_parallel_tool_calls(tools_server, client, monkeypatch):  # noqa: F811
    script_engine(monkeypatch, tools_server, [CALL_TEXT, CALL_TEXT.replace("Paris", "Rome")])
    none = client.chat.completions.create(model="tiny", messages=[USER], tools=[WEATHER_TOOL], tool_choice="none")
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason == "stop"
    assert none.choices[0].message.content.count("<tool_call>") == 2  # not parsed: the text as generated
    both = client.chat.completions.create(model="tiny", messages=[USER], tools=[WEATHER_TOOL])
    assert [json.loads(c.function.arguments)["city"] for c in both.choices[0].message.tool_calls] == ["Paris", "Rome"]
    one = client.chat.completions.create(model="tiny", messages=[USER], tools=[WEATHER_TOOL],
                                         parallel_tool_calls=False)
    assert [json.loads(c.function.arguments)["city"] for c in one.choices[0].message.tool_calls] == ["Paris"]


def test_reasoning_include_reasoning_and_enable_thinking(tools_server, client, monkeypatch):  # noqa: F811
    prompts = script_engine(monkeypatch, tools_server, ["<thi", "nk>two plus ", "two</th", "ink>\n\n4"])
    out = client.chat.completions.create(model="tiny", messages=[USER])
    assert out.choices[0].message.reasoning_content == "two plus two" and out.choices[0].message.content == "\n\n4"
    chunks = list(client.chat.completions.create(model="tiny", messages=[USER], stream=True))
    assert "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks) == "two plus two"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "\n\n4"
    hidden = client.chat.completions.create(model="tiny", messages=[USER], extra_body={"include_reasoning": False})
    assert hidden.choices[0].message.reasoning_content is None and hidden.choices[0].message.content == "\n\n4"
    assert not prompts[0]["prompt"].endswith("<think></think>")
    client.chat.completions.create(model="tiny", messages=[USER],
                                   extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert prompts[-1]["prompt"].endswith("assistant:<think></think>")


CITY_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                     "days": {"type": "integer"}}, "required": ["city", "days"]}}}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "strict": True, "parameters": {
    "type": "object", "properties": {"tz": {"type": "string", "enum": ["CET", "UTC"]}}, "required": ["tz"]}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (CITY_TOOL, TIME_TOOL)}


def test_required_tool_call_round_trip_on_a_real_model(client):
    """A random model, constrained: every call parses and validates, at any seed."""
    kw = dict(model="tiny", tools=[CITY_TOOL, TIME_TOOL], temperature=1.0, max_tokens=150)
    for seed in range(3):
        first = client.chat.completions.create(messages=[USER], tool_choice="required", seed=seed, **kw)
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        history = [USER, choice.message.model_dump(exclude_none=True)]
        history += [{"role": "tool", "tool_call_id": c.id, "content": "18 C"} for c in choice.message.tool_calls]
        final = client.chat.completions.create(messages=history, tool_choice="none", seed=seed,
                                               **{**kw, "max_tokens": 6})
        assert final.choices[0].message.content and final.choices[0].finish_reason == "length"
        assert final.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens


def test_named_and_single_forced_calls_stream_like_the_whole_reply(client):
    kw = dict(model="tiny", messages=[USER], tools=[CITY_TOOL, TIME_TOOL], temperature=1.0, max_tokens=150, seed=3)
    for choice in ({"type": "function", "function": {"name": "get_time"}}, "required"):
        whole = client.chat.completions.create(tool_choice=choice, parallel_tool_calls=False, **kw).choices[0]
        (call,) = whole.message.tool_calls
        assert choice == "required" or call.function.name == "get_time"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        chunks = list(client.chat.completions.create(tool_choice=choice, parallel_tool_calls=False, stream=True, **kw))
        head, *fragments = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or []]
        assert head.function.name == call.function.name and head.function.arguments == ""
        assert "".join(f.function.arguments for f in fragments) == call.function.arguments
        assert chunks[-1].choices[0].finish_reason == "tool_calls"


BAD_TOOLS = [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]},
     "tools", "not a valid JSON schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": 5}}}]},
     "tools", "not a valid JSON schema"),
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools", "name"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools", "pattern"),
    ({"tools": [{"type": "function", "function": {"name": "f", "bogus": 1}}]}, "tools", "bogus"),
    ({"tools": [WEATHER_TOOL, WEATHER_TOOL]}, "tools", "duplicate"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True}}]}, "tools", "strict"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"type": "string", "pattern": "(unclosed"}}}}}], "tool_choice": "required"}, "tools", "regex"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"$ref": "#/nope"}}}}}], "tool_choice": "required"}, "tools", "cannot constrain"),
    ({"tools": [WEATHER_TOOL], "tool_choice": "sometimes"}, "tool_choice", "tool_choice"),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "not in tools"),
    ({"tool_choice": "auto"}, "tool_choice", "non-empty tools"),
    ({"tools": [WEATHER_TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", "cannot be combined"),
    ({"messages": [USER, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "get_weather", "arguments": "{not json"}}]}]}, "messages", "not valid JSON"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", "may not set"),
    ({"continue_final_message": True}, "continue_final_message", "add_generation_prompt=false"),
]


@pytest.mark.parametrize("extra, param, words", BAD_TOOLS)
def test_bad_tools_are_400_naming_the_field_and_the_server_keeps_serving(tools_server, extra, param, words):  # noqa: F811
    r = httpx.post(f"{tools_server.url}/v1/chat/completions", json={"messages": [USER], "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and words in r.json()["error"]["message"], r.json()
    ok = httpx.post(f"{tools_server.url}/v1/chat/completions", json={"messages": [USER], "max_tokens": 2})
    assert ok.status_code == 200, ok.text


def test_auto_tool_choice_needs_the_server_flags(live_server):  # noqa: F811
    body = {"messages": [USER], "tools": [WEATHER_TOOL], "max_tokens": 2}
    r = httpx.post(f"{live_server.url}/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    assert "--enable-auto-tool-choice" in r.json()["error"]["message"]
    assert httpx.post(f"{live_server.url}/v1/chat/completions", json={**body, "tool_choice": "none"}).status_code == 200


def test_chat_flags_parse_into_chat_options():
    parser = make_arg_parser(argparse.ArgumentParser())
    args = parser.parse_args(["--enable-auto-tool-choice", "--tool-call-parser", "llama3_json",
                              "--reasoning-parser", "deepseek_r1"])
    assert _chat_options_from_cli(args) == ChatOptions(True, "llama3_json", "deepseek_r1")
    with pytest.raises(ValueError, match="needs tool_call_parser"):
        _chat_options_from_cli(parser.parse_args(["--enable-auto-tool-choice"]))
    with pytest.raises(SystemExit):
        parser.parse_args(["--tool-call-parser", "nope"])

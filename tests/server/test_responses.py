"""OpenAI's Responses API (``/v1/responses``) with the real ``openai`` client.

One server: a tiny random Llama behind a Hermes-style template, with the hermes tool-call parser
and the qwen3 reasoning parser. Where a test is about the model's text (greedy equality, limits,
structured output) the real model runs; where it is about parsing a known output (tool calls,
reasoning, the prompt a follow-up renders) the engine's text is scripted (``script_engine``).
"""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
import torch
from chat_server import TOOL_TEMPLATE, WEATHER_TOOL, script_engine, tools_server  # noqa: F401 - fixture
from live_server import server_model_dir  # noqa: F401 - fixture

from pagedllm.entrypoints.openai.api_server import make_arg_parser
from pagedllm.entrypoints.openai.responses import ResponseStore, StoredResponse
from pagedllm.entrypoints.openai.responses_protocol import ResponseObject

FUNCTION_TOOL = {"type": "function", **WEATHER_TOOL["function"]}  # Responses' flat tool shape
# a random model fills a free string up to the token limit: an enum keeps a forced call short
CITY_SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}
CITY_TOOL = {"type": "function", "name": "get_weather", "parameters": CITY_SCHEMA}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TEXT_EVENTS = ["response.output_item.added", "response.content_part.added", "response.output_text.delta",
               "response.output_text.done", "response.content_part.done", "response.output_item.done"]


@pytest.fixture(scope="module")
def client(tools_server):  # noqa: F811
    with openai.OpenAI(base_url=f"{tools_server.url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def collapsed(types: list[str]) -> list[str]:
    """Event types with runs of one type (the deltas) shown once."""
    return [t for i, t in enumerate(types) if i == 0 or t != types[i - 1]]


# ---------------------------------------------------------------------- the model's text
def test_text_equals_chat_completions_and_transformers(client, server_model_dir):  # noqa: F811
    import transformers as tf
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=10)
    resp = client.responses.create(model="tiny", instructions="be brief", input="hello world", temperature=0,
                                   max_output_tokens=10)
    assert resp.id.startswith("resp_") and resp.object == "response" and resp.model == "tiny"
    assert resp.output_text == chat.choices[0].message.content
    assert [item.type for item in resp.output] == ["message"] and resp.output[0].content[0].type == "output_text"
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.usage.output_tokens == chat.usage.completion_tokens
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    assert resp.instructions == "be brief" and resp.max_output_tokens == 10 and resp.temperature == 0
    # the oracle: transformers' greedy continuation of the same rendered prompt
    tokenizer = tf.AutoTokenizer.from_pretrained(server_model_dir)
    prompt = tokenizer.apply_chat_template(messages, chat_template=TOOL_TEMPLATE, add_generation_prompt=True,
                                           tokenize=False)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    model = tf.AutoModelForCausalLM.from_pretrained(server_model_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert resp.output_text == tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)


def test_streamed_events_build_the_same_reply(client):
    kw = dict(model="tiny", input=[{"role": "user", "content": [{"type": "input_text", "text": "a block"}]}],
              temperature=0, max_output_tokens=12, metadata={"run": "7"})
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    types = [e.type for e in events]
    # a random model rarely stops by itself: the reply ends at max_output_tokens, as the whole one did
    assert collapsed(types) == ["response.created", "response.in_progress", *TEXT_EVENTS, f"response.{whole.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == whole.output_text
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == whole.output_text and done.item_id == events[2].item.id
    final = events[-1].response
    assert final.status == whole.status and final.output_text == whole.output_text
    assert final.metadata == {"run": "7"} and final.usage.output_tokens == whole.usage.output_tokens
    assert client.responses.retrieve(final.id).output_text == whole.output_text  # a streamed reply is stored too


def test_max_output_tokens_makes_it_incomplete(client):
    resp = client.responses.create(model="tiny", input="hello world", temperature=0, max_output_tokens=3)
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage.output_tokens == 3 and resp.output[0].status == "incomplete"
    events = list(client.responses.create(model="tiny", input="hello world", temperature=0, max_output_tokens=3,
                                          stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.status == "incomplete"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == resp.output_text


def test_text_format_json_schema(client):
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
              "additionalProperties": False}
    resp = client.responses.create(model="tiny", input="where?", temperature=1.0, max_output_tokens=40,
                                   text={"format": {"type": "json_schema", "name": "place", "schema": schema}})
    assert resp.status == "completed"
    jsonschema.validate(json.loads(resp.output_text), schema)
    assert resp.text.format.type == "json_schema"


def test_parse_with_a_pydantic_model(client):
    from typing import Literal

    from pydantic import BaseModel

    class Place(BaseModel):
        city: Literal["Paris", "Oslo"]

    resp = client.responses.parse(model="tiny", input="where?", temperature=1.0, max_output_tokens=40,
                                  text_format=Place)
    assert isinstance(resp.output_parsed, Place)


def test_client_disconnect_aborts_the_stream(tools_server, client):  # noqa: F811
    with client.responses.create(model="tiny", input="hello", temperature=1.0, max_output_tokens=100,
                                 stream=True) as stream:
        for event in stream:
            if event.type == "response.output_text.delta":
                break
    stats = tools_server.wait_idle()
    assert stats.num_used_blocks == 0 and tools_server.engine.num_in_flight == 0


# ---------------------------------------------------------------------- conversation state
def test_previous_response_id_continues_the_conversation(tools_server, client, monkeypatch):  # noqa: F811
    prompts = script_engine(monkeypatch, tools_server, ["Hello ", "there."])
    first = client.responses.create(model="tiny", instructions="be kind", input="hi")
    assert first.output_text == "Hello there."
    assert prompts[-1]["prompt"] == "<s>system: be kind\n<s>user: hi\nassistant:"
    second = client.responses.create(model="tiny", previous_response_id=first.id, input="and you?")
    # the first turn, then the new input; instructions are not carried over (OpenAI's rule)
    assert prompts[-1]["prompt"] == "<s>user: hi\n<s>assistant: Hello there.\n<s>user: and you?\nassistant:"
    assert second.previous_response_id == first.id
    third = client.responses.create(model="tiny", previous_response_id=second.id, input="bye")
    assert third.status == "completed"
    assert prompts[-1]["prompt"].startswith("<s>user: hi\n<s>assistant: Hello there.\n<s>user: and you?\n"
                                            "<s>assistant: Hello there.\n<s>user: bye")
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == "Hello there." and got.status == "completed"


def test_store_false_retrieve_delete_and_cancel(tools_server, client, monkeypatch):  # noqa: F811
    script_engine(monkeypatch, tools_server, ["ok"])
    unstored = client.responses.create(model="tiny", input="hi", store=False)
    assert unstored.output_text == "ok"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model="tiny", input="again", previous_response_id=unstored.id)
    assert err.value.body["param"] == "previous_response_id"
    stored = client.responses.create(model="tiny", input="hi")
    with pytest.raises(openai.BadRequestError, match="only background responses"):
        client.responses.cancel(stored.id)
    with pytest.raises(openai.BadRequestError) as err:  # resuming a stream needs background mode
        client.responses.retrieve(stored.id, stream=True)
    assert err.value.body["param"] == "stream"
    deleted = httpx.delete(f"{tools_server.url}/v1/responses/{stored.id}")
    assert deleted.json() == {"id": stored.id, "object": "response.deleted", "deleted": True}
    for call in (lambda: client.responses.retrieve(stored.id), lambda: client.responses.cancel(stored.id),
                 lambda: client.responses.delete(stored.id)):
        with pytest.raises(openai.NotFoundError):
            call()


def test_input_items_are_listed_as_openai_pages(tools_server, client, monkeypatch):  # noqa: F811
    script_engine(monkeypatch, tools_server, ["ok"])
    given = [{"role": "developer", "content": "be kind"},
             {"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]
    resp = client.responses.create(model="tiny", input=given)
    newest_first = client.responses.input_items.list(resp.id)
    assert [(i.type, i.role, i.content[0].text) for i in newest_first.data] == [
        ("message", "user", "hi"), ("message", "developer", "be kind")]
    assert all(i.id.startswith("msg_") and i.status == "completed" for i in newest_first.data)
    paged = list(client.responses.input_items.list(resp.id, order="asc", limit=1))  # the client follows `after`
    assert [i.id for i in paged] == [i.id for i in reversed(newest_first.data)]
    one = client.responses.create(model="tiny", input="plain")
    (item,) = client.responses.input_items.list(one.id).data
    assert item.role == "user" and item.content[0].type == "input_text" and item.content[0].text == "plain"
    for query, param in (({"limit": 0}, "limit"), ({"order": "up"}, "order"), ({"after": "x"}, "after"),
                         ({"include": ["x"]}, "include")):
        r = httpx.get(f"{tools_server.url}/v1/responses/{resp.id}/input_items", params=query)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_store_is_a_bounded_lru():
    store = ResponseStore(2)
    entry = {k: StoredResponse(ResponseObject(id=k, status="completed", model="m"), []) for k in "abc"}
    store.put("a", entry["a"])
    store.put("b", entry["b"])
    assert store.get("a") is entry["a"]  # a is now the most recently used
    store.put("c", entry["c"])
    assert store.get("b") is None and store.get("a") is entry["a"] and len(store) == 2
    with pytest.raises(ValueError, match="responses_store_size"):
        ResponseStore(0)
    import argparse
    args = make_arg_parser(argparse.ArgumentParser()).parse_args(["--model", "x", "--responses-store-size", "7"])
    assert args.responses_store_size == 7


# ---------------------------------------------------------------------- tools and reasoning
def test_function_call_round_trip(tools_server, client, monkeypatch):  # noqa: F811
    prompts = script_engine(monkeypatch, tools_server, ["<think>need the weather</think>", CALL_TEXT])
    resp = client.responses.create(model="tiny", input="weather in Paris?", tools=[FUNCTION_TOOL])
    assert [item.type for item in resp.output] == ["reasoning", "function_call"]
    reasoning, call = resp.output
    assert reasoning.content[0].text == "need the weather" and resp.usage.output_tokens_details.reasoning_tokens > 0
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id.startswith("call_") and call.id.startswith("fc_") and resp.output_text == ""
    assert '<s>system: You may call: get_weather{"type": "object"' in prompts[-1]["prompt"]

    prompts = script_engine(monkeypatch, tools_server, ["It is 18 C."])
    follow = [{"role": "user", "content": "weather in Paris?"}, *resp.output,  # the reply's items, as clients send them
              {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}]
    final = client.responses.create(model="tiny", input=follow, tools=[FUNCTION_TOOL])
    assert final.output_text == "It is 18 C." and [item.type for item in final.output] == ["message"]
    rendered = prompts[-1]["prompt"]
    assert '<s>assistant: <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in rendered
    assert f"<s>tool: <tool_response>{call.call_id} 18 C</tool_response>" in rendered
    # the same turn through previous_response_id: only the call's output is sent
    chained = client.responses.create(model="tiny", previous_response_id=resp.id, tools=[FUNCTION_TOOL], input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}])
    assert chained.output_text == "It is 18 C." and prompts[-1]["prompt"] == rendered


def test_streamed_function_call_and_reasoning_events(tools_server, client, monkeypatch):  # noqa: F811
    text = "<think>hm</think>Checking. " + CALL_TEXT
    cuts = [0, 4, 12, 20, 30, 45, 60, len(text) - 3, len(text)]
    script_engine(monkeypatch, tools_server, [text[a:b] for a, b in zip(cuts, cuts[1:])])
    # the client's stream helper, which checks that every event fits the snapshot it builds
    with client.responses.stream(model="tiny", input="weather?", tools=[FUNCTION_TOOL]) as stream:
        events = list(stream)
        snapshot = stream.get_final_response()
    assert collapsed([e.type for e in events]) == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        *TEXT_EVENTS,
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert [e.output_index for e in events if e.type == "response.output_item.added"] == [0, 1, 2]
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(args) == {"city": "Paris"}
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call"]
    assert final.output_text == "Checking. " and final.output[2].arguments == args
    assert snapshot.output_text == "Checking. " and snapshot.output[2].arguments == args


def test_tool_choice_none_and_a_named_function(tools_server, client, monkeypatch):  # noqa: F811
    script_engine(monkeypatch, tools_server, [CALL_TEXT])
    plain = client.responses.create(model="tiny", input="hi", tools=[FUNCTION_TOOL], tool_choice="none")
    assert [item.type for item in plain.output] == ["message"] and "<tool_call>" in plain.output_text
    monkeypatch.undo()  # a named function constrains the real model's output to the call
    named = client.responses.create(model="tiny", input="hi", tools=[CITY_TOOL], temperature=1.0,
                                    max_output_tokens=60, tool_choice={"type": "function", "name": "get_weather"})
    (call,) = [item for item in named.output if item.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), CITY_SCHEMA)
    assert named.status == "completed" and named.tool_choice.name == "get_weather"


def test_an_engine_error_mid_stream_is_an_error_event(tools_server, client, monkeypatch):  # noqa: F811
    from pagedllm.engine.async_engine import RequestStream
    from pagedllm.outputs import CompletionOutput, RequestOutput

    async def failing(requests, params, arrival_time=None, queue=None, **options):
        (request_id, _), = requests
        stream = RequestStream(request_id, queue)
        stream.put(RequestOutput(request_id, None, [1, 2], [CompletionOutput(0, "Hel", [5], None, None, None)], False))
        queue.put_nowait(RuntimeError("the engine broke"))
        return [stream]
    monkeypatch.setattr(tools_server.engine, "add_requests", failing)
    events = list(client.responses.create(model="tiny", input="hi", stream=True))
    assert [e.type for e in events[-3:]] == ["response.output_text.delta", "error", "response.failed"]
    assert events[-2].message == "the engine broke" and events[-1].response.error.message == "the engine broke"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    with pytest.raises(openai.NotFoundError):  # a failed response is not kept
        client.responses.retrieve(events[-1].response.id)


# ---------------------------------------------------------------------- refusals
@pytest.mark.parametrize("fields, param", [
    ({"background": True}, "background"),
    ({"truncation": "auto"}, "truncation"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"reasoning": {"effort": "low"}}, "reasoning"),
    ({"max_tool_calls": 2}, "max_tool_calls"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"text": {"verbosity": "low"}}, "text"),
    ({"stream_options": {"include_obfuscation": False}}, "stream_options"),
    ({"service_tier": "flex"}, "service_tier"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tools": [{**FUNCTION_TOOL, "strict": True}]}, "tools"),
    ({"temperature": -1.0}, "temperature"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"model": "other"}, "model"),
])
def test_bad_fields_are_400_naming_them(tools_server, fields, param):  # noqa: F811
    body = {"model": "tiny", "input": "hi", **fields}
    r = httpx.post(f"{tools_server.url}/v1/responses", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_errors_use_the_responses_names(tools_server):  # noqa: F811
    r = httpx.post(f"{tools_server.url}/v1/responses", json={"model": "tiny", "input": [], "max_output_tokens": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    assert r.json()["error"]["message"].startswith("input must not be empty")
    r = httpx.post(f"{tools_server.url}/v1/responses", json={"model": "tiny", "input": "hi", "max_output_tokens": 0})
    assert r.json()["error"]["message"].startswith("max_output_tokens=0")

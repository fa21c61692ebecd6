"""Structured outputs and the vLLM sampling fields over HTTP, with the real ``openai`` client."""
from __future__ import annotations

import json
import re
import shutil

import httpx
import jsonschema
import openai
import pytest
from live_server import live_server, server_model_dir, start_server  # noqa: F401 - fixtures

SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                           "code": {"type": "string", "pattern": "^[A-Z]{2}$"}},
          "required": ["city", "code"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "where to?"}]


@pytest.fixture(scope="module")
def client(live_server):  # noqa: F811
    with openai.OpenAI(base_url=f"{live_server.url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def json_schema_format(strict: bool = True) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA, "strict": strict}}


def test_chat_response_format_json_schema(client):
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=1.0, max_tokens=60, n=3,
                                         seed=1, response_format=json_schema_format())
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_streamed_deltas_concatenate_to_a_valid_document(client):
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=1.0, max_tokens=60,
                                            seed=2, stream=True, response_format=json_schema_format(False))
    chunks = [c for c in stream if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert len([c for c in chunks if c.choices[0].delta.content]) > 1  # really streamed in pieces
    jsonschema.validate(json.loads(text), SCHEMA)
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("extra, check", [
    ({"guided_regex": "[a-c]{3}-[0-9]{2}"}, lambda t: re.fullmatch("[a-c]{3}-[0-9]{2}", t)),
    ({"guided_choice": ["red", "green"]}, lambda t: t in ("red", "green")),
    # a schema whose grammar has no whitespace slots (a random model would fill them up to max_tokens)
    ({"guided_json": {"enum": ["Paris", "Oslo"]}}, lambda t: json.loads(t) in ("Paris", "Oslo")),
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
     lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ({"guided_grammar": 'root ::= "<" [0-9] [0-9] ">"'}, lambda t: re.fullmatch("<[0-9]{2}>", t)),
    ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down")),
    ({"response_format": {"type": "json_object"}, "logit_bias": {}}, lambda t: t.startswith("{")),
])
def test_completion_constraint_fields(client, extra, check):
    out = client.completions.create(model="tiny", prompt="hello world", temperature=1.0, max_tokens=60, n=2,
                                    seed=3, extra_body=extra)
    for choice in out.choices:
        assert check(choice.text), choice.text


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "strin"}}}}, "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object", "schema": {"type": "object"}}},
     "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "text", "json_schema": {"schema": {}}}}, "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object"}, "strict_mode": True}}}, "response_format"),
    ("/v1/completions", {"guided_json": {"type": "object", "properties": 5}}, "guided_json"),
    ("/v1/completions", {"guided_regex": "[a-"}, "guided_regex"),
    ("/v1/chat/completions", {"guided_choice": []}, "guided_choice"),
    ("/v1/completions", {"guided_grammar": "root ::= "}, "guided_grammar"),
    ("/v1/completions", {"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ("/v1/chat/completions", {"guided_regex": "a", "response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/completions", {"structured_outputs": {"regex": "a", "json": {}}}, "structured_outputs"),
    ("/v1/completions", {"structured_outputs": {"regexp": "a"}}, "structured_outputs"),
    ("/v1/completions", {"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend"),
    ("/v1/completions", {"guided_whitespace_pattern": " ", "guided_json": {}}, "guided_whitespace_pattern"),
    ("/v1/completions", {"guided_regex": "a", "min_tokens": 2}, "min_tokens"),
    ("/v1/completions", {"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("/v1/completions", {"bad_words": [""]}, "bad_words"),
    ("/v1/completions", {"logprobs": -2}, "logprobs"),
    ("/v1/completions", {"logprobs": -1}, "logprobs"),  # the whole vocabulary is over max_logprobs=20
    ("/generate", {"structured_outputs": {"choice": []}}, None),
    # over max_structured_output_bytes (64 KiB by default): refused before any compile
    ("/v1/completions", {"structured_outputs": {"choice": ["x" * 1000] * 70}}, "structured_outputs"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": {
        "type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(4000)}}}}},
     "response_format"),
])
def test_bad_constraints_are_400_and_the_server_keeps_serving(live_server, path, body, param):  # noqa: F811
    base = {"messages": MESSAGES} if "chat" in path else {"prompt": "hello"}
    r = httpx.post(f"{live_server.url}{path}", json={**base, "max_tokens": 5, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"], err
    ok = httpx.post(f"{live_server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2,
                                                                "guided_choice": ["ok"]})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "ok"
    assert live_server.wait_idle().num_used_blocks == 0


BIG_SCHEMA = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(40000)}}  # ~1 MB


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"structured_outputs": {"json": BIG_SCHEMA}}),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "big", "schema": BIG_SCHEMA}}}),
    ("/generate", {"structured_outputs": {"json": BIG_SCHEMA}}),
    ("/v1/completions", {"guided_regex": "a" * 70000}),
])
def test_a_spec_over_the_limit_is_refused_before_it_is_parsed(live_server, monkeypatch, path, body):  # noqa: F811
    """The size limit used to be checked after the constructor parsed the spec on the event loop:
    a 3 MB schema (a body under the 4 MiB limit) held every client 4.6 s before its 400."""
    import pagedllm.contracts.grammar as grammar
    parsed = []
    monkeypatch.setattr(grammar, "check_grammar", lambda params: parsed.append(params.kind))
    base = {"messages": MESSAGES} if "chat" in path else {"prompt": "hello"}
    r = httpx.post(f"{live_server.url}{path}", json={**base, "max_tokens": 5, **body}, timeout=60)
    assert r.status_code == 400 and "max_structured_output_bytes=65536" in r.json()["error"]["message"], r.text
    assert parsed == []


def test_truncate_prompt_tokens_and_top_k_zero(client):
    full = client.completions.create(model="tiny", prompt="the quick brown fox jumps over the lazy dog",
                                     max_tokens=2, temperature=0)
    cut = client.completions.create(model="tiny", prompt="the quick brown fox jumps over the lazy dog",
                                    max_tokens=2, temperature=0, extra_body={"truncate_prompt_tokens": 3, "top_k": 0})
    assert full.usage.prompt_tokens > 3 and cut.usage.prompt_tokens == 3
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2,
                                          extra_body={"truncate_prompt_tokens": 4})
    assert chat.usage.prompt_tokens == 4


def test_generation_config_defaults_apply_unless_vllm(server_model_dir, tmp_path):  # noqa: F811
    """The model's generation_config.json max_new_tokens caps requests (vLLM's rule); 'vllm' ignores it."""
    model = shutil.copytree(server_model_dir, tmp_path / "model")
    (model / "generation_config.json").write_text('{"max_new_tokens": 3, "temperature": 0.0}')
    for source, expected in (("auto", 3), ("vllm", 8)):
        srv = start_server(str(model), generation_config=source)
        try:
            body = {"prompt": "hello", "max_tokens": 8, "ignore_eos": True, "n": 2, "seed": 4}
            out = httpx.post(f"{srv.url}/v1/completions", json=body).json()
            assert out["usage"]["completion_tokens"] == 2 * expected
            texts = [c["text"] for c in out["choices"]]
            # temperature 0 from the file: both samples are the greedy one; at pagedllm's 1.0 they differ
            assert (texts[0] == texts[1]) == (source == "auto"), texts
        finally:
            srv.stop()

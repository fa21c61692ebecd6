"""The vLLM tool-call and reasoning parsers beyond hermes / llama3_json / think tags, on each format's
documented output (model cards, vLLM's parser docs), whole and streamed at every split."""
from __future__ import annotations

import argparse
import json
import re

import openai
import pytest
from chat_server import TOOL_TEMPLATE, WEATHER_TOOL, script_engine
from hypothesis import given, settings
from hypothesis import strategies as st
from live_server import server_model_dir, start_server  # noqa: F401 - fixture
from test_chat_parsers import stream, whole

from pagedllm.entrypoints.openai.chat_features import ChatOptions, ChoiceParser, keeps_special_tokens
from pagedllm.entrypoints.openai.protocol import ChatTool
from pagedllm.entrypoints.openai.reasoning_parsers import REASONING_PARSERS, get_reasoning_parser
from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS, ParsedCall, get_tool_parser, tool_schemas


def tool(name: str, **properties) -> ChatTool:
    return ChatTool.model_validate({"type": "function", "function": {
        "name": name, "parameters": {"type": "object", "properties": properties}}})


TOOLS = [tool("get_current_weather", location={"type": "string"}, format={"type": "string", "enum": ["c", "f"]}),
         tool("get_weather", city={"type": "string"}, metric={"type": "string"}),
         tool("get_time", tz={"type": "string"}),
         tool("search", query={"type": "string"}, days={"type": "integer"}, detailed={"type": "boolean"},
              threshold={"type": "number"}, filters={"type": "object"}, tags={"type": "array"},
              note={"anyOf": [{"type": "string"}, {"type": "null"}]})]
SCHEMAS = tool_schemas(TOOLS)
PARIS = ParsedCall("get_current_weather", '{"location": "Paris, France", "format": "celsius"}')
CET = ParsedCall("get_time", '{"tz": "CET"}')

VLLM_TOOL_PARSERS = {"mistral", "pythonic", "qwen3_coder", "openai", "granite", "deepseek_v3", "deepseek_v31",
                     "internlm", "jamba"}
VLLM_REASONING_PARSERS = {"mistral", "granite", "openai_gptoss", "gpt_oss", "deepseek_v3"}


def parse(name: str, text: str) -> tuple[str, tuple[ParsedCall, ...]]:
    got = get_tool_parser(name, tools=SCHEMAS).parse(text, final=True)
    return got.content, tuple(ParsedCall(c.name, c.arguments) for c in got.calls)  # ids checked apart


def test_every_vllm_name_is_registered_and_offered_by_the_cli():
    from pagedllm.entrypoints.openai.api_server import make_arg_parser
    assert VLLM_TOOL_PARSERS <= set(TOOL_PARSERS) and VLLM_REASONING_PARSERS <= set(REASONING_PARSERS)
    actions = {a.dest: a for a in make_arg_parser(argparse.ArgumentParser())._actions}
    assert VLLM_TOOL_PARSERS <= set(actions["tool_call_parser"].choices)
    assert VLLM_REASONING_PARSERS <= set(actions["reasoning_parser"].choices)


# ---------------------------------------------------------------- tool formats, whole outputs
MISTRAL_V3 = ('[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, France", '
              '"format": "celsius"}}, {"name": "get_time", "arguments": {"tz": "CET"}}]')
MISTRAL_V11 = ('[TOOL_CALLS]get_current_weather[ARGS]{"location": "Paris, France", "format": "celsius"}'
               '[TOOL_CALLS]get_time[ARGS]{"tz": "CET"}')
PYTHONIC = "[get_weather(city='San Francisco', metric='celsius'), get_weather(city='Seattle', metric='celsius')]"
QWEN3_CODER = ("I'll search.\n<tool_call>\n<function=search>\n<parameter=query>\nweather\nin Paris\n</parameter>\n"
               "<parameter=days>\n3\n</parameter>\n<parameter=detailed>\nTrue\n</parameter>\n"
               "<parameter=threshold>\n0.5\n</parameter>\n<parameter=filters>\n{\"unit\": \"C\"}\n</parameter>\n"
               "<parameter=tags>\n['a', 'b']\n</parameter>\n<parameter=note>\nnull\n</parameter>\n"
               "<parameter=extra>\n42\n</parameter>\n</function>\n</tool_call>")
SEARCH_ARGS = {"query": "weather\nin Paris", "days": 3, "detailed": True, "threshold": 0.5, "filters": {"unit": "C"},
               "tags": ["a", "b"], "note": None, "extra": "42"}
HARMONY_CALL = ("<|channel|>analysis<|message|>Need the weather, use get_current_weather.<|end|><|start|>assistant"
                "<|channel|>commentary to=functions.get_current_weather <|constrain|>json<|message|>"
                '{"location": "Paris, France", "format": "celsius"}<|call|>')
HARMONY_ANSWER = ("<|channel|>analysis<|message|>User asks 2+2. Simple.<|end|><|start|>assistant<|channel|>final"
                  "<|message|>2 + 2 = 4.")
DS_BEGIN, DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
DEEPSEEK_V3 = (f"Let me check.{DS_BEGIN}{DS_CALL}function{DS_SEP}get_current_weather\n```json\n"
               f'{{"location": "Paris, France", "format": "celsius"}}\n```{DS_CALL_END}\n'
               f'{DS_CALL}function{DS_SEP}get_time\n```json\n{{"tz": "CET"}}\n```{DS_CALL_END}{DS_END}')
DEEPSEEK_V31 = (f'{DS_BEGIN}{DS_CALL}get_current_weather{DS_SEP}{{"location": "Paris, France", "format": "celsius"}}'
                f'{DS_CALL_END}{DS_CALL}get_time{DS_SEP}{{"tz": "CET"}}{DS_CALL_END}{DS_END}')
INTERNLM = ('I will check.<|action_start|><|plugin|>\n{"name": "get_current_weather", "parameters": '
            '{"location": "Paris, France", "format": "celsius"}}<|action_end|>')
JAMBA = ('<tool_calls>[{"name": "get_current_weather", "arguments": {"location": "Paris, France", '
         '"format": "celsius"}}, {"name": "get_time", "arguments": {"tz": "CET"}}]</tool_calls>')
GRANITE = ('<|tool_call|>[{"arguments": {"location": "Paris, France", "format": "celsius"}, '
           '"name": "get_current_weather"}]')


@pytest.mark.parametrize("name, text, content, calls", [
    ("mistral", MISTRAL_V3, "", (PARIS, CET)),
    ("mistral", MISTRAL_V11, "", (PARIS, CET)),
    ("mistral", 'Checking.[TOOL_CALLS]get_time{"tz": "CET"}', "Checking.", (CET,)),  # [ARGS] dropped by decoding
    ("mistral", "The weather is sunny.", "The weather is sunny.", ()),
    ("pythonic", PYTHONIC, "", (ParsedCall("get_weather", '{"city": "San Francisco", "metric": "celsius"}'),
                                ParsedCall("get_weather", '{"city": "Seattle", "metric": "celsius"}'))),
    ("pythonic", "[get_time(tz='CET')]\nDone.", "\nDone.", (CET,)),
    ("pythonic", "[1, 2, 3] are the numbers.", "[1, 2, 3] are the numbers.", ()),
    ("qwen3_coder", QWEN3_CODER, "I'll search.\n", (ParsedCall("search", json.dumps(SEARCH_ARGS)),)),
    ("qwen3_coder", "<tool_call>\n<function=get_time>\n<parameter=tz>\nCET\n</parameter>\n</function>", "", (CET,)),
    ("openai", HARMONY_CALL, "<|channel|>analysis<|message|>Need the weather, use get_current_weather.<|end|>",
     (PARIS,)),  # alone, the tool parser keeps the analysis message as written (the reasoning parser takes it)
    ("openai", "<|channel|>final<|message|>It is sunny.<|return|>", "It is sunny.", ()),
    ("granite", GRANITE, "", (PARIS,)),
    ("granite", '<tool_call>[{"name": "get_time", "arguments": {"tz": "CET"}}]', "", (CET,)),
    ("granite", "It is sunny.", "It is sunny.", ()),
    ("deepseek_v3", DEEPSEEK_V3, "Let me check.", (PARIS, CET)),
    ("deepseek_v31", DEEPSEEK_V31, "", (PARIS, CET)),
    ("deepseek_v3", DEEPSEEK_V31, "", (PARIS, CET)),  # one parser reads both
    ("internlm", INTERNLM, "I will check.", (PARIS,)),
    ("jamba", JAMBA, "", (PARIS, CET)),
    ("jamba", "It is sunny.", "It is sunny.", ()),
])
def test_documented_outputs_parse(name, text, content, calls):
    assert parse(name, text) == (content, calls)


# malformed output: vLLM returns it as content (never a crash, never half a call)
MALFORMED = [
    ("mistral", '[TOOL_CALLS] [{"name": "get_time", "arguments": {"tz": '),  # cut off by max_tokens
    ("mistral", "[TOOL_CALLS]get_time[ARGS]{not json}"),
    ("mistral", "[TOOL_CALLS]delete_files[ARGS]{}"),  # a tool the request does not offer
    ("pythonic", "[get_time(tz='CET'"),
    ("pythonic", "[get_time(tz=__import__('os').getcwd())]"),  # not a literal: never evaluated
    ("pythonic", "[delete_files()]"),
    ("pythonic", "[get_time('CET')]"),  # positional arguments have no names
    ("qwen3_coder", "<tool_call>\n<function=get_time>\n<parameter=tz>\nCET"),
    ("qwen3_coder", "<tool_call>\n<function=delete_files>\n</function>\n</tool_call>"),
    ("openai", "<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{\"tz\": "),
    ("openai", "<|channel|>commentary to=functions.delete_files <|constrain|>json<|message|>{}"),
    ("granite", '<|tool_call|>[{"name": "get_time", "arguments": {"tz"'),
    ("granite", '<|tool_call|>[{"name": "delete_files", "arguments": {}}]'),
    ("deepseek_v3", f"{DS_BEGIN}{DS_CALL}function{DS_SEP}get_time\n```json\n{{\"tz\""),
    ("deepseek_v3", f"{DS_BEGIN}{DS_CALL}delete_files{DS_SEP}{{}}{DS_CALL_END}{DS_END}"),
    ("internlm", '<|action_start|><|plugin|>\n{"name": "get_time", "parameters": {'),
    ("internlm", '<|action_start|><|plugin|>\n{"name": "delete_files", "parameters": {}}<|action_end|>'),
    ("jamba", '<tool_calls>[{"name": "get_time", "arguments": {"tz": "CET"}'),
    ("jamba", '<tool_calls>[{"name": "delete_files", "arguments": {}}]</tool_calls>'),
]


@pytest.mark.parametrize("name, text", MALFORMED)
def test_malformed_or_unknown_calls_stay_content(name, text):
    assert parse(name, text) == (text, ())


def test_qwen3_coder_converts_by_schema_type_and_leaves_untyped_parameters_strings():
    from pagedllm.entrypoints.openai.tool_parsers.qwen3_coder import convert_parameter
    assert convert_parameter("7", {"type": "integer"}) == 7 and convert_parameter("x7", {"type": "integer"}) == "x7"
    assert convert_parameter("2.0", {"type": "number"}) == 2 and convert_parameter("nan", {"type": "number"}) == "nan"
    assert convert_parameter("false", {"type": "boolean"}) is False
    assert convert_parameter("null", {"type": "string"}) == "null"  # a string may be the word null
    assert convert_parameter("null", {"type": ["string", "null"]}) is None
    assert convert_parameter("{1, 2}", {"type": "array"}) == "{1, 2}"  # a set is no JSON value
    assert convert_parameter("[1, 2]", None) == "[1, 2]"  # a parameter the schema does not name


def test_mistral_ids_are_nine_alphanumerics_or_the_models_own():
    options = ChatOptions(enable_auto_tool_choice=True, tool_call_parser="mistral")
    msg = ChoiceParser.for_request(options, "auto", True, True, TOOLS).message(MISTRAL_V11)
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_current_weather", "get_time"]
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", c["id"]) for c in msg["tool_calls"])
    text = '[TOOL_CALLS]get_time[CALL_ID]a1B2c3D4e[ARGS]{"tz": "CET"}'
    (call,) = ChoiceParser.for_request(options, "auto", True, True, TOOLS).message(text)["tool_calls"]
    assert call["id"] == "a1B2c3D4e" and call["function"] == {"name": "get_time", "arguments": CET.arguments}


# ---------------------------------------------------------------- reasoning formats
@pytest.mark.parametrize("name, kwargs, text, reasoning, content", [
    ("mistral", None, "[THINK]The user wants 2+2.[/THINK]It is 4.", "The user wants 2+2.", "It is 4."),
    ("mistral", None, "It is 4.", "", "It is 4."),
    ("mistral", None, "[THINK]still thinking", "still thinking", ""),
    ("mistral", None, "It is[/THINK] 4.", "", "It is 4."),  # a stray end tag is dropped, as in vLLM
    ("granite", None, "Here is my thought process:\n2+2 is basic.\nHere is my response:\nIt is 4.",
     "\n2+2 is basic.\n", "\nIt is 4."),
    ("granite", None, "Here's my thought process: a Here's my response: b", " a ", " b"),
    ("granite", None, "It is 4.", "", "It is 4."),
    ("gpt_oss", None, HARMONY_ANSWER, "User asks 2+2. Simple.", "2 + 2 = 4."),
    ("openai_gptoss", None, HARMONY_CALL, "Need the weather, use get_current_weather.",
     HARMONY_CALL[HARMONY_CALL.index("<|start|>"):]),  # the call, as written, for the tool parser
    ("deepseek_v3", None, "no thinking</think> here", "", "no thinking</think> here"),
    ("deepseek_v3", {"thinking": True}, "2+2 is basic.</think>It is 4.", "2+2 is basic.", "It is 4."),
    ("deepseek_v3", {"enable_thinking": True}, "<think>a</think>b", "a", "b"),
])
def test_reasoning_formats_split(name, kwargs, text, reasoning, content):
    assert get_reasoning_parser(name, chat_template_kwargs=kwargs).split(text, final=True) == (reasoning, content)


def test_gpt_oss_reasoning_then_openai_tool_parser_make_the_whole_harmony_reply():
    options = ChatOptions(enable_auto_tool_choice=True, tool_call_parser="openai", reasoning_parser="openai_gptoss")
    msg = ChoiceParser.for_request(options, "auto", True, True, TOOLS).message(
        "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary<|message|>"
        "Checking now.<|end|>" + HARMONY_CALL[HARMONY_CALL.index("<|start|>"):])
    assert msg["reasoning_content"] == "Need weather." and msg["content"] == "Checking now."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == \
        [("get_current_weather", {"location": "Paris, France", "format": "celsius"})]


def test_the_openai_tool_parser_implies_harmony_reasoning_as_in_vllm():
    options = ChatOptions(enable_auto_tool_choice=True, tool_call_parser="openai")
    assert options.reasoning_parser == "openai_gptoss"
    msg = ChoiceParser.for_request(options, "auto", True, True, TOOLS).message(HARMONY_CALL)
    assert msg["reasoning_content"] == "Need the weather, use get_current_weather." and msg["content"] is None
    assert ChatOptions(tool_call_parser="openai", reasoning_parser="deepseek_r1").reasoning_parser == "deepseek_r1"
    assert ChatOptions(tool_call_parser="mistral").reasoning_parser is None


def test_special_token_formats_keep_special_tokens_while_tools_are_on():
    def keeps(tool_choice, tools=None, reasoning=None):
        return keeps_special_tokens(ChatOptions(enable_auto_tool_choice=tools is not None, tool_call_parser=tools,
                                                reasoning_parser=reasoning), tool_choice)
    assert keeps("auto", "mistral") and keeps("auto", "openai") and keeps("auto", "hermes")
    assert not keeps("none", "mistral") and not keeps("auto", "deepseek_v3") and not keeps("auto", "pythonic")
    assert keeps("none", reasoning="gpt_oss") and keeps("none", reasoning="mistral")
    assert not keeps("none", reasoning="granite") and not keeps("required", "mistral", "mistral")


# ---------------------------------------------------------------- streaming == whole
STREAMED = [
    (None, "mistral", "Let me check. " + MISTRAL_V11, None),
    (None, "mistral", MISTRAL_V3 + " done", None),
    (None, "mistral", "[TOOL_CALLS]get_time[CALL_ID]a1B2c3D4e[ARGS]{\"tz\": \"CET\"} [TOOL_CALLS]bad", None),
    (None, "pythonic", PYTHONIC, None),
    (None, "pythonic", "[get_time(tz='CET]')] and text", None),
    (None, "qwen3_coder", QWEN3_CODER + "\nDone.", None),
    (None, "openai", HARMONY_CALL, None),
    ("openai_gptoss", "openai", HARMONY_CALL, None),
    ("gpt_oss", None, HARMONY_ANSWER, None),
    (None, "granite", GRANITE + " ok", None),
    (None, "deepseek_v3", DEEPSEEK_V3 + "Done.", None),
    (None, "deepseek_v31", DEEPSEEK_V31, None),
    (None, "internlm", INTERNLM + " Done.", None),
    (None, "jamba", "Sure. " + JAMBA, None),
    ("mistral", "mistral", "[THINK]need time[/THINK]" + MISTRAL_V11, None),
    ("granite", None, "Here is my thought process: Here's a plan. Here is my response: 4", None),
    ("deepseek_v3", "deepseek_v3", "think</think>" + DEEPSEEK_V3, {"thinking": True}),
] + [(None, name, text, None) for name, text in MALFORMED]


def make_parser(reasoning, tools, kwargs):
    options = ChatOptions(enable_auto_tool_choice=tools is not None, tool_call_parser=tools,
                          reasoning_parser=reasoning)
    return ChoiceParser.for_request(options, "auto" if tools else "none", True, True, TOOLS, kwargs)


@pytest.mark.parametrize("reasoning, tools, text, kwargs", STREAMED)
def test_streamed_at_every_split_equals_the_whole_reply(reasoning, tools, text, kwargs):
    expected = whole(make_parser(reasoning, tools, kwargs), text)
    for cut in range(len(text) + 1):
        assert stream(make_parser(reasoning, tools, kwargs), text, [cut]) == expected, cut
    assert stream(make_parser(reasoning, tools, kwargs), text, list(range(1, len(text)))) == expected


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(STREAMED), data=st.data())
def test_streamed_in_any_pieces_equals_the_whole_reply(case, data):
    reasoning, tools, text, kwargs = case
    cuts = data.draw(st.lists(st.integers(1, len(text) - 1), max_size=25, unique=True).map(sorted))
    assert stream(make_parser(reasoning, tools, kwargs), text, cuts) == whole(make_parser(reasoning, tools, kwargs),
                                                                              text)


# every parser on text made of its formats' pieces in any order: no crash, and streamed == whole
PIECES = ["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "a1B2c3D4e", "[THINK]", "[/THINK]", "get_time", "delete_files",
          '{"tz": "CET"}', '{"name": "get_time", "arguments": {"tz": "CET"}}', "[", "]", ", ", "(tz='CET')", "{",
          "<tool_call>", "</tool_call>", "<function=get_time>", "<parameter=tz>", "</parameter>", "</function>",
          "<|start|>assistant", "<|channel|>", "analysis", "final", "commentary to=functions.get_time", "<|message|>",
          "<|end|>", "<|call|>", "<|tool_call|>", "<tool_calls>", "</tool_calls>", "<|action_start|><|plugin|>",
          "<|action_end|>", DS_BEGIN, DS_CALL, "function", DS_SEP, "\n```json\n", "\n```", DS_CALL_END, DS_END,
          "Here is my thought process:", "Here's my response:", "</think>", "\n", " ", "text"]


@settings(max_examples=150, deadline=None)
@given(pieces=st.lists(st.sampled_from(PIECES), min_size=1, max_size=12), data=st.data(),
       tools=st.sampled_from(sorted(VLLM_TOOL_PARSERS) + [None]),
       reasoning=st.sampled_from(sorted(VLLM_REASONING_PARSERS) + [None]))
def test_any_mix_of_markers_parses_without_error_and_streams_as_a_whole(pieces, data, tools, reasoning):
    text = "".join(pieces)
    kwargs = {"thinking": True}
    cuts = data.draw(st.lists(st.integers(1, max(1, len(text) - 1)), max_size=20, unique=True).map(sorted))
    cuts = [c for c in cuts if c < len(text)]
    assert stream(make_parser(reasoning, tools, kwargs), text, cuts) == whole(make_parser(reasoning, tools, kwargs),
                                                                              text)


# ---------------------------------------------------------------- through the server, with the real openai client
@pytest.fixture(scope="module")
def mistral_server(server_model_dir):  # noqa: F811
    options = ChatOptions(enable_auto_tool_choice=True, tool_call_parser="mistral", reasoning_parser="mistral")
    srv = start_server(server_model_dir, chat_template=TOOL_TEMPLATE, chat_options=options, max_model_len=512)
    yield srv
    srv.stop()


def scripted(monkeypatch, server, pieces: list[str]) -> list:
    """``script_engine``, also recording the SamplingParams each request was given."""
    script_engine(monkeypatch, server, pieces)
    params, add = [], server.engine.add_requests

    async def recording(requests, sampling, *args, **kwargs):
        params.append(sampling)
        return await add(requests, sampling, *args, **kwargs)
    monkeypatch.setattr(server.engine, "add_requests", recording)
    return params


def test_mistral_calls_and_thinking_through_the_server(mistral_server, monkeypatch):
    text = '[THINK]The user wants the weather.[/THINK][TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
    cuts = [0, 4, 9, 30, 41, 45, 52, 58, 66, len(text)]  # inside every marker
    user = {"role": "user", "content": "weather in Paris?"}
    with openai.OpenAI(base_url=f"{mistral_server.url}/v1", api_key="x", max_retries=0, timeout=60) as client:
        params = scripted(monkeypatch, mistral_server, [text])
        reply = client.chat.completions.create(model="tiny", messages=[user], tools=[WEATHER_TOOL])
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert choice.message.reasoning_content == "The user wants the weather."
        (call,) = choice.message.tool_calls
        assert re.fullmatch(r"[A-Za-z0-9]{9}", call.id) and call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Paris"}
        assert params[0].skip_special_tokens is False  # [TOOL_CALLS] and [THINK] are control tokens

        scripted(monkeypatch, mistral_server, [text[a:b] for a, b in zip(cuts, cuts[1:])])
        chunks = list(client.chat.completions.create(model="tiny", messages=[user], tools=[WEATHER_TOOL],
                                                     stream=True))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "The user wants the weather."
        head, *rest = [tc for d in deltas for tc in d.tool_calls or []]
        assert re.fullmatch(r"[A-Za-z0-9]{9}", head.id) and head.function.name == "get_weather"
        assert json.loads("".join(tc.function.arguments for tc in rest)) == {"city": "Paris"}
        assert chunks[-1].choices[0].finish_reason == "tool_calls"

        scripted(monkeypatch, mistral_server, ["[TOOL_CALLS]get_weather[ARGS]{bad"])  # malformed: the text
        bad = client.chat.completions.create(model="tiny", messages=[user], tools=[WEATHER_TOOL])
        assert bad.choices[0].message.content == "[TOOL_CALLS]get_weather[ARGS]{bad"
        assert bad.choices[0].message.tool_calls is None and bad.choices[0].finish_reason == "stop"
        params = scripted(monkeypatch, mistral_server, ["plain"])
        client.chat.completions.create(model="tiny", messages=[user])
        assert params[0].skip_special_tokens is False  # the reasoning parser reads [THINK] without tools too

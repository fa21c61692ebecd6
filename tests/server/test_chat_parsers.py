"""Tool-call and reasoning parsers on fixed model outputs, whole and streamed at every boundary."""
from __future__ import annotations

import json
import random

import pytest

from pagedllm.entrypoints.openai.chat_features import ChatOptions, ChoiceParser
from pagedllm.entrypoints.openai.reasoning_parsers import REASONING_PARSERS, get_reasoning_parser
from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS, ParsedCall, get_tool_parser

HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n'
          '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"tz": "CET"}}</tool_call>')
WEATHER = ParsedCall("get_weather", '{"city": "Paris", "unit": "C"}')
TIME = ParsedCall("get_time", '{"tz": "CET"}')


def test_registries_name_the_formats():
    assert {"hermes", "llama3_json"} <= set(TOOL_PARSERS) and {"deepseek_r1", "qwen3"} <= set(REASONING_PARSERS)
    with pytest.raises(ValueError, match=r"tool_call_parser='nope' is invalid: must be one of \[.*'hermes'"):
        get_tool_parser("nope")
    with pytest.raises(ValueError, match="reasoning_parser='nope'"):
        get_reasoning_parser("nope")
    with pytest.raises(ValueError, match="enable_auto_tool_choice=True needs tool_call_parser"):
        ChatOptions(enable_auto_tool_choice=True)


@pytest.mark.parametrize("text, content, calls", [
    (HERMES, "Let me check.\n\n", (WEATHER, TIME)),
    ("no calls here", "no calls here", ()),
    ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', "", (ParsedCall("f", '{"a": 1}'),)),
    ('<tool_call>{"name": "f", "arguments": {}}', "", (ParsedCall("f", "{}"),)),  # stopped before the end tag
    ("<tool_call>not json</tool_call> after", "<tool_call>not json</tool_call> after", ()),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', ()),  # no name
])
def test_hermes_parses_complete_output(text, content, calls):
    parsed = get_tool_parser("hermes").parse(text, final=True)
    assert parsed.content == content and parsed.calls == calls


@pytest.mark.parametrize("text, content, calls", [
    ('{"name": "get_time", "parameters": {"tz": "CET"}}', "", (TIME,)),
    ('<|python_tag|>{"name": "get_time", "parameters": {"tz": "CET"}}; {"name": "f", "parameters": {}}', "",
     (TIME, ParsedCall("f", "{}"))),
    ("The answer is 4.", "The answer is 4.", ()),
    ('{"not": "a call"}', '{"not": "a call"}', ()),
])
def test_llama3_json_parses_complete_output(text, content, calls):
    parsed = get_tool_parser("llama3_json").parse(text, final=True)
    assert parsed.content == content and parsed.calls == calls


@pytest.mark.parametrize("name, text, reasoning, content", [
    ("qwen3", "<think>\nthe user wants 2+2</think>\n\nIt is 4.", "\nthe user wants 2+2", "\n\nIt is 4."),
    ("qwen3", "It is 4.", "", "It is 4."),  # enable_thinking=False: the template closed the block
    ("deepseek_r1", "the user wants 2+2</think>It is 4.", "the user wants 2+2", "It is 4."),
    ("deepseek_r1", "<think>hmm</think>4", "hmm", "4"),
    ("deepseek_r1", "still thinking when max_tokens hit", "still thinking when max_tokens hit", ""),
])
def test_reasoning_parsers_split_complete_output(name, text, reasoning, content):
    assert get_reasoning_parser(name).split(text, final=True) == (reasoning, content)


def stream(parser: ChoiceParser, text: str, cuts: list[int]) -> dict:
    """Feeds ``text`` in pieces cut at ``cuts``; returns the message the deltas assemble to."""
    bounds = [0, *cuts, len(text)]
    reasoning, content, calls = "", "", {}
    for k, (a, b) in enumerate(zip(bounds, bounds[1:])):
        for piece in parser.feed(text[a:b], final=k == len(bounds) - 2):
            reasoning += piece.reasoning_content or ""
            content += piece.content or ""
            for delta in piece.tool_calls or []:
                if "id" in delta:  # the opening delta: id, type and name, arguments ""
                    assert delta["index"] == len(calls) and delta["function"]["arguments"] == ""
                    calls[delta["index"]] = {"name": delta["function"]["name"], "arguments": ""}
                else:  # later deltas: argument fragments only
                    assert set(delta) == {"index", "function"} and set(delta["function"]) == {"arguments"}
                    calls[delta["index"]]["arguments"] += delta["function"]["arguments"]
    return {"reasoning": reasoning, "content": content, "calls": list(calls.values())}


def whole(parser: ChoiceParser, text: str) -> dict:
    msg = parser.message(text)
    return {"reasoning": msg["reasoning_content"] or "", "content": msg["content"] or "",
            "calls": [c["function"] for c in msg["tool_calls"] or []]}


OUTPUTS = [
    ("qwen3", "hermes", "<think>I should call the tool.</think>\n" + HERMES),
    ("qwen3", None, "<think>a</think>b"),
    ("deepseek_r1", None, "thinking </thi nk> still</think>answer <think> not a tag"),
    (None, "hermes", HERMES),
    (None, "hermes", "x <tool_ca y <tool_call>bad</tool_call> z"),
    (None, "llama3_json", '{"name": "get_time", "parameters": {"tz": "CET"}}; {"name": "f", "parameters": {}}'),
    (None, "llama3_json", "plain text answer"),
]


@pytest.mark.parametrize("reasoning, tools, text", OUTPUTS)
def test_streamed_deltas_at_every_boundary_equal_the_whole_reply(reasoning, tools, text):
    options = ChatOptions(enable_auto_tool_choice=tools is not None, tool_call_parser=tools,
                          reasoning_parser=reasoning)
    make = lambda: ChoiceParser.for_request(options, "auto" if tools else "none", True, True)  # noqa: E731
    expected = whole(make(), text)
    for cut in range(len(text) + 1):  # every single boundary, inside the tags too
        assert stream(make(), text, [cut]) == expected, cut
    rng = random.Random(0)
    for _ in range(30):  # and many small deltas, as tokens arrive
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 40))))
        assert stream(make(), text, cuts) == expected, cuts


def test_streamed_tool_call_deltas_are_openai_shaped_and_finish_with_tool_calls():
    options = ChatOptions(enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="qwen3")
    parser = ChoiceParser.for_request(options, "auto", True, True)
    text = "<think>I should call the tool.</think>\n" + HERMES
    got = stream(parser, text, list(range(1, len(text))))  # one character per delta
    assert got == {"reasoning": "I should call the tool.", "content": "\nLet me check.\n\n",
                   "calls": [{"name": "get_weather", "arguments": WEATHER.arguments},
                             {"name": "get_time", "arguments": TIME.arguments}]}
    assert json.loads(got["calls"][0]["arguments"]) == {"city": "Paris", "unit": "C"}
    assert parser.finish_reason("stop") == "tool_calls" and parser.finish_reason("length") == "length"
    ids = [cid for cid, _ in parser.calls]
    assert len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)


def test_parallel_tool_calls_false_keeps_the_first_call_and_include_reasoning_false_drops_thinking():
    options = ChatOptions(enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="qwen3")
    msg = ChoiceParser.for_request(options, "auto", False, False).message("<think>t</think>" + HERMES)
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather"]
    assert msg["reasoning_content"] is None and msg["content"] == "Let me check.\n\n"


def test_tool_choice_none_leaves_calls_in_the_content():
    options = ChatOptions(enable_auto_tool_choice=True, tool_call_parser="hermes")
    msg = ChoiceParser.for_request(options, "none", True, True).message(HERMES)
    assert msg == {"content": HERMES, "reasoning_content": None, "tool_calls": None}

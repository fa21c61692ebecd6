"""Calls forced by ``tool_choice``: ``required`` (a JSON array of calls) or a named function (the
arguments object alone). The output is constrained to the schema from ``forced_call_schema``
(structured outputs), so it parses; these parsers are chosen by tool_choice, not registered."""
from __future__ import annotations

import json

from .base import ParsedCall, ToolParse, ToolParser, call_from_json

_DECODER = json.JSONDecoder()


def forced_call_schema(tools: list, tool_choice, parallel_tool_calls: bool) -> dict:
    """vLLM's schemas: ``required`` -> ``[{"name": <a tool>, "parameters": <its schema>}, ...]``
    (at most one item without parallel calls); a named function -> its parameters schema."""
    if tool_choice == "required":
        items = {"type": "object", "anyOf": [_call_schema(t.function) for t in tools]}
        schema = {"type": "array", "minItems": 1, "items": items}
        return schema if parallel_tool_calls else {**schema, "maxItems": 1}
    fn = next(t.function for t in tools if t.function.name == tool_choice.function.name)
    return _parameters(fn)


def _call_schema(fn) -> dict:
    return {"type": "object", "properties": {"name": {"type": "string", "enum": [fn.name]},
                                             "parameters": _parameters(fn)},
            "required": ["name", "parameters"]}


def _parameters(fn) -> dict:
    return fn.parameters or {"type": "object", "properties": {}}


class RequiredCallsParser(ToolParser):
    """``tool_choice="required"``: each complete element of the array is a call as soon as it closes."""

    def parse(self, text: str, final: bool) -> ToolParse:
        calls: list[ParsedCall] = []
        pos = text.find("[") + 1
        while 0 < pos < len(text):
            while pos < len(text) and text[pos] in " \t\r\n,":
                pos += 1
            try:
                obj, pos = _DECODER.raw_decode(text, pos)
            except json.JSONDecodeError:
                break  # not complete yet (or cut off by max_tokens)
            call = call_from_json(obj)
            if call is None:
                break
            calls.append(call)
        return ToolParse(text if final and not calls else "", tuple(calls))


class NamedCallParser(ToolParser):
    """A named function: the whole output is its arguments object."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def parse(self, text: str, final: bool) -> ToolParse:
        if not final:
            return ToolParse("")
        try:
            args = json.loads(text)
        except json.JSONDecodeError:
            return ToolParse(text)  # cut off by max_tokens: the text as generated
        if not isinstance(args, dict):
            return ToolParse(text)
        return ToolParse("", (ParsedCall(self.name, json.dumps(args, ensure_ascii=False)),))

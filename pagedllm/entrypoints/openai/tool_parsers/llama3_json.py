"""Llama 3.1 / 3.2 JSON format: the whole output is ``{"name": ..., "parameters": {...}}``, or several
separated by ``;``, optionally after ``<|python_tag|>``. An output that does not start with ``{`` is
plain content."""
from __future__ import annotations

import json

from .base import ParsedCall, ToolParse, ToolParser, call_from_json, register_tool_parser

PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()


@register_tool_parser("llama3_json")
class Llama3JsonToolParser(ToolParser):
    def parse(self, text: str, final: bool) -> ToolParse:
        body = text.lstrip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG):].lstrip()
        elif not final and (not body or PYTHON_TAG.startswith(body)):
            return ToolParse("")  # still undecided
        if not body.startswith("{"):
            return ToolParse(text)
        calls, rest = _leading_calls(body, self)
        if not final:
            return ToolParse("", calls)
        return ToolParse(rest if calls else text, calls)


def _leading_calls(body: str, parser: ToolParser) -> tuple[tuple[ParsedCall, ...], str]:
    """The complete calls at the start of ``body`` (``;``-separated) and the text after them."""
    calls: list[ParsedCall] = []
    pos = 0
    while pos < len(body):
        try:
            obj, end = _DECODER.raw_decode(body, pos)
        except json.JSONDecodeError:
            break
        call = parser.known(call_from_json(obj))
        if call is None:
            break
        calls.append(call)
        pos = end
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
    return tuple(calls), body[pos:]

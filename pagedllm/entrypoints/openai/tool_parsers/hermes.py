"""Hermes / Qwen2.5 / Qwen3 format: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
any number of them, with plain text around them."""
from __future__ import annotations

from ..parser_registry import partial_suffix
from .base import ParsedCall, ToolParse, ToolParser, call_from_text, register_tool_parser

START, END = "<tool_call>", "</tool_call>"


@register_tool_parser("hermes")
class HermesToolParser(ToolParser):
    """A block whose JSON is not a call stays in the content, tags and all (nothing is dropped)."""

    def parse(self, text: str, final: bool) -> ToolParse:
        content: list[str] = []
        calls: list[ParsedCall] = []
        pos = 0
        while True:
            start = text.find(START, pos)
            if start < 0:
                tail = text[pos:]
                content.append(tail[:len(tail) - (0 if final else partial_suffix(tail, START))])
                break
            content.append(text[pos:start])
            end = text.find(END, start)
            if end < 0:  # a call still being written; at the end, one the model left unclosed
                call = call_from_text(text[start + len(START):]) if final else None
                calls += [call] if call else []
                content += [text[start:]] if final and not call else []
                break
            call = call_from_text(text[start + len(START):end])
            calls += [call] if call else []
            content += [] if call else [text[start:end + len(END)]]
            pos = end + len(END)
        return ToolParse("".join(content), tuple(calls))

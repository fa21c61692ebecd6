"""Hermes / Qwen2.5 / Qwen3 format: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
any number of them, with plain text around them."""
from __future__ import annotations

from .base import ToolParse, ToolParser, call_from_text, register_tool_parser, tagged_calls

START, END = "<tool_call>", "</tool_call>"


@register_tool_parser("hermes")
class HermesToolParser(ToolParser):
    """A block whose JSON is not a call stays in the content, tags and all (nothing is dropped)."""

    needs_special_tokens = True  # <tool_call> is a special token in some Hermes tokenizers (vLLM keeps them)

    def parse(self, text: str, final: bool) -> ToolParse:
        def body_calls(body: str):
            call = self.known(call_from_text(body))
            return [call] if call else None
        return tagged_calls(text, final, START, END, body_calls)

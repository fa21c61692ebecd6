"""Formats whose calls are JSON: Granite's list, Jamba's ``<tool_calls>`` list and InternLM's
``<|action_start|><|plugin|>`` object."""
from __future__ import annotations

from .base import (
    ParsedCall,
    ToolParse,
    ToolParser,
    array_calls,
    call_from_json,
    json_value,
    register_tool_parser,
    tagged_calls,
)


@register_tool_parser("granite")
class GraniteToolParser(ToolParser):
    """IBM Granite 3.x: the whole output is a JSON list of ``{"name", "arguments"}`` calls, after
    ``<|tool_call|>`` (Granite 3.0, a special token) or ``<tool_call>`` (Granite 3.1+). An output
    that is not one is content, as in vLLM; text after the list is content."""

    needs_special_tokens = True
    prefixes = ("<|tool_call|>", "<tool_call>")

    def parse(self, text: str, final: bool) -> ToolParse:
        body = text.lstrip()
        for prefix in self.prefixes:
            body = body.removeprefix(prefix).lstrip()
        if not final and (not body or any(p.startswith(text.lstrip()) for p in self.prefixes)):
            return ToolParse("")  # still undecided
        if not body.startswith("["):
            return ToolParse(text)
        found = array_calls(body, self)
        if found is None:
            return ToolParse(text if final else "")
        calls, end = found
        return ToolParse(body[end:] if final else "", tuple(calls))


@register_tool_parser("jamba")
class JambaToolParser(ToolParser):
    """AI21 Jamba 1.5+: ``<tool_calls>[{"name": ..., "arguments": {...}}, ...]</tool_calls>`` after
    any content; a block that is not a list of calls stays in the content."""

    needs_special_tokens = True  # <tool_calls> and </tool_calls> are special tokens

    def parse(self, text: str, final: bool) -> ToolParse:
        return tagged_calls(text, final, "<tool_calls>", "</tool_calls>", self._block_calls)

    def _block_calls(self, body: str) -> list[ParsedCall] | None:
        found = array_calls(body, self)
        return found[0] if found and not body[found[1]:].strip() else None


@register_tool_parser("internlm")
class InternLMToolParser(ToolParser):
    """InternLM2 / 2.5: ``<|action_start|><|plugin|>\\n{"name": ..., "parameters": {...}}<|action_end|>``
    after any content (vLLM's ``internlm``). Each action is one call."""

    needs_special_tokens = True  # the action markers are special tokens

    def parse(self, text: str, final: bool) -> ToolParse:
        return tagged_calls(text, final, "<|action_start|><|plugin|>", "<|action_end|>", self._block_calls)

    def _block_calls(self, body: str) -> list[ParsedCall] | None:
        found = json_value(body)
        if found is None or body[found[1]:].strip():
            return None
        call = self.known(call_from_json(found[0], ("parameters", "arguments")))
        return [call] if call else None

"""Mistral format: content, then ``[TOOL_CALLS]`` and the calls.

- tokenizer v2-v7 (Mistral 7B v0.3, Mixtral 8x22B, Nemo): ``[TOOL_CALLS][{"name": ..., "arguments":
  {...}}, ...]``, one JSON array of calls;
- tokenizer v11+ (Mistral Small 3.1+, Magistral, Devstral): ``[TOOL_CALLS]name[ARGS]{...}`` per call,
  ``[TOOL_CALLS]name[CALL_ID]id[ARGS]{...}`` when the model writes the id (mistral-common's
  ``decode_tool_calls``), and ``name{...}`` when a tokenizer drops ``[ARGS]`` on decoding.

Mistral requires tool call ids of 9 letters and digits, so the ids made here have that shape.
"""
from __future__ import annotations

import random
import re
import string

from ..parser_registry import held_tail
from .base import ParsedCall, ToolParse, ToolParser, array_calls, call_with_arguments, json_value, register_tool_parser

BOT = "[TOOL_CALLS]"
CALL_ID, ARGS = "[CALL_ID]", "[ARGS]"
_ALPHANUMERIC = string.ascii_letters + string.digits
# name, optional [CALL_ID]id, optional [ARGS], then the arguments object
_V11_HEAD = re.compile(r"([A-Za-z0-9_.\-]{1,64})(?:\[CALL_ID\]([A-Za-z0-9]+))?(?:\[ARGS\])?(?=\s*\{)")


def mistral_call_id() -> str:
    """9 random letters and digits (mistral-common refuses any other id in a conversation)."""
    return "".join(random.choices(_ALPHANUMERIC, k=9))


@register_tool_parser("mistral")
class MistralToolParser(ToolParser):
    """Calls after ``[TOOL_CALLS]``; the text before it is content. Calls that do not parse (or name
    a tool the request lacks) stay in the content from their ``[TOOL_CALLS]`` on."""

    needs_special_tokens = True  # [TOOL_CALLS], [ARGS], [CALL_ID] are control tokens

    def call_id(self) -> str:
        return mistral_call_id()

    def parse(self, text: str, final: bool) -> ToolParse:
        begin = text.find(BOT)
        if begin < 0:
            return ToolParse(text[:len(text) - held_tail(text, (BOT,), final)])
        content, rest = text[:begin], text[begin + len(BOT):]
        if rest.lstrip().startswith("["):  # v2-v7: one array of calls
            found = array_calls(rest, self)
            if found is None:
                return ToolParse(content + (text[begin:] if final else ""))
            calls, end = found
            return ToolParse(content + (rest[end:] if final else ""), tuple(calls))
        calls, pos = self._v11_calls(text, begin)
        return ToolParse(content + (text[pos:] if final else ""), tuple(calls))

    def _v11_calls(self, text: str, pos: int) -> tuple[list[ParsedCall], int]:
        """The complete ``[TOOL_CALLS]name[ARGS]{...}`` calls from ``pos`` on, and where they stop."""
        calls: list[ParsedCall] = []
        while text.startswith(BOT, pos):
            call, end = self._v11_call(text, pos + len(BOT))
            if call is None:
                break
            calls.append(call)
            after = text[end:]
            pos = end + len(after) - len(after.lstrip()) if after.lstrip().startswith(BOT) else end
        return calls, pos

    def _v11_call(self, text: str, start: int) -> tuple[ParsedCall | None, int]:
        head = _V11_HEAD.match(text, start)
        if head is None:
            return None, start
        value = json_value(text[head.end():])
        if value is None:
            return None, start
        call = self.known(call_with_arguments(head.group(1), value[0]))
        if call is None:
            return None, start
        model_id = head.group(2)
        if model_id and len(model_id) == 9:
            call = ParsedCall(call.name, call.arguments, model_id)
        return call, head.end() + value[1]

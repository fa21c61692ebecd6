"""The tool-parser interface, its registry, and the JSON shape shared by the formats."""
from __future__ import annotations

import json
from dataclasses import dataclass

from ..parser_registry import ParserRegistry


@dataclass(frozen=True)
class ParsedCall:
    """One function call: its name and its arguments as a JSON object text."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ToolParse:
    content: str  # the text that is not a call (held back while it may still become one)
    calls: tuple[ParsedCall, ...] = ()


class ToolParser:
    """Splits generated text into content and complete calls.

    ``parse(text, final)`` must be monotonic in ``text``: the content of a longer text extends
    the content of a shorter one, and its calls extend the shorter one's calls. Text that may
    still turn out to be part of a call is held back until ``final``.
    """

    def parse(self, text: str, final: bool) -> ToolParse:
        raise NotImplementedError


TOOL_PARSERS: ParserRegistry[ToolParser] = ParserRegistry("tool_call_parser")
register_tool_parser = TOOL_PARSERS.register
get_tool_parser = TOOL_PARSERS.create  # ValueError lists the registered names


def call_from_json(obj: object, arguments_keys: tuple[str, ...] = ("arguments", "parameters")) -> ParsedCall | None:
    """``{"name": str, "arguments": {...}}`` (or the arguments as a JSON string) -> a call; else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = next((obj[k] for k in arguments_keys if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


def call_from_text(text: str) -> ParsedCall | None:
    try:
        return call_from_json(json.loads(text))
    except json.JSONDecodeError:
        return None

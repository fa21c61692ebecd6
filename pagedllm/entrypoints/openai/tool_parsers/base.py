"""The tool-parser interface, its registry, and the shapes shared by the formats: JSON calls, JSON
arrays of calls, and calls inside start/end markers."""
from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..parser_registry import ParserRegistry, held_tail


@dataclass(frozen=True)
class ParsedCall:
    """One function call: its name and its arguments as a JSON object text; ``id`` when the model
    wrote one (Mistral's ``[CALL_ID]``), else the server makes one (``ToolParser.call_id``)."""

    name: str
    arguments: str
    id: str | None = None


@dataclass(frozen=True)
class ToolParse:
    content: str  # the text that is not a call (held back while it may still become one)
    calls: tuple[ParsedCall, ...] = ()


class ToolParser:
    """Splits generated text into content and complete calls.

    ``parse(text, final)`` must be monotonic in ``text``: the content of a longer text extends
    the content of a shorter one, and its calls extend the shorter one's calls. Text that may
    still turn out to be part of a call is held back until ``final``.

    ``tools`` maps each function the request offers to its parameters' JSON schema (None: not
    known, any name is taken). A call naming another function is not a call: its text stays in
    the content, as a malformed one does (vLLM's InternLM parser means to do the same).
    """

    # The format's markers are special tokens, so the output is decoded with
    # skip_special_tokens=False while tools are on (vLLM's adjust_request does the same).
    needs_special_tokens = False
    # The reasoning parser the format implies when none is named (vLLM always reads gpt-oss output as harmony).
    reasoning_parser: str | None = None

    def __init__(self, tools: Mapping[str, dict] | None = None):
        self.tools = tools

    def parse(self, text: str, final: bool) -> ToolParse:
        raise NotImplementedError

    def call_id(self) -> str:
        """The id of a call the model gave none (OpenAI's shape)."""
        return f"call_{uuid.uuid4().hex[:24]}"

    def known(self, call: ParsedCall | None) -> ParsedCall | None:
        """``call`` if it names one of the request's tools, else None."""
        if call is None or (self.tools is not None and call.name not in self.tools):
            return None
        return call


TOOL_PARSERS: ParserRegistry[ToolParser] = ParserRegistry("tool_call_parser")
register_tool_parser = TOOL_PARSERS.register
get_tool_parser = TOOL_PARSERS.create  # ValueError lists the registered names


def tool_schemas(tools: list | None) -> dict[str, dict] | None:
    """A request's ``tools`` as ``ToolParser`` takes them: function name -> parameters schema."""
    return {t.function.name: t.function.parameters or {} for t in tools} if tools else None


_DECODER = json.JSONDecoder()


def call_from_json(obj: object, arguments_keys: tuple[str, ...] = ("arguments", "parameters")) -> ParsedCall | None:
    """``{"name": str, "arguments": {...}}`` (or the arguments as a JSON string) -> a call; else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = next((obj[k] for k in arguments_keys if k in obj), {})
    return call_with_arguments(obj["name"], args)


def call_with_arguments(name: str, args: object) -> ParsedCall | None:
    """A call whose arguments are a dict, or a JSON object text; else None."""
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(name, json.dumps(args, ensure_ascii=False))


def call_from_text(text: str) -> ParsedCall | None:
    try:
        return call_from_json(json.loads(text))
    except json.JSONDecodeError:
        return None


def json_value(text: str) -> tuple[object, int] | None:
    """The JSON value at the start of ``text`` (after whitespace) and where it ends; None if there
    is none (yet)."""
    pos = len(text) - len(text.lstrip())
    try:
        return _DECODER.raw_decode(text, pos)
    except json.JSONDecodeError:
        return None


def array_calls(text: str, parser: ToolParser) -> tuple[list[ParsedCall], int] | None:
    """The JSON array at the start of ``text`` (after whitespace), if it is complete and all calls to
    known tools: the calls and where the array ends; else None."""
    value = json_value(text)
    if value is None or not isinstance(value[0], list) or not value[0]:
        return None
    calls = [parser.known(call_from_json(obj)) for obj in value[0]]
    return None if None in calls else (calls, value[1])


def tagged_calls(text: str, final: bool, start: str, end: str,
                 body_calls: Callable[[str], list[ParsedCall] | None]) -> ToolParse:
    """Content with blocks ``start`` body ``end`` in it, each body all calls (``body_calls``) or not
    (None: the block stays in the content, markers and all: nothing is dropped).

    A block's calls go out when its end marker arrives; a block the model left unclosed is parsed
    as it stands once the text is final.
    """
    content: list[str] = []
    calls: list[ParsedCall] = []
    pos = 0
    while True:
        begin = text.find(start, pos)
        if begin < 0:
            tail = text[pos:]
            content.append(tail[:len(tail) - held_tail(tail, (start,), final)])
            break
        content.append(text[pos:begin])
        close = text.find(end, begin + len(start))
        if close < 0 and not final:
            break  # a block still being written
        stop = len(text) if close < 0 else close + len(end)
        got = body_calls(text[begin + len(start):len(text) if close < 0 else close])
        calls += got or []
        content += [] if got else [text[begin:stop]]
        pos = stop
        if close < 0:
            break
    return ToolParse("".join(content), tuple(calls))

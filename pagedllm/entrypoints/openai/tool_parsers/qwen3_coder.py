"""Qwen3-Coder XML format: ``<tool_call>`` blocks with plain text around them::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

A parameter's value is text; it becomes the JSON type its tool's schema gives the parameter, as
vLLM's ``qwen3_coder`` parser converts it (integers, numbers, booleans, objects and arrays; a
nullable parameter's ``null``; an unknown parameter or an unconvertible value stays a string).
"""
from __future__ import annotations

import ast
import json
import math
import re
from typing import Any

from .base import ParsedCall, ToolParse, ToolParser, register_tool_parser, tagged_calls

START, END = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*\Z", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)
_STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")
_INT_PREFIXES = ("int", "uint", "long", "short", "unsigned")


@register_tool_parser("qwen3_coder")
class Qwen3CoderToolParser(ToolParser):
    """A block that is not one well-formed function (or names a tool the request lacks) stays in
    the content, tags and all."""

    def parse(self, text: str, final: bool) -> ToolParse:
        return tagged_calls(text, final, START, END, self._block_calls)

    def _block_calls(self, body: str) -> list[ParsedCall] | None:
        fn = _FUNCTION.match(body)
        if fn is None:
            return None
        name = fn.group(1).strip()
        schema = (self.tools or {}).get(name, {})
        properties = schema.get("properties", {}) if isinstance(schema, dict) else {}
        inner = fn.group(2)
        params = list(_PARAMETER.finditer(inner))
        if _PARAMETER.sub("", inner).strip():  # text outside the parameters: not this format
            return None
        args = {m.group(1).strip(): convert_parameter(m.group(2), properties.get(m.group(1).strip()))
                for m in params}
        call = self.known(ParsedCall(name, json.dumps(args, ensure_ascii=False)))
        return [call] if call else None


def convert_parameter(value: str, schema: Any) -> Any:
    """``value`` as the type ``schema`` declares (its first non-null type of an ``anyOf``)."""
    kind, nullable = _schema_type(schema)
    if nullable and value.lower() in ("null", "none"):
        return None
    if kind in _STRING_TYPES:
        return value
    if value.lower() in ("null", "none"):
        return None
    if kind.startswith(_INT_PREFIXES):
        try:
            return int(value)
        except ValueError:
            return value
    if kind.startswith(("num", "float")):
        try:
            number = float(value)
        except ValueError:
            return value
        if not math.isfinite(number):
            return value  # JSON has no nan / inf
        return int(number) if number.is_integer() else number
    if kind in ("boolean", "bool", "binary"):
        return value.lower() == "true"  # vLLM: anything but "true" is false
    return _container(value)


def _container(value: str) -> Any:
    """An object / array (or an untyped value): JSON, else a Python literal, else the text."""
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        pass
    try:
        parsed = ast.literal_eval(value)
        json.dumps(parsed, allow_nan=False)  # only what JSON can carry (not a set, bytes, ...)
        return parsed
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return value


def _schema_type(schema: Any) -> tuple[str, bool]:
    """(the declared type, lower case; whether null is allowed). No schema: a string, as in vLLM."""
    if not isinstance(schema, dict):
        return "string", False
    if "type" in schema:
        declared = schema["type"]
        types = [str(t).strip().lower() for t in (declared if isinstance(declared, list) else [declared])]
        others = [t for t in types if t != "null"]
        return (others[0] if others else "null"), "null" in types
    options = [o for o in schema.get("anyOf", []) if isinstance(o, dict) and "type" in o]
    types = [str(o["type"]).strip().lower() for o in options]
    others = [t for t in types if t != "null"]
    return (others[0] if others else "string"), "null" in types

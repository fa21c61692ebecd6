"""Tool-call parsers: find the function calls in a model's output text.

``--tool-call-parser NAME`` picks one from ``TOOL_PARSERS``; a new format registers itself with
``@register_tool_parser("name")``. A parser is stateless: ``parse(text, final)`` maps the text
generated so far to the plain content and the *complete* calls in it, both growing monotonically
as text is appended, so streaming sends the difference and a non-streamed reply is one call with
``final=True``.
"""
from __future__ import annotations

from .base import TOOL_PARSERS, ParsedCall, ToolParse, ToolParser, get_tool_parser, register_tool_parser
from .hermes import HermesToolParser
from .llama3_json import Llama3JsonToolParser

__all__ = ["TOOL_PARSERS", "ParsedCall", "ToolParse", "ToolParser", "get_tool_parser", "register_tool_parser",
           "HermesToolParser", "Llama3JsonToolParser"]

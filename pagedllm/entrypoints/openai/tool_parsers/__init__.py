"""Tool-call parsers: find the function calls in a model's output text.

``--tool-call-parser NAME`` picks one from ``TOOL_PARSERS``; a new format registers itself with
``@register_tool_parser("name")``. A parser is stateless: ``parse(text, final)`` maps the text
generated so far to the plain content and the *complete* calls in it, both growing monotonically
as text is appended, so streaming sends the difference and a non-streamed reply is one call with
``final=True``. A parser is made per request, with the request's tools (``tool_schemas``).
"""
from __future__ import annotations

from .base import TOOL_PARSERS, ParsedCall, ToolParse, ToolParser, get_tool_parser, register_tool_parser, tool_schemas
from .deepseek_v3 import DeepSeekV3ToolParser
from .harmony import OpenAIToolParser
from .hermes import HermesToolParser
from .json_blocks import GraniteToolParser, InternLMToolParser, JambaToolParser
from .llama3_json import Llama3JsonToolParser
from .mistral import MistralToolParser
from .pythonic import PythonicToolParser
from .qwen3_coder import Qwen3CoderToolParser

__all__ = ["TOOL_PARSERS", "ParsedCall", "ToolParse", "ToolParser", "get_tool_parser", "register_tool_parser",
           "tool_schemas", "HermesToolParser", "Llama3JsonToolParser", "MistralToolParser", "PythonicToolParser",
           "Qwen3CoderToolParser", "OpenAIToolParser", "GraniteToolParser", "DeepSeekV3ToolParser",
           "InternLMToolParser", "JambaToolParser"]

"""Reasoning parsers: split a reasoning model's output into its thinking and its answer.

``--reasoning-parser NAME`` picks one from ``REASONING_PARSERS``; a new format registers itself
with ``@register_reasoning_parser("name")``. A parser is stateless: ``split(text, final)`` maps
the text generated so far to ``(reasoning, content)``, both growing monotonically as text is
appended, so streaming sends the difference and a non-streamed reply is one call with
``final=True`` (the two agree by construction). A parser is made per request, with the request's
``chat_template_kwargs``.
"""
from __future__ import annotations

from .base import REASONING_PARSERS, ReasoningParser, get_reasoning_parser, register_reasoning_parser
from .more import DeepSeekV3ReasoningParser, GptOssReasoningParser, GraniteReasoningParser, MistralReasoningParser
from .think_tags import DeepSeekR1ReasoningParser, Qwen3ReasoningParser

__all__ = ["REASONING_PARSERS", "ReasoningParser", "get_reasoning_parser", "register_reasoning_parser",
           "DeepSeekR1ReasoningParser", "Qwen3ReasoningParser", "MistralReasoningParser", "GraniteReasoningParser",
           "GptOssReasoningParser", "DeepSeekV3ReasoningParser"]

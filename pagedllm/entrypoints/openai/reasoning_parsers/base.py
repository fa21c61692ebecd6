"""The reasoning-parser interface and its registry."""
from __future__ import annotations

from typing import Any

from ..parser_registry import ParserRegistry


class ReasoningParser:
    """Splits generated text into ``(reasoning, content)``.

    ``split(text, final)`` must be monotonic: for any text ``t`` and extension ``t + s``, each
    part of ``split(t)`` is a prefix of the same part of ``split(t + s)``. So while a tag may be
    incomplete (``final=False``) the ambiguous tail is held back rather than guessed.

    ``chat_template_kwargs`` are the request's: a template switch such as DeepSeek-V3.1's
    ``thinking`` decides whether the model thinks at all.
    """

    # The format's markers are special tokens, so the output is decoded with skip_special_tokens=False.
    needs_special_tokens = False

    def __init__(self, chat_template_kwargs: dict[str, Any] | None = None):
        self.chat_template_kwargs = dict(chat_template_kwargs or {})

    def split(self, text: str, final: bool) -> tuple[str, str]:
        raise NotImplementedError


REASONING_PARSERS: ParserRegistry[ReasoningParser] = ParserRegistry("reasoning_parser")
register_reasoning_parser = REASONING_PARSERS.register
get_reasoning_parser = REASONING_PARSERS.create  # ValueError lists the registered names

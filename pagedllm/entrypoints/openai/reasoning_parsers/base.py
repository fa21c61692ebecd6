"""The reasoning-parser interface and its registry."""
from __future__ import annotations

from ..parser_registry import ParserRegistry


class ReasoningParser:
    """Splits generated text into ``(reasoning, content)``.

    ``split(text, final)`` must be monotonic: for any text ``t`` and extension ``t + s``, each
    part of ``split(t)`` is a prefix of the same part of ``split(t + s)``. So while a tag may be
    incomplete (``final=False``) the ambiguous tail is held back rather than guessed.
    """

    def split(self, text: str, final: bool) -> tuple[str, str]:
        raise NotImplementedError


REASONING_PARSERS: ParserRegistry[ReasoningParser] = ParserRegistry("reasoning_parser")
register_reasoning_parser = REASONING_PARSERS.register
get_reasoning_parser = REASONING_PARSERS.create  # ValueError lists the registered names

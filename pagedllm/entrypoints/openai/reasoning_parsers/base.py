"""The reasoning-parser interface and its registry."""
from __future__ import annotations

from collections.abc import Callable

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {}


class ReasoningParser:
    """Splits generated text into ``(reasoning, content)``.

    ``split(text, final)`` must be monotonic: for any text ``t`` and extension ``t + s``, each
    part of ``split(t)`` is a prefix of the same part of ``split(t + s)``. So while a tag may be
    incomplete (``final=False``) the ambiguous tail is held back rather than guessed.
    """

    def split(self, text: str, final: bool) -> tuple[str, str]:
        raise NotImplementedError


def register_reasoning_parser(name: str) -> Callable[[type[ReasoningParser]], type[ReasoningParser]]:
    def add(cls: type[ReasoningParser]) -> type[ReasoningParser]:
        REASONING_PARSERS[name] = cls
        return cls
    return add


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The parser called ``name``; ValueError lists the registered names."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser={name!r} is invalid: must be one of {sorted(REASONING_PARSERS)}")
    return REASONING_PARSERS[name]()

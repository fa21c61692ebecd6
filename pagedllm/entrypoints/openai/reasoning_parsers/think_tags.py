"""``<think>...</think>`` reasoning (DeepSeek-R1, Qwen3, QwQ)."""
from __future__ import annotations

from ..parser_registry import partial_suffix
from .base import ReasoningParser, register_reasoning_parser


class ThinkTagParser(ReasoningParser):
    """Reasoning between ``start`` and ``end`` at the start of the output.

    ``implicit_start``: the chat template already wrote the start tag into the prompt (DeepSeek-R1),
    so the output is reasoning from its first token, whether or not it repeats the tag. Otherwise
    (Qwen3) an output that does not open with the tag has no reasoning at all (e.g. a template
    called with ``enable_thinking=False`` closed the block in the prompt).
    """

    start = "<think>"
    end = "</think>"
    implicit_start = False

    def split(self, text: str, final: bool) -> tuple[str, str]:
        if not final and len(text) < len(self.start) and self.start.startswith(text.lstrip()):
            return "", ""  # may still become the start tag
        stripped = text.lstrip()
        if stripped.startswith(self.start):
            return self._reasoning_then_content(stripped[len(self.start):], final)
        if self.implicit_start:
            return self._reasoning_then_content(text, final)
        return "", text

    def _reasoning_then_content(self, body: str, final: bool) -> tuple[str, str]:
        idx = body.find(self.end)
        if idx >= 0:
            return body[:idx], body[idx + len(self.end):]
        held = 0 if final else partial_suffix(body, self.end)
        return body[:len(body) - held], ""


@register_reasoning_parser("deepseek_r1")
class DeepSeekR1ReasoningParser(ThinkTagParser):
    """DeepSeek-R1: its template opens ``<think>`` in the prompt; an output that never closes the
    block is all reasoning (it ran out of tokens while thinking)."""

    implicit_start = True


@register_reasoning_parser("qwen3")
class Qwen3ReasoningParser(ThinkTagParser):
    """Qwen3 / QwQ: the output opens with ``<think>`` when the model thinks."""

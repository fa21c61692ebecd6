"""Reasoning formats beyond ``<think>`` at the start: Mistral's ``[THINK]`` block, Granite's
sentences, gpt-oss's analysis channel, and DeepSeek-V3.1's template switch."""
from __future__ import annotations

import re
from typing import Any

from ..parser_registry import held_tail
from ..tool_parsers.harmony import segments
from .base import ReasoningParser, register_reasoning_parser
from .think_tags import DeepSeekR1ReasoningParser


@register_reasoning_parser("mistral")
class MistralReasoningParser(ReasoningParser):
    """Magistral / Mistral tokenizer v13+: ``[THINK]reasoning[/THINK]answer``. Without ``[THINK]``
    the output is all content (a stray ``[/THINK]`` is dropped); text before ``[THINK]`` is content
    too, and a block that never closes is all reasoning (vLLM's rules)."""

    needs_special_tokens = True  # [THINK] and [/THINK] are control tokens
    start, end = "[THINK]", "[/THINK]"

    def split(self, text: str, final: bool) -> tuple[str, str]:
        begin = text.find(self.start)
        if begin < 0:
            before = text.replace(self.end, "")
            held = held_tail(before, (self.start, self.end), final)
            return "", before[:len(before) - held]
        before, body = text[:begin].replace(self.end, ""), text[begin + len(self.start):]
        close = body.find(self.end)
        if close < 0:
            return body[:len(body) - held_tail(body, (self.end,), final)], before
        return body[:close], before + body[close + len(self.end):]


@register_reasoning_parser("granite")
class GraniteReasoningParser(ReasoningParser):
    """IBM Granite 3.2+ (thinking on through ``chat_template_kwargs={"thinking": true}``): the output
    opens with ``Here is my thought process:`` and the answer follows ``Here is my response:``
    (``Here's`` too, as vLLM accepts). An output that does not open so is all content; one that
    stops before the response is all reasoning."""

    starts = ("Here is my thought process:", "Here's my thought process:")
    responses = ("Here is my response:", "Here's my response:")
    _response = re.compile("|".join(re.escape(r) for r in responses))

    def split(self, text: str, final: bool) -> tuple[str, str]:
        stripped = text.lstrip()
        start = next((s for s in self.starts if stripped.startswith(s)), None)
        if start is None:
            undecided = not final and any(s.startswith(stripped) for s in self.starts)
            return "", "" if undecided else text
        body = stripped[len(start):]
        match = self._response.search(body)
        if match:
            return body[:match.start()], body[match.end():]
        return body[:len(body) - held_tail(body, self.responses, final)], ""


@register_reasoning_parser("openai_gptoss")
@register_reasoning_parser("gpt_oss")
class GptOssReasoningParser(ReasoningParser):
    """gpt-oss (harmony): the analysis channel is the reasoning; the answer's text (final channel,
    commentary preambles) is the content; tool-call messages stay in the content as written, for
    ``--tool-call-parser openai`` to turn into calls."""

    needs_special_tokens = True  # the harmony markers are special tokens

    def split(self, text: str, final: bool) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        for seg in segments(text, final):
            if seg.channel == "analysis" and seg.recipient is None:
                reasoning.append(seg.body)
            elif seg.loose or seg.is_answer:
                content.append(seg.body)
            elif seg.closed:
                content.append(seg.raw)
            else:
                break  # a tool call still being written
        return "".join(reasoning), "".join(content)


@register_reasoning_parser("deepseek_v3")
class DeepSeekV3ReasoningParser(ReasoningParser):
    """DeepSeek-V3.1 / V3.2: the chat template thinks only when the request sends
    ``chat_template_kwargs={"thinking": true}`` (or ``enable_thinking``), opening ``<think>`` in the
    prompt; then the output is DeepSeek-R1's (reasoning up to ``</think>``). Otherwise it is all
    content, as vLLM's ``deepseek_v3`` parser does."""

    def __init__(self, chat_template_kwargs: dict[str, Any] | None = None):
        super().__init__(chat_template_kwargs)
        kwargs = self.chat_template_kwargs
        self.thinking = bool(kwargs.get("thinking") or kwargs.get("enable_thinking"))
        self._r1 = DeepSeekR1ReasoningParser()

    def split(self, text: str, final: bool) -> tuple[str, str]:
        return self._r1.split(text, final) if self.thinking else ("", text)

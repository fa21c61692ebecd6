"""OpenAI's harmony format (gpt-oss), read from the decoded text (special tokens kept)::

    <|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Rome"}<|call|>

The prompt ends with ``<|start|>assistant``, so the first message opens at ``<|channel|>``. A message
ends at ``<|end|>``, ``<|call|>`` or ``<|return|>`` (the last two are stop tokens, so the output
usually just ends). Channels: ``analysis`` (chain of thought), ``commentary`` (tool calls, and
preambles meant for the user when it has no recipient), ``final`` (the answer).

``--tool-call-parser openai`` turns ``to=functions.NAME`` messages into calls;
``--reasoning-parser openai_gptoss`` (or ``gpt_oss``; implied by ``openai``, as vLLM reads gpt-oss
output as harmony whatever the flags) puts the analysis channel in ``reasoning_content``. Both
put the answer's text in the content, and keep every other message as written, so the one that
runs second still finds what it parses.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from ..parser_registry import held_tail
from .base import ParsedCall, ToolParse, ToolParser, call_with_arguments, register_tool_parser

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


@dataclass(frozen=True)
class Segment:
    """A piece of harmony text: a message (``channel`` or ``recipient`` set, or both), or text
    outside any message (``loose``). ``body`` is a message's text (so far, while ``closed`` is
    false); ``raw`` is the piece as written, markers and all."""

    raw: str
    body: str
    channel: str | None = None
    recipient: str | None = None
    loose: bool = False
    closed: bool = True

    @property
    def is_answer(self) -> bool:
        """Text for the user: the final channel, or a commentary preamble (no recipient)."""
        return not self.loose and self.recipient is None and self.channel in ("final", "commentary", None)

    @property
    def function(self) -> str | None:
        """The function a ``to=functions.NAME`` message calls."""
        return self.recipient.removeprefix("functions.") if self.recipient and \
            self.recipient.startswith("functions.") else None


def segments(text: str, final: bool) -> list[Segment]:
    """``text`` cut into messages and loose text. A message whose header is not complete yet ends
    the list (nothing of it is known); an unterminated last message is open until ``final``."""
    out: list[Segment] = []
    pos = 0
    while pos < len(text):
        begin = _next_start(text, pos)
        if begin < 0:
            tail = text[pos:]
            keep = tail[:len(tail) - held_tail(tail, (START, CHANNEL), final)]
            out += [Segment(keep, keep, loose=True)] if keep else []
            break
        if begin > pos:
            out.append(Segment(text[pos:begin], text[pos:begin], loose=True))
        header_end = text.find(MESSAGE, begin)
        if header_end < 0:  # the header is still being written
            out += [Segment(text[begin:], text[begin:], loose=True)] if final else []
            break
        seg, pos = _message(text, begin, header_end, final)
        out.append(seg)
        if not seg.closed:
            break
    return out


def _next_start(text: str, pos: int) -> int:
    found = [i for i in (text.find(START, pos), text.find(CHANNEL, pos)) if i >= 0]
    return min(found) if found else -1


def _message(text: str, begin: int, header_end: int, final: bool) -> tuple[Segment, int]:
    header = text[begin:header_end]
    channel = _CHANNEL.search(header)
    recipient = _RECIPIENT.search(header)
    body_start = header_end + len(MESSAGE)
    ends = [(i, m) for m in ENDS if (i := text.find(m, body_start)) >= 0]
    restart = text.find(START, body_start)  # a new message without an end marker ends this one
    ends += [(restart, "")] if restart >= 0 else []
    fields = dict(channel=channel.group(1) if channel else None, recipient=recipient.group(1) if recipient else None)
    if ends:
        stop, marker = min(ends)
        end = stop + len(marker)
        return Segment(text[begin:end], text[body_start:stop], **fields), end
    body = text[body_start:]
    body = body[:len(body) - held_tail(body, ENDS + (START,), final)]
    return Segment(text[begin:], body, closed=final, **fields), len(text)


@register_tool_parser("openai")
class OpenAIToolParser(ToolParser):
    """gpt-oss: a ``to=functions.NAME`` message whose text is a JSON object is a call (sent when the
    message ends); answer text is content; any other message stays in the content as written."""

    needs_special_tokens = True  # the harmony markers are special tokens
    reasoning_parser = "openai_gptoss"  # vLLM's gpt-oss serving command names no reasoning parser

    def parse(self, text: str, final: bool) -> ToolParse:
        content: list[str] = []
        calls: list[ParsedCall] = []
        for seg in segments(text, final):
            if seg.loose or seg.is_answer:
                content.append(seg.body)
                continue
            if not seg.closed:
                break  # a call or other message still being written
            call = self.known(call_with_arguments(seg.function, seg.body.strip())) if seg.function else None
            calls += [call] if call else []
            content += [] if call else [seg.raw]
        return ToolParse("".join(content), tuple(calls))

"""DeepSeek-V3 / R1-0528 and V3.1 formats (full-width bars and ``▁`` are part of the markers)::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

V3.1 drops the type and the code fence:
``<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>``.
Both are read under either name (``deepseek_v3``, ``deepseek_v31``); text before and after the
calls block is content.
"""
from __future__ import annotations

import re

from .base import ParsedCall, ToolParse, ToolParser, call_with_arguments, register_tool_parser, tagged_calls

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_V3_CALL = re.compile(r"\s*function" + SEP + r"([^\n]+)\n```json\n(.*)\n```\s*\Z", re.DOTALL)
_V31_CALL = re.compile(r"\s*([^\n<]+?)" + SEP + r"(.*)\Z", re.DOTALL)


@register_tool_parser("deepseek_v3")
@register_tool_parser("deepseek_v31")
class DeepSeekV3ToolParser(ToolParser):
    """A calls block goes out when ``<｜tool▁calls▁end｜>`` arrives; one whose calls do not all parse
    stays in the content, markers and all."""

    def parse(self, text: str, final: bool) -> ToolParse:
        return tagged_calls(text, final, CALLS_BEGIN, CALLS_END, self._block_calls)

    def _block_calls(self, body: str) -> list[ParsedCall] | None:
        inner = tagged_calls(body, True, CALL_BEGIN, CALL_END, self._one_call)
        return list(inner.calls) if inner.calls and not inner.content.strip() else None

    def _one_call(self, body: str) -> list[ParsedCall] | None:
        match = _V3_CALL.match(body) or _V31_CALL.match(body)
        if match is None:
            return None
        call = self.known(call_with_arguments(match.group(1).strip(), match.group(2).strip()))
        return [call] if call else None

"""Pythonic format (Llama 3.2 / Llama 4 / ToolACE): the whole output is a Python list of calls,
``[get_weather(city="Paris", unit="C"), get_time()]``, keyword arguments only.

It is read with ``ast.parse`` and never evaluated: an argument must be a literal (a string, number,
bool, None, or a list / dict / tuple of those). Anything else is plain content, as in vLLM.
"""
from __future__ import annotations

import ast
import io
import json
import tokenize

from .base import ParsedCall, ToolParse, ToolParser, register_tool_parser


class _NotACall(ValueError):
    pass


@register_tool_parser("pythonic")
class PythonicToolParser(ToolParser):
    """An output that starts with ``[`` is held back until its list closes; then it is all calls or
    all content. Text after the list's ``]`` is content."""

    def parse(self, text: str, final: bool) -> ToolParse:
        body = text.lstrip()
        if not body and not final:
            return ToolParse("")  # still undecided
        if not body.startswith("["):
            return ToolParse(text)
        end = _list_end(body)
        if end is None:
            return ToolParse(text if final else "")
        calls = self._calls(body[:end])
        if calls is None:
            return ToolParse(text if final else "")
        return ToolParse(body[end:] if final else "", tuple(calls))

    def _calls(self, source: str) -> list[ParsedCall] | None:
        try:
            tree = ast.parse(source, mode="eval").body
            if not isinstance(tree, ast.List) or not tree.elts:
                return None
            calls = [self.known(_call(node)) for node in tree.elts]
        except (SyntaxError, ValueError, TypeError):  # not a call, not a literal, not JSON (a set, bytes)
            return None
        return None if None in calls else calls


def _list_end(text: str) -> int | None:
    """Where the list opened by ``text[0]`` closes (just past its ``]``); None while it is open.
    Python's tokenizer finds the brackets, so ``]`` inside a string is not one."""
    depth = 0
    offsets = [0]
    for line in io.StringIO(text).readlines():  # the lines as the tokenizer reads them
        offsets.append(offsets[-1] + len(line))
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.OP and tok.string in "([{":
                depth += 1
            elif tok.type == tokenize.OP and tok.string in ")]}":
                depth -= 1
                if depth == 0:
                    row, col = tok.end
                    return offsets[row - 1] + col
            elif tok.type == tokenize.ERRORTOKEN and tok.string.strip():
                return None  # an unterminated string: still being written
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return None
    return None


def _call(node: ast.expr) -> ParsedCall:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        raise _NotACall("not a call by name with keyword arguments")
    if any(k.arg is None for k in node.keywords):
        raise _NotACall("**kwargs")
    args = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
    return ParsedCall(node.func.id, json.dumps(args, ensure_ascii=False, allow_nan=False))

"""From ``StructuredOutputsParams`` to xgrammar: the check at construction and the compilation.

Both go through the same per-kind conversion, so a spec that passes the check compiles. The
check builds the tokenizer-independent ``xgrammar.Grammar`` (a parse, well under a millisecond for
small specs) and turns xgrammar's ``RuntimeError`` into a ``ValueError`` naming the field.
"""
from __future__ import annotations

import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedllm.sampling_params import StructuredOutputsParams


def choice_ebnf(choices: list[str]) -> str:
    """``root ::= "a" | "b"``: JSON string escapes are EBNF string escapes."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


# Free whitespace between JSON tokens, at most this many characters per gap. Unbounded (xgrammar's
# default, and vLLM's unless disable_any_whitespace), a model sampled at temperature 1 can write
# "{" and then whitespace until max_tokens: the whitespace tokens are many and always allowed. 20
# is llama.cpp's bound for its JSON grammars (a newline and up to 20 spaces or tabs): pretty-printed
# JSON nested ten levels deep at indent 2 still fits, and every gap ends within 20 tokens.
JSON_MAX_WHITESPACE = 20


def check_spec_size(kind: str, size: int, limit: int) -> None:
    """ValueError naming ``max_structured_output_bytes`` when a spec of ``size`` bytes is over ``limit``."""
    if size > limit:
        raise ValueError(f"structured_outputs.{kind} is {size} bytes, over max_structured_output_bytes={limit}; "
                         "use a smaller spec (or start the engine with a larger limit)")


def raw_spec_size(fields: dict) -> tuple[str, int] | None:
    """``(kind, bytes)`` of the spec in StructuredOutputsParams' keyword arguments, measured as
    ``spec_bytes`` measures the constructed params (a JSON schema as compact JSON), without parsing
    it as a grammar: the server checks the size limit first, because the parse in the constructor of
    a 3 MB schema took 4.6 s (None when there is no spec or it is malformed: the constructor says why)."""
    for kind in ("json", "regex", "grammar", "choice"):
        spec = fields.get(kind)
        if spec is None:
            continue
        if kind == "choice":
            ok = isinstance(spec, (list, tuple)) and all(isinstance(c, str) for c in spec)
            return (kind, sum(len(c.encode()) for c in spec)) if ok else None
        if kind == "json":
            try:
                spec = json.dumps(json.loads(spec) if isinstance(spec, str) else spec, ensure_ascii=False)
            except (TypeError, ValueError):
                return None
        return (kind, len(spec.encode())) if isinstance(spec, str) else None
    return None


def spec_bytes(params: StructuredOutputsParams) -> int:
    """The size of the constraint's spec in UTF-8 bytes (a choice list: all choices together),
    which bounds what compiling it costs (``max_structured_output_bytes``)."""
    spec = getattr(params, params.kind)
    if isinstance(spec, bool):  # json_object
        return 0
    if isinstance(spec, list):
        return sum(len(c.encode()) for c in spec)
    return len(spec.encode())


# values that are data, not subschemas: a "maxLength" key inside them is not a keyword
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


def lengths_as_patterns(schema_json: str) -> str:
    """The schema with each string's ``minLength`` / ``maxLength`` written as a ``pattern``.

    xgrammar 0.2.9 compiles a length bound to a class that excludes only the quote, backslash, CR
    and LF, which lets raw control characters (U+0000-U+001F) into the string: the output is then
    not JSON, and ``json.loads`` refuses it (mlc-ai/xgrammar#800, open). Its ``pattern`` rule
    matches JSON string characters, so ``^.{m,n}$`` bounds the same number of characters and keeps
    control characters out. A string schema with its own ``pattern`` or ``format`` is left as it is.
    """
    return json.dumps(_rewrite_lengths(json.loads(schema_json)), ensure_ascii=False)


def _rewrite_lengths(node):
    if isinstance(node, list):
        return [_rewrite_lengths(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: value if key in _DATA_KEYWORDS else _rewrite_lengths(value) for key, value in node.items()}
    lo, hi = node.get("minLength", 0), node.get("maxLength")
    if "pattern" in node or "format" in node or not ("minLength" in node or "maxLength" in node):
        return node
    if not _is_count(lo) or not (hi is None or _is_count(hi)):  # a property named "maxLength", or invalid
        return node
    rest = {key: value for key, value in node.items() if key not in ("minLength", "maxLength")}
    return {**rest, "pattern": f"^.{{{lo},{'' if hi is None else hi}}}$"}


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def to_grammar(params: StructuredOutputsParams):
    """The xgrammar ``Grammar`` of the constraint (raises xgrammar's RuntimeError when invalid)."""
    import xgrammar as xgr
    kind = params.kind
    # disable_any_whitespace: xgrammar's compact separators (", " and ": "), no free whitespace
    whitespace = (dict(any_whitespace=False) if params.disable_any_whitespace
                  else dict(any_whitespace=True, max_whitespace_cnt=JSON_MAX_WHITESPACE))
    if kind == "json":
        return xgr.Grammar.from_json_schema(lengths_as_patterns(params.json), **whitespace)
    if kind == "json_object":  # an object (OpenAI's json_object), not any JSON value like the builtin grammar
        return xgr.Grammar.from_json_schema('{"type": "object"}', strict_mode=False, **whitespace)
    if kind == "regex":
        return xgr.Grammar.from_regex(params.regex)
    if kind == "choice":
        return xgr.Grammar.from_ebnf(choice_ebnf(params.choice))
    return xgr.Grammar.from_ebnf(params.grammar)


def check_grammar(params: StructuredOutputsParams) -> None:
    """ValueError naming the field when xgrammar cannot parse the schema, regex or grammar."""
    try:
        to_grammar(params)
    except RuntimeError as exc:
        raise ValueError(f"{params.kind}={_short(getattr(params, params.kind))} is invalid: "
                         f"{_reason(exc)}") from None


def _short(spec) -> str:
    text = repr(spec)
    return text if len(text) <= 120 else text[:117] + "..."


def _reason(exc: RuntimeError) -> str:
    """xgrammar's message without its ``[time] file.cc:line:`` prefix."""
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    last = lines[0] if lines else "rejected by xgrammar"
    return last.split(": ", 1)[1] if ".cc:" in last and ": " in last else last

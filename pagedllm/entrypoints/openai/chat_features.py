"""Chat-only features: tool definitions and tool_choice, the conversation handed to the chat
template, and the per-choice parser that turns generated text into ``reasoning_content``,
``content`` and ``tool_calls`` (streamed as OpenAI streams them).
"""
from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field
from typing import Any

from .reasoning_parsers import REASONING_PARSERS, ReasoningParser, get_reasoning_parser
from .request_fields import RequestFieldError
from .tool_parsers import TOOL_PARSERS, ParsedCall, ToolParser, get_tool_parser, tool_schemas
from .tool_parsers.forced import NamedCallParser, RequiredCallsParser

# apply_chat_template's own arguments: chat_template_kwargs may not override them
RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "tools", "documents", "chat_template",
                                       "add_generation_prompt", "continue_final_message", "tokenize", "padding",
                                       "truncation", "max_length", "return_tensors", "return_dict",
                                       "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens"})


@dataclass(frozen=True)
class ChatOptions:
    """The server's chat flags (vLLM's names): ``--enable-auto-tool-choice``, ``--tool-call-parser``,
    ``--reasoning-parser``; ``--trust-request-chat-template`` (else a request's own ``chat_template`` is
    refused: a template is code the server runs); ``--default-chat-template-kwargs`` (template variables a
    request's ``chat_template_kwargs`` override); ``--exclude-tools-when-tool-choice-none``;
    ``--chat-template-content-format`` (message content as a string or a list of parts; "auto": the
    one the template reads)."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    trust_request_chat_template: bool = False
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    exclude_tools_when_tool_choice_none: bool = False
    chat_template_content_format: str = "auto"

    def __post_init__(self):
        if self.chat_template_content_format not in CONTENT_FORMATS:
            raise ValueError(f"chat_template_content_format={self.chat_template_content_format!r} is invalid: "
                             f"must be one of {list(CONTENT_FORMATS)}")
        if self.tool_call_parser is not None:
            TOOL_PARSERS.check(self.tool_call_parser)
            if self.reasoning_parser is None:  # a format that comes with its reasoning (gpt-oss's harmony)
                object.__setattr__(self, "reasoning_parser", TOOL_PARSERS[self.tool_call_parser].reasoning_parser)
        if self.reasoning_parser is not None:
            REASONING_PARSERS.check(self.reasoning_parser)
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice=True needs tool_call_parser (--tool-call-parser NAME)")
        if not isinstance(self.default_chat_template_kwargs, dict):
            raise ValueError(f"default_chat_template_kwargs={self.default_chat_template_kwargs!r} is invalid: "
                             "must be a JSON object of template variables")
        clash = sorted(RESERVED_TEMPLATE_KWARGS & self.default_chat_template_kwargs.keys())
        if clash:
            raise ValueError(f"default_chat_template_kwargs may not set {clash}: they are request fields or "
                             "apply_chat_template's own arguments")


# ---------------------------------------------------------------------- tools and tool_choice
def resolve_tool_choice(tools: list | None, tool_choice: Any, options: ChatOptions) -> Any:
    """``"none"`` (tool calls are not parsed), ``"auto"``, ``"required"`` or the named function;
    refuses what cannot be honoured.

    OpenAI's default is ``auto`` when tools are given; ``auto`` needs a tool-call parser.
    ``required`` and a named function constrain the output to a call (``forced_call_schema``).
    """
    choice = tool_choice if tool_choice is not None else ("auto" if tools else "none")
    if isinstance(choice, str) and choice not in ("none", "auto", "required"):
        raise RequestFieldError(f"tool_choice={choice!r} is invalid: must be 'none', 'auto', 'required' or "
                                "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
    if choice != "none" and not tools:
        raise RequestFieldError(f"tool_choice={_show(choice)} needs a non-empty tools list", "tool_choice")
    if not isinstance(choice, str):
        _check_named(choice, tools)
    if choice == "auto" and not options.enable_auto_tool_choice:
        raise RequestFieldError("tool_choice='auto' (the default when tools are given) needs the server to run "
                                "with --enable-auto-tool-choice --tool-call-parser NAME; send tool_choice='none' "
                                "to only show the tools to the model", "tool_choice")
    return choice


def is_forced(tool_choice: Any) -> bool:
    return tool_choice not in ("none", "auto")


def _check_named(choice: Any, tools: list) -> None:
    name = choice.function.name
    if name not in {t.function.name for t in tools}:
        raise RequestFieldError(f"tool_choice names function {name!r}, which is not in tools", "tool_choice")


def _show(choice: Any) -> str:
    return repr(choice) if isinstance(choice, str) else json.dumps(choice.model_dump())


def check_tools(tools: list | None, tool_choice: Any) -> None:
    """Unique names, valid JSON schemas, and no ``strict`` under ``auto``, where arguments are parsed
    from free text (a forced call is constrained to the schema; ``none`` makes no calls)."""
    import jsonschema
    seen: set[str] = set()
    for i, tool in enumerate(tools or []):
        fn = tool.function
        if fn.name in seen:
            raise RequestFieldError(f"tools[{i}].function.name={fn.name!r} is a duplicate", "tools")
        seen.add(fn.name)
        if fn.strict and tool_choice == "auto":
            raise RequestFieldError(f"tools[{i}].function.strict=true needs tool_choice 'required' or a named "
                                    "function: under 'auto' arguments are parsed from free text, not constrained "
                                    "to the schema", "tools")
        try:
            jsonschema.validators.validator_for(fn.parameters or {}).check_schema(fn.parameters or {})
        except jsonschema.SchemaError as exc:
            raise RequestFieldError(f"tools[{i}].function.parameters is not a valid JSON schema: "
                                    f"{exc.message}", "tools") from None


def tools_for_template(tools: list | None) -> list[dict] | None:
    """The tool definitions as the chat template expects them (OpenAI's JSON)."""
    return [t.model_dump(exclude_none=True) for t in tools] if tools else None


# ---------------------------------------------------------------------- the conversation
def conversation_of(messages: list, text_of) -> list[dict]:
    """Messages as chat templates read them; tool-call arguments become dicts (templates ``tojson``
    them), so an assistant's earlier calls and the ``role: tool`` replies reach the model."""
    conversation = []
    for i, m in enumerate(messages):
        msg: dict[str, Any] = {"role": m.role, "content": text_of(m)}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.reasoning_content is not None:
            msg["reasoning_content"] = m.reasoning_content
        if m.tool_calls:
            msg["tool_calls"] = [_template_call(c, i) for c in m.tool_calls]
        conversation.append(msg)
    return conversation


def _template_call(call, i: int) -> dict:
    try:
        arguments = json.loads(call.function.arguments)
    except json.JSONDecodeError:
        raise RequestFieldError(f"messages[{i}].tool_calls: arguments of {call.function.name!r} are not valid "
                                f"JSON: {call.function.arguments!r}", "messages") from None
    return {"id": call.id, "type": call.type, "function": {"name": call.function.name, "arguments": arguments}}


# ---------------------------------------------------------------------- generated text -> message
def _tool_parser(options: ChatOptions, tool_choice: Any, tools: list | None) -> ToolParser | None:
    if tool_choice == "none":
        return None
    if tool_choice == "auto":
        return get_tool_parser(options.tool_call_parser, tools=tool_schemas(tools))
    if tool_choice == "required":
        return RequiredCallsParser()
    return NamedCallParser(tool_choice.function.name)


def keeps_special_tokens(options: ChatOptions, tool_choice: Any) -> bool:
    """Whether the parsers this request uses read special tokens (Mistral's ``[TOOL_CALLS]``,
    harmony's ``<|channel|>``): then its output is decoded with skip_special_tokens=False."""
    tools = tool_choice == "auto" and TOOL_PARSERS[options.tool_call_parser].needs_special_tokens
    thinks = options.reasoning_parser is not None and not is_forced(tool_choice) and \
        REASONING_PARSERS[options.reasoning_parser].needs_special_tokens
    return bool(tools or thinks)


@dataclass
class MessagePiece:
    """One streamed delta of a choice (the serving layer wraps it in a chunk)."""

    reasoning_content: str | None = None
    content: str | None = None
    tool_calls: list[dict] | None = None


@dataclass
class ChoiceParser:
    """Accumulates one choice's generated text and says what is new since the last call.

    Reasoning is split off first, then the content is searched for tool calls. Each complete
    call goes out as OpenAI streams it: a delta with ``index``, ``id``, ``type`` and the function
    ``name`` (arguments ``""``), then a delta with the argument text.
    """

    reasoning: ReasoningParser | None = None
    tools: ToolParser | None = None
    parallel_tool_calls: bool = True
    include_reasoning: bool = True
    text: str = ""
    sent_reasoning: int = 0
    sent_content: int = 0
    calls: list[tuple[str, ParsedCall]] = field(default_factory=list)

    @classmethod
    def for_request(cls, options: ChatOptions, tool_choice: Any, parallel: bool, include_reasoning: bool,
                    tools: list | None = None, chat_template_kwargs: dict | None = None):
        """A forced call is constrained JSON from the first token: no reasoning to split off."""
        thinks = options.reasoning_parser and not is_forced(tool_choice)
        reasoning = get_reasoning_parser(options.reasoning_parser, chat_template_kwargs=chat_template_kwargs) \
            if thinks else None
        return cls(reasoning, _tool_parser(options, tool_choice, tools), parallel, include_reasoning)

    def feed(self, delta: str, final: bool) -> list[MessagePiece]:
        """The pieces that ``delta`` (appended to the text so far) makes sendable."""
        if self.reasoning is None and self.tools is None:  # plain chat: the delta is the content, no
            return [MessagePiece(content=delta)] if delta else []  # text to keep and reparse per delta
        self.text += delta
        reasoning, content = self.reasoning.split(self.text, final) if self.reasoning else ("", self.text)
        calls: tuple[ParsedCall, ...] = ()
        if self.tools is not None:
            parsed = self.tools.parse(content, final)
            content, calls = parsed.content, parsed.calls
        pieces = []
        if len(reasoning) > self.sent_reasoning and self.include_reasoning:
            pieces.append(MessagePiece(reasoning_content=reasoning[self.sent_reasoning:]))
        self.sent_reasoning = len(reasoning)
        if len(content) > self.sent_content:
            pieces.append(MessagePiece(content=content[self.sent_content:]))
            self.sent_content = len(content)
        return pieces + self._new_calls(calls)

    def _new_calls(self, calls: tuple[ParsedCall, ...]) -> list[MessagePiece]:
        limit = None if self.parallel_tool_calls else 1
        pieces = []
        for call in calls[len(self.calls):limit]:
            index, call_id = len(self.calls), call.id or self.tools.call_id()
            self.calls.append((call_id, call))
            pieces.append(MessagePiece(tool_calls=[{"index": index, "id": call_id, "type": "function",
                                                    "function": {"name": call.name, "arguments": ""}}]))
            pieces.append(MessagePiece(tool_calls=[{"index": index, "function": {"arguments": call.arguments}}]))
        return pieces

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI reports ``tool_calls`` when a choice that called tools stopped by itself."""
        return "tool_calls" if reason == "stop" and self.calls else reason

    def message(self, text: str) -> dict:
        """The whole reply at once (non-streaming): the same parse as the stream's, joined."""
        pieces = self.feed(text, final=True)
        reasoning = "".join(p.reasoning_content for p in pieces if p.reasoning_content)
        content = "".join(p.content for p in pieces if p.content)
        calls = [{"id": cid, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                 for cid, c in self.calls]
        return {"content": None if calls and not content.strip() else content,
                "reasoning_content": (reasoning or None) if self.include_reasoning else None,
                "tool_calls": calls or None}


def load_chat_template(value: str | None) -> str | None:
    """A path to a template file, or the template itself."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if value.endswith((".jinja", ".jinja2", ".j2")):
        raise ValueError(f"chat_template={value!r}: file not found")
    return value


# ---------------------------------------------------------------------- message content format
CONTENT_FORMATS = ("auto", "string", "openai")


def content_for_template(text: str, content_format: str) -> str | list[dict]:
    """A message's text as the template reads it: a string, or OpenAI's list of parts ("openai")."""
    return [{"type": "text", "text": text}] if content_format == "openai" else text


@functools.lru_cache(maxsize=32)
def detect_content_format(template: str) -> str:
    """vLLM's ``--chat-template-content-format auto``: "openai" when the template loops over a
    message's ``content`` (a list of parts), else "string". The rule of vLLM's renderers/hf.py,
    following variables assigned from ``messages`` and the loops over them; its tracing of content
    passed through macro parameters is left out (such a template reads as "string")."""
    import jinja2
    from jinja2 import nodes
    try:
        root = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateSyntaxError:
        return "string"
    messages = {"messages"}
    changed = True
    while changed:  # {% set loop_messages = messages[1:] %} and the like
        changed = False
        for assign in root.find_all(nodes.Assign):
            if (isinstance(assign.target, nodes.Name) and assign.target.name not in messages
                    and any(_reads(assign.node, name) for name in messages)):
                messages.add(assign.target.name)
                changed = True
    items = {loop.target.name for loop in root.find_all(nodes.For)
             if isinstance(loop.target, nodes.Name) and any(_reads(loop.iter, name) for name in messages)}
    for loop in root.find_all(nodes.For):
        if any(_reads(loop.iter, item, "content") for item in items) or (
                isinstance(loop.iter, nodes.Name) and loop.iter.name == "content"):
            return "openai"
    return "string"


def _reads(node, varname: str, key: str | None = None) -> bool:
    """Whether ``node`` is ``varname`` (or its ``key`` item/attribute), through filters, tests and slices."""
    from jinja2 import nodes
    if isinstance(node, (nodes.Filter, nodes.Test)):
        return node.node is not None and _reads(node.node, varname, key)
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
        return _reads(node.node, varname, key)
    if key is None:
        return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == varname
    if isinstance(node, nodes.Getitem):
        return _reads(node.node, varname) and isinstance(node.arg, nodes.Const) and node.arg.value == key
    return isinstance(node, nodes.Getattr) and _reads(node.node, varname) and node.attr == key

"""OpenAI's Responses API: ``POST /v1/responses``, ``GET`` / ``DELETE /v1/responses/{id}``,
``GET /v1/responses/{id}/input_items`` and ``POST /v1/responses/{id}/cancel``.

A Responses request becomes a chat request (instructions -> a system message, input items ->
messages, function tools -> chat tools, ``text.format`` -> ``response_format``) and runs through
the chat path: the same template rendering, tokenization, SamplingParams, tool-call and reasoning
parsers, and abort when the client goes away. The parsed reply becomes output items: ``reasoning``,
``message`` (``output_text`` parts) and ``function_call``; streamed, the same items are built by
OpenAI's typed events, each with its ``sequence_number``.

Replies are kept (``store``, true by default) in a bounded in-memory LRU store
(``--responses-store-size``) so they can be retrieved and continued with ``previous_response_id``:
a follow-up sees the stored conversation (its inputs and reply, not its instructions, as OpenAI
does) before its own input. Fields this server cannot honour are refused with a 400 naming them:
``background`` (so there is nothing to cancel, nor a stream to resume), ``truncation="auto"``,
``include``, ``reasoning.effort``/``summary``, ``text.verbosity`` other than medium,
``max_tool_calls``, ``top_logprobs``, ``stream_options.include_obfuscation``.
"""
from __future__ import annotations

import argparse
import itertools
import json
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, FastAPI, Request

from pagedllm.entrypoints.http_common import with_cancellation
from pagedllm.outputs import RequestOutput
from pagedllm.utils import check_int

from .chat_features import ChoiceParser, MessagePiece, check_tools, resolve_tool_choice
from .protocol import (
    ChatCompletionRequest,
    ChatMessage,
    ChatTool,
    FunctionCall,
    FunctionDefinition,
    NamedFunction,
    NamedToolChoice,
    ToolCall,
)
from .request_fields import RequestFieldError
from .responses_protocol import (
    DeletedResponse,
    FunctionCallItem,
    FunctionCallOutputItem,
    IncompleteDetails,
    InputItem,
    InputTokensDetails,
    MessageItem,
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputReasoning,
    OutputReasoningText,
    OutputText,
    OutputTokensDetails,
    ReasoningItem,
    ResponseError,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from .serving import OpenAIServing, RequestGroup, ServingError, check_fields, collect, start_streaming

DEFAULT_STORE_SIZE = 1024
# chat-path names of the request fields -> the Responses names a 400 shows
_PARAMS = {"messages": "input", "prompt": "input", "max_tokens": "max_output_tokens",
           "max_completion_tokens": "max_output_tokens", "response_format": "text"}

router = APIRouter()


# ---------------------------------------------------------------------- the store
@dataclass
class StoredResponse:
    """A kept reply, the conversation a follow-up continues (inputs and reply, no instructions) and
    the request's own input items as ``GET /v1/responses/{id}/input_items`` lists them."""

    response: ResponseObject
    conversation: list[ChatMessage]
    input_items: list[dict] = field(default_factory=list)


class ResponseStore:
    """Replies by id, least recently used evicted first beyond ``capacity``.

    Only the event loop touches it (no awaits inside its methods), so it needs no lock.
    """

    def __init__(self, capacity: int = DEFAULT_STORE_SIZE):
        check_int("responses_store_size", capacity, 1)
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def put(self, response_id: str, entry: StoredResponse) -> None:
        self._entries[response_id] = entry
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def delete(self, response_id: str) -> bool:
        return self._entries.pop(response_id, None) is not None


# ---------------------------------------------------------------------- request -> chat request
def refuse_unsupported(req: ResponsesRequest) -> None:
    """Fields accepted only at their no-op values (each refusal names the field)."""
    refusals = [
        (req.background, "background", "background=true (this server runs every response in its request)"),
        (req.truncation == "auto", "truncation", "truncation='auto' (a prompt longer than the context is a 400)"),
        (req.include, "include", f"include={req.include!r} (no extra output data is produced)"),
        (req.max_tool_calls is not None, "max_tool_calls", "max_tool_calls"),
        (req.top_logprobs, "top_logprobs", "top_logprobs"),
        (req.reasoning and (req.reasoning.effort or req.reasoning.summary or req.reasoning.generate_summary),
         "reasoning", "reasoning.effort / reasoning.summary (the model reasons as its chat template says; "
                      "with --reasoning-parser its reasoning is returned as a reasoning item)"),
        (req.text and req.text.verbosity not in (None, "medium"), "text", "text.verbosity other than 'medium'"),
        (req.stream_options and req.stream_options.include_obfuscation, "stream_options",
         "stream_options.include_obfuscation=true"),
        (req.stream_options is not None and not req.stream, "stream_options", "stream_options without stream=true"),
    ]
    for condition, param, what in refusals:
        if condition:
            raise ServingError(f"{what} is not supported by this server", 400, param)


def input_messages(items: str | list[InputItem]) -> list[ChatMessage]:
    """Input items as chat messages: a developer message is a system message, a ``function_call``
    joins the assistant message before it (or starts one), a ``function_call_output`` is a
    ``role: tool`` message, and reasoning goes to the next assistant message."""
    if isinstance(items, str):
        return [ChatMessage(role="user", content=items)]
    messages: list[ChatMessage] = []
    reasoning: str | None = None
    for item in items:
        if isinstance(item, ReasoningItem):
            reasoning = (reasoning or "") + "".join(part.text for part in item.content or [])
            continue
        if isinstance(item, FunctionCallItem):
            call = ToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
            if messages and messages[-1].role == "assistant" and reasoning is None:
                messages[-1].tool_calls = [*(messages[-1].tool_calls or []), call]
                continue
            message = ChatMessage(role="assistant", tool_calls=[call])
        elif isinstance(item, FunctionCallOutputItem):
            message = ChatMessage(role="tool", tool_call_id=item.call_id, content=_joined(item.output))
        else:
            message = _message(item)
        if reasoning is not None and message.role == "assistant":
            message.reasoning_content, reasoning = reasoning, None
        messages.append(message)
    if reasoning is not None:
        messages.append(ChatMessage(role="assistant", content="", reasoning_content=reasoning))
    return messages


_ITEM_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def listed_items(items: str | list[InputItem]) -> list[dict]:
    """Input items as OpenAI lists them: each with an id and a status, a message's text as a part."""
    if isinstance(items, str):
        items = [MessageItem(role="user", content=items)]
    listed = []
    for item in items:
        entry = item.model_dump(by_alias=True, exclude_none=True)
        entry.setdefault("id", _new_id(_ITEM_ID_PREFIXES[item.type]))
        entry.setdefault("status", "completed")
        if isinstance(item, MessageItem) and isinstance(item.content, str):
            part = OutputText(text=item.content).model_dump() if item.role == "assistant" else \
                {"type": "input_text", "text": item.content}
            entry["content"] = [part]
        listed.append(entry)
    return listed


def _message(item: MessageItem) -> ChatMessage:
    # chat templates know system, user and assistant: developer instructions are the system's
    return ChatMessage(role="system" if item.role == "developer" else item.role, content=_joined(item.content))


def _joined(content: str | list) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


def chat_request_of(req: ResponsesRequest, messages: list[ChatMessage], model: str) -> ChatCompletionRequest:
    """The chat request that runs a Responses request (its prompt is ``messages``)."""
    tools = [ChatTool(type="function", function=FunctionDefinition(
        name=t.name, description=t.description, parameters=t.parameters, strict=t.strict)) for t in req.tools or []]
    choice = req.tool_choice
    if choice is not None and not isinstance(choice, str):
        choice = NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
    sampling = {name: getattr(req, name) for name in ("temperature", "top_p", "seed", "top_k", "min_p",
                                                      "repetition_penalty", "presence_penalty",
                                                      "frequency_penalty", "stop", "user")}
    return ChatCompletionRequest(model=model, messages=messages, max_completion_tokens=req.max_output_tokens,
                                 stream=req.stream, tools=tools or None, tool_choice=choice,
                                 parallel_tool_calls=req.parallel_tool_calls, response_format=_response_format(req),
                                 priority=req.priority, cache_salt=req.cache_salt, **sampling)


def _response_format(req: ResponsesRequest) -> dict | None:
    fmt = req.text.format if req.text else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    spec = {"name": fmt.name, "schema": fmt.schema_, "description": fmt.description, "strict": fmt.strict}
    return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if v is not None}}


def as_responses_error(exc: ServingError | RequestFieldError) -> ServingError:
    """A chat-path error under the Responses field names (messages -> input, max_tokens ->
    max_output_tokens, response_format -> text, tools[i].function.x -> tools[i].x)."""
    message, param = (exc.message, exc.param) if isinstance(exc, ServingError) else (str(exc), exc.param)
    status = exc.status if isinstance(exc, ServingError) else 400
    leading = re.match(r"[A-Za-z_]+", message)
    if leading and leading.group(0) in _PARAMS:
        message = _PARAMS[leading.group(0)] + message[leading.end():]
    return ServingError(message.replace("].function.", "]."), status, _PARAMS.get(param, param))


# ---------------------------------------------------------------------- output items and events
def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class OutputBuilder:
    """Builds a reply's output items from its parsed pieces, and says which stream events build them.

    One item is open at a time; a piece of another kind closes it. Content that is only whitespace
    waits until more content comes (a message of only whitespace around tool calls is dropped, as
    the chat reply drops it). The non-streamed reply is built by the same code from the whole text,
    so the streamed and non-streamed items agree.
    """

    items: list[OutputItem] = field(default_factory=list)
    open: OutputItem | None = None
    blank: str = ""  # content held back while it is only whitespace
    called: bool = False

    def add(self, pieces: list[MessagePiece]) -> list[dict]:
        events: list[dict] = []
        for piece in pieces:
            if piece.reasoning_content:
                events += self._text(OutputReasoning, piece.reasoning_content)
            if piece.content:
                events += self._content(piece.content)
            for call in piece.tool_calls or []:
                events += self._call(call)
        return events

    def finish(self, incomplete: bool) -> list[dict]:
        """Closes the open item (``incomplete``: cut by the token limit); a reply without a call
        always has a message, possibly empty."""
        events = []
        if not self.called and (self.blank or not any(isinstance(i, OutputMessage) for i in self.items)):
            events += self._open(OutputMessage) + self._delta(self.blank)
            self.blank = ""
        return events + self._close("incomplete" if incomplete else "completed")

    def _content(self, text: str) -> list[dict]:
        if isinstance(self.open, OutputMessage):
            return self._delta(text)
        self.blank += text
        if not self.blank.strip():
            return []
        text, self.blank = self.blank, ""
        return self._text(OutputMessage, text)

    def _text(self, kind: type, text: str) -> list[dict]:
        events = [] if isinstance(self.open, kind) else self._open(kind)
        return events + self._delta(text)

    def _open(self, kind: type) -> list[dict]:
        events = self._close("completed")
        index = len(self.items)
        part = OutputText(text="") if kind is OutputMessage else OutputReasoningText(text="")
        self.open = kind(id=_new_id("msg" if kind is OutputMessage else "rs"), status="in_progress", content=[part])
        self.items.append(self.open)
        added = {**self.open.model_dump(), "content": []}  # the part is added by its own event
        return events + [_event("response.output_item.added", output_index=index, item=added),
                         _event("response.content_part.added", item_id=self.open.id, output_index=index,
                                content_index=0, part=part.model_dump())]

    def _delta(self, text: str) -> list[dict]:
        item, index = self.open, len(self.items) - 1
        item.content[0].text += text
        if not text:
            return []
        if isinstance(item, OutputMessage):
            return [_event("response.output_text.delta", item_id=item.id, output_index=index, content_index=0,
                           delta=text, logprobs=[])]
        return [_event("response.reasoning_text.delta", item_id=item.id, output_index=index, content_index=0,
                       delta=text)]

    def _call(self, call: dict) -> list[dict]:
        if "id" in call:  # the call's head: its id and name; its arguments follow
            events = self._close("completed")
            self.called, self.blank = True, ""
            self.open = OutputFunctionCall(id=_new_id("fc"), call_id=call["id"], name=call["function"]["name"],
                                           arguments="", status="in_progress")
            self.items.append(self.open)
            return events + [_event("response.output_item.added", output_index=len(self.items) - 1,
                                    item=self.open.model_dump())]
        self.open.arguments += call["function"]["arguments"]
        return [_event("response.function_call_arguments.delta", item_id=self.open.id,
                       output_index=len(self.items) - 1, delta=call["function"]["arguments"])]

    def _close(self, status: str) -> list[dict]:
        item, index = self.open, len(self.items) - 1
        if item is None:
            return []
        self.open, item.status = None, status
        if isinstance(item, OutputFunctionCall):
            events = [_event("response.function_call_arguments.done", item_id=item.id, output_index=index,
                             name=item.name, arguments=item.arguments)]
        else:
            part = item.content[0]
            kind = "output_text" if isinstance(item, OutputMessage) else "reasoning_text"
            done = {"logprobs": []} if isinstance(item, OutputMessage) else {}
            events = [_event(f"response.{kind}.done", item_id=item.id, output_index=index, content_index=0,
                             text=part.text, **done),
                      _event("response.content_part.done", item_id=item.id, output_index=index, content_index=0,
                             part=part.model_dump())]
        return events + [_event("response.output_item.done", output_index=index, item=item.model_dump())]


def _event(kind: str, **fields) -> dict:
    return {"type": kind, **fields}


def assistant_message(items: list[OutputItem]) -> ChatMessage:
    """A reply's items as the assistant turn a follow-up (``previous_response_id``) shows the model."""
    text = "".join(i.content[0].text for i in items if isinstance(i, OutputMessage) and i.content)
    reasoning = "".join(i.content[0].text for i in items if isinstance(i, OutputReasoning) and i.content)
    calls = [ToolCall(id=i.call_id, function=FunctionCall(name=i.name, arguments=i.arguments))
             for i in items if isinstance(i, OutputFunctionCall)]
    return ChatMessage(role="assistant", content=text if text or not calls else None,
                       reasoning_content=reasoning or None, tool_calls=calls or None)


# ---------------------------------------------------------------------- one response in flight
@dataclass
class PendingResponse:
    """What a response accumulates while it runs: its items, token counts and finish."""

    id: str
    model: str
    req: ResponsesRequest
    tool_choice: Any
    conversation: list[ChatMessage]  # history and this request's input (no instructions)
    parser: ChoiceParser
    created_at: int = field(default_factory=lambda: int(time.time()))
    builder: OutputBuilder = field(default_factory=OutputBuilder)
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    finish_reason: str | None = None

    def observe(self, out: RequestOutput) -> list[dict]:
        """One engine output (a delta when streaming, the whole reply otherwise): its events."""
        c = out.outputs[0]
        self.input_tokens, self.cached_tokens = len(out.prompt_token_ids), out.num_cached_tokens
        self.output_tokens += len(c.token_ids)
        events = self.builder.add(self.parser.feed(c.text, final=c.finish_reason is not None))
        if c.finish_reason is not None:
            self.finish_reason = c.finish_reason
            events += self.builder.finish(incomplete=c.finish_reason == "length")
        return events

    def response(self, status: str, usage: ResponseUsage | None = None, error: ResponseError | None = None,
                 output: list[OutputItem] | None = None) -> ResponseObject:
        req, choice = self.req, self.tool_choice
        return ResponseObject(
            id=self.id, created_at=self.created_at, status=status, model=self.model,
            output=self.builder.items if output is None else output, usage=usage, error=error,
            completed_at=int(time.time()) if status == "completed" else None,
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None,
            instructions=req.instructions, max_output_tokens=req.max_output_tokens, metadata=req.metadata or {},
            parallel_tool_calls=req.parallel_tool_calls, previous_response_id=req.previous_response_id,
            reasoning=req.reasoning.model_dump() if req.reasoning else None, store=req.store,
            temperature=req.temperature, top_p=req.top_p, user=req.user, safety_identifier=req.safety_identifier,
            text=req.text.model_dump(by_alias=True, exclude_none=True) if req.text else {"format": {"type": "text"}},
            tool_choice=choice if isinstance(choice, str) else {"type": "function", "name": choice.function.name},
            tools=[t.model_dump(exclude_none=True) for t in req.tools or []], truncation=req.truncation or "disabled")

    def final(self, tokenizer) -> ResponseObject:
        """The finished reply; ``reasoning_tokens`` counts the reasoning text re-encoded (the engine
        counts tokens, not which part of the text they became)."""
        if self.finish_reason == "abort":
            return self.response("failed", error=ResponseError(code="server_error", message="the request was aborted"))
        reasoning = "".join(i.content[0].text for i in self.builder.items if isinstance(i, OutputReasoning))
        reasoning_tokens = len(tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
        usage = ResponseUsage(input_tokens=self.input_tokens,
                              input_tokens_details=InputTokensDetails(cached_tokens=self.cached_tokens),
                              output_tokens=self.output_tokens,
                              output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning_tokens),
                              total_tokens=self.input_tokens + self.output_tokens)
        return self.response("incomplete" if self.finish_reason == "length" else "completed", usage)


# ---------------------------------------------------------------------- the handlers
class ResponsesServing:
    """The Responses endpoints over the server's chat path (``OpenAIServing``) and a ResponseStore."""

    def __init__(self, serving: OpenAIServing, store: ResponseStore):
        self.serving, self.store = serving, store

    async def create(self, req: ResponsesRequest, arrival: float):
        """``POST /v1/responses``: a Response object, or its events when streaming."""
        pending, chat = self._prepare(req)
        try:
            group = await self.serving.start_chat(pending.id, chat, arrival, pending.tool_choice)
        except (ServingError, RequestFieldError) as exc:
            raise as_responses_error(exc) from None
        if req.stream:
            return await start_streaming(self._events(group, pending), "text/event-stream")
        for out in await collect(group):
            pending.observe(out)
        return self._finished(pending)

    def _prepare(self, req: ResponsesRequest) -> tuple[PendingResponse, ChatCompletionRequest]:
        """Checks everything that can be checked before the engine sees the request."""
        model = self.serving.check_model(req.model)
        check_fields(req)
        refuse_unsupported(req)
        conversation = self._history(req.previous_response_id) + input_messages(req.input)
        system = [ChatMessage(role="system", content=req.instructions)] if req.instructions is not None else []
        chat = chat_request_of(req, system + conversation, model)
        try:
            tool_choice = resolve_tool_choice(chat.tools, chat.tool_choice, self.serving.chat_options)
            check_tools(chat.tools, tool_choice)
        except RequestFieldError as exc:
            raise as_responses_error(exc) from None
        parser = ChoiceParser.for_request(self.serving.chat_options, tool_choice, req.parallel_tool_calls, True)
        return PendingResponse(_new_id("resp"), model, req, tool_choice, conversation, parser), chat

    def _history(self, previous_id: str | None) -> list[ChatMessage]:
        if previous_id is None:
            return []
        entry = self.store.get(previous_id)
        if entry is None:
            raise ServingError(f"Previous response with id {previous_id!r} not found (never stored, store=false, "
                               "deleted, or evicted from this server's --responses-store-size most recent)",
                               404, "previous_response_id")
        return list(entry.conversation)

    def _finished(self, pending: PendingResponse) -> ResponseObject:
        response = pending.final(self.serving.tokenizer)
        if pending.req.store and response.status in ("completed", "incomplete"):
            conversation = [*pending.conversation, assistant_message(response.output)]
            self.store.put(response.id, StoredResponse(response, conversation, listed_items(pending.req.input)))
        return response

    async def _events(self, group: RequestGroup, pending: PendingResponse) -> AsyncIterator[str]:
        """OpenAI's stream: created, in_progress, the items' events, then completed (incomplete or
        failed); an error after the first event becomes an ``error`` event and ``response.failed``."""
        seq = itertools.count()

        def sse(event: dict) -> str:
            event["sequence_number"] = next(seq)
            return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"
        try:
            start = pending.response("in_progress", output=[]).model_dump()
            yield sse(_event("response.created", response=start))
            yield sse(_event("response.in_progress", response=start))
            async for _, out in group.outputs():
                for event in pending.observe(out):
                    yield sse(event)
            response = self._finished(pending)
            kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
                response.status, "response.failed")
            yield sse(_event(kind, response=response.model_dump()))
        except Exception as exc:
            status = exc.status if isinstance(exc, ServingError) else 500
            yield sse(_event("error", code=str(status), message=str(exc), param=getattr(exc, "param", None)))
            failed = pending.response("failed", error=ResponseError(code="server_error", message=str(exc)))
            yield sse(_event("response.failed", response=failed.model_dump()))
        finally:
            group.close()

    def retrieve(self, response_id: str, query: dict[str, str]) -> ResponseObject:
        """``GET /v1/responses/{id}``; resuming a stream (``stream``, ``starting_after``) needs
        background responses, which this server does not run."""
        query = dict(query)
        if query.get("stream", "").lower() == "false":
            del query["stream"]
        _refuse_query(query, " (streaming a stored response needs background=true, which this server does not run)")
        return self._stored(response_id).response

    def input_items(self, response_id: str, query: dict[str, str]) -> dict:
        """``GET /v1/responses/{id}/input_items``: OpenAI's cursor page (``after``, ``limit`` 1-100,
        default 20, ``order`` asc or desc, default desc)."""
        items = self._stored(response_id).input_items
        query = dict(query)
        order, limit, after = query.pop("order", "desc"), query.pop("limit", "20"), query.pop("after", None)
        _refuse_query(query)
        if order not in ("asc", "desc"):
            raise ServingError(f"order={order!r} is invalid: use 'asc' or 'desc'", 400, "order")
        if not limit.isdigit() or not 1 <= int(limit) <= 100:
            raise ServingError(f"limit={limit!r} is invalid: must be an integer in [1, 100]", 400, "limit")
        items = items if order == "asc" else items[::-1]
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise ServingError(f"after={after!r} is not an input item of response {response_id!r}", 400, "after")
            items = items[ids.index(after) + 1:]
        page = items[:int(limit)]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(items) > len(page)}

    def delete(self, response_id: str) -> DeletedResponse:
        self._stored(response_id)
        self.store.delete(response_id)
        return DeletedResponse(id=response_id)

    def cancel(self, response_id: str) -> None:
        """Only a background response can be cancelled, and this server runs none: a stored one has finished."""
        self._stored(response_id)
        raise ServingError(f"Cannot cancel response {response_id!r}: only background responses can be cancelled "
                           "(this one has finished)", 400, "response_id")

    def _stored(self, response_id: str) -> StoredResponse:
        entry = self.store.get(response_id)
        if entry is None:
            raise ServingError(f"Response with id {response_id!r} not found", 404, "response_id")
        return entry


def _refuse_query(query: dict[str, str], why: str = "") -> None:
    for name, value in query.items():
        raise ServingError(f"query parameter {name}={value!r} is not supported by this server{why}", 400, name)


# ---------------------------------------------------------------------- routes and set-up
def _responses(raw: Request) -> ResponsesServing:
    return raw.app.state.responses


async def _cancellable(raw: Request, handler):
    return await with_cancellation(raw, handler)


@router.post("/v1/responses")
async def create_response(request: ResponsesRequest, raw: Request):
    return await _cancellable(raw, _responses(raw).create(request, time.time()))


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, raw: Request):
    return _responses(raw).retrieve(response_id, dict(raw.query_params))


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(response_id: str, raw: Request):
    return _responses(raw).input_items(response_id, dict(raw.query_params))


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, raw: Request):
    return _responses(raw).delete(response_id)


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, raw: Request):
    return _responses(raw).cancel(response_id)


def add_responses_api(app: FastAPI, store_size: int = DEFAULT_STORE_SIZE) -> None:
    """Adds the Responses routes to a server app (``app.state.serving`` must be set)."""
    app.state.responses = ResponsesServing(app.state.serving, ResponseStore(store_size))
    app.include_router(router)


def add_responses_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("responses API")
    g.add_argument("--responses-store-size", type=int, default=DEFAULT_STORE_SIZE,
                   help="how many /v1/responses replies (store=true) are kept in memory for retrieval and "
                        "previous_response_id; the least recently used are dropped first")

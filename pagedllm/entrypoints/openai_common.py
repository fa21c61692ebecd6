"""What the OpenAI-compatible server and the router share: error bodies, server-sent events, handler
cancellation on disconnect, and chat-template loading and rendering.

Both import this module; neither imports the other (the router forwards to servers, it does not run
one), so the router renders a chat prompt with the very function the server uses and its prefix
hashes are the replicas' own.
"""
from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Awaitable

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from .openai.chat_features import conversation_of, tools_for_template
from .openai.protocol import ChatCompletionRequest, ChatMessage
from .openai.request_fields import RequestFieldError

_ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "not_found_error",
                500: "server_error", 503: "service_unavailable"}
# apply_chat_template's own arguments: chat_template_kwargs may not override them
RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "tools", "documents", "chat_template",
                                      "add_generation_prompt", "continue_final_message", "tokenize", "padding",
                                      "truncation", "max_length", "return_tensors", "return_dict",
                                      "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens"})


# ---------------------------------------------------------------------- errors
def error_body(message: str, status: int, param: str | None = None, code: str | int | None = None) -> dict:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code if code is not None else status}}


class ServingError(Exception):
    """An error with its HTTP status; the app turns it into an OpenAI-style error response."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.status, self.param, self.code), status_code=self.status)


# ---------------------------------------------------------------------- streaming and cancellation
def sse(data: dict | str) -> str:
    """One server-sent event: ``data: <json or text>`` and a blank line."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


async def with_cancellation(raw: Request, handler: Awaitable):
    """Runs a handler, cancelling it if the client disconnects first (its requests are aborted).

    Starlette cancels a streaming body on disconnect by itself, but a plain handler keeps
    running; this races it against the ``http.disconnect`` message.
    """
    task = asyncio.ensure_future(handler)
    watcher = asyncio.ensure_future(_disconnected(raw))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        return Response(status_code=499)  # nobody is listening any more
    return task.result()


async def _disconnected(raw: Request) -> None:
    while (await raw.receive())["type"] != "http.disconnect":
        pass


# ---------------------------------------------------------------------- chat templates
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


def template_options(req: ChatCompletionRequest) -> dict:
    """The request's template inputs: its own template, tools, documents, continue_final_message
    and ``chat_template_kwargs`` (e.g. ``enable_thinking``), which reach the template as variables."""
    if req.continue_final_message and req.add_generation_prompt:
        raise ServingError("continue_final_message=true needs add_generation_prompt=false (the reply "
                           "continues the last message instead of starting a new one)", 400,
                           "continue_final_message")
    extra = dict(req.chat_template_kwargs or {})
    clash = sorted(RESERVED_TEMPLATE_KWARGS & extra.keys())
    if clash:
        raise ServingError(f"chat_template_kwargs may not set {clash}: they are request fields or "
                           "apply_chat_template's own arguments", 400, "chat_template_kwargs")
    return dict(extra, template=req.chat_template, tools=tools_for_template(req.tools),
                documents=req.documents, continue_final_message=req.continue_final_message)


def render_chat(tokenizer, server_template: str | None, messages: list[ChatMessage], add_generation_prompt: bool,
                template: str | None = None, **kwargs) -> str:
    """The chat template (``template``, else ``server_template``, else the tokenizer's) applied to the
    messages: the prompt text. The one rendering path of the server (and of the router, which must
    see the same tokens). ``kwargs`` go to ``apply_chat_template`` (tools, template variables)."""
    template = template if template is not None else server_template
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise ServingError("this model's tokenizer has no chat template; start the server with "
                           "--chat-template FILE_OR_STRING", 400, "messages")
    if not messages:
        raise ServingError("messages must not be empty", 400, "messages")
    try:
        conversation = conversation_of(messages, message_text)
    except RequestFieldError as exc:
        raise ServingError(str(exc), 400, exc.param) from None
    try:
        return tokenizer.apply_chat_template(conversation, chat_template=template,
                                             add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs)
    except Exception as exc:  # jinja errors (raise_exception in a template)
        raise ServingError(f"cannot apply the chat template: {exc}", 400, "messages") from None


def message_text(m: ChatMessage) -> str:
    """A message's text: its string content, or its text parts joined (other parts are refused)."""
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    if any(p.type != "text" for p in m.content):
        raise ServingError("only text content parts are supported", 400, "messages")
    return "".join(p.text or "" for p in m.content)

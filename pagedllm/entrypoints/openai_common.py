"""The chat prompt as the server renders it, shared by the server and the router: the request's
template inputs, the rendering itself, and the error it raises (``ServingError``, an OpenAI-style
error with its HTTP status).

Both import this module; neither imports the other (the router forwards to servers, it does not run
one), so the router renders a chat prompt with the very function the server uses and its prefix
hashes are the replicas' own.
"""
from __future__ import annotations

from fastapi.responses import JSONResponse

from .http_common import error_body
from .openai.chat_features import (
    RESERVED_TEMPLATE_KWARGS,
    content_for_template,
    conversation_of,
    detect_content_format,
    tools_for_template,
)
from .openai.protocol import ChatCompletionRequest, ChatMessage
from .openai.request_fields import RequestFieldError


class ServingError(Exception):
    """An error with its HTTP status; the app turns it into an OpenAI-style error response."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None,
                 type_: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.code, self.type = message, status, param, code, type_

    def body(self) -> dict:
        return error_body(self.message, self.status, self.param, self.code, self.type)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


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
                template: str | None = None, content_format: str = "auto", image_placeholder: str | None = None,
                video_placeholder: str | None = None, **kwargs) -> str:
    """The chat template (``template``, else ``server_template``, else the tokenizer's) applied to the
    messages: the prompt text. The one rendering path of the server (and of the router, which must
    see the same tokens). ``content_format`` (--chat-template-content-format): message content as a
    string, OpenAI's list of parts, or whichever the template reads ("auto"). ``image_placeholder``: a
    vision-language model's image text, for ``image_url`` parts (``video_placeholder``: its video
    text, for ``video_url`` parts, where it takes videos). ``kwargs`` go to
    ``apply_chat_template`` (tools, template variables)."""
    template = template if template is not None else server_template
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise ServingError("this model's tokenizer has no chat template; start the server with "
                           "--chat-template FILE_OR_STRING", 400, "messages")
    if not messages:
        raise ServingError("messages must not be empty", 400, "messages")
    if content_format == "auto":
        text = template if template is not None else tokenizer.chat_template
        content_format = detect_content_format(text) if isinstance(text, str) else "string"

    def content_of(m: ChatMessage) -> str | list[dict]:
        text = message_text(m, image_placeholder, video_placeholder)
        return content_for_template(text, content_format) if m.content is not None else ""
    try:
        conversation = conversation_of(messages, content_of)
    except RequestFieldError as exc:
        raise ServingError(str(exc), 400, exc.param) from None
    try:
        return tokenizer.apply_chat_template(conversation, chat_template=template,
                                             add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs)
    except Exception as exc:  # jinja errors (raise_exception in a template)
        raise ServingError(f"cannot apply the chat template: {exc}", 400, "messages") from None


def message_text(m: ChatMessage, image_placeholder: str | None = None, video_placeholder: str | None = None) -> str:
    """A message's text; each ``image_url`` part becomes the model's image placeholder and a newline
    (a vision-language model only: ``image_placeholder``), each ``video_url`` part its video
    placeholder (``video_placeholder``: a model that takes videos)."""
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    return "".join(_part_text(p, image_placeholder, video_placeholder) for p in m.content)


def _part_text(part, image_placeholder: str | None, video_placeholder: str | None) -> str:
    if part.type == "text":
        return part.text or ""
    if part.type == "image_url" and part.image_url is not None:
        if image_placeholder is None:
            raise ServingError("this model takes text only: image_url content parts need a vision-language model",
                               400, "messages")
        return image_placeholder + "\n"
    if part.type == "video_url" and part.video_url is not None:
        if video_placeholder is None:
            raise ServingError("this model does not take videos: video_url content parts need a model that does "
                               "(Qwen2-VL, Qwen2.5-VL)", 400, "messages")
        return video_placeholder + "\n"
    raise ServingError(f"content part type {part.type!r} is not supported: 'text', 'image_url' or 'video_url' (with "
                       "its image_url / video_url object)", 400, "messages")

"""Pydantic models of OpenAI's Responses API (``POST /v1/responses``).

The request is validated like the chat request (strict types, finite numbers, unknown top-level
fields kept in ``model_extra`` and refused by name); input items and tools are closed shapes, so
an item or tool type this server cannot run (``input_image``, ``web_search``, ...) is a 400 naming
``input`` or ``tools``. The reply objects follow OpenAI's ``Response`` schema (the ``openai``
client's ``output_text`` joins their ``output_text`` parts).
"""
from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator

from .protocol import Int64, OpenAIBaseModel, RequestModel, Seed, StrictModel

# ---------------------------------------------------------------------- input items
MESSAGE_ROLES = ("user", "system", "developer", "assistant")


class InputText(StrictModel):
    type: Literal["input_text"]
    text: str


class OutputTextPart(StrictModel):
    """An assistant's earlier text, as this server (or OpenAI) returned it in ``output``."""

    type: Literal["output_text"]
    text: str
    annotations: list[Any] = Field(default_factory=list, max_length=0)  # none are produced, none are accepted
    logprobs: list[Any] | None = None  # what the earlier reply carried; the model never reads it


ContentPart = Annotated[InputText | OutputTextPart, Field(discriminator="type")]


class MessageItem(StrictModel):
    """A message (``type`` may be left out, as in OpenAI's "easy input message")."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallItem(StrictModel):
    """A call the model made earlier (sent back so the model sees it before the call's output)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # a JSON object, as text
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(StrictModel):
    """The client's result of a call: it reaches the template as a ``role: tool`` message."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class ReasoningText(StrictModel):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(StrictModel):
    """Earlier reasoning (as returned in ``output``): it goes to the next assistant message's
    ``reasoning_content``, which the chat template may show or drop."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[Any] = Field(default_factory=list, max_length=0)  # this server writes no summaries
    content: list[ReasoningText] | None = None
    encrypted_content: None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


def _item_kind(value: Any) -> str:
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if isinstance(kind, str) else "message"


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")] | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_kind, custom_error_type="invalid_item",
                  custom_error_message="input items are messages, function_call, function_call_output or "
                                       "reasoning items")]


# ---------------------------------------------------------------------- tools and text format
class FunctionTool(StrictModel):
    """Responses' function tool (flat: ``name`` beside ``type``); the only tool type served."""

    type: Literal["function"]
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(StrictModel):
    type: Literal["function"]
    name: str


class TextFormatText(StrictModel):
    type: Literal["text"]


class TextFormatJsonObject(StrictModel):
    type: Literal["json_object"]


class TextFormatJsonSchema(StrictModel):
    type: Literal["json_schema"]
    name: str
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None  # strict or not, the schema is enforced


class TextConfig(StrictModel):
    format: Annotated[TextFormatText | TextFormatJsonObject | TextFormatJsonSchema,
                      Field(discriminator="type")] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # only medium (the default) is served


class ReasoningConfig(StrictModel):
    effort: str | None = None  # refused when set: the model thinks as its template says
    summary: str | None = None  # refused when set: no summaries are written
    generate_summary: str | None = None  # OpenAI's deprecated name for summary


class StreamOptions(StrictModel):
    include_obfuscation: bool | None = None  # refused when true: no padding field on delta events


# ---------------------------------------------------------------------- the request
class ResponsesRequest(RequestModel):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool = True
    max_tool_calls: Int64 | None = None
    text: TextConfig | None = None
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, str] | None = None
    user: str | None = None  # an end-user label (OpenAI's abuse monitoring): echoed, changes no output
    safety_identifier: str | None = None  # the same, under OpenAI's newer name
    reasoning: ReasoningConfig | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    background: bool | None = None
    top_logprobs: Int64 | None = None
    # vLLM's sampling extras (the chat request's fields of the same names)
    seed: Seed | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stop: str | list[str] | None = None
    priority: Int64 = 0
    cache_salt: str | None = None

    @field_validator("metadata")
    @classmethod
    def _bounded_metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        """OpenAI's limits: 16 pairs, keys up to 64 characters, values up to 512."""
        if value is None:
            return value
        if len(value) > 16:
            raise ValueError(f"metadata has {len(value)} keys: at most 16 are allowed")
        for key, text in value.items():
            if len(key) > 64 or len(text) > 512:
                raise ValueError(f"metadata[{key[:64]!r}]: keys are at most 64 characters, values at most 512")
        return value


# ---------------------------------------------------------------------- the reply
class OutputText(OpenAIBaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(OpenAIBaseModel):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class OutputReasoningText(OpenAIBaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(OpenAIBaseModel):
    type: Literal["reasoning"] = "reasoning"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    summary: list[Any] = Field(default_factory=list)
    content: list[OutputReasoningText]


class OutputFunctionCall(OpenAIBaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = OutputMessage | OutputReasoning | OutputFunctionCall


class InputTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0  # prompt tokens served by the prefix cache


class OutputTokensDetails(OpenAIBaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(OpenAIBaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(OpenAIBaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseError(OpenAIBaseModel):
    code: str
    message: str


class ResponseObject(OpenAIBaseModel):
    """OpenAI's ``Response``; the request's settings are echoed as OpenAI echoes them."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    completed_at: int | None = None
    status: Literal["completed", "failed", "in_progress", "incomplete", "cancelled", "queued"]
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None
    store: bool = True
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    truncation: str = "disabled"
    background: bool = False
    user: str | None = None
    safety_identifier: str | None = None


class DeletedResponse(OpenAIBaseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True

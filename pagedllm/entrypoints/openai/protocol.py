"""Pydantic models of the OpenAI-compatible API (and vLLM's extra sampling fields).

Requests are validated strictly (no "5" for 5, no NaN/Infinity) so a wrong type is a 400, not
a surprise deep in the sampler. A top-level field the models do not declare is kept in
``model_extra`` and refused by the server (``request_fields.py``): a dropped field would let a
client believe its output was constrained when it was not. Nested objects forbid unknown keys.
Range checks live in ``SamplingParams`` so the API and the Python API agree.
"""
from __future__ import annotations

import dataclasses
import time
import typing
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, create_model, field_validator

from pagedllm import envs
from pagedllm.sampling_params import SEED_MAX, SEED_MIN, SamplingParams, StructuredOutputsParams

# int64 range: larger values cannot become tensors or generator seeds
Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
TokenId = Int64
Seed = Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)]


def _only_true(value: bool) -> bool:
    """vLLM's ``spaces_between_special_tokens``: declared so that False is refused, not ignored."""
    if value is not True:
        raise ValueError("only true is supported (output text is what the tokenizer's decode() returns)")
    return value


SpacesBetweenSpecialTokens = Annotated[bool, AfterValidator(_only_true)]


class OpenAIBaseModel(BaseModel):
    """Responses (and the error body): built by the server, so validated leniently."""

    model_config = ConfigDict(extra="allow")


class RequestModel(BaseModel):
    """Request bodies: strict types, finite numbers; unknown fields are collected in ``model_extra``
    so the server can name them in its 400 (``request_fields.check_request_fields``)."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


# ---------------------------------------------------------------------- errors
class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


# ---------------------------------------------------------------------- requests
class StreamOptions(StrictModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # usage (so far) on every chunk


def _wire_type(name: str, hint: Any) -> Any:
    """A SamplingParams field's type on the wire: integers bounded to int64 (a seed to its range),
    token id lists as int64 lists, the structured-outputs object as its fields' dict."""
    if name == "seed":
        return Seed | None
    wire = {int: Int64, int | None: Int64 | None, list[int] | None: list[TokenId] | None,
            StructuredOutputsParams | None: dict[str, Any] | None}
    return wire.get(hint, hint)


def sampling_fields(names: typing.Iterable[str]) -> dict[str, Any]:
    """``{name: (wire type, default)}`` of SamplingParams fields, for ``create_model``: the request
    models take their names, types and defaults from the one declaration (sampling_params.py)."""
    hints = typing.get_type_hints(SamplingParams)
    defaults = {f.name: f.default for f in dataclasses.fields(SamplingParams)}
    return {name: (_wire_type(name, hints[name]), defaults[name]) for name in names}


# vLLM's extra sampling fields of completions and chat: SamplingParams' own, with its defaults
_VllmSamplingExtras = create_model(
    "_VllmSamplingExtras", __base__=RequestModel,
    **sampling_fields(("stop_token_ids", "allowed_token_ids", "ignore_eos", "min_tokens", "prompt_logprobs",
                       "include_stop_str_in_output", "skip_special_tokens", "bad_words", "truncate_prompt_tokens")))


class SamplingFields(_VllmSamplingExtras):
    """Sampling fields shared by completions and chat: OpenAI's, whose unset value (None) means the
    model's generation_config default, and vLLM's extras (from SamplingParams, above)."""

    model: str | None = None
    n: Int64 | None = 1
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user label (OpenAI's abuse monitoring); it changes no output
    request_id: str | None = None  # vLLM: the response id becomes "<cmpl|chatcmpl>-<request_id>"
    logit_bias: dict[str, float] | None = None
    # vLLM extras
    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    spaces_between_special_tokens: SpacesBetweenSpecialTokens = True
    return_token_ids: bool | None = False  # prompt_token_ids and each choice's token_ids in the reply
    return_tokens_as_token_ids: bool | None = None  # logprobs tokens as "token_id:N" (default: the server's)
    priority: Int64 = 0  # needs the server's --scheduling-policy priority; lower values go first
    use_beam_search: bool = False  # n beams (the choices, best first); serving.beam_search_params
    length_penalty: float = 1.0  # beam search: a beam's score is cum_logprob / length ** length_penalty
    cache_salt: str | None = None  # only requests with the same salt share prefix-cache blocks
    # structured outputs (serving.structured_outputs_of): OpenAI's response_format, vLLM's
    # structured_outputs (StructuredOutputsParams' fields) and its legacy guided_* fields
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # only xgrammar (or "auto") is accepted
    guided_whitespace_pattern: str | None = None  # refused: xgrammar has no whitespace pattern


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: Int64 | None = 16
    best_of: Int64 | None = None
    echo: bool | None = False
    logprobs: Int64 | None = None
    suffix: str | None = None
    add_special_tokens: bool = True

    @field_validator("prompt", mode="before")
    @classmethod
    def _bounded_prompt_list(cls, value):
        """Each listed prompt is an engine request: more than PAGEDLLM_MAX_COMPLETION_PROMPTS is
        refused before the list's items are validated (vLLM's rule, its default 1024)."""
        limit = envs.PAGEDLLM_MAX_COMPLETION_PROMPTS
        if isinstance(value, list) and len(value) > limit and not isinstance(value[0], int):
            raise ValueError(f"a list of {len(value)} prompts exceeds the maximum of {limit} per request; send "
                             "them in several requests (the server's PAGEDLLM_MAX_COMPLETION_PROMPTS sets it)")
        return value


class ImageURL(StrictModel):
    url: str  # data: (base64), file:// or http(s):// (entrypoints/openai/media.py says which are allowed)
    detail: Literal["auto"] | None = None  # OpenAI's resize hint: the model's own processor sizes images here


class ContentPart(StrictModel):
    type: str  # "text", "image_url" or "video_url" (vLLM's; a video file or data:video/jpeg frames)
    text: str | None = None
    image_url: ImageURL | None = None
    video_url: ImageURL | None = None


class FunctionCall(StrictModel):
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape)


class ToolCall(StrictModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(StrictModel):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a role "tool" message: the call it answers
    reasoning_content: str | None = None
    # OpenAI SDK response fields a client may send back in its history: only null is accepted
    refusal: None = None
    function_call: None = None
    audio: None = None
    annotations: None = None


class FunctionDefinition(StrictModel):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema (checked by the server)
    strict: bool | None = None


class ChatTool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: Int64 | None = None
    max_completion_tokens: Int64 | None = None
    logprobs: bool | None = False
    top_logprobs: Int64 | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    # vLLM's chat extras
    best_of: Int64 | None = None
    echo: bool = False  # prepend the last message's content when it has the reply's role
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the template writes its own BOS
    include_reasoning: bool = True
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # the HF processor's options for the messages' images / videos (a vision-language model's), e.g. max_pixels
    mm_processor_kwargs: dict[str, Any] | None = None


class EmbeddingRequest(RequestModel):
    """OpenAI's embeddings body, plus vLLM's extras (needs a server run with --runner pooling)."""

    model: str | None = None
    input: str | list[str] | list[TokenId] | list[list[TokenId]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int64 | None = None  # refused: no matryoshka truncation
    user: str | None = None
    request_id: str | None = None
    truncate_prompt_tokens: Int64 | None = None
    add_special_tokens: bool = True
    normalize: bool | None = None  # None: the server's --pooler-config
    priority: Int64 = 0
    cache_salt: str | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _bounded_input_list(cls, value):
        return CompletionRequest._bounded_prompt_list(value)


class TokenizeRequest(RequestModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[TokenId]


# SamplingParams fields the legacy /generate never took (its body is StrictModel: refused by name)
_NOT_ON_GENERATE = ("logit_bias", "allowed_token_ids", "prompt_logprobs", "detokenize", "output_kind", "extra_args",
                    "bad_words_token_ids")

GenerateRequest = create_model(
    "GenerateRequest", __base__=StrictModel,
    __doc__="vLLM's legacy ``/generate`` body: a prompt, ``stream``, and SamplingParams fields.",
    prompt=(str | list[TokenId], ...), stream=(bool, False),
    **sampling_fields(f.name for f in dataclasses.fields(SamplingParams) if f.name not in _NOT_ON_GENERATE))


# ---------------------------------------------------------------------- responses
class ApiObject(OpenAIBaseModel):
    """What every OpenAI object opens with: its id, kind (``object``, fixed per class) and creation time."""

    id: str
    object: str
    created: int = Field(default_factory=lambda: int(time.time()))


class PromptTokenUsageInfo(OpenAIBaseModel):
    cached_tokens: int = 0


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokenUsageInfo | None = None  # --enable-prompt-tokens-details


class PromptLogprob(OpenAIBaseModel):
    """vLLM's Logprob as its replies show it (``prompt_logprobs`` entries)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# one per prompt position (the first None): token id (a JSON key, so text) -> its logprob
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionLogprobs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids (streamed: on a choice's first chunk)
    token_ids: list[int] | None = None  # return_token_ids (streamed: the chunk's own)


class CompletionResponse(ApiObject):
    object: Literal["text_completion"] = "text_completion"
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobContent(ChatLogprob):
    top_logprobs: list[ChatLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(OpenAIBaseModel):
    content: list[ChatLogprobContent] | None = None


class ChatResponseMessage(OpenAIBaseModel):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatCompletionChoice(OpenAIBaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(ApiObject):
    object: Literal["chat.completion"] = "chat.completion"
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # only the keys OpenAI sends in that delta


class ChatStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(ApiObject):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids: on the chunk that opens a choice


class ModelCard(ApiObject):
    object: Literal["model"] = "model"
    owned_by: str = "pagedllm"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class EmbeddingData(OpenAIBaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str  # str: encoding_format "base64" (float32, little-endian)


class EmbeddingResponse(ApiObject):
    object: Literal["list"] = "list"
    model: str
    data: list[EmbeddingData]
    usage: UsageInfo


class TokenizeResponse(OpenAIBaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str

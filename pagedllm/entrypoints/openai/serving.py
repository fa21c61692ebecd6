"""Request handlers behind the HTTP routes: completions, chat, tokenize, and legacy /generate.

Every handler validates completely (model name, unsupported fields, SamplingParams, prompt
length) before anything is streamed, so bad input is always a 400 with an OpenAI-style body.
The engine requests of one HTTP request live in a ``RequestGroup`` whose synchronous
``close()`` aborts whatever is unfinished: it runs in ``finally`` blocks, so a disconnect, a
cancellation or an error anywhere frees the KV blocks at once.
"""
from __future__ import annotations

import asyncio
import base64
import json
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedllm.engine.async_engine import AsyncLLMEngine, RequestStream
from pagedllm.engine.llm_engine import PromptType
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams

from .chat_features import (
    ChatOptions,
    ChoiceParser,
    MessagePiece,
    check_tools,
    conversation_of,
    is_forced,
    keeps_special_tokens,
    resolve_tool_choice,
    tools_for_template,
)
from .protocol import (
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprob,
    ChatLogprobContent,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    GenerateRequest,
    ModelCard,
    ModelList,
    PromptLogprob,
    PromptLogprobs,
    PromptTokenUsageInfo,
    SamplingFields,
    TokenizeRequest,
    TokenizeResponse,
    UsageInfo,
)
from .request_fields import RequestFieldError, check_request_fields
from .tool_parsers.forced import forced_call_schema

# what one engine request runs: a generation, a beam search or an embedding
EngineParams = SamplingParams | BeamSearchParams | PoolingParams
_ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "not_found_error",
                500: "server_error", 503: "service_unavailable"}
_PARAM_NAMES = (set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)
                | set(GenerateRequest.model_fields) | set(EmbeddingRequest.model_fields))
_PARAM_ALIASES = {"prompt_token_ids": "prompt", "token": "tokens"}
_CHAT_PARAMS = {"prompt": "messages", "logprobs": "top_logprobs"}
# apply_chat_template's own arguments: chat_template_kwargs may not override them
_RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "tools", "documents", "chat_template",
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


def param_of(message: str) -> str | None:
    """The request field an engine/SamplingParams message names first ("top_p=0 is invalid")."""
    match = re.match(r"[A-Za-z_]+", message)
    word = _PARAM_ALIASES.get(match.group(0), match.group(0)) if match else None
    return word if word in _PARAM_NAMES else None


def bad_request(exc: BaseException) -> ServingError:
    return ServingError(str(exc) or type(exc).__name__, 400, param_of(str(exc)))


def _unsupported(condition: object, param: str, what: str) -> None:
    if condition:
        raise ServingError(f"{what} is not supported by this server", 400, param)


def check_fields(req) -> None:
    """Every field the request sends is honoured or refused (request_fields.py)."""
    try:
        check_request_fields(req)
    except RequestFieldError as exc:
        raise ServingError(str(exc), 400, exc.param) from None


def response_id(prefix: str, req) -> str:
    """vLLM's ids: ``<prefix>-<request_id>`` when the client names the request, else a fresh uuid."""
    return f"{prefix}-{req.request_id if req.request_id is not None else uuid.uuid4().hex}"


# ---------------------------------------------------------------------- structured outputs
_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}


def structured_outputs_of(req: SamplingFields) -> StructuredOutputsParams | None:
    """The request's output constraint from whichever field gives it (``structured_outputs``, a
    ``guided_*`` field or ``response_format``); two at once, or an invalid one, is a 400 naming the field."""
    _check_guided_options(req)
    sources = [(name, kwargs) for name, kwargs in _constraint_sources(req) if kwargs is not None]
    if not sources:
        return None
    if len(sources) > 1:
        names = [name for name, _ in sources]
        raise ServingError(f"{' and '.join(names)} both constrain the output; give only one", 400, names[1])
    name, kwargs = sources[0]
    try:
        return StructuredOutputsParams(**kwargs)
    except (ValueError, TypeError) as exc:
        raise ServingError(f"{name}: {exc}", 400, name) from None


def _constraint_sources(req: SamplingFields) -> list[tuple[str, dict | None]]:
    sources = [("structured_outputs", None if req.structured_outputs is None else dict(req.structured_outputs))]
    sources += [(name, None if getattr(req, name) is None else {kind: getattr(req, name)})
                for name, kind in _GUIDED_FIELDS.items()]
    return sources + [("response_format", _response_format(req.response_format))]


def _response_format(fmt: dict | None) -> dict | None:
    """OpenAI's response_format: text (no constraint), json_object, or json_schema (its ``schema``;
    ``strict`` or not, the schema is always enforced)."""
    kind = (fmt or {}).get("type", "text")
    if kind not in _RESPONSE_FORMAT_KEYS:
        raise ServingError(f"response_format type {kind!r} is invalid: use text, json_object or json_schema",
                           400, "response_format")
    _refuse_unknown_keys(fmt or {}, _RESPONSE_FORMAT_KEYS[kind], f"response_format of type {kind!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    spec = fmt.get("json_schema")
    if isinstance(spec, dict):
        _refuse_unknown_keys(spec, _JSON_SCHEMA_KEYS, "response_format.json_schema")
    schema = spec.get("schema", spec.get("json_schema")) if isinstance(spec, dict) else None
    if schema is None:
        raise ServingError("response_format json_schema needs json_schema.schema", 400, "response_format")
    return {"json": schema}


# OpenAI's response_format shapes (json_schema.json_schema: an alias some clients send for schema)
_RESPONSE_FORMAT_KEYS = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "json_schema"}}
_JSON_SCHEMA_KEYS = {"name", "description", "schema", "strict", "json_schema"}


def _refuse_unknown_keys(obj: dict, allowed: set[str], what: str) -> None:
    """A key the server would not read is a 400, not a constraint silently dropped."""
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise ServingError(f"{what} does not take {unknown}: its keys are {sorted(allowed)}", 400, "response_format")


def _check_guided_options(req: SamplingFields) -> None:
    if req.guided_decoding_backend not in (None, "auto", "xgrammar"):
        raise ServingError(f"guided_decoding_backend={req.guided_decoding_backend!r} is invalid: this server "
                           "has xgrammar only", 400, "guided_decoding_backend")
    _unsupported(req.guided_whitespace_pattern is not None, "guided_whitespace_pattern",
                 "guided_whitespace_pattern (use structured_outputs.disable_any_whitespace)")


# ---------------------------------------------------------------------- engine requests
class RequestGroup:
    """The engine requests behind one HTTP request (several prompts -> several requests).

    Its requests share one output queue, read by ``outputs()``: nothing per request runs on the
    event loop but the engine's ``put``, so a request of many prompts costs the loop no more than
    its outputs (no task per prompt).
    """

    def __init__(self, engine: AsyncLLMEngine):
        self.engine = engine
        self.streams: list[RequestStream] = []
        self.queue: asyncio.Queue = asyncio.Queue()

    async def add_all(self, requests: list[tuple[str, PromptType]], params: EngineParams, arrival: float,
                      **options) -> None:
        """Queues every prompt's request: tokenized side by side on the tokenizer threads, a batch
        of ``_ADD_BATCH`` per job, each batch added to the engine in one op. The first invalid
        prompt, in prompt order, becomes the 400; ``close()`` aborts the others. BeamSearchParams
        queue beam searches (each answers with one finished output, its beams as completions)."""
        add = (self.engine.add_beam_searches if isinstance(params, BeamSearchParams) else
               self.engine.add_pooling_requests if isinstance(params, PoolingParams) else self.engine.add_requests)
        batches = [requests[i:i + _ADD_BATCH] for i in range(0, len(requests), _ADD_BATCH)]
        slots: list[list[RequestStream] | None] = [None] * len(batches)

        async def add_batch(k: int) -> None:
            slots[k] = await add(batches[k], params, arrival, self.queue, **options)
            self.streams.extend(slots[k])  # at once, so that close() aborts them whatever happens next

        results = await asyncio.gather(*(add_batch(k) for k in range(len(batches))), return_exceptions=True)
        self.streams = [stream for batch in slots if batch is not None for stream in batch]  # prompt order
        for error in results:
            if isinstance(error, (ValueError, TypeError)):  # TypeError: the tokenizer refuses e.g. lone surrogates
                raise bad_request(error) from None
            if isinstance(error, BaseException):
                raise error

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Yields ``(prompt index, output)`` from all requests as they arrive."""
        index = {stream.request_id: i for i, stream in enumerate(self.streams)}
        remaining = len(self.streams)
        while remaining:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                remaining -= 1
            yield index[item.request_id], item

    async def finals(self) -> list[RequestOutput]:
        """The last output of every request (requests run with output_kind="final_only")."""
        last: list[RequestOutput | None] = [None] * len(self.streams)
        async for i, out in self.outputs():
            last[i] = out
        return last

    def close(self) -> None:
        """Aborts every unfinished request (frees its blocks); safe to call more than once."""
        for stream in self.streams:
            self.engine.abort(stream.request_id)


_ADD_BATCH = 256  # prompts per tokenizer-thread job and engine op (RequestGroup.add_all)
# what a use_beam_search request may set: the beams' parameters, the prompt and the reply's shape
_BEAM_SEARCH_FIELDS = frozenset({
    "model", "prompt", "messages", "n", "max_tokens", "max_completion_tokens", "temperature", "ignore_eos",
    "length_penalty", "include_stop_str_in_output", "use_beam_search", "stream", "stream_options", "echo", "user",
    "request_id", "return_token_ids", "cache_salt", "priority", "add_special_tokens",
    "add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs", "documents",
    "include_reasoning", "tools", "tool_choice", "parallel_tool_calls"})


# ---------------------------------------------------------------------- streaming helpers
def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


async def sse_body(events: AsyncIterator[str], group: RequestGroup) -> AsyncIterator[str]:
    """Server-sent events ending in ``[DONE]``.

    An error before the first event propagates (so the client gets a real HTTP status); a
    later one becomes an ``{"error": ...}`` event, since the 200 status is already sent.
    """
    sent = False
    try:
        async for event in events:
            sent = True
            yield event
    except Exception as exc:
        if not sent:
            raise
        status = 500 if not isinstance(exc, ServingError) else exc.status
        yield sse(error_body(str(exc), status))
    finally:
        group.close()
    yield sse("[DONE]")


async def start_streaming(body: AsyncIterator[str], media_type: str) -> StreamingResponse:
    """Waits for the first chunk, so errors before any output still get an HTTP error status."""
    first = await anext(body)  # on error the generator has already closed its group

    async def chained() -> AsyncIterator[str]:
        yield first
        async for chunk in body:
            yield chunk
    return StreamingResponse(chained(), media_type=media_type)


async def collect(group: RequestGroup) -> list[RequestOutput]:
    try:
        return await group.finals()
    finally:
        group.close()


# ---------------------------------------------------------------------- response pieces
@dataclass(frozen=True)
class ResponseOptions:
    """Server flags that shape replies (vLLM's names): ``--enable-prompt-tokens-details`` adds
    ``usage.prompt_tokens_details.cached_tokens`` (prompt tokens served by the prefix cache);
    ``--return-tokens-as-token-ids`` shows logprobs tokens as ``token_id:N`` unless a request says
    otherwise (its ``return_tokens_as_token_ids``)."""

    enable_prompt_tokens_details: bool = False
    return_tokens_as_token_ids: bool = False


def make_usage(prompt: int, completion: int, cached: int | None = None) -> UsageInfo:
    """``cached``: prompt tokens served by the prefix cache, shown when not None."""
    details = PromptTokenUsageInfo(cached_tokens=cached) if cached is not None else None
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=details)


def usage_of(outputs: list[RequestOutput], details: bool = False) -> UsageInfo:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return make_usage(prompt, completion, sum(o.num_cached_tokens for o in outputs) if details else None)


def token_text(token_id: int, decoded: str | None, as_ids: bool) -> str:
    """A logprobs entry's token as replies show it: its text, or ``token_id:N``
    (``return_tokens_as_token_ids``: tokens that are not whole characters stay distinct)."""
    return f"token_id:{token_id}" if as_ids else decoded or ""


LOGPROB_FLOOR = -9999.0  # vLLM's: JSON has no -Infinity


def prompt_logprobs_json(out: RequestOutput) -> PromptLogprobs:
    """The request's ``prompt_logprobs`` as vLLM replies with them: per prompt position (the
    first None), token id -> ``{logprob, rank, decoded_token}``, -inf floored."""
    return [None if entry is None else
            {str(t): PromptLogprob(logprob=max(e.logprob, LOGPROB_FLOOR), rank=e.rank, decoded_token=e.decoded_token)
             for t, e in entry.items()}
            for entry in out.prompt_logprobs or []]


def completion_logprobs(c: CompletionOutput, offset: int, lp: CompletionLogprobs | None = None,
                        as_ids: bool = False) -> CompletionLogprobs:
    """OpenAI's legacy format; each top_logprobs dict holds the sampled token and the top-k.

    ``text_offset`` counts the characters of the ``tokens`` before each one (vLLM's rule), from
    ``offset`` (those sent in earlier chunks): a token holding part of a multi-byte character
    shows as U+FFFD, so the tokens need not join to the text, and offsets taken from the text
    would go backwards. ``lp`` may already hold the echoed prompt's entries
    (``prompt_logprobs_entries``); the generated tokens' offsets continue after them."""
    lp = lp or CompletionLogprobs()
    if lp.tokens:
        offset = lp.text_offset[-1] + len(lp.tokens[-1])
    for token_id, entry in zip(c.token_ids, c.logprobs or []):
        token = token_text(token_id, entry[token_id].decoded_token, as_ids)
        lp.tokens.append(token)
        lp.token_logprobs.append(entry[token_id].logprob)
        lp.top_logprobs.append({token_text(t, e.decoded_token, as_ids): e.logprob for t, e in entry.items()})
        lp.text_offset.append(offset)
        offset += len(token)
    return lp


def prompt_logprobs_entries(out: RequestOutput, decode_one, as_ids: bool = False) -> CompletionLogprobs:
    """echo + logprobs: the prompt's tokens first; the first has no logprob (null, as OpenAI)."""
    lp, offset = CompletionLogprobs(), 0
    for pos, token_id in enumerate(out.prompt_token_ids):
        entry = out.prompt_logprobs[pos] if out.prompt_logprobs else None
        token = token_text(token_id, entry[token_id].decoded_token if entry else decode_one(token_id), as_ids)
        lp.tokens.append(token)
        lp.token_logprobs.append(entry[token_id].logprob if entry else None)
        lp.top_logprobs.append({token_text(t, e.decoded_token, as_ids): e.logprob for t, e in entry.items()}
                               if entry else None)
        lp.text_offset.append(offset)
        offset += len(token)
    return lp


def _chat_logprob(token: str, logprob: float) -> ChatLogprob:
    return ChatLogprob(token=token, logprob=logprob, bytes=list(token.encode("utf-8", "replace")))


def chat_logprobs(c: CompletionOutput, top: int, as_ids: bool = False) -> ChatChoiceLogprobs:
    content = []
    for token_id, entry in zip(c.token_ids, c.logprobs or []):
        best = sorted(entry.items(), key=lambda item: -item[1].logprob)[:top]
        sampled = _chat_logprob(token_text(token_id, entry[token_id].decoded_token, as_ids), entry[token_id].logprob)
        content.append(ChatLogprobContent(**sampled.model_dump(), top_logprobs=[
            _chat_logprob(token_text(t, e.decoded_token, as_ids), e.logprob) for t, e in best]))
    return ChatChoiceLogprobs(content=content)


@dataclass
class StreamState:
    """What a stream has sent so far: opened choices, logprobs text offsets (of the tokens the
    client got, echoed prompt included), token counts. The engine's delta outputs carry each completion only
    when it has something new, and its finish once."""

    started: set[int] = field(default_factory=set)
    token_chars: dict[int, int] = field(default_factory=dict)  # characters of the logprobs tokens sent
    prompt_tokens: dict[int, int] = field(default_factory=dict)
    cached_tokens: dict[int, int] = field(default_factory=dict)  # per prompt: served by the prefix cache
    choice_tokens: dict[int, int] = field(default_factory=dict)  # per choice: generated so far
    completion_tokens: int = 0
    logprobs: bool = False  # per-token logprobs must reach the client even when the text is held back
    token_ids: bool = False  # return_token_ids: every new token must reach the client too
    details: bool = False  # --enable-prompt-tokens-details
    n: int = 1  # choices per prompt: choice idx belongs to prompt idx // n

    def news(self, i: int, out: RequestOutput) -> list[tuple[int, CompletionOutput]]:
        """The choices of this output that carry something new, with their global index."""
        self.prompt_tokens[i] = len(out.prompt_token_ids)
        self.cached_tokens[i] = out.num_cached_tokens
        fresh = []
        for c in out.outputs:
            idx = i * self.n + c.index
            self.completion_tokens += len(c.token_ids)
            self.choice_tokens[idx] = self.choice_tokens.get(idx, 0) + len(c.token_ids)
            if not (c.text or c.finish_reason or ((self.logprobs or self.token_ids) and c.token_ids)):
                continue  # nothing to show: text held back (a partial character, a possible stop string)
            fresh.append((idx, c))
        return fresh

    def usage(self) -> UsageInfo:
        """The whole request's, for the last chunk (``include_usage``)."""
        cached = sum(self.cached_tokens.values()) if self.details else None
        return make_usage(sum(self.prompt_tokens.values()), self.completion_tokens, cached)

    def choice_usage(self, idx: int) -> UsageInfo:
        """One choice's so far (``continuous_usage_stats``, vLLM's): its prompt's tokens and its own."""
        i = idx // self.n
        return make_usage(self.prompt_tokens[i], self.choice_tokens.get(idx, 0),
                          self.cached_tokens[i] if self.details else None)


# ---------------------------------------------------------------------- the handlers
class OpenAIServing:
    """Completion, chat, tokenizer and legacy handlers over one AsyncLLMEngine."""

    def __init__(self, engine: AsyncLLMEngine, served_model_names: list[str], chat_template: str | None = None,
                 chat_options: ChatOptions | None = None, response_options: ResponseOptions | None = None):
        self.engine = engine
        self.served_model_names = served_model_names
        self.model_config = engine.model_config
        self.tokenizer = engine.get_tokenizer()  # this thread's own copy (for templates and decoding)
        self.chat_template = chat_template
        self.chat_options = chat_options or ChatOptions()
        self.response_options = response_options or ResponseOptions()
        self.lora_models = None  # LoRAModels (lora_serving.py), set by build_app with --enable-lora

    # ------------------------------------------------------------------ shared checks
    def check_model(self, name: str | None) -> str:
        if name is None:
            return self.served_model_names[0]
        if name not in self.served_model_names and self.lora_for(name) is None:
            raise ServingError(f"The model `{name}` does not exist; this server serves "
                               f"{self.served_model_names}", 400, "model", "model_not_found")
        return name

    def lora_for(self, name: str | None):
        """The LoRARequest of an adapter served under ``name`` (None: a base model name, or no LoRA)."""
        return self.lora_models.get(name) if self.lora_models is not None else None

    def check_token_ids(self, ids: list[int] | None, param: str) -> None:
        vocab = self.model_config.vocab_size
        bad = [t for t in ids or [] if not 0 <= t < vocab]
        if bad:
            raise ServingError(f"{param} contains {bad[:5]}: token ids must be in [0, {vocab})", 400, param)

    def sampling_params(self, req: SamplingFields, output_kind: str, **fields) -> SamplingParams:
        """SamplingParams from the request's fields (None = the default); ValueError -> 400."""
        _check_stream_options(req)
        if req.stream and req.prompt_logprobs is not None:  # vLLM's rule: they come with the whole reply
            raise ServingError("prompt_logprobs is not available when stream is true", 400, "prompt_logprobs")
        if req.length_penalty != 1.0:
            raise ServingError("length_penalty applies to beam search only: set use_beam_search", 400,
                               "length_penalty")
        optional = dict(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
                        repetition_penalty=req.repetition_penalty, presence_penalty=req.presence_penalty,
                        frequency_penalty=req.frequency_penalty, stop=req.stop, stop_token_ids=req.stop_token_ids,
                        logit_bias=req.logit_bias, allowed_token_ids=req.allowed_token_ids)
        kwargs = {k: v for k, v in optional.items() if v is not None}
        kwargs.update(n=1 if req.n is None else req.n, seed=req.seed, ignore_eos=req.ignore_eos,
                      min_tokens=req.min_tokens, include_stop_str_in_output=req.include_stop_str_in_output,
                      skip_special_tokens=req.skip_special_tokens, output_kind=output_kind,
                      structured_outputs=structured_outputs_of(req), bad_words=req.bad_words,
                      truncate_prompt_tokens=req.truncate_prompt_tokens)
        kwargs.update(fields)  # the handler's own (a forced tool call's constraint replaces the None above)
        try:
            return SamplingParams(**self.with_generation_defaults(kwargs))
        except (ValueError, TypeError) as exc:
            raise bad_request(exc) from None

    def beam_search_params(self, req: SamplingFields, max_tokens: int | None) -> BeamSearchParams:
        """``use_beam_search`` (vLLM's): ``n`` beams, returned best first as the choices. The fields
        beam search has no use for are refused unless at their defaults (it is deterministic: no
        sampling, penalties, seeds; no logprobs; no stop strings)."""
        _check_stream_options(req)
        for name in sorted(req.model_fields_set - _BEAM_SEARCH_FIELDS):
            if getattr(req, name) != type(req).model_fields[name].default:  # names the field as sent
                raise RequestFieldError(f"{name} cannot be combined with use_beam_search", name)
        try:
            return BeamSearchParams(beam_width=1 if req.n is None else req.n, max_tokens=max_tokens,
                                    ignore_eos=req.ignore_eos, temperature=req.temperature or 0.0,
                                    length_penalty=req.length_penalty,
                                    include_stop_str_in_output=req.include_stop_str_in_output)
        except (ValueError, TypeError) as exc:
            raise bad_request(exc) from None

    def with_generation_defaults(self, kwargs: dict) -> dict:
        """The model's generation_config.json defaults for the fields the request leaves unset;
        its max_new_tokens caps max_tokens (vLLM's rule)."""
        defaults = dict(self.model_config.generation_defaults)
        cap = defaults.pop("max_tokens", None)
        merged = {**defaults, **{k: v for k, v in kwargs.items() if v is not None or k not in defaults}}
        if cap is not None:
            merged["max_tokens"] = cap if merged.get("max_tokens") is None else min(cap, merged["max_tokens"])
        return merged

    async def start(self, base_id: str, prompts: list[PromptType], params: EngineParams, arrival: float,
                    req: SamplingFields | EmbeddingRequest | None = None) -> RequestGroup:
        """Adds every prompt's request; if one is invalid, aborts those already added. ``req``:
        the request whose ``cache_salt`` and ``priority`` the engine requests take."""
        group = RequestGroup(self.engine)
        ids = [base_id] if len(prompts) == 1 else [f"{base_id}-{i}" for i in range(len(prompts))]
        options = {} if req is None else {"cache_salt": req.cache_salt, "priority": req.priority}
        lora = self.lora_for(getattr(req, "model", None))
        if lora is not None:  # model= named an adapter
            options["lora_request"] = lora
        try:
            await group.add_all(list(zip(ids, prompts)), params, arrival, **options)
        except BaseException:
            group.close()
            raise
        return group

    # ------------------------------------------------------------------ completions
    async def create_completion(self, req: CompletionRequest, arrival: float):
        """``POST /v1/completions``: a JSON response, or server-sent events when streaming."""
        model = self.check_model(req.model)
        check_fields(req)
        _unsupported(req.suffix, "suffix", "suffix")
        _refuse_streamed_best_of(req)
        scored_prompt = req.echo and req.logprobs is not None  # echo + logprobs: score the prompt too
        prompt_logprobs = req.prompt_logprobs if req.prompt_logprobs is not None or not scored_prompt else req.logprobs
        params = self.completion_beams(req) if req.use_beam_search else self.sampling_params(
            req, "delta" if req.stream else "final_only", max_tokens=req.max_tokens, best_of=req.best_of,
            logprobs=req.logprobs, prompt_logprobs=prompt_logprobs)
        rid = response_id("cmpl", req)
        prompts = self.completion_prompts(req.prompt)
        if not req.add_special_tokens:
            prompts = [await self.encoded_without_special(p) for p in prompts]
        group = await self.start(rid, prompts, params, arrival, req)
        if req.stream:
            body = sse_body(self.completion_events(group, rid, model, req), group)
            return await start_streaming(body, "text/event-stream")
        return await self.completion_json(rid, model, req, await collect(group))

    def completion_beams(self, req: CompletionRequest) -> BeamSearchParams:
        try:
            return self.beam_search_params(req, req.max_tokens)
        except RequestFieldError as exc:
            raise ServingError(str(exc), 400, exc.param) from None

    def completion_prompts(self, prompt, param: str = "prompt") -> list[PromptType]:
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise ServingError(f"{param} must not be empty", 400, param)
        if all(isinstance(p, int) for p in prompt):
            prompt = [prompt]
        return [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompt]

    async def encoded_without_special(self, prompt: PromptType) -> PromptType:
        """add_special_tokens=false: a text prompt is tokenized without the BOS (token ids pass as given)."""
        if not isinstance(prompt, str):
            return prompt
        try:
            return {"prompt": prompt, "prompt_token_ids": await self.engine.encode(prompt, add_special_tokens=False)}
        except ValueError as exc:
            raise ServingError(str(exc), 400, "prompt") from None

    def prompt_text(self, out: RequestOutput, tokenizer=None) -> str:
        """``tokenizer``: the calling thread's own (None: the event loop's, ``self.tokenizer``)."""
        tokenizer = tokenizer or self.tokenizer
        return out.prompt if out.prompt is not None else tokenizer.decode(out.prompt_token_ids)

    async def completion_json(self, rid: str, model: str, req: CompletionRequest,
                              finals: list[RequestOutput]) -> Response:
        """The whole reply, built and serialized on a tokenizer thread (with that thread's tokenizer
        for echoed token-id prompts): a reply of 100k choices takes seconds to build and encode,
        which on the event loop would hold every stream and ``/health`` for as long."""
        def build(tokenizer) -> bytes:
            return self.completion_response(rid, model, req, finals, tokenizer).model_dump_json().encode()
        return Response(await self.engine.with_tokenizer(build), media_type="application/json")

    def completion_response(self, rid: str, model: str, req: CompletionRequest,
                            finals: list[RequestOutput], tokenizer=None) -> CompletionResponse:
        choices = []
        for i, out in enumerate(finals):
            prefix = self.prompt_text(out, tokenizer) if req.echo else ""
            prompt_lp = prompt_logprobs_json(out) if req.prompt_logprobs is not None else None
            for j, c in enumerate(out.outputs):
                lp = self.choice_logprobs(req, out, c, 0, echoed=bool(req.echo), tokenizer=tokenizer)
                choices.append(CompletionChoice(index=i * (req.n or 1) + j, text=prefix + c.text, logprobs=lp,
                                                finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                                prompt_logprobs=prompt_lp, **_token_ids(req, out, c)))
        usage = usage_of(finals, self.response_options.enable_prompt_tokens_details)
        return CompletionResponse(id=rid, model=model, choices=choices, usage=usage)

    def stream_state(self, req: SamplingFields, logprobs: bool) -> StreamState:
        return StreamState(logprobs=logprobs, token_ids=bool(req.return_token_ids),
                           details=self.response_options.enable_prompt_tokens_details, n=req.n or 1)

    async def completion_events(self, group: RequestGroup, rid: str, model: str,
                                req: CompletionRequest) -> AsyncIterator[str]:
        state, created = self.stream_state(req, req.logprobs is not None), int(time.time())
        async for i, out in group.outputs():
            for idx, c in state.news(i, out):
                yield sse(self.completion_chunk(state, idx, c, out, req, rid, model, created))
        if req.stream_options and req.stream_options.include_usage:
            yield sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                       "choices": [], "usage": state.usage().model_dump()})

    def completion_chunk(self, state: StreamState, idx: int, c: CompletionOutput, out: RequestOutput,
                         req: CompletionRequest, rid: str, model: str, created: int) -> dict:
        text = c.text
        first = idx not in state.started
        echo_now = bool(req.echo) and first
        if echo_now:
            text = self.prompt_text(out) + text
        state.started.add(idx)
        lp = self.choice_logprobs(req, out, c, state.token_chars.get(idx, 0), echoed=echo_now)
        if lp is not None and lp.tokens:
            state.token_chars[idx] = lp.text_offset[-1] + len(lp.tokens[-1])
        choice = CompletionChoice(index=idx, text=text, logprobs=lp, finish_reason=c.finish_reason,
                                  stop_reason=c.stop_reason, **_token_ids(req, out, c, with_prompt=first))
        return CompletionResponse(id=rid, model=model, created=created, choices=[choice],
                                  usage=_continuous_usage(req, state, idx)).model_dump()

    def choice_logprobs(self, req: CompletionRequest, out: RequestOutput, c: CompletionOutput, offset: int,
                        echoed: bool, tokenizer=None) -> CompletionLogprobs | None:
        """A choice's logprobs; with echo the prompt's come first (generated offsets then continue
        after the prompt's tokens)."""
        if req.logprobs is None:
            return None
        as_ids = self.tokens_as_ids(req)
        if not echoed:
            return completion_logprobs(c, offset, as_ids=as_ids)
        tokenizer = tokenizer or self.tokenizer
        prompt_lp = prompt_logprobs_entries(out, lambda t: tokenizer.decode([t]), as_ids)
        return completion_logprobs(c, offset, prompt_lp, as_ids)

    def tokens_as_ids(self, req: SamplingFields) -> bool:
        """``return_tokens_as_token_ids``: the request's, else the server's flag."""
        if req.return_tokens_as_token_ids is not None:
            return req.return_tokens_as_token_ids
        return self.response_options.return_tokens_as_token_ids

    # ------------------------------------------------------------------ embeddings
    async def create_embedding(self, req: EmbeddingRequest, arrival: float) -> EmbeddingResponse:
        """``POST /v1/embeddings`` (a server run with ``--runner pooling``): one vector per input."""
        model = self.check_model(req.model)
        check_fields(req)
        if self.engine.engine.config.pooler is None:
            raise ServingError("this server generates text (--runner generate): /v1/embeddings needs a server "
                               "started with --runner pooling", 400, "model")
        try:
            params = PoolingParams(task="embed", normalize=req.normalize, dimensions=req.dimensions,
                                   truncate_prompt_tokens=req.truncate_prompt_tokens)
        except ValueError as exc:
            raise bad_request(exc) from None
        prompts = self.completion_prompts(req.input, "input")
        if not req.add_special_tokens:
            prompts = [await self.encoded_without_special(p) for p in prompts]
        rid = response_id("embd", req)
        try:
            group = await self.start(rid, prompts, params, arrival, req)
        except ServingError as exc:  # the engine names the prompt: here it is the input
            exc.param = "input" if exc.param == "prompt" else exc.param
            raise
        finals = await collect(group)
        data = [EmbeddingData(index=i, embedding=_encode_embedding(out.outputs.embedding, req.encoding_format))
                for i, out in enumerate(finals)]
        prompt_tokens = sum(len(out.prompt_token_ids) for out in finals)
        usage = UsageInfo(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens)
        return EmbeddingResponse(id=rid, model=model, data=data, usage=usage)

    # ------------------------------------------------------------------ chat
    async def create_chat_completion(self, req: ChatCompletionRequest, arrival: float):
        """``POST /v1/chat/completions``: renders the chat template, then generates."""
        model = self.check_model(req.model)
        check_fields(req)
        rid = response_id("chatcmpl", req)
        try:
            tool_choice = resolve_tool_choice(req.tools, req.tool_choice, self.chat_options)
            check_tools(req.tools, tool_choice)
            group = await self.start_chat(rid, req, arrival, tool_choice)
        except RequestFieldError as exc:
            raise ServingError(str(exc), 400, exc.param) from None
        except ServingError as exc:
            raise _as_chat_error(exc, req) from None
        parsers = [ChoiceParser.for_request(self.chat_options, tool_choice, req.parallel_tool_calls,
                                            req.include_reasoning, req.tools, req.chat_template_kwargs)
                   for _ in range(req.n or 1)]
        if req.stream:
            return await start_streaming(sse_body(self.chat_events(group, rid, model, req, parsers), group),
                                         "text/event-stream")
        return self.chat_response(rid, model, req, (await collect(group))[0], parsers)

    async def start_chat(self, rid: str, req: ChatCompletionRequest, arrival: float,
                         tool_choice: Any = "none") -> RequestGroup:
        if req.top_logprobs is not None and not req.logprobs:
            raise ServingError("top_logprobs requires logprobs=true", 400, "top_logprobs")
        _refuse_streamed_best_of(req)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if req.use_beam_search:
            if tool_choice != "none" and req.tools:
                raise RequestFieldError("tools cannot be combined with use_beam_search", "tools")
            params = self.beam_search_params(req, max_tokens)
        else:
            params = self.sampling_params(req, "delta" if req.stream else "final_only", max_tokens=max_tokens,
                                          logprobs=logprobs, best_of=req.best_of, prompt_logprobs=req.prompt_logprobs,
                                          **forced_call_fields(req, tool_choice), skip_special_tokens=(
                                              req.skip_special_tokens
                                              and not keeps_special_tokens(self.chat_options, tool_choice)))
        text = await self.render_chat(req.messages, req.add_generation_prompt, **self.template_options(req))
        try:  # on a tokenizer thread, bounded like any prompt; by default no extra BOS: the template writes its own
            ids = await self.engine.encode(text, add_special_tokens=req.add_special_tokens, field="messages")
        except ValueError as exc:
            raise ServingError(str(exc), 400, "messages") from None
        return await self.start(rid, [{"prompt": text, "prompt_token_ids": ids}], params, arrival, req)

    @staticmethod
    def template_options(req: ChatCompletionRequest) -> dict:
        """The request's template inputs: its own template, tools, documents, continue_final_message
        and ``chat_template_kwargs`` (e.g. ``enable_thinking``), which reach the template as variables."""
        if req.continue_final_message and req.add_generation_prompt:
            raise ServingError("continue_final_message=true needs add_generation_prompt=false (the reply "
                               "continues the last message instead of starting a new one)", 400,
                               "continue_final_message")
        extra = dict(req.chat_template_kwargs or {})
        clash = sorted(_RESERVED_TEMPLATE_KWARGS & extra.keys())
        if clash:
            raise ServingError(f"chat_template_kwargs may not set {clash}: they are request fields or "
                               "apply_chat_template's own arguments", 400, "chat_template_kwargs")
        return dict(extra, template=req.chat_template, tools=tools_for_template(req.tools),
                    documents=req.documents, continue_final_message=req.continue_final_message)

    async def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool,
                          template: str | None = None, **kwargs) -> str:
        """The chat template (the request's, else the server's, else the tokenizer's) applied to the
        messages: the prompt text, rendered on a tokenizer thread. ``kwargs`` go to
        ``apply_chat_template`` (tools, template variables)."""
        return await self.engine.with_tokenizer(lambda tokenizer: render_chat(
            tokenizer, self.chat_template, messages, add_generation_prompt, template, **kwargs))

    def chat_response(self, rid: str, model: str, req: ChatCompletionRequest, out: RequestOutput,
                      parsers: list[ChoiceParser]) -> ChatCompletionResponse:
        choices = []
        as_ids = self.tokens_as_ids(req)
        for j, c in enumerate(out.outputs):
            message = parsers[j].message(c.text)
            if req.echo:
                message["content"] = _echo_prefix(req) + (message["content"] or "")
            lp = chat_logprobs(c, req.top_logprobs or 0, as_ids) if req.logprobs else None
            choices.append(ChatCompletionChoice(index=j, message=ChatResponseMessage(**message), logprobs=lp,
                                                finish_reason=parsers[j].finish_reason(c.finish_reason),
                                                stop_reason=c.stop_reason,
                                                token_ids=c.token_ids if req.return_token_ids else None))
        return ChatCompletionResponse(
            id=rid, model=model, choices=choices,
            usage=usage_of([out], self.response_options.enable_prompt_tokens_details),
            prompt_logprobs=prompt_logprobs_json(out) if req.prompt_logprobs is not None else None,
            prompt_token_ids=out.prompt_token_ids if req.return_token_ids else None)

    async def chat_events(self, group: RequestGroup, rid: str, model: str, req: ChatCompletionRequest,
                          parsers: list[ChoiceParser]) -> AsyncIterator[str]:
        state, created = self.stream_state(req, bool(req.logprobs)), int(time.time())
        as_ids = self.tokens_as_ids(req)

        def chunk(choice: ChatStreamChoice, **fields) -> str:
            return sse(ChatCompletionChunk(id=rid, model=model, created=created, choices=[choice],
                                           usage=_continuous_usage(req, state, choice.index), **fields).model_dump())
        async for _, out in group.outputs():
            for idx, c in state.news(0, out):
                if idx not in state.started:  # OpenAI streams open each choice with the role
                    state.started.add(idx)
                    opening = _echo_prefix(req) if req.echo else ""
                    yield chunk(ChatStreamChoice(index=idx, delta=DeltaMessage(role="assistant", content=opening)),
                                prompt_token_ids=out.prompt_token_ids if req.return_token_ids else None)
                for choice in chat_stream_choices(idx, c, parsers[c.index], req, as_ids):
                    yield chunk(choice)
        if req.stream_options and req.stream_options.include_usage:
            yield sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                       "choices": [], "usage": state.usage().model_dump()})

    # ------------------------------------------------------------------ tokenizer and models
    async def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        """``POST /tokenize``: on a tokenizer thread (a 4 MiB body takes seconds)."""
        self.check_model(req.model)
        check_fields(req)
        if (req.prompt is None) == (req.messages is None):
            raise ServingError("give exactly one of prompt or messages", 400, "prompt")
        if req.messages is not None:  # rendered and encoded in one tokenizer-thread job (one hop, not two)
            ids = await self.engine.with_tokenizer(lambda tokenizer: _encode(tokenizer, render_chat(
                tokenizer, self.chat_template, req.messages, req.add_generation_prompt), False, "messages"))
        else:
            ids = await self.engine.with_tokenizer(
                lambda tokenizer: _encode(tokenizer, req.prompt, req.add_special_tokens, "prompt"))
        return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=self.model_config.max_model_len)

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        """``POST /detokenize``: on a tokenizer thread."""
        self.check_model(req.model)
        check_fields(req)
        self.check_token_ids(req.tokens, "tokens")
        text = await self.engine.with_tokenizer(lambda tokenizer: tokenizer.decode(req.tokens))
        return DetokenizeResponse(prompt=text)

    def models(self) -> ModelList:
        cards = [ModelCard(id=name, root=self.model_config.model, max_model_len=self.model_config.max_model_len)
                 for name in self.served_model_names]
        if self.lora_models is not None:
            cards += self.lora_models.cards(self.model_config.max_model_len)
        return ModelList(data=cards)

    # ------------------------------------------------------------------ legacy /generate
    async def generate(self, req: GenerateRequest, arrival: float):
        """vLLM's simple api_server: ``{"text": [prompt + completion, ...]}``; streams NDJSON."""
        _refuse_streamed_best_of(req)
        _unsupported(req.logprobs is not None, "logprobs", "logprobs on /generate (its reply is text only; "
                     "use /v1/completions)")
        fields = req.model_dump(exclude={"prompt", "stream"})
        try:
            params = SamplingParams(**fields, output_kind="cumulative" if req.stream else "final_only")
        except (ValueError, TypeError) as exc:
            raise bad_request(exc) from None
        prompt = req.prompt if isinstance(req.prompt, str) else {"prompt_token_ids": req.prompt}
        group = await self.start(f"generate-{uuid.uuid4().hex}", [prompt], params, arrival)
        if req.stream:
            return await start_streaming(self.generate_lines(group), "application/x-ndjson")
        return JSONResponse(self.generate_json((await collect(group))[0]))

    def generate_json(self, out: RequestOutput) -> dict:
        prompt = self.prompt_text(out)
        return {"text": [prompt + c.text for c in out.outputs]}

    async def generate_lines(self, group: RequestGroup) -> AsyncIterator[str]:
        """One JSON object per line (vLLM's format); an error after the first line ends the stream."""
        try:
            async for _, out in group.outputs():
                yield json.dumps(self.generate_json(out)) + "\n"
        finally:
            group.close()


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
        conversation = conversation_of(messages, _message_text)
    except RequestFieldError as exc:
        raise ServingError(str(exc), 400, exc.param) from None
    try:
        return tokenizer.apply_chat_template(conversation, chat_template=template,
                                             add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs)
    except Exception as exc:  # jinja errors (raise_exception in a template)
        raise ServingError(f"cannot apply the chat template: {exc}", 400, "messages") from None


def forced_call_fields(req: ChatCompletionRequest, tool_choice: Any) -> dict:
    """``tool_choice`` "required" or a named function: the output is constrained to the call(s),
    compact JSON (free whitespace would only let a model pad the call)."""
    if not is_forced(tool_choice):
        return {}
    if structured_outputs_of(req) is not None:
        raise ServingError(f"tool_choice={tool_choice if isinstance(tool_choice, str) else 'a named function'!r} "
                           "constrains the output to the call: it cannot be combined with response_format, "
                           "structured_outputs or guided_*", 400, "tool_choice")
    schema = forced_call_schema(req.tools, tool_choice, req.parallel_tool_calls)
    try:
        return {"structured_outputs": StructuredOutputsParams(json=schema, disable_any_whitespace=True)}
    except ValueError as exc:  # a tool schema the grammar compiler cannot take
        raise ServingError(f"tools: cannot constrain the output to the call: {exc}", 400, "tools") from None


def chat_stream_choices(idx: int, c: CompletionOutput, parser: ChoiceParser,
                        req: ChatCompletionRequest, as_ids: bool = False) -> list[ChatStreamChoice]:
    """One engine delta of a choice as stream choices: one per parsed piece (a tool call's name and
    its arguments go in separate chunks, as OpenAI sends them); the finish, the logprobs and the
    token ids ride on the last. Nothing to send (text held back by a parser) and no finish: no chunk."""
    pieces = parser.feed(c.text, final=c.finish_reason is not None)
    lp = chat_logprobs(c, req.top_logprobs or 0, as_ids) if req.logprobs else None
    token_ids = c.token_ids if req.return_token_ids else None
    if not pieces and c.finish_reason is None and not (lp and lp.content) and not token_ids:
        return []
    pieces = pieces or [MessagePiece(content="")]
    choices = [ChatStreamChoice(index=idx, delta=DeltaMessage(**vars(p))) for p in pieces]
    choices[-1].logprobs = lp
    choices[-1].token_ids = token_ids
    choices[-1].finish_reason = parser.finish_reason(c.finish_reason)
    choices[-1].stop_reason = c.stop_reason
    return choices


def _check_stream_options(req: SamplingFields) -> None:
    if req.stream_options is not None and not req.stream:
        raise ServingError("stream_options is only allowed when stream is true", 400, "stream_options")


def _token_ids(req: SamplingFields, out: RequestOutput, c: CompletionOutput, with_prompt: bool = True) -> dict:
    """``return_token_ids``: a completion choice's ``token_ids`` (and its prompt's, once)."""
    if not req.return_token_ids:
        return {}
    return {"token_ids": c.token_ids, "prompt_token_ids": out.prompt_token_ids if with_prompt else None}


def _continuous_usage(req: SamplingFields, state: StreamState, idx: int) -> UsageInfo | None:
    """``stream_options.continuous_usage_stats``: the choice's usage so far on each of its chunks."""
    if req.stream_options is None or not req.stream_options.continuous_usage_stats:
        return None
    return state.choice_usage(idx)


def _encode_embedding(vector: list[float], encoding_format: str) -> list[float] | str:
    """OpenAI's encodings: the floats, or base64 of their float32 little-endian bytes."""
    if encoding_format == "float":
        return vector
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")


def _as_chat_error(exc: ServingError, req: ChatCompletionRequest) -> ServingError:
    """Names the chat field: engine and SamplingParams messages name the prompt, logprobs and
    max_tokens, which a chat request may have sent as max_completion_tokens."""
    if exc.param == "max_tokens" and req.max_completion_tokens is not None:
        exc.param = "max_completion_tokens"
        exc.message = re.sub(r"^max_tokens\b", "max_completion_tokens", exc.message)
    exc.param = _CHAT_PARAMS.get(exc.param, exc.param)
    return exc


def _echo_prefix(req: ChatCompletionRequest) -> str:
    """vLLM's chat ``echo``: the last message's content, when it is the assistant's (being continued)."""
    last = req.messages[-1] if req.messages else None
    return _message_text(last) if last is not None and last.role == "assistant" else ""


def _message_text(m: ChatMessage) -> str:
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    if any(p.type != "text" for p in m.content):
        raise ServingError("only text content parts are supported", 400, "messages")
    return "".join(p.text or "" for p in m.content)


def _encode(tokenizer, text: str, add_special_tokens: bool, param: str) -> list[int]:
    """/tokenize: no length bound (it reports the count against max_model_len)."""
    try:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    except (TypeError, ValueError) as exc:
        raise ServingError(f"cannot tokenize {param}: {exc}", 400, param) from None


def _refuse_streamed_best_of(req) -> None:
    """A streamed request shows its sequences as they grow; best_of > n would rank them only at the end."""
    if req.stream and req.best_of is not None and req.best_of != req.n:
        raise ServingError("best_of != n is not supported when streaming", 400, "best_of")

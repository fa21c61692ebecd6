"""The one request-to-engine path every endpoint family shares (completions.py, chat.py, embeddings.py,
tokenization.py and the routes other modules add): errors, request checks, structured-output fields,
``RequestGroup``, server-sent events and ``ServingBase``, whose ``start`` adds an HTTP request's engine
requests.

Every handler validates completely (model name, unsupported fields, SamplingParams, prompt
length) before anything is streamed, so bad input is always a 400 with an OpenAI-style body.
The engine requests of one HTTP request live in a ``RequestGroup`` whose synchronous
``close()`` aborts whatever is unfinished: it runs in ``finally`` blocks, so a disconnect, a
cancellation or an error anywhere frees the KV blocks at once. A server past its shutdown deadline
ends every live group with a ``server_shutdown`` error (``ShutdownGate``).
"""
from __future__ import annotations

import asyncio
import contextlib
import re
import uuid
import weakref
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from pagedllm.contracts.grammar import check_spec_size, raw_spec_size
from pagedllm.engine.async_engine import AsyncLLMEngine, RequestStream
from pagedllm.engine.llm_engine import PromptType
from pagedllm.entrypoints.http_common import error_body, sse
from pagedllm.entrypoints.openai_common import ServingError
from pagedllm.outputs import RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams

from .chat_features import ChatOptions
from .client_identity import client_id
from .protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    ErrorResponse,
    GenerateRequest,
    SamplingFields,
    UsageInfo,
)
from .request_fields import RequestFieldError, check_request_fields
from .response_pieces import ResponseOptions, StreamState

# what one engine request runs: a generation, a beam search or an embedding
EngineParams = SamplingParams | BeamSearchParams | PoolingParams
_PARAM_NAMES = (set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)
                | set(GenerateRequest.model_fields) | set(EmbeddingRequest.model_fields))
_PARAM_ALIASES = {"prompt_token_ids": "prompt", "token": "tokens"}


# ---------------------------------------------------------------------- errors
def shutdown_error() -> ServingError:
    """What a request still running at the shutdown deadline gets (a 503, or an event in a stream)."""
    return ServingError("server shutting down", 503, type_="server_shutdown")


class ShutdownGate:
    """The server's shutdown deadline (``--shutdown-timeout`` after SIGINT/SIGTERM). ``expire()``
    ends every live RequestGroup with ``shutdown_error()``: a stream sends it as an error event and
    ``[DONE]``, a plain request answers 503, so no client is left with a truncated body; requests
    arriving later are refused the same way."""

    def __init__(self):
        self.groups: weakref.WeakSet[RequestGroup] = weakref.WeakSet()
        self.expired = False

    def admit(self, group: RequestGroup) -> None:
        if self.expired:
            raise shutdown_error()
        self.groups.add(group)

    def expire(self) -> None:
        """On the event loop: fails and aborts every live group."""
        self.expired = True
        for group in list(self.groups):
            group.fail(shutdown_error())


def param_of(message: str) -> str | None:
    """The request field an engine/SamplingParams message names first ("top_p=0 is invalid")."""
    match = re.match(r"[A-Za-z_]+", message)
    word = _PARAM_ALIASES.get(match.group(0), match.group(0)) if match else None
    return word if word in _PARAM_NAMES else None


def bad_request(exc: BaseException) -> ServingError:
    return ServingError(str(exc) or type(exc).__name__, 400, param_of(str(exc)))


def unsupported(condition: object, param: str, what: str) -> None:
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

def serving_of(raw: Request):
    """The app's handlers (``OpenAIServing``: every family's methods on one object)."""
    return raw.app.state.serving


# the error replies the routes document in the OpenAPI schema
ERROR_RESPONSES = {400: {"model": ErrorResponse}, 401: {"model": ErrorResponse}, 500: {"model": ErrorResponse},
                   503: {"model": ErrorResponse}}


# ---------------------------------------------------------------------- structured outputs
_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}


def structured_outputs_of(req: SamplingFields, max_bytes: int | None = None) -> StructuredOutputsParams | None:
    """The request's output constraint from whichever field gives it (``structured_outputs``, a
    ``guided_*`` field or ``response_format``); two at once, or an invalid one, is a 400 naming the field.
    ``max_bytes``: the engine's ``max_structured_output_bytes``, checked before the spec is parsed."""
    source = constraint_source(req)
    if source is None:
        return None
    name, kwargs = source
    try:
        check_raw_spec_size(kwargs, max_bytes)
        return StructuredOutputsParams(**kwargs)
    except (ValueError, TypeError) as exc:
        raise ServingError(f"{name}: {exc}", 400, name) from None


def constraint_source(req: SamplingFields) -> tuple[str, dict] | None:
    """``(field name, StructuredOutputsParams' keyword arguments)`` of the request's one constraint,
    unparsed; two at once is a 400 naming the second."""
    _check_guided_options(req)
    sources = [(name, kwargs) for name, kwargs in _constraint_sources(req) if kwargs is not None]
    if len(sources) > 1:
        names = [name for name, _ in sources]
        raise ServingError(f"{' and '.join(names)} both constrain the output; give only one", 400, names[1])
    return sources[0] if sources else None


def check_raw_spec_size(fields: dict | None, max_bytes: int | None) -> None:
    """ValueError for a spec over ``max_bytes`` (None: no check), before anything parses it: parsing
    happens on the event loop, and a 3 MB schema (a body under the 4 MiB limit) held it 4.6 s."""
    found = raw_spec_size(fields) if fields and max_bytes is not None else None
    if found is not None:
        check_spec_size(*found, max_bytes)


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
    unsupported(req.guided_whitespace_pattern is not None, "guided_whitespace_pattern",
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

    def fail(self, error: BaseException) -> None:
        """Ends the group: its reader raises ``error`` next, and its requests are aborted."""
        self.queue.put_nowait(error)
        self.close()


_ADD_BATCH = 256  # prompts per tokenizer-thread job and engine op (RequestGroup.add_all)
# what a use_beam_search request may set: the beams' parameters, the prompt and the reply's shape
_BEAM_SEARCH_FIELDS = frozenset({
    "model", "prompt", "messages", "n", "max_tokens", "max_completion_tokens", "temperature", "ignore_eos",
    "length_penalty", "include_stop_str_in_output", "use_beam_search", "stream", "stream_options", "echo", "user",
    "request_id", "return_token_ids", "cache_salt", "priority", "add_special_tokens",
    "add_generation_prompt", "continue_final_message", "chat_template", "chat_template_kwargs", "documents",
    "include_reasoning", "tools", "tool_choice", "parallel_tool_calls"})


# ---------------------------------------------------------------------- streaming helpers
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
        yield sse(exc.body() if isinstance(exc, ServingError) else error_body(str(exc), 500))
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


KEEP_ALIVE_COMMENT = ": keep-alive\n\n"  # an SSE comment: clients skip it, proxies see bytes


async def with_keep_alive(body: AsyncIterator[str], interval: float) -> AsyncIterator[str]:
    """``body``, with a keep-alive comment whenever it has been silent for ``interval`` seconds
    (``--sse-keep-alive-interval``: queued, in prefill, between tokens), so a proxy's read timeout
    does not cut the stream. One retained ``anext`` task advances ``body``: cancelling it on a
    timeout (``wait_for``) would abort the generator mid-step."""
    step = asyncio.ensure_future(anext(body))
    try:
        while True:
            done, _ = await asyncio.wait({step}, timeout=interval)
            if not done:
                yield KEEP_ALIVE_COMMENT
                continue
            try:
                chunk = step.result()
            except StopAsyncIteration:
                return
            yield chunk
            step = asyncio.ensure_future(anext(body))
    finally:
        step.cancel()
        with contextlib.suppress(BaseException):
            await step
        with contextlib.suppress(BaseException):
            await body.aclose()  # runs sse_body's finally: the group is closed


async def collect(group: RequestGroup) -> list[RequestOutput]:
    try:
        return await group.finals()
    finally:
        group.close()


# ---------------------------------------------------------------------- the handlers
class ServingBase:
    """What every handler family shares over one AsyncLLMEngine: model and token checks, request
    parameters, and ``start`` (the one path from an HTTP request to engine requests)."""

    def __init__(self, engine: AsyncLLMEngine, served_model_names: list[str], chat_template: str | None = None,
                 chat_options: ChatOptions | None = None, response_options: ResponseOptions | None = None):
        self.engine = engine
        self.served_model_names = served_model_names
        self.model_config = engine.model_config
        self.tokenizer = engine.get_tokenizer()  # this thread's own copy (for templates and decoding)
        self.chat_template = chat_template
        self.chat_options = chat_options or ChatOptions()
        self.response_options = response_options or ResponseOptions()
        self.shutdown_gate = ShutdownGate()
        self.max_spec_bytes = engine.engine.config.structured_output.max_spec_bytes  # checked before parsing
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
                      structured_outputs=structured_outputs_of(req, self.max_spec_bytes), bad_words=req.bad_words,
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
        the request whose ``cache_salt`` and ``priority`` the engine requests take. Generations are
        charged to the HTTP client (``client_identity.py``): its grammar compiles queue as one client's."""
        group = RequestGroup(self.engine)
        self.shutdown_gate.admit(group)
        ids = [base_id] if len(prompts) == 1 else [f"{base_id}-{i}" for i in range(len(prompts))]
        options = {} if req is None else {"cache_salt": req.cache_salt, "priority": req.priority}
        if isinstance(params, SamplingParams):
            options["client_id"] = client_id(getattr(req, "user", None))
        lora = self.lora_for(getattr(req, "model", None))
        if lora is not None:  # model= named an adapter
            options["lora_request"] = lora
        try:
            await group.add_all(list(zip(ids, prompts)), params, arrival, **options)
        except BaseException:
            group.close()
            raise
        return group

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

    def stream_state(self, req: SamplingFields, logprobs: bool) -> StreamState:
        return StreamState(logprobs=logprobs, token_ids=bool(req.return_token_ids),
                           details=self.response_options.enable_prompt_tokens_details, n=req.n or 1)
    async def stream_sse(self, events: AsyncIterator[str], group: RequestGroup) -> StreamingResponse:
        """A stream's response: ``events`` as server-sent events ending in ``[DONE]``, with keep-alive
        comments under ``--sse-keep-alive-interval`` (the first may commit the 200 before any output)."""
        body = sse_body(events, group)
        interval = self.response_options.sse_keep_alive_interval
        return await start_streaming(with_keep_alive(body, interval) if interval else body, "text/event-stream")

    def include_usage(self, req: SamplingFields) -> bool:
        """Whether a stream ends with the usage chunk: the request's ``stream_options.include_usage``,
        or always under ``--enable-force-include-usage`` (vLLM's rule)."""
        asked = req.stream_options is not None and bool(req.stream_options.include_usage)
        return asked or self.response_options.enable_force_include_usage

    def tokens_as_ids(self, req: SamplingFields) -> bool:
        """``return_tokens_as_token_ids``: the request's, else the server's flag."""
        if req.return_tokens_as_token_ids is not None:
            return req.return_tokens_as_token_ids
        return self.response_options.return_tokens_as_token_ids


def continuous_usage(req: SamplingFields, state: StreamState, idx: int) -> UsageInfo | None:
    """``stream_options.continuous_usage_stats``: the choice's usage so far on each of its chunks."""
    if req.stream_options is None or not req.stream_options.continuous_usage_stats:
        return None
    return state.choice_usage(idx)




def _check_stream_options(req: SamplingFields) -> None:
    if req.stream_options is not None and not req.stream:
        raise ServingError("stream_options is only allowed when stream is true", 400, "stream_options")



def refuse_streamed_best_of(req) -> None:
    """A streamed request shows its sequences as they grow; best_of > n would rank them only at the end."""
    if req.stream and req.best_of is not None and req.best_of != req.n:
        raise ServingError("best_of != n is not supported when streaming", 400, "best_of")

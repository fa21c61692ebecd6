"""The OpenAI-compatible HTTP server (FastAPI + uvicorn).

    pagedllm serve MODEL [flags]
    python -m pagedllm.entrypoints.openai.api_server --model MODEL [flags]

``build_app`` makes the ASGI app from EngineArgs, an LLMEngine or an AsyncLLMEngine; the engine
thread starts with the app (lifespan) and stops with it.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import logging
import math
import os
import sys
import time
from collections.abc import Awaitable
from dataclasses import dataclass

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm import envs
from pagedllm.engine.arg_utils import EngineArgs, add_engine_args, engine_args_from_cli
from pagedllm.engine.async_engine import AsyncLLMEngine, EngineDeadError
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.router.data_parallel import add_data_parallel_args, run_data_parallel, wants_data_parallel
from pagedllm.metrics.prometheus import CONTENT_TYPE_LATEST, PrometheusMetrics
from pagedllm.utils import check_int

from .admin import include_admin_routes
from .chat_features import ChatOptions
from .lora_serving import LoRAModels, LoRAModulePath, add_lora_args, lora_router
from .pooling_serving import router as pooling_router
from .protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    ErrorResponse,
    GenerateRequest,
    TokenizeRequest,
)
from .reasoning_parsers import REASONING_PARSERS
from .responses import DEFAULT_STORE_SIZE, add_responses_api, add_responses_args
from .serving import OpenAIServing, ResponseOptions, ServingError, error_body
from .tool_parsers import TOOL_PARSERS

logger = logging.getLogger(__name__)

# routes that run the model or the tokenizer need the key; /health and /metrics stay open for probes
_PROTECTED_PREFIXES = ("/v1", "/generate", "/tokenize", "/detokenize", "/pooling", "/classify", "/score", "/rerank",
                       "/v2")
_ERRORS = {400: {"model": ErrorResponse}, 401: {"model": ErrorResponse}, 500: {"model": ErrorResponse}}

router = APIRouter()


# ---------------------------------------------------------------------- cancellation
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


def _serving(raw: Request) -> OpenAIServing:
    return raw.app.state.serving


# ---------------------------------------------------------------------- routes
@router.post("/v1/completions", responses=_ERRORS)
async def create_completion(request: CompletionRequest, raw: Request):
    return await with_cancellation(raw, _serving(raw).create_completion(request, time.time()))


@router.post("/v1/embeddings", responses=_ERRORS)
async def create_embedding(request: EmbeddingRequest, raw: Request):
    return await with_cancellation(raw, _serving(raw).create_embedding(request, time.time()))


@router.post("/v1/chat/completions", responses=_ERRORS)
async def create_chat_completion(request: ChatCompletionRequest, raw: Request):
    return await with_cancellation(raw, _serving(raw).create_chat_completion(request, time.time()))


_GENERATE_BODY = {"requestBody": {"required": True, "content": {
    "application/json": {"schema": GenerateRequest.model_json_schema()}}}}


@router.post("/generate", responses=_ERRORS, openapi_extra=_GENERATE_BODY)
async def generate(raw: Request):
    """vLLM's legacy endpoint; like vLLM it reads JSON whatever the content type (``curl -d``)."""
    try:
        request = GenerateRequest.model_validate_json(await raw.body())
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False)) from None
    return await with_cancellation(raw, _serving(raw).generate(request, time.time()))


@router.get("/v1/models")
async def show_models(raw: Request):
    return _serving(raw).models()


@router.post("/tokenize", responses=_ERRORS)
async def tokenize(request: TokenizeRequest, raw: Request):
    return await _serving(raw).tokenize(request)


@router.post("/detokenize", responses=_ERRORS)
async def detokenize(request: DetokenizeRequest, raw: Request):
    return await _serving(raw).detokenize(request)


@router.get("/health")
async def health(raw: Request) -> Response:
    engine: AsyncLLMEngine = raw.app.state.engine
    if engine.is_healthy:
        return Response(status_code=200)
    reason = str(engine.dead_error or "the engine is not running")
    return JSONResponse(error_body(reason, 503), status_code=503)


@router.get("/metrics")
async def metrics(raw: Request) -> Response:
    engine: AsyncLLMEngine = raw.app.state.engine
    snapshot = await engine.get_metrics()
    body = raw.app.state.metrics.render(snapshot, engine_running=engine.is_healthy)
    return Response(body, media_type=CONTENT_TYPE_LATEST)


# ---------------------------------------------------------------------- errors and auth
def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    """FastAPI's 422 becomes OpenAI's 400, naming the first offending field."""
    err = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
    if err.get("type") == "json_invalid":  # loc is a character offset, not a field
        reason = (err.get("ctx") or {}).get("error", "")
        return JSONResponse(error_body(f"malformed JSON body: {reason}".rstrip(": "), 400), status_code=400)
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    param = loc[0] if loc else None
    # a union field fails once per alternative: show a few, so "expected str or list" is visible
    message = "; ".join(_describe(e) for e in exc.errors()[:3])
    return JSONResponse(error_body(message, 400, param), status_code=400)


def _describe(err: dict) -> str:
    where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
    return f"{where}: {err.get('msg')}" if where else str(err.get("msg"))


def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    return JSONResponse(error_body(str(exc.detail), exc.status_code), status_code=exc.status_code,
                        headers=exc.headers)


def _engine_dead(_: Request, exc: EngineDeadError) -> JSONResponse:
    return JSONResponse(error_body(str(exc), 500), status_code=500)


def _internal_error(_: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error", exc_info=exc)
    return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", 500), status_code=500)


def _add_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ServingError, lambda _, exc: exc.response())
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(EngineDeadError, _engine_dead)
    app.add_exception_handler(Exception, _internal_error)


class ApiKeyMiddleware:
    """Pure ASGI (unlike BaseHTTPMiddleware it leaves streaming and disconnects alone)."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(_PROTECTED_PREFIXES) and not self._ok(scope):
            body = error_body("invalid or missing API key", 401, code="invalid_api_key")
            await JSONResponse(body, status_code=401)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _ok(self, scope) -> bool:
        given = dict(scope["headers"]).get(b"authorization", b"")
        return hmac.compare_digest(given, self.expected)


# ---------------------------------------------------------------------- request bodies and shutdown
@dataclass(frozen=True)
class ServerLimits:
    """Bounds on what one client can make the server do (the flags of the same names).

    ``max_request_body_bytes``: a larger body is refused with 413 before it is read whole, from its
    Content-Length up front or, for a chunked body, as soon as the bytes read pass the limit, so one
    huge prompt can neither fill memory nor hold the tokenizer. The default, 4 MiB (TGI's is 2 MB,
    nginx's 1 MiB), fits a 128k-token prompt several times over, as text or as token ids.
    ``request_body_timeout``: seconds to wait for the next piece of a body (nginx's
    client_body_timeout) before answering 408. ``shutdown_timeout``: seconds SIGINT/SIGTERM lets
    in-flight requests finish before the rest are aborted; 20 keeps the exit inside Kubernetes'
    default 30 s grace period.
    """

    max_request_body_bytes: int = 4 * 2**20
    request_body_timeout: float = 30.0
    shutdown_timeout: float = 20.0

    def __post_init__(self):
        check_int("max_request_body_bytes", self.max_request_body_bytes, 1)
        for name in ("request_body_timeout", "shutdown_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name}={value!r} is invalid: must be a finite number of seconds")
        if self.request_body_timeout <= 0:
            raise ValueError(f"request_body_timeout={self.request_body_timeout!r} is invalid: must be > 0")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout={self.shutdown_timeout!r} is invalid: must be >= 0")


class RequestBodyMiddleware:
    """Pure ASGI: refuses a body over the size limit (413) or one that stops arriving (408)."""

    def __init__(self, app, limits: ServerLimits):
        self.app, self.limits = app, limits

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.limits.max_request_body_bytes:
            exc = _too_large(declared, self.limits)  # refused before a byte of the body is read
            await _http_error(None, exc)(scope, receive, send)
            return
        await self.app(scope, _BodyReader(receive, self.limits), send)


class _BodyReader:
    """Wraps ASGI ``receive``: counts body bytes and bounds the wait for each piece of the body.

    Raises HTTPException (413 or 408) from inside the route's body read, so the app's error
    handler answers it; the connection is closed since the rest of the body is never read.
    """

    def __init__(self, receive, limits: ServerLimits):
        self._receive, self.limits = receive, limits
        self.received, self.complete = 0, False

    async def __call__(self) -> dict:
        if self.complete:  # later receives wait for a disconnect, as long as the response takes
            return await self._receive()
        try:
            message = await asyncio.wait_for(self._receive(), self.limits.request_body_timeout)
        except asyncio.TimeoutError:
            raise _body_timeout(self.limits) from None
        if message["type"] == "http.request":
            self.received += len(message.get("body", b""))
            self.complete = not message.get("more_body", False)
            if self.received > self.limits.max_request_body_bytes:
                raise _too_large(self.received, self.limits, read_so_far=True)
        return message


def _content_length(scope) -> int | None:
    value = dict(scope["headers"]).get(b"content-length")
    return int(value) if value is not None and value.isdigit() else None


def _too_large(size: int, limits: ServerLimits, read_so_far: bool = False) -> StarletteHTTPException:
    what = f"more than {limits.max_request_body_bytes}" if read_so_far else str(size)
    return StarletteHTTPException(413, f"request body is {what} bytes: the limit is {limits.max_request_body_bytes} "
                                       "bytes (--max-request-body-bytes)", headers={"Connection": "close"})


def _body_timeout(limits: ServerLimits) -> StarletteHTTPException:
    return StarletteHTTPException(408, f"request body incomplete: no data for {limits.request_body_timeout:g} s "
                                       "(--request-body-timeout)", headers={"Connection": "close"})


# ---------------------------------------------------------------------- the app
def build_app(engine: EngineArgs | LLMEngine | AsyncLLMEngine, *, served_model_name: str | list[str] | None = None,
              chat_template: str | None = None, api_key: str | None = None,
              limits: ServerLimits | None = None, chat_options: ChatOptions | None = None,
              response_options: ResponseOptions | None = None,
              responses_store_size: int = DEFAULT_STORE_SIZE,
              lora_modules: list[LoRAModulePath] | None = None) -> FastAPI:
    """The ASGI app; ``chat_template`` is a template string or a path to a template file;
    ``chat_options``: tool calling and reasoning (``--enable-auto-tool-choice``, ``--tool-call-parser``,
    ``--reasoning-parser``); ``response_options``: ``--enable-prompt-tokens-details``,
    ``--return-tokens-as-token-ids``; ``lora_modules``: the adapters served by name (``--lora-modules``,
    with ``--enable-lora``)."""
    limits = limits or ServerLimits()
    async_engine = _as_async_engine(engine)
    names = _served_names(engine, served_model_name)
    prometheus = PrometheusMetrics(names[0], async_engine.model_config.max_model_len)
    async_engine.observers.append(prometheus)
    app = FastAPI(title="pagedllm OpenAI-compatible server", lifespan=_lifespan(async_engine))
    app.state.engine, app.state.metrics = async_engine, prometheus
    app.state.serving = OpenAIServing(async_engine, names, load_chat_template(chat_template), chat_options,
                                      response_options)
    _add_lora(app, async_engine, names, lora_modules)
    app.include_router(router)
    add_responses_api(app, responses_store_size)
    app.include_router(pooling_router)
    include_admin_routes(app, api_key)
    _add_error_handlers(app)
    app.add_middleware(RequestBodyMiddleware, limits=limits)
    if api_key:  # added last, so outermost: a request without the key is refused before its body is read
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    return app


def _add_lora(app: FastAPI, engine: AsyncLLMEngine, names: list[str], modules: list[LoRAModulePath] | None) -> None:
    """With --enable-lora: the adapters served by name, and the runtime (un)load routes when allowed."""
    if engine.engine.lora_registry is None:
        if modules:
            raise ValueError("--lora-modules needs --enable-lora")
        return
    models = app.state.serving.lora_models = LoRAModels(engine, names)
    models.add_static(modules or [])
    if envs.PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING:
        app.include_router(lora_router)


def _as_async_engine(engine: EngineArgs | LLMEngine | AsyncLLMEngine) -> AsyncLLMEngine:
    if isinstance(engine, AsyncLLMEngine):
        return engine
    if isinstance(engine, LLMEngine):
        return AsyncLLMEngine(engine)
    return AsyncLLMEngine.from_engine_args(engine)


def _served_names(engine, served_model_name: str | list[str] | None) -> list[str]:
    """The explicit names, else the engine's own (EngineArgs.served_model_name, else the model as given)."""
    if isinstance(served_model_name, str):
        return [served_model_name]
    if served_model_name:
        return list(served_model_name)
    if isinstance(engine, EngineArgs):
        return list(engine.served_model_names())
    # LLMEngine and AsyncLLMEngine both expose model_config
    return list(engine.model_config.served_model_names) or [engine.model_config.model]


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


def _lifespan(engine: AsyncLLMEngine):
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        engine.start()
        try:
            yield
        finally:  # SIGINT/SIGTERM end here too: stops the engine thread, then the engine's workers
            await engine.shutdown()
    return lifespan


# ---------------------------------------------------------------------- command line
def make_arg_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Server flags plus the engine flags (vLLM's names; --served-model-name is an engine flag, as in vLLM)."""
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind")
    g.add_argument("--port", type=int, default=8000, help="port to bind")
    g.add_argument("--chat-template", default=None, help="chat template file or string (default: the tokenizer's)")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1, /generate, /tokenize, /detokenize "
                        "(or set $PAGEDLLM_API_KEY)")
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"], help="uvicorn's log level")
    g.add_argument("--headless", action="store_true",
                   help="no engine and no API: host this node's ranks of a multi-node launch (--nnodes, --node-rank)")
    _add_limit_args(parser)
    _add_chat_args(parser)
    _add_response_args(parser)
    add_lora_args(parser)
    add_responses_args(parser)
    add_engine_args(parser)
    add_data_parallel_args(parser)
    return parser


def _add_chat_args(parser: argparse.ArgumentParser) -> None:
    """The ChatOptions flags (vLLM's names)."""
    g = parser.add_argument_group("tool calling and reasoning")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="parse tool calls from the output when a chat request sends tools (tool_choice 'auto'); "
                        "needs --tool-call-parser")
    g.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="the model's tool-call format, by vLLM's name: hermes (Hermes/Qwen), llama3_json, mistral, "
                        "pythonic (Llama 3.2/4), qwen3_coder, openai (gpt-oss harmony; implies --reasoning-parser "
                        "openai_gptoss), granite, deepseek_v3, deepseek_v31, internlm, jamba")
    g.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                   help="put a reasoning model's thinking into reasoning_content: deepseek_r1, qwen3 (<think>), "
                        "mistral ([THINK]), granite, openai_gptoss / gpt_oss (harmony analysis channel), "
                        "deepseek_v3 (thinking when chat_template_kwargs has thinking: true)")


def _add_response_args(parser: argparse.ArgumentParser) -> None:
    """The ResponseOptions flags (vLLM's names)."""
    g = parser.add_argument_group("replies")
    g.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="add usage.prompt_tokens_details.cached_tokens: prompt tokens served by the prefix cache")
    g.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="show logprobs tokens as 'token_id:N' (a request's return_tokens_as_token_ids overrides it)")


def _response_options_from_cli(args: argparse.Namespace) -> ResponseOptions:
    return ResponseOptions(enable_prompt_tokens_details=args.enable_prompt_tokens_details,
                           return_tokens_as_token_ids=args.return_tokens_as_token_ids)


def _chat_options_from_cli(args: argparse.Namespace) -> ChatOptions:
    return ChatOptions(enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser,
                       reasoning_parser=args.reasoning_parser)


def _add_limit_args(parser: argparse.ArgumentParser) -> None:
    """The ServerLimits flags (request bodies, shutdown); defaults come from the dataclass."""
    d = ServerLimits()
    g = parser.add_argument_group("server limits")
    g.add_argument("--max-request-body-bytes", type=int, default=d.max_request_body_bytes,
                   help="refuse a request body larger than this with HTTP 413, before reading it")
    g.add_argument("--request-body-timeout", type=float, default=d.request_body_timeout,
                   help="seconds to wait for the next part of a request body before answering HTTP 408")
    g.add_argument("--shutdown-timeout", type=float, default=d.shutdown_timeout,
                   help="on SIGINT/SIGTERM, seconds to let in-flight requests finish; the rest are then aborted")


def _limits_from_cli(args: argparse.Namespace) -> ServerLimits:
    return ServerLimits(max_request_body_bytes=args.max_request_body_bytes,
                        request_body_timeout=args.request_body_timeout, shutdown_timeout=args.shutdown_timeout)


def run_server(args: argparse.Namespace) -> int:
    """Loads the model, then serves until interrupted (SIGINT/SIGTERM: drains for --shutdown-timeout)."""
    import uvicorn
    if getattr(args, "model_tag", None):
        args.model = args.model_tag
    limits = _limits_from_cli(args)
    chat_options = _chat_options_from_cli(args)  # checked before the model loads
    if wants_data_parallel(args):  # N replicas on internal ports, this process runs the router
        return run_data_parallel(args)
    engine_args = engine_args_from_cli(args)
    config = engine_args.create_engine_config()  # once: it reads the model's config files and checks everything
    from pagedllm.entrypoints.headless import is_headless, run_headless
    if is_headless(config, args.headless):
        return run_headless(config)
    app = build_app(LLMEngine(config), served_model_name=list(engine_args.served_model_names()),
                    chat_template=args.chat_template, api_key=args.api_key or envs.PAGEDLLM_API_KEY,
                    limits=limits, chat_options=chat_options, response_options=_response_options_from_cli(args),
                    responses_store_size=args.responses_store_size, lora_modules=args.lora_modules)
    # after the timeout uvicorn cancels the remaining request tasks (which aborts their requests)
    # and runs the lifespan's shutdown, which stops the engine
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                timeout_graceful_shutdown=limits.shutdown_timeout)
    return 0


def register(subparsers) -> None:
    """Adds ``pagedllm serve MODEL`` to the pagedllm CLI."""
    p = subparsers.add_parser("serve", help="start the OpenAI-compatible server",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("model_tag", nargs="?", default=None, help="model to serve (overrides --model)")
    make_arg_parser(p)
    p.set_defaults(func=run_server)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedllm.entrypoints.openai.api_server",
                                     description="pagedllm OpenAI-compatible server",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    args = make_arg_parser(parser).parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return run_server(args)
    except (ValueError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

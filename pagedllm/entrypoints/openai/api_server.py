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
import dataclasses
import gc
import json
import logging
import sys

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm import envs
from pagedllm.engine.arg_utils import EngineArgs, add_engine_args, engine_args_from_cli
from pagedllm.engine.async_engine import AsyncLLMEngine, EngineDeadError
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.headless import is_headless, run_headless
from pagedllm.entrypoints.http_common import (
    HttpOptions,
    add_http_args,
    fastapi_kwargs,
    http_options_from_cli,
    install_middlewares,
    uvicorn_kwargs,
)
from pagedllm.entrypoints.http_guards import (
    RequestBodyMiddleware,
    ServerLimits,
    add_limit_args,
    http_error,
    limits_from_cli,
)
from pagedllm.entrypoints.router.data_parallel import add_data_parallel_args, run_data_parallel, wants_data_parallel
from pagedllm.metrics.prometheus import CONTENT_TYPE_LATEST, PrometheusMetrics, add_metrics_args

from . import chat, completions, dashboard, embeddings, tokenization
from .admin import include_admin_routes
from .chat_features import CONTENT_FORMATS, ChatOptions, load_chat_template
from .cli_args import ConfigFileAction, add_refused_args, check_refused_args
from .client_identity import ClientIdentityMiddleware
from .lora_serving import LoRAModels, LoRAModulePath, add_lora_args, check_lora_modules
from .lora_serving import router as lora_router
from .pooling_serving import router as pooling_router
from .reasoning_parsers import REASONING_PARSERS
from .responses import DEFAULT_STORE_SIZE, add_responses_api, add_responses_args
from .serving import OpenAIServing, ResponseOptions, ServingError, error_body
from .serving_base import ShutdownGate
from .tool_parsers import TOOL_PARSERS

logger = logging.getLogger(__name__)

router = APIRouter()  # the server's own probes: /health and /metrics


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


def _engine_dead(_: Request, exc: EngineDeadError) -> JSONResponse:
    return JSONResponse(error_body(str(exc), 500), status_code=500)


def _internal_error(_: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error", exc_info=exc)
    return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", 500), status_code=500)


def _add_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ServingError, lambda _, exc: exc.response())
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(EngineDeadError, _engine_dead)
    app.add_exception_handler(Exception, _internal_error)


# ---------------------------------------------------------------------- request bodies and shutdown
# ---------------------------------------------------------------------- the app
# every endpoint family's routes; a new family adds its APIRouter here
ROUTERS: list[APIRouter] = [completions.router, chat.router, embeddings.router, tokenization.router, pooling_router,
                            dashboard.router, lora_router, router]


def build_app(engine: EngineArgs | LLMEngine | AsyncLLMEngine, *, served_model_name: str | list[str] | None = None,
              chat_template: str | None = None, api_key: str | list[str] | None = None,
              limits: ServerLimits | None = None, chat_options: ChatOptions | None = None,
              response_options: ResponseOptions | None = None, http_options: HttpOptions | None = None,
              responses_store_size: int = DEFAULT_STORE_SIZE,
              lora_modules: list[LoRAModulePath] | None = None) -> FastAPI:
    """The ASGI app; ``chat_template`` is a template string or a path to a template file;
    ``chat_options``: tool calling, reasoning and template options (``--enable-auto-tool-choice``,
    ``--tool-call-parser``, ``--reasoning-parser``...); ``response_options``: ``--enable-prompt-tokens-details``,
    ``--return-tokens-as-token-ids``; ``http_options``: the deployment (TLS is uvicorn's: see
    ``uvicorn_kwargs``), ``api_key`` adds keys to its ``api_keys``; ``lora_modules``: the adapters served by
    name (``--lora-modules``, with ``--enable-lora``)."""
    limits = limits or ServerLimits()
    http_options = _with_api_keys(http_options or HttpOptions(), api_key)
    async_engine = _as_async_engine(engine)
    names = _served_names(engine, served_model_name)
    prometheus = PrometheusMetrics(names[0], async_engine.model_config.max_model_len)
    async_engine.observers.append(prometheus)
    app = FastAPI(title="pagedllm OpenAI-compatible server", lifespan=_lifespan(async_engine),
                  **fastapi_kwargs(http_options))
    app.state.engine, app.state.metrics = async_engine, prometheus
    app.state.serving = OpenAIServing(async_engine, names, load_chat_template(chat_template), chat_options,
                                      response_options)
    _add_lora(app, async_engine, names, lora_modules)
    for routes in ROUTERS:
        app.include_router(routes)
    add_responses_api(app, responses_store_size)
    include_admin_routes(app)
    _add_error_handlers(app)
    app.add_middleware(RequestBodyMiddleware, limits=limits)
    app.add_middleware(ClientIdentityMiddleware, keys_checked=bool(http_options.api_keys))  # client_identity.py
    # outside the body limits: a request without the key is refused before its body is read
    install_middlewares(app, http_options)
    return app


def _with_api_keys(options: HttpOptions, api_key: str | list[str] | None) -> HttpOptions:
    keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
    return dataclasses.replace(options, api_keys=(*options.api_keys, *keys)) if keys else options


def _add_lora(app: FastAPI, engine: AsyncLLMEngine, names: list[str], modules: list[LoRAModulePath] | None) -> None:
    """With --enable-lora: the adapters served by name; the runtime (un)load routes (lora_serving.router)
    answer only when PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING was set at start-up."""
    check_lora_modules(modules, engine.engine.lora_registry is not None)
    if engine.engine.lora_registry is None:
        return
    models = LoRAModels(engine, names, runtime_updates=envs.PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING)
    models.add_static(modules or [])
    app.state.serving.lora_models = models


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
    g.add_argument("--config", action=ConfigFileAction, default=None, metavar="YAML",
                   help="read flags from a YAML file (vLLM's format: max-model-len: 4096); the command line wins")
    g.add_argument("--headless", action="store_true",
                   help="no engine and no API: host this node's ranks of a multi-node launch (--nnodes, --node-rank)")
    add_metrics_args(g)
    dashboard.add_dashboard_args(g)
    add_http_args(parser)
    add_limit_args(parser)
    _add_chat_args(parser)
    _add_response_args(parser)
    add_lora_args(parser)
    add_responses_args(parser)
    add_refused_args(parser)
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
    g.add_argument("--chat-template-content-format", default="auto", choices=CONTENT_FORMATS,
                   help="message content in the chat template: a string, OpenAI's list of parts (openai), or "
                        "the one the template loops over (auto, vLLM's detection)")
    g.add_argument("--exclude-tools-when-tool-choice-none", action=argparse.BooleanOptionalAction, default=False,
                   help="leave the tools out of the chat template when a request says tool_choice 'none'")
    g.add_argument("--trust-request-chat-template", action=argparse.BooleanOptionalAction, default=False,
                   help="let requests bring their own chat_template (refused otherwise: a template is code)")
    g.add_argument("--default-chat-template-kwargs", type=json.loads, default=None,
                   help='template variables for every chat request, as JSON, e.g. \'{"enable_thinking": false}\' '
                        "(a request's chat_template_kwargs override them)")


def _add_response_args(parser: argparse.ArgumentParser) -> None:
    """The ResponseOptions flags (vLLM's names)."""
    g = parser.add_argument_group("replies")
    g.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="add usage.prompt_tokens_details.cached_tokens: prompt tokens served by the prefix cache")
    g.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="show logprobs tokens as 'token_id:N' (a request's return_tokens_as_token_ids overrides it)")
    g.add_argument("--enable-force-include-usage", action=argparse.BooleanOptionalAction, default=False,
                   help="end every stream with the usage chunk (as stream_options.include_usage)")
    g.add_argument("--response-role", default="assistant",
                   help="the role of a chat reply after the generation prompt")
    g.add_argument("--sse-keep-alive-interval", type=int, default=0,
                   help="send an SSE keep-alive comment on a completion or chat stream silent this many seconds "
                        "(for proxies with read timeouts); 0: never")


def _response_options_from_cli(args: argparse.Namespace) -> ResponseOptions:
    return ResponseOptions(enable_prompt_tokens_details=args.enable_prompt_tokens_details,
                           return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                           enable_force_include_usage=args.enable_force_include_usage,
                           response_role=args.response_role,
                           sse_keep_alive_interval=args.sse_keep_alive_interval)


def _chat_options_from_cli(args: argparse.Namespace) -> ChatOptions:
    return ChatOptions(enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser,
                       reasoning_parser=args.reasoning_parser,
                       trust_request_chat_template=args.trust_request_chat_template,
                       default_chat_template_kwargs=args.default_chat_template_kwargs or {},
                       exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
                       chat_template_content_format=args.chat_template_content_format)


def run_server(args: argparse.Namespace) -> int:
    """Loads the model, then serves until interrupted (SIGINT/SIGTERM: drains for --shutdown-timeout)."""
    if getattr(args, "model_tag", None):
        args.model = args.model_tag
    limits = limits_from_cli(args)
    chat_options = _chat_options_from_cli(args)  # checked before the model loads
    check_refused_args(args)
    check_lora_modules(args.lora_modules, args.enable_lora)
    env_keys = (envs.PAGEDLLM_API_KEY,) if envs.PAGEDLLM_API_KEY else ()
    http_options = http_options_from_cli(args, env_keys)
    if wants_data_parallel(args):  # N replicas on internal ports, this process runs the router
        return run_data_parallel(args, serve=run_server, http_options=http_options)
    engine_args = engine_args_from_cli(args)
    config = engine_args.create_engine_config()  # once: it reads the model's config files and checks everything
    if is_headless(config, args.headless):
        return run_headless(config)
    app = build_app(LLMEngine(config), served_model_name=list(engine_args.served_model_names()),
                    chat_template=args.chat_template, limits=limits, chat_options=chat_options,
                    response_options=_response_options_from_cli(args), http_options=http_options,
                    responses_store_size=args.responses_store_size, lora_modules=args.lora_modules)
    app.state.metrics.names = args.metrics_names
    app.state.dashboard = not args.disable_dashboard
    # as vLLM: the start-up objects (model, tokenizer, modules) live as long as the process, so the
    # collector need not walk them again: no GC pauses over them while serving, and an exit seconds
    # shorter (the final collection over torch's and transformers' objects took 2-4 s)
    gc.collect()
    gc.freeze()
    serve_app(app, args.host, args.port, http_options, limits.shutdown_timeout)
    return 0


def serve_app(app: FastAPI, host: str, port: int, http_options: HttpOptions, shutdown_timeout: float) -> None:
    """Runs the app under uvicorn until SIGINT/SIGTERM, then drains: requests get ``shutdown_timeout``
    seconds to finish; those still running are ended with a ``server_shutdown`` error (``ShutdownGate``)
    and the lifespan's shutdown stops the engine."""
    # uvicorn's own deadline a little later than the gate's, so the ended requests' last bytes go out
    config = uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=shutdown_timeout + _FLUSH_SECONDS,
                            **uvicorn_kwargs(http_options))
    with contextlib.suppress(KeyboardInterrupt):  # uvicorn re-raises the SIGINT it drained for (as uvicorn.run)
        DrainingServer(config, app.state.serving.shutdown_gate, shutdown_timeout).run()


_FLUSH_SECONDS = 0.5  # after the shutdown deadline: time for the error events and 503s to reach the clients


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose SIGINT/SIGTERM also arms the ShutdownGate's deadline."""

    def __init__(self, config: uvicorn.Config, gate: ShutdownGate, timeout: float):
        super().__init__(config)
        self.gate, self.timeout = gate, timeout
        self.loop: asyncio.AbstractEventLoop | None = None
        self.armed = False

    async def serve(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        if self.loop is not None and not self.armed:  # in a signal handler: only hand the loop a callback
            self.armed = True
            self.loop.call_soon_threadsafe(self.loop.call_later, self.timeout, self.gate.expire)


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

"""The router's ASGI app: its own /health, /metrics and /router/backends; everything else is forwarded.

Like a replica it refuses a body over ``--max-request-body-bytes`` (413, before reading it or as
soon as a chunked body passes the limit) and one that stops arriving (408), and with ``--api-key``
every route but /health needs the key (/metrics and /router/backends too, unless
``--metrics-public``): what one client sends is judged here, before any backend sees it.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Callable

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from pagedllm.entrypoints.dashboard.page import PAGE_PATH
from pagedllm.entrypoints.http_common import (
    HttpOptions,
    error_body,
    fastapi_kwargs,
    install_middlewares,
    with_cancellation,
)
from pagedllm.entrypoints.http_guards import RequestBodyMiddleware, http_error
from pagedllm.metrics.prometheus import CONTENT_TYPE_LATEST

from .config import RouterConfig
from .dashboard import routes as dashboard_routes
from .prompt_hasher import PromptHasher
from .proxy import Router, request_headers

routes = APIRouter()
# the router's own status routes: behind the API key unless --metrics-public
STATUS_PATHS = ("/metrics", "/router/backends")


def _router(raw: Request) -> Router:
    return raw.app.state.router


@routes.get("/health")
async def health(raw: Request) -> Response:
    """200 while at least one backend answering whole requests (not a prefill-only one) is in rotation."""
    if _router(raw).serving():
        return Response(status_code=200)
    return JSONResponse(error_body("no healthy backend", 503), status_code=503)


@routes.get("/metrics")
async def metrics(raw: Request) -> Response:
    return Response(_router(raw).metrics.render(), media_type=CONTENT_TYPE_LATEST)


@routes.get("/router/backends")
async def backends(raw: Request) -> dict:
    """Each backend's URL, health, in-flight count and last scraped queue depth."""
    return _router(raw).describe()


@routes.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
async def forward(raw: Request) -> Response:
    try:  # read before the disconnect watcher starts listening; 413/408 are raised from here
        body = await raw.body()
    except ClientDisconnect:
        return Response(status_code=499)  # the client left mid-upload: no backend saw the request
    path_qs = raw.url.path + (f"?{raw.url.query}" if raw.url.query else "")
    handler = _router(raw).forward(raw.method, path_qs, request_headers(raw.headers), body)
    return await with_cancellation(raw, handler)


def build_router_app(config: RouterConfig, hasher: PromptHasher | None = None,
                     http_options: HttpOptions | None = None) -> FastAPI:
    """The router app; ``hasher`` is needed by the prefix policy (see ``load_hasher``); ``http_options``:
    the deployment middlewares (the same as the server's: CORS, root path, request ids...)."""
    if config.policy == "prefix" and hasher is None:
        raise ValueError("routing_policy='prefix' needs a PromptHasher (the replicas' tokenizer)")
    router = Router(config, hasher)
    http_options = http_options or HttpOptions()
    app = FastAPI(title="pagedllm router", lifespan=_lifespan(router), **fastapi_kwargs(http_options))
    app.state.router = router
    app.include_router(dashboard_routes)  # before the catch-all forward of ``routes``
    app.include_router(routes)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_middleware(RequestBodyMiddleware, limits=config.limits)
    # outside the body limits: a request without the key is refused before its body is read
    if config.api_keys:
        http_options = dataclasses.replace(http_options, api_keys=(*http_options.api_keys, *config.api_keys))
    install_middlewares(app, http_options, protected=key_required(config))
    return app


def key_required(config: RouterConfig) -> Callable[[str], bool]:
    """Which paths need the API key: all but /health and the dashboard's page, which holds no data (and
    the status routes with ``metrics_public``)."""
    open_paths = frozenset(("/health", PAGE_PATH, *(STATUS_PATHS if config.metrics_public else ())))
    return lambda path: path not in open_paths


def load_hasher(config: RouterConfig) -> PromptHasher | None:
    """The prompt hasher the config's policy needs (None for load-only policies)."""
    if config.policy != "prefix":
        return None
    return PromptHasher.load(config.tokenizer, config.block_size, config.chat_template, config.trust_remote_code)


def _lifespan(router: Router):
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        await router.pool.check_all()
        watcher = asyncio.create_task(router.pool.watch(router.config.health_check_interval))
        try:
            yield
        finally:
            watcher.cancel()
            await router.close()
    return lifespan

"""What the OpenAI server and the router share over HTTP, without importing either: OpenAI-style
error bodies, server-sent events, cancellation on disconnect, and the deployment layer (vLLM's
flags: CORS, API keys, request ids, request logging, root path, user middleware, TLS and
uvicorn options) as ``HttpOptions`` plus ``install_middlewares`` / ``uvicorn_kwargs``.
"""
from __future__ import annotations

import argparse
import asyncio
import hmac
import importlib
import inspect
import json
import logging
import os
import ssl
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.middleware.cors import CORSMiddleware

logger = logging.getLogger(__name__)

_ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "not_found_error",
                500: "server_error", 503: "service_unavailable"}


# ---------------------------------------------------------------------- errors and events
def error_body(message: str, status: int, param: str | None = None, code: str | int | None = None,
               type_: str | None = None) -> dict:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``; ``type_``
    overrides the type the status implies (e.g. ``server_shutdown``)."""
    return {"error": {"message": message, "type": type_ or _ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code if code is not None else status}}


def sse(data: dict | str) -> str:
    """One server-sent event: ``data: <json or text>`` and a blank line."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


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


# ---------------------------------------------------------------------- deployment options
H11_MAX_INCOMPLETE_EVENT_SIZE = 4 * 2**20  # vLLM's default (h11's own is 16 KiB)
_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


@dataclass(frozen=True)
class HttpOptions:
    """How a server is deployed (vLLM's frontend flags of the same names; see ``add_http_args``).

    ``api_keys``: any of them in ``Authorization: Bearer KEY`` opens the protected routes.
    ``allowed_origins`` etc.: CORS, answered before the key check so a browser's preflight gets its
    answer. ``root_path``: the prefix a path-routing proxy puts in front; requests are served with
    or without it. ``enable_request_id_headers``: ``X-Request-Id`` echoed (made when absent).
    ``middleware``: import paths of extra ASGI middleware classes or ``http`` middleware functions.
    The rest are uvicorn's: TLS, log level, access log, Unix socket, h11 event size.
    """

    api_keys: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    root_path: str = ""
    enable_request_id_headers: bool = False
    middleware: tuple[str, ...] = ()
    disable_fastapi_docs: bool = False
    enable_log_requests: bool = False
    max_log_len: int | None = None
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = int(ssl.CERT_NONE)
    ssl_ciphers: str | None = None
    uvicorn_log_level: str = "info"
    disable_uvicorn_access_log: bool = False
    disable_access_log_for_endpoints: tuple[str, ...] = ()
    uds: str | None = None
    h11_max_incomplete_event_size: int = H11_MAX_INCOMPLETE_EVENT_SIZE

    def __post_init__(self):
        if self.root_path and (not self.root_path.startswith("/") or self.root_path.endswith("/")):
            raise ValueError(f"root_path={self.root_path!r} is invalid: it must start with '/' and not end with "
                             "one, e.g. '/llm'")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("ssl_keyfile and ssl_certfile go together: give both, or neither for plain HTTP")
        for name in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"{name}={path!r}: file not found")
        if self.ssl_cert_reqs not in (ssl.CERT_NONE, ssl.CERT_OPTIONAL, ssl.CERT_REQUIRED):
            raise ValueError(f"ssl_cert_reqs={self.ssl_cert_reqs!r} is invalid: 0 (none), 1 (optional) or "
                             "2 (required), as Python's ssl module")
        if self.max_log_len is not None and self.max_log_len < 0:
            raise ValueError(f"max_log_len={self.max_log_len!r} is invalid: must be >= 0 (or unset: no limit)")
        if any(not key for key in self.api_keys):
            raise ValueError("api_key must not be empty")

    @property
    def tls(self) -> bool:
        return self.ssl_certfile is not None


def add_http_args(parser: argparse.ArgumentParser, api_key: bool = True,
                  uvicorn_log_level: str = "info") -> None:
    """vLLM's deployment flags (names and defaults of vLLM's FrontendArgs): TLS, CORS, root path,
    request ids and logging, extra middleware, docs, uvicorn's logging. ``api_key``: add
    ``--api-key`` too (the router defines its own)."""
    g = parser.add_argument_group("deployment (vLLM's flags)")
    if api_key:
        g.add_argument("--api-key", nargs="+", default=None, metavar="KEY",
                       help="require 'Authorization: Bearer KEY' (any of the keys) on every route but the "
                            "probes /health, /metrics, /ping, /version and the docs (or set $PAGEDLLM_API_KEY)")
    g.add_argument("--ssl-keyfile", default=None, help="TLS private key file (PEM); serve HTTPS with --ssl-certfile")
    g.add_argument("--ssl-certfile", default=None, help="TLS certificate chain file (PEM)")
    g.add_argument("--ssl-ca-certs", default=None, help="CA certificates to verify client certificates with")
    g.add_argument("--ssl-cert-reqs", type=int, default=int(ssl.CERT_NONE),
                   help="client certificates: 0 not asked, 1 optional, 2 required (Python's ssl.CERT_*)")
    g.add_argument("--ssl-ciphers", default=None, help="TLS 1.2 cipher suites, OpenSSL syntax")
    g.add_argument("--allowed-origins", type=_json_list("allowed_origins"), default=[],
                   help='CORS: origins browsers may call from, as JSON, e.g. \'["https://app.example.com"]\' '
                        "(default: none, cross-origin access off)")
    g.add_argument("--allowed-methods", type=_json_list("allowed_methods"), default=["*"],
                   help="CORS: methods, as a JSON list")
    g.add_argument("--allowed-headers", type=_json_list("allowed_headers"), default=["*"],
                   help="CORS: request headers, as a JSON list")
    g.add_argument("--allow-credentials", action=argparse.BooleanOptionalAction, default=False,
                   help="CORS: let browsers send cookies and Authorization")
    g.add_argument("--root-path", default=None,
                   help="the path prefix a path-routing proxy adds, e.g. /llm: routes answer with and without it")
    g.add_argument("--middleware", action="append", default=[], metavar="IMPORT.PATH",
                   help="an ASGI middleware class (app.add_middleware) or an 'http' middleware function "
                        "(@app.middleware('http')) to add, by import path (repeatable)")
    g.add_argument("--enable-request-id-headers", action=argparse.BooleanOptionalAction, default=False,
                   help="answer with an X-Request-Id header: the request's own, else a new one")
    g.add_argument("--disable-fastapi-docs", action=argparse.BooleanOptionalAction, default=False,
                   help="no /docs, /redoc or /openapi.json")
    g.add_argument("--enable-log-requests", action=argparse.BooleanOptionalAction, default=False,
                   help="log each request (id, method, path, body up to --max-log-len characters) and its status")
    g.add_argument("--disable-log-requests", action="store_true",
                   help="deprecated (vLLM's older flag): requests are not logged unless --enable-log-requests")
    g.add_argument("--max-log-len", type=int, default=None,
                   help="characters of a request body --enable-log-requests logs (default: all)")
    g.add_argument("--uvicorn-log-level", default=uvicorn_log_level, choices=_LOG_LEVELS, help="uvicorn's log level")
    g.add_argument("--disable-uvicorn-access-log", action=argparse.BooleanOptionalAction, default=False,
                   help="no uvicorn access log lines")
    g.add_argument("--disable-access-log-for-endpoints", default=None, metavar="PATHS",
                   help="comma-separated paths left out of the access log, e.g. /health,/metrics")
    g.add_argument("--uds", default=None, help="listen on this Unix domain socket instead of --host/--port")
    g.add_argument("--h11-max-incomplete-event-size", type=int, default=H11_MAX_INCOMPLETE_EVENT_SIZE,
                   help="bytes of request head h11 buffers before refusing the request")


def _json_list(name: str):
    def parse(text: str) -> list[str]:
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError(f"--{name.replace('_', '-')} takes a JSON list of strings, e.g. "
                                             f'\'["*"]\', not {text!r}')
        return value
    return parse


def http_options_from_cli(args: argparse.Namespace, api_keys: tuple[str, ...] = ()) -> HttpOptions:
    """The HttpOptions of ``add_http_args``' flags; ``api_keys``: used when the parser has no --api-key."""
    if args.disable_log_requests:
        logger.warning("--disable-log-requests is deprecated: requests are logged only with --enable-log-requests")
    keys = tuple(getattr(args, "api_key", None) or api_keys)
    skipped = tuple(p for p in (args.disable_access_log_for_endpoints or "").split(",") if p)
    return HttpOptions(
        api_keys=keys, allowed_origins=tuple(args.allowed_origins), allowed_methods=tuple(args.allowed_methods),
        allowed_headers=tuple(args.allowed_headers), allow_credentials=args.allow_credentials,
        root_path=args.root_path or "", enable_request_id_headers=args.enable_request_id_headers,
        middleware=tuple(args.middleware), disable_fastapi_docs=args.disable_fastapi_docs,
        enable_log_requests=args.enable_log_requests, max_log_len=args.max_log_len, ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile, ssl_ca_certs=args.ssl_ca_certs, ssl_cert_reqs=args.ssl_cert_reqs,
        ssl_ciphers=args.ssl_ciphers, uvicorn_log_level=args.uvicorn_log_level,
        disable_uvicorn_access_log=args.disable_uvicorn_access_log, disable_access_log_for_endpoints=skipped,
        uds=args.uds, h11_max_incomplete_event_size=args.h11_max_incomplete_event_size)


def fastapi_kwargs(options: HttpOptions) -> dict:
    """FastAPI(...) arguments: the docs routes, or none (their root path comes from RootPathMiddleware)."""
    return dict(docs_url=None, redoc_url=None, openapi_url=None) if options.disable_fastapi_docs else {}


def uvicorn_kwargs(options: HttpOptions) -> dict:
    """uvicorn.run(...) arguments: TLS, logging, Unix socket, h11 limits."""
    if options.disable_access_log_for_endpoints:
        logging.getLogger("uvicorn.access").addFilter(_AccessLogFilter(options.disable_access_log_for_endpoints))
    kwargs = dict(log_level=options.uvicorn_log_level, access_log=not options.disable_uvicorn_access_log,
                  h11_max_incomplete_event_size=options.h11_max_incomplete_event_size)
    if options.uds is not None:
        kwargs["uds"] = options.uds
    if options.tls:
        kwargs.update(ssl_keyfile=options.ssl_keyfile, ssl_certfile=options.ssl_certfile,
                      ssl_ca_certs=options.ssl_ca_certs, ssl_cert_reqs=options.ssl_cert_reqs)
        if options.ssl_ciphers is not None:
            kwargs["ssl_ciphers"] = options.ssl_ciphers
    return kwargs


class _AccessLogFilter(logging.Filter):
    """Drops uvicorn access lines for the given paths (its record args: client, method, path, ...)."""

    def __init__(self, paths: tuple[str, ...]):
        super().__init__()
        self.paths = frozenset(paths)

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        path = str(args[2]).split("?", 1)[0] if len(args) > 2 else None
        return path not in self.paths


# ---------------------------------------------------------------------- middlewares
# probes and docs stay open with --api-key (load balancers and Kubernetes call them without a key)
PUBLIC_PATHS = frozenset({"/health", "/metrics", "/ping", "/version", "/is_sleeping", "/docs",
                          "/docs/oauth2-redirect", "/redoc", "/openapi.json"})


def install_middlewares(app, options: HttpOptions, protected: Callable[[str], bool] | None = None) -> None:
    """Adds the deployment middlewares to ``app``; outermost first: root path, request logging,
    request id, CORS (a preflight is answered here, before the key check), API key (for the paths
    ``protected`` picks; default: all but PUBLIC_PATHS), then the user's ``--middleware``, then
    whatever the app added before this call. Starlette's ``add_middleware`` puts each new one
    outside the others, hence the reverse order below."""
    for path in options.middleware:
        _add_user_middleware(app, path)
    if options.api_keys:
        app.add_middleware(ApiKeyMiddleware, api_keys=options.api_keys,
                           protected=protected or (lambda path: path not in PUBLIC_PATHS))
    if options.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(options.allowed_origins),
                           allow_methods=list(options.allowed_methods), allow_headers=list(options.allowed_headers),
                           allow_credentials=options.allow_credentials)
    if options.enable_request_id_headers or options.enable_log_requests:
        app.add_middleware(RequestIdMiddleware, echo=options.enable_request_id_headers,
                           log=options.enable_log_requests, max_log_len=options.max_log_len)
    if options.root_path:
        app.add_middleware(RootPathMiddleware, root_path=options.root_path)


def _add_user_middleware(app, path: str) -> None:
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise ValueError(f"middleware={path!r} is not an import path (module.attribute)")
    try:
        target = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"middleware={path!r} cannot be imported: {exc}") from None
    if inspect.isclass(target):
        app.add_middleware(target)
    elif inspect.iscoroutinefunction(target):
        app.middleware("http")(target)
    else:
        raise ValueError(f"middleware={path!r} is neither an ASGI middleware class nor an async 'http' middleware "
                         "function (request, call_next)")


class ApiKeyMiddleware:
    """Pure ASGI (unlike BaseHTTPMiddleware it leaves streaming and disconnects alone): a protected
    path without one of the keys as ``Authorization: Bearer KEY`` is refused with 401."""

    def __init__(self, app, api_keys: tuple[str, ...], protected: Callable[[str], bool]):
        self.app, self.protected = app, protected
        self.expected = [f"Bearer {key}".encode() for key in api_keys]

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and self.protected(scope["path"]) and not self._ok(scope):
            body = error_body("invalid or missing API key", 401, code="invalid_api_key")
            await JSONResponse(body, status_code=401)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _ok(self, scope) -> bool:
        given = dict(scope["headers"]).get(b"authorization", b"")
        # every key compared, in constant time each, so the timing tells nothing about which one nearly matched
        return sum(hmac.compare_digest(given, key) for key in self.expected) > 0


class RootPathMiddleware:
    """Behind a proxy that forwards ``/llm/v1/...`` unchanged: strips the prefix, so routes, the key
    check and the router see ``/v1/...``; a request without it (a proxy that strips it) passes as it
    is. Either way the ASGI ``root_path`` is the prefix, so the docs link their schema under it."""

    def __init__(self, app, root_path: str):
        self.app, self.root = app, root_path

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] in ("http", "websocket"):
            path = scope["path"]
            if path == self.root or path.startswith(self.root + "/"):
                path = path[len(self.root):] or "/"
                scope = dict(scope, path=path, raw_path=path.encode())
            scope = dict(scope, root_path=self.root)
        await self.app(scope, receive, send)


class RequestIdMiddleware:
    """``X-Request-Id``: the client's, else a new uuid; echoed on the response when ``echo``
    (--enable-request-id-headers). With ``log`` (--enable-log-requests) each request is logged once
    its body arrived (id, method, path, body cut at ``max_log_len`` characters), and its status."""

    def __init__(self, app, echo: bool, log: bool, max_log_len: int | None):
        self.app, self.echo, self.log, self.max_log_len = app, echo, log, max_log_len
        if log and logger.getEffectiveLevel() > logging.INFO:  # asked for: shown under `pagedllm --log-level WARNING`
            logger.setLevel(logging.INFO)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"x-request-id")
        request_id = given.decode("latin-1") if given else uuid.uuid4().hex
        body = bytearray()

        async def logged_receive() -> dict:
            message = await receive()
            if message["type"] == "http.request" and self.log:
                body.extend(message.get("body", b"")[:self._room(len(body))])
                if not message.get("more_body", False):
                    logger.info("request %s: %s %s body=%s", request_id, scope["method"], scope["path"],
                                self._cut(bytes(body).decode("utf-8", "replace")))
            return message

        async def tagged_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                if self.echo:
                    headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                    message = dict(message, headers=[*headers, (b"x-request-id", request_id.encode("latin-1"))])
                if self.log:
                    logger.info("request %s: status %d", request_id, message["status"])
            await send(message)
        await self.app(scope, logged_receive, tagged_send)

    def _room(self, have: int) -> int | None:
        """Bytes more of the body worth keeping for the log line (a few over the limit: cut in characters)."""
        return None if self.max_log_len is None else max(0, 4 * self.max_log_len + 4 - have)

    def _cut(self, text: str) -> str:
        if self.max_log_len is None or len(text) <= self.max_log_len:
            return text
        return text[:self.max_log_len] + f"... ({len(text) - self.max_log_len}+ more characters)"

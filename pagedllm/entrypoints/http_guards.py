"""What a request must pass before an app sees it, shared by the server and the router: the API key,
the size of its body and the pace at which the body arrives. Pure ASGI middlewares (unlike
BaseHTTPMiddleware they leave streaming and disconnects alone) and the flags that configure them.
"""
from __future__ import annotations

import argparse
import asyncio
import math
from dataclasses import dataclass

from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm.utils import check_int

from .http_common import error_body


def http_error(_, exc: StarletteHTTPException) -> JSONResponse:
    """An HTTPException as an OpenAI-style error body (the apps' exception handler)."""
    return JSONResponse(error_body(str(exc.detail), exc.status_code), status_code=exc.status_code,
                        headers=exc.headers)


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


def add_limit_args(parser: argparse.ArgumentParser) -> None:
    """The ServerLimits flags (request bodies, shutdown); defaults come from the dataclass."""
    d = ServerLimits()
    g = parser.add_argument_group("server limits")
    g.add_argument("--max-request-body-bytes", type=int, default=d.max_request_body_bytes,
                   help="refuse a request body larger than this with HTTP 413, before reading it")
    g.add_argument("--request-body-timeout", type=float, default=d.request_body_timeout,
                   help="seconds to wait for the next part of a request body before answering HTTP 408")
    g.add_argument("--shutdown-timeout", type=float, default=d.shutdown_timeout,
                   help="on SIGINT/SIGTERM, seconds to let in-flight requests finish; the rest are then aborted")


def limits_from_cli(args: argparse.Namespace) -> ServerLimits:
    return ServerLimits(max_request_body_bytes=args.max_request_body_bytes,
                        request_body_timeout=args.request_body_timeout, shutdown_timeout=args.shutdown_timeout)


class RequestBodyMiddleware:
    """Refuses a body over the size limit (413) or one that stops arriving (408).

    A declared Content-Length over the limit is answered at once; otherwise the app's own body read
    raises the 413/408 (an HTTPException: the app's handler must turn it into a response, see
    ``http_error``) as soon as the bytes read pass the limit or a piece is late."""

    def __init__(self, app, limits: ServerLimits):
        self.app, self.limits = app, limits

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.limits.max_request_body_bytes:
            exc = _too_large(declared, self.limits)  # refused before a byte of the body is read
            await http_error(None, exc)(scope, receive, send)
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

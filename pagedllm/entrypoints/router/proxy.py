"""Forwarding with failover: one request, tried on backends in the policy's order until one answers.

A request is *pending* until its first byte reaches the client: for a stream, until the backend
sends its first event (a pagedllm server sends none before the first generated token); for a
plain response, until the backend's whole answer arrived. A backend that fails while a request is
pending is taken out and the request goes to the next backend: generation has no side effects, so
this is a safe retry. Once a stream began it cannot be replayed transparently (the client already
holds part of one answer): the router then ends it with an OpenAI-style ``{"error": ...}`` event
and ``[DONE]``.

Only the backend's own failure takes it out, never what one client sent: a backend that cannot be
reached or answers 502/503/504 is out; one that drops a connection or answers 500 is out only if
its ``GET /health`` fails right after. A 4xx (and a 500 from a healthy backend) is the backend's
answer to this request and is relayed unchanged. A healthy backend that stops reading a request
body and drops the connection refused the body (a server answers 413 and closes; the reset loses
that answer): the client gets 413 and nothing is retried. A healthy backend that drops a
connection after taking the whole body is skipped for this request only.

Prefill/decode disaggregation (``RouterConfig.prefill_backends``, as vLLM's disaggregated proxy): a
completion or chat request goes first, whole but with ``max_tokens=1`` and no streaming, to a
prefill backend (a ``--kv-role producer`` replica answers only once the prompt's blocks are in the
shared Redis pool), then unchanged to a decode backend, which loads them from the pool and
generates, streaming or not. The prefill's answer is discarded. A 4xx from it (the request's own
fault: the decode backend would refuse it too) goes to the client; when no prefill backend can
take the request, the decode backend gets it anyway and computes the prompt itself (counted:
``pagedllm:router_pd_prefill_skipped``).
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NoReturn

import anyio
import httpx
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedllm.entrypoints.http_common import error_body, sse

from .adapters import ADMIN_PATHS, AdapterTable, adapter_of
from .backends import Backend, BackendPool
from .config import RouterConfig
from .metrics import RouterMetrics
from .policy import Choice, Picker
from .prefix_table import PrefixTable
from .prompt_hasher import PromptHasher

logger = logging.getLogger(__name__)

# hop-by-hop and framing headers: the router's own connections set them
_DROPPED_REQUEST_HEADERS = frozenset({"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te",
                                      "upgrade", "accept-encoding"})
_DROPPED_RESPONSE_HEADERS = frozenset({"content-length", "connection", "keep-alive", "transfer-encoding",
                                       "content-encoding", "date", "server"})
_BACKEND_DOWN_STATUSES = (502, 503, 504)
PD_PATHS = ("/v1/completions", "/v1/chat/completions")  # split into a prefill and a decode request
# what changes the generated text, not the prompt's K/V: the prefill copy (one discarded token) goes without
_PREFILL_DROPPED = ("stream", "stream_options", "n", "best_of", "min_tokens", "max_completion_tokens", "logprobs",
                    "top_logprobs", "prompt_logprobs", "echo", "use_beam_search")
CONNECT_TIMEOUT = 5.0
_EVENT_ENDS = (b"\n\n", b"\r\n\r\n")


class BackendFailed(Exception):
    """The request failed on a backend while pending: try the next one; ``down``: the backend itself
    failed (take it out), else only this request's connection did."""

    def __init__(self, reason: str, down: bool = True):
        super().__init__(reason)
        self.down = down


class ConnectionLost(Exception):
    """A connection to the backend failed after it was made: whether the backend failed is judged
    by its health check (``Router._judge``)."""


class Upload:
    """A request body handed to httpx as a stream, so the router knows whether the backend took it
    all: ``complete`` stays False when the backend stopped reading and dropped the connection."""

    def __init__(self, body: bytes):
        self.body, self.complete = body, not body

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield self.body
        self.complete = True  # resumed only after the transport wrote the body


class Router:
    """Routes each request to a backend (policy, prefix table, load) and relays its answer.

    Stateful: the prefix table, the backends' health and in-flight counts, and the counters of
    ``/metrics``. Runs on one event loop; tokenization runs on its own single thread.
    """

    def __init__(self, config: RouterConfig, hasher: PromptHasher | None = None):
        self.config, self.hasher = config, hasher
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(config.request_timeout, connect=CONNECT_TIMEOUT),
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        self.table = PrefixTable(config.prefix_table_size)
        self.adapters = AdapterTable()  # which backends hold which LoRA adapters (adapters.py)
        self.pool = BackendPool(config.all_backends, self.client, on_down=self._taken_out, on_scrape=self._scraped)
        self.decoders, self.prefillers = frozenset(config.backends), frozenset(config.prefill_backends)
        self.picker = Picker(config.policy, config.balance_threshold)
        self.metrics = RouterMetrics(self.pool)
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="router-tokenizer")

    def _taken_out(self, url: str) -> None:
        """A backend left rotation: its cache is assumed lost."""
        self.table.forget(url)
        self.adapters.forget(url)
        self.metrics.taken_out.labels(backend=url).inc()

    def _scraped(self, backend: Backend) -> None:
        self.adapters.observe(backend.url, backend.active_adapters, backend.lora_slots)

    def serving(self) -> bool:
        """A backend that answers whole requests (a decode backend, with prefill ones) is in rotation."""
        return any(b.url in self.decoders for b in self.pool.healthy())

    async def close(self) -> None:
        await self.client.aclose()
        self._tokenizer_thread.shutdown(wait=False)

    # ------------------------------------------------------------------ choosing
    async def prompt_hashes(self, path: str, data: Any, adapter: str | None = None) -> list[bytes]:
        """The prompt's block hashes from the already parsed body ``data`` (see ``parse_body``)."""
        if self.hasher is None:
            return []
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizer_thread, self.hasher.block_hashes, path, data, adapter)

    def choose(self, hashes: list[bytes], tried: set[str], adapter: str | None = None,
               among: frozenset[str] | None = None) -> Choice | None:
        """The next backend for a request (None when every healthy one was tried); counts it as in flight.
        ``adapter``: the LoRA adapter it names: only backends serving it are candidates (any backend if
        none does: its answer names the unknown model), those holding it preferred. ``among``: the
        backends to pick from (default: those answering whole requests, not the prefill-only ones)."""
        among = self.decoders if among is None else among
        candidates = [b for b in self.pool.healthy() if b.url not in tried and b.url in among]
        if adapter is not None:
            candidates = [b for b in candidates if adapter in b.adapters] or candidates
        holders = self.adapters.holders(adapter) if adapter is not None else set()
        choice = self.picker.pick(candidates, self.table.match(hashes), holders)
        if choice is None:
            return None
        url = choice.backend.url
        self.table.record(hashes, url)
        if adapter is not None:
            self.adapters.record(adapter, url, choice.backend.lora_slots)
        if choice.adapter_affinity:
            self.metrics.adapter_hits.labels(backend=url).inc()
        choice.backend.in_flight += 1
        self.metrics.requests.labels(backend=url).inc()
        self.metrics.matched_tokens.labels(backend=url).inc(choice.matched_blocks * self.config.block_size)
        if choice.affinity:
            self.metrics.affinity_hits.labels(backend=url).inc()
        return choice

    # ------------------------------------------------------------------ forwarding
    async def forward(self, method: str, path_qs: str, headers: dict[str, str], body: bytes) -> Response:
        """Sends the request to backends in turn until one answers; 503 when none can."""
        path = path_qs.split("?", 1)[0]
        headers = backend_headers(headers, self.config.backend_api_key)
        data = parse_body(body)  # once: the hasher and the stream check both read it
        if path in ADMIN_PATHS and method == "POST":
            return await self.broadcast(path_qs, headers, body, data)
        adapter = adapter_of(data, self.pool.all_adapters())
        hashes = await self.prompt_hashes(path, data, adapter)
        stream = wants_stream(data)
        disaggregated = bool(self.prefillers) and method == "POST" and path in PD_PATHS and isinstance(data, dict)
        if disaggregated:
            refused, handed_off = await self._prefill(path_qs, headers, data, hashes, adapter)
            if refused is not None:
                return refused
            handoffs = self.metrics.pd_handoffs if handed_off else self.metrics.pd_prefill_skipped
        tried: set[str] = set()
        skipped: list[str] = []  # healthy backends that dropped this request's connection
        while (choice := self.choose(hashes, tried, adapter)) is not None:
            backend = choice.backend
            tried.add(backend.url)
            if disaggregated:
                handoffs.labels(backend=backend.url).inc()
            try:
                return await self._attempt(backend, method, path_qs, headers, body, stream)
            except httpx.TimeoutException:
                message = f"backend {backend.url} did not answer within {self.config.request_timeout:g} s"
                return JSONResponse(error_body(message, 504), status_code=504)
            except BackendFailed as exc:
                if exc.down:
                    self.pool.mark_down(backend.url, str(exc))
                else:
                    skipped.append(f"{backend.url}: {exc}")
                self.metrics.failovers.labels(backend=backend.url).inc()
        return self._unanswered(tried, skipped)

    async def _prefill(self, path_qs: str, headers: dict[str, str], data: dict, hashes: list[bytes],
                       adapter: str | None) -> tuple[Response | None, bool]:
        """The prefill half of a disaggregated request, on the prefill backends in turn: ``(None, True)``
        once one answered 200 (the prompt's blocks are in the pool); ``(its answer, False)`` for a 4xx
        or a timeout (the client gets it); ``(None, False)`` when none could (the decode backend
        recomputes)."""
        body = json.dumps({k: v for k, v in data.items() if k not in _PREFILL_DROPPED} | {"max_tokens": 1}).encode()
        tried: set[str] = set()
        while (choice := self.choose(hashes, tried, adapter, among=self.prefillers)) is not None:
            backend = choice.backend
            tried.add(backend.url)
            try:
                response = await self._attempt(backend, "POST", path_qs, headers, body, stream=False)
            except httpx.TimeoutException:
                message = f"prefill backend {backend.url} did not answer within {self.config.request_timeout:g} s"
                return JSONResponse(error_body(message, 504), status_code=504), False
            except BackendFailed as exc:
                if exc.down:
                    self.pool.mark_down(backend.url, str(exc))
                self.metrics.failovers.labels(backend=backend.url).inc()
                continue
            if response.status_code == 200:
                self.metrics.pd_prefills.labels(backend=backend.url).inc()
                return None, True
            if 400 <= response.status_code < 500:
                return response, False
            logger.warning("prefill on %s answered %d: the decode backend computes the prompt itself", backend.url,
                           response.status_code)
            break
        return None, False

    async def broadcast(self, path_qs: str, headers: dict[str, str], body: bytes, data: Any) -> Response:
        """A LoRA load/unload, sent to every healthy backend so that all serve the same adapters: the
        first answer that is not 200 is relayed (with the backend named), else the first answer."""
        backends = self.pool.healthy()
        if not backends:
            return self._unanswered(set(), [])
        answers = await asyncio.gather(*(self._admin_call(b, path_qs, headers, body) for b in backends))
        for backend, (status, content, upstream_headers) in zip(backends, answers):
            if status != 200:
                logger.warning("%s on %s answered %d: %s", path_qs, backend.url, status, content[:200])
                return Response(content, status_code=status, headers=upstream_headers)
        name = data.get("lora_name") if isinstance(data, dict) else None
        for backend in backends:  # routing follows at once, before the next /v1/models probe
            backend.adapters = (backend.adapters | {name} if path_qs.startswith(ADMIN_PATHS[0])
                                else backend.adapters - {name})
        status, content, upstream_headers = answers[0]
        return Response(content, status_code=status, headers=upstream_headers)

    async def _admin_call(self, backend: Backend, path_qs: str, headers: dict[str, str],
                          body: bytes) -> tuple[int, bytes, dict[str, str]]:
        try:
            upstream = await self.client.post(backend.url + path_qs, headers=headers, content=body)
        except httpx.HTTPError as exc:
            message = f"backend {backend.url} did not answer {path_qs} ({type(exc).__name__}: {exc})"
            return 502, json.dumps(error_body(message, 502)).encode(), {"content-type": "application/json"}
        return upstream.status_code, upstream.content, response_headers(upstream.headers)

    def _unanswered(self, tried: set[str], skipped: list[str]) -> JSONResponse:
        """502 when healthy backends dropped this request's connection (the request, not the backends,
        is the likely cause); 503 when no backend was healthy."""
        if skipped:
            message = f"every backend tried closed the connection without answering: {'; '.join(skipped)}"
            return JSONResponse(error_body(message, 502), status_code=502)
        message = f"no healthy backend could take the request (tried {sorted(tried)})" if tried else \
            "no healthy backend: every backend failed its health check"
        return JSONResponse(error_body(message, 503), status_code=503)

    async def _attempt(self, backend: Backend, method: str, path_qs: str, headers: dict[str, str], body: bytes,
                       stream: bool) -> Response:
        """One try on ``backend``; releases its in-flight slot unless a relayed stream now owns it."""
        owned_by_stream, upload = False, Upload(body)
        try:
            upstream = await self._send(backend, method, path_qs, headers, upload)
            if not stream or upstream.status_code != 200:
                return await self._whole(backend, upstream)
            response = await self._stream(backend, upstream)
            owned_by_stream = True
            return response
        except ConnectionLost as exc:
            return await self._judge(backend, exc, upload)
        finally:
            if not owned_by_stream:
                backend.in_flight -= 1

    async def _send(self, backend: Backend, method: str, path_qs: str, headers: dict[str, str],
                    upload: Upload) -> httpx.Response:
        if upload.body:  # streamed with its length (not chunked), to learn whether the backend read it all
            headers = headers | {"content-length": str(len(upload.body))}
        request = self.client.build_request(method, backend.url + path_qs, headers=headers,
                                            content=upload if upload.body else b"")
        try:
            upstream = await self.client.send(request, stream=True)
        except httpx.TransportError as exc:
            raise_failure(exc, "connection lost before the response")
        if upstream.status_code in _BACKEND_DOWN_STATUSES:
            await upstream.aclose()
            raise BackendFailed(f"answered {upstream.status_code} {method} {path_qs}")
        if upstream.status_code == 500 and (reason := await self.pool.health_error(backend.url)) is not None:
            await upstream.aclose()  # a 500 from a backend whose health check fails: its engine died
            raise BackendFailed(f"answered 500 {method} {path_qs}, then GET /health: {reason}")
        return upstream

    async def _judge(self, backend: Backend, lost: ConnectionLost, upload: Upload) -> Response:
        """A dropped connection: the backend is taken out (BackendFailed) only if its health check
        fails now too. A healthy one that stopped reading the body refused it (413, not retried: the
        next backend has the same limit); one that took the body is skipped for this request."""
        reason = await self.pool.health_error(backend.url)
        if reason is not None:
            raise BackendFailed(f"{lost}, then GET /health: {reason}")
        if not upload.complete:
            allowed = self.config.limits.max_request_body_bytes
            message = (f"backend {backend.url} stopped reading the {len(upload.body)}-byte request body and closed "
                       "the connection: the body is over its size limit (a pagedllm server's "
                       f"--max-request-body-bytes; this router allows {allowed} bytes)")
            return JSONResponse(error_body(message, 413), status_code=413)
        raise BackendFailed(str(lost), down=False)

    async def _whole(self, backend: Backend, upstream: httpx.Response) -> Response:
        """The backend's whole answer, relayed once it has arrived (retried elsewhere if it breaks)."""
        try:
            content = await upstream.aread()
        except httpx.TransportError as exc:
            raise_failure(exc, "connection lost before the answer")
        finally:
            await close_quietly(upstream)
        return Response(content, status_code=upstream.status_code, headers=response_headers(upstream.headers))

    async def _stream(self, backend: Backend, upstream: httpx.Response) -> StreamingResponse:
        """Waits for the first event (still pending until then), then relays the rest as it comes."""
        events = sse_events(upstream.aiter_bytes())
        try:
            first = await anext(events, b"")
        except httpx.TransportError as exc:
            await close_quietly(upstream)
            raise_failure(exc, "connection lost before the first event")
        except BaseException:  # the client left (cancelled) while the request was queued
            await close_quietly(upstream)
            raise
        return StreamingResponse(self._relay(backend, upstream, first, events), status_code=200,
                                 headers=response_headers(upstream.headers))

    async def _relay(self, backend: Backend, upstream: httpx.Response, first: bytes,
                     events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        try:
            yield first
            async for event in events:
                yield event
        except httpx.TransportError as exc:
            yield await self._broken_stream(backend, exc)
        finally:  # also when the client leaves: closing the upstream makes the backend abort the request
            backend.in_flight -= 1
            await close_quietly(upstream)

    async def _broken_stream(self, backend: Backend, exc: Exception) -> bytes:
        """The error event that ends a stream whose backend failed after output began (the backend is
        taken out if its health check fails too)."""
        self.metrics.stream_errors.labels(backend=backend.url).inc()
        reason = None if isinstance(exc, httpx.TimeoutException) else await self.pool.health_error(backend.url)
        if reason is not None:
            self.pool.mark_down(backend.url, f"stream broke ({type(exc).__name__}: {exc}), then GET /health: {reason}")
        message = (f"backend {backend.url} failed after the stream began ({type(exc).__name__}); a started stream "
                   "cannot be replayed on another backend: send the request again")
        return (sse(error_body(message, 502)) + sse("[DONE]")).encode()

    # ------------------------------------------------------------------ state for /router/backends
    def describe(self) -> dict:
        backends = [{"url": b.url, "healthy": b.healthy, "in_flight": b.in_flight, "queue_depth": b.queued,
                     "error": b.error} for b in self.pool.backends.values()]
        for entry, b in zip(backends, self.pool.backends.values()):
            entry["role"] = ("both" if b.url in self.prefillers and b.url in self.decoders else "prefill"
                             if b.url in self.prefillers else "decode") if self.prefillers else "serve"
            entry["remote_kv_hits"], entry["remote_kv_misses"] = b.remote_kv
            entry["lora_adapters"] = sorted(b.adapters)
            entry["lora_adapters_held"] = sorted(a for a in b.adapters if b.url in self.adapters.holders(a))
        return {"policy": self.config.policy, "prefix_table_entries": len(self.table), "backends": backends}


def raise_failure(exc: httpx.TransportError, when: str) -> NoReturn:
    """Raises what a transport error means: BackendFailed for a backend that cannot be reached (take
    it out, retry elsewhere), ConnectionLost for a connection dropped once made (see ``_judge``),
    or, for a read that outlived ``request_timeout``, the timeout itself (the client gets 504)."""
    if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
        raise BackendFailed(f"unreachable ({type(exc).__name__}: {exc})") from exc
    if isinstance(exc, httpx.TimeoutException):
        raise exc
    raise ConnectionLost(f"{when} ({type(exc).__name__}: {exc})") from exc


async def close_quietly(upstream: httpx.Response) -> None:
    """Closes a backend response even inside a cancelled scope (the client left)."""
    with anyio.CancelScope(shield=True):
        await upstream.aclose()


def parse_body(body: bytes) -> Any:
    """A request body's JSON value; None for an empty body or one that is not JSON (the router
    relays it unchanged and the backend answers it)."""
    try:
        return json.loads(body) if body else None
    except ValueError:
        return None


def wants_stream(data: Any) -> bool:
    """Whether a parsed JSON body asks for ``"stream": true`` (anything else is relayed whole)."""
    return isinstance(data, dict) and data.get("stream") is True


async def sse_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Regroups a byte stream into whole server-sent events (each ending in a blank line, with LF or
    CRLF line ends), so an error event appended after a failure never lands inside a half-relayed one."""
    buffer = b""
    async for chunk in chunks:
        buffer += chunk
        cut = max(buffer.rfind(sep) + len(sep) if sep in buffer else 0 for sep in _EVENT_ENDS)
        if cut:
            yield buffer[:cut]
            buffer = buffer[cut:]
    if buffer:
        yield buffer


def request_headers(headers) -> dict[str, str]:
    """The client's headers worth passing on (Authorization included: the backends check keys)."""
    return {k: v for k, v in headers.items() if k.lower() not in _DROPPED_REQUEST_HEADERS}


def backend_headers(headers: dict[str, str], backend_api_key: str | None) -> dict[str, str]:
    """The headers sent on: the client's, with ``Authorization`` replaced by the backends' key if set."""
    if backend_api_key is None:
        return headers
    kept = {k: v for k, v in headers.items() if k.lower() != "authorization"}
    return kept | {"authorization": f"Bearer {backend_api_key}"}


def response_headers(headers) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in _DROPPED_RESPONSE_HEADERS}

"""The router's aggregate dashboard: ``GET /dashboard`` shows one panel per backend, each fed by
that backend's own ``/v1/kv_events`` (and ``/v1/kv_snapshot``), which the router relays under
``/router/replicas/{index}/v1/...`` (the page is public, the relays need the key like every other
route; the backends get the client's key, or ``--backend-api-key``). ``--disable-dashboard``:
404 on all of it."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedllm.entrypoints.dashboard.page import PAGE_PATH, render_page
from pagedllm.entrypoints.http_common import error_body

from .proxy import Router, backend_headers, close_quietly, request_headers, response_headers

routes = APIRouter()
FEEDS = ("kv_events", "kv_snapshot")  # the backends' dashboard routes the router relays


def _router(raw: Request) -> Router:
    return raw.app.state.router


def _disabled() -> JSONResponse:
    return JSONResponse(error_body("the dashboard is disabled (--disable-dashboard)", 404), status_code=404)


@routes.get(PAGE_PATH)
async def dashboard(raw: Request) -> Response:
    router = _router(raw)
    if router.config.disable_dashboard:
        return _disabled()
    panels = [{"name": url, "base": f"router/replicas/{i}/"} for i, url in enumerate(router.config.all_backends)]
    return render_page("pagedllm router", panels)


@routes.get("/router/replicas/{index}/v1/{feed}")
async def replica_feed(raw: Request, index: int, feed: str) -> Response:
    """Backend ``index``'s ``/v1/{feed}``, relayed as it streams."""
    router = _router(raw)
    if router.config.disable_dashboard:
        return _disabled()
    backends = router.config.all_backends
    if feed not in FEEDS or not 0 <= index < len(backends):
        message = f"no dashboard feed {feed!r} of replica {index}: replicas are 0..{len(backends) - 1}, feeds {FEEDS}"
        return JSONResponse(error_body(message, 404), status_code=404)
    url = f"{backends[index]}/v1/{feed}" + (f"?{raw.url.query}" if raw.url.query else "")
    headers = backend_headers(request_headers(raw.headers), router.config.backend_api_key)
    try:
        upstream = await router.client.send(router.client.build_request("GET", url, headers=headers), stream=True)
    except Exception as exc:  # noqa: BLE001 - any transport failure: the page shows it and retries
        message = f"replica {index} ({backends[index]}) is unreachable: {type(exc).__name__}: {exc}"
        return JSONResponse(error_body(message, 502), status_code=502)
    return StreamingResponse(_relay(upstream), status_code=upstream.status_code,
                             headers=response_headers(upstream.headers))


async def _relay(upstream):
    try:
        async for chunk in upstream.aiter_raw():
            yield chunk
    finally:  # also when the viewer leaves: the backend's stream ends with it
        await close_quietly(upstream)

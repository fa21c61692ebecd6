"""The live KV-cache dashboard: ``GET /dashboard`` (the page), ``GET /v1/kv_snapshot`` and the
``GET /v1/kv_events`` server-sent-event stream it is fed by (useful without the page too).

``/v1/kv_events`` sends, each as ``event: <name>`` with a JSON ``data:`` line:

* ``snapshot``: every block's reference count and hash prefix, the block tables and the request
  queues (``engine/kv_events.py``), the config card, and ``dropped`` (events lost so far);
* ``steps``: a list of the per-step diffs that arrived since the previous message (batched every
  ``interval`` seconds), each replayable onto the snapshot, with the step's block moves; the
  queues (``requests``, ``queue_sizes``) come with a step when a queue changed size, else at most
  every 0.1 s;
* ``metrics``: every ``interval_metrics`` seconds, the samples ``/metrics`` exports, parsed back
  from its own text (one source: the page never computes a number a scrape would not show).

A viewer whose queue overflows (``MAX_QUEUED_EVENTS`` steps unread) gets a fresh ``snapshot``
instead of the steps it missed; the engine never waits for it. The page is public (it holds no
data); the two ``/v1`` routes need the API key like every other ``/v1`` route (``page.py``).
``--disable-dashboard`` answers 404 on all three.
"""
from __future__ import annotations

import asyncio
import time
from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.entrypoints.dashboard.data import build_config_card, parse_samples, sse_event
from pagedllm.entrypoints.dashboard.page import PAGE_PATH, render_page

from .serving import error_body

router = APIRouter()

MAX_QUEUED_EVENTS = 512  # per viewer: ~10 s of steps at 50 steps/s before it falls back to a snapshot


def add_dashboard_args(parser) -> None:
    parser.add_argument("--disable-dashboard", action="store_true",
                        help="no /dashboard page and no /v1/kv_events or /v1/kv_snapshot routes (404)")


def _enabled(raw: Request) -> bool:
    return getattr(raw.app.state, "dashboard", True)


def _not_found() -> JSONResponse:
    return JSONResponse(error_body("the dashboard is disabled (--disable-dashboard)", 404), status_code=404)


@router.get(PAGE_PATH)
async def dashboard(raw: Request) -> Response:
    if not _enabled(raw):
        return _not_found()
    return render_page("pagedllm", [{"name": raw.app.state.serving.served_model_names[0], "base": ""}])


@router.get("/v1/kv_snapshot")
async def kv_snapshot(raw: Request) -> Response:
    """The block pool, tables and queues now, with the config card and the /metrics samples."""
    if not _enabled(raw):
        return _not_found()
    engine: AsyncLLMEngine = raw.app.state.engine
    snapshot = await engine.get_kv_snapshot()
    return JSONResponse({**snapshot, "config": config_card(raw), "metrics": await metric_samples(raw)})


@router.get("/v1/kv_events")
async def kv_events(raw: Request, interval: Annotated[float, Query()] = 0.1,
                    interval_metrics: Annotated[float, Query()] = 1.0) -> Response:
    if not _enabled(raw):
        return _not_found()
    bounds = (("interval", interval, 0.01, 10.0), ("interval_metrics", interval_metrics, 0.1, 60.0))
    for name, value, low, high in bounds:
        if not low <= value <= high:
            message = f"{name}={value} must be between {low} and {high} seconds"
            return JSONResponse(error_body(message, 400, name), status_code=400)
    engine: AsyncLLMEngine = raw.app.state.engine
    sub, snapshot = await engine.subscribe_kv_events(MAX_QUEUED_EVENTS)
    return StreamingResponse(_stream(raw, sub, snapshot, interval, interval_metrics), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _stream(raw: Request, sub, snapshot: dict, interval: float, interval_metrics: float):
    """The event stream of one viewer (Starlette cancels it when the viewer leaves)."""
    engine: AsyncLLMEngine = raw.app.state.engine
    dropped = 0
    try:
        yield sse_event("snapshot", {**snapshot, "config": config_card(raw), "dropped": dropped})
        next_metrics = 0.0
        while True:
            if time.monotonic() >= next_metrics:
                yield sse_event("metrics", {"time": time.time(), "samples": await metric_samples(raw)})
                next_metrics = time.monotonic() + interval_metrics
            await asyncio.sleep(interval)
            if sub.overflowed:  # too slow for the engine: start again from now
                dropped += sub.dropped
                sub.close()
                sub, snapshot = await engine.subscribe_kv_events(MAX_QUEUED_EVENTS)
                yield sse_event("snapshot", {**snapshot, "config": config_card(raw), "dropped": dropped})
            if events := sub.take():
                yield sse_event("steps", events)
    finally:
        sub.close()


# ---------------------------------------------------------------------- the numbers /metrics exports
async def metric_samples(raw: Request) -> list[list]:
    """``[name, labels, value]`` for every sample ``/metrics`` shows now, under the name without its
    ``pagedllm:`` / ``vllm:`` prefix (each once, whatever ``--metrics-names`` says)."""
    engine: AsyncLLMEngine = raw.app.state.engine
    text = raw.app.state.metrics.render(await engine.get_metrics(), engine_running=engine.is_healthy)
    return parse_samples(text.decode())


def config_card(raw: Request) -> dict:
    """What the page shows beside the map (computed once per server)."""
    card = getattr(raw.app.state, "dashboard_card", None)
    if card is None:
        card = raw.app.state.dashboard_card = build_config_card(raw.app.state.engine.engine)
    return card

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
import json
import math
import time
from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client.parser import text_string_to_metric_families

from pagedllm.config import dtype_name
from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.dashboard.page import PAGE_PATH, render_page

from .serving import error_body

router = APIRouter()

MAX_QUEUED_EVENTS = 512  # per viewer: ~10 s of steps at 50 steps/s before it falls back to a snapshot
_METRIC_PREFIXES = ("pagedllm:", "vllm:")
_DROPPED_LABELS = ("model_name", "engine")  # the same for every sample of one server


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
        yield _event("snapshot", {**snapshot, "config": config_card(raw), "dropped": dropped})
        next_metrics = 0.0
        while True:
            if time.monotonic() >= next_metrics:
                yield _event("metrics", {"time": time.time(), "samples": await metric_samples(raw)})
                next_metrics = time.monotonic() + interval_metrics
            await asyncio.sleep(interval)
            if sub.overflowed:  # too slow for the engine: start again from now
                dropped += sub.dropped
                sub.close()
                sub, snapshot = await engine.subscribe_kv_events(MAX_QUEUED_EVENTS)
                yield _event("snapshot", {**snapshot, "config": config_card(raw), "dropped": dropped})
            if events := sub.take():
                yield _event("steps", events)
    finally:
        sub.close()


def _event(name: str, data) -> str:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


# ---------------------------------------------------------------------- the numbers /metrics exports
async def metric_samples(raw: Request) -> list[list]:
    """``[name, labels, value]`` for every sample ``/metrics`` shows now, under the name without its
    ``pagedllm:`` / ``vllm:`` prefix (each once, whatever ``--metrics-names`` says)."""
    engine: AsyncLLMEngine = raw.app.state.engine
    text = raw.app.state.metrics.render(await engine.get_metrics(), engine_running=engine.is_healthy)
    return parse_samples(text.decode())


def parse_samples(text: str) -> list[list]:
    seen: dict[tuple, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            prefix = next((p for p in _METRIC_PREFIXES if s.name.startswith(p)), None)
            if prefix is None:
                continue
            labels = {k: v for k, v in sorted(s.labels.items()) if k not in _DROPPED_LABELS}
            name = s.name.removeprefix(prefix)
            value = s.value if math.isfinite(s.value) else None  # JSON has no inf / nan
            seen.setdefault((name, tuple(labels.items())), [name, labels, value])
    return list(seen.values())


# ---------------------------------------------------------------------- the config card
def config_card(raw: Request) -> dict:
    """What the page shows beside the map (computed once per server)."""
    card = getattr(raw.app.state, "dashboard_card", None)
    if card is None:
        card = raw.app.state.dashboard_card = build_config_card(raw.app.state.engine.engine)
    return card


def build_config_card(engine: LLMEngine) -> dict:
    """Block size, pool sizes, bytes per block, lengths, tiers, dtypes, quantization, parallelism,
    and ``pagedllm plan``'s estimate of the same pool beside what the engine measured."""
    c, ex = engine.config, engine.executor
    bytes_per_block = ex.block_bytes()
    card = {
        "model": c.model.model, "device": str(c.device), "block_size": c.cache.block_size,
        "num_gpu_blocks": ex.num_blocks, "num_cpu_blocks": ex.num_cpu_blocks, "bytes_per_block": bytes_per_block,
        "kv_cache_bytes": ex.num_blocks * bytes_per_block, "max_model_len": c.model.max_model_len,
        "max_num_seqs": c.scheduler.max_num_seqs, "max_num_batched_tokens": c.scheduler.max_num_batched_tokens,
        "dtype": dtype_name(c.model.dtype), "kv_cache_dtype": dtype_name(c.cache.cache_dtype or c.model.dtype),
        "quantization": c.model.quantization, "tensor_parallel_size": c.parallel.tensor_parallel_size,
        "pipeline_parallel_size": c.parallel.pipeline_parallel_size,
        "enable_prefix_caching": c.cache.enable_prefix_caching, "preemption_mode": c.scheduler.preemption_mode,
        "tiers": {"cpu_bytes": c.cache.kv_offload_cpu_bytes, "disk_dir": c.cache.kv_offload_dir,
                  "disk_bytes": c.cache.kv_offload_disk_bytes},
        "speculative": c.speculative is not None,
    }
    card["plan"] = _plan_estimate(c, card)
    return card


def _plan_estimate(c, card: dict) -> dict:
    """``plan_kv`` on the model's config.json for this engine's settings: its bytes per block and
    token, its weights estimate, and how many blocks the engine's measured KV budget holds by it."""
    from pagedllm.entrypoints.plan import load_config, plan_kv
    try:
        plan = plan_kv(load_config(c.model.model), gpu_memory=1 << 50, max_model_len=c.model.max_model_len,
                       block_size=c.cache.block_size, dtype=card["dtype"], kv_cache_dtype=card["kv_cache_dtype"],
                       quantization=c.model.quantization, device="cuda" if c.device.type == "cuda" else "cpu")
    except (ValueError, OSError) as exc:  # a config plan cannot read: the card says why
        return {"error": str(exc)}
    # per rank, as the engine measures it: a rank holds its share of the KV heads (tensor parallel)
    # and of the layers (pipeline parallel)
    per_block = plan.kv_bytes_per_block // (c.parallel.tensor_parallel_size * c.parallel.pipeline_parallel_size)
    return {"bytes_per_block": per_block, "bytes_per_token": plan.kv_bytes_per_token,
            "weights_bytes": plan.weights_bytes, "num_blocks_for_budget": card["kv_cache_bytes"] // per_block}

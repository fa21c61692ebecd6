"""vLLM's operational routes: ``/version``, ``/ping``, ``/server_info``, ``/reset_prefix_cache``,
``/start_profile`` / ``/stop_profile`` and sleep mode (``/sleep``, ``/wake_up``, ``/is_sleeping``).

Sleep mode needs ``--enable-sleep-mode`` (else ``/sleep`` and ``/wake_up`` answer 400 saying so);
while asleep, every generation request gets a 503 (``EngineSleepingError``) and the server
serves again after ``/wake_up``. The server's API key middleware (http_common) guards them all
but ``/version``, ``/ping`` and ``/is_sleeping``, which stay open as ``/health`` (vLLM serves the state-changing
ones only in its dev mode).
"""
from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response

from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.engine.llm_engine import EngineSleepingError
from pagedllm.version import __version__

from .serving import error_body

public = APIRouter()
control = APIRouter()


def include_admin_routes(app: FastAPI) -> None:
    """Adds the routes and the 503 for requests that reach a sleeping engine."""
    app.include_router(public)
    app.include_router(control)
    app.add_exception_handler(EngineSleepingError, _asleep)


def _asleep(_: Request, exc: EngineSleepingError) -> JSONResponse:
    return JSONResponse(error_body(str(exc), 503), status_code=503)


def _engine(raw: Request) -> AsyncLLMEngine:
    return raw.app.state.engine


def _error(exc: Exception, status: int = 400) -> JSONResponse:
    return JSONResponse(error_body(str(exc), status), status_code=status)


# ---------------------------------------------------------------------- open
@public.get("/version")
async def version() -> dict:
    return {"version": __version__}


@public.api_route("/ping", methods=["GET", "POST"])
async def ping(raw: Request) -> Response:
    """vLLM's (SageMaker's) liveness probe: 200 while the engine can serve, else 503 with why."""
    engine = _engine(raw)
    if engine.is_healthy:
        return Response(status_code=200)
    return _error(RuntimeError(engine.dead_error or "the engine is not running"), 503)


@public.get("/is_sleeping")
async def is_sleeping(raw: Request) -> dict:
    return {"is_sleeping": await _engine(raw).is_sleeping()}


# ---------------------------------------------------------------------- behind the API key
@control.get("/server_info")
async def server_info(raw: Request) -> dict:
    """The engine's resolved configuration (as text, like vLLM's ``vllm_config``)."""
    engine = _engine(raw).engine
    return {"version": __version__, "engine_config": str(engine.config),
            "num_gpu_blocks": engine.executor.num_blocks, "num_cpu_blocks": engine.executor.num_cpu_blocks}


@control.post("/reset_prefix_cache")
async def reset_prefix_cache(raw: Request, reset_disk: bool = False) -> Response:
    """Forgets every cached prefix (the disk tier's too with ``?reset_disk=true``); 409 while
    running requests hold cached blocks."""
    if await _engine(raw).reset_prefix_cache(reset_disk):
        return Response(status_code=200)
    return _error(RuntimeError("requests in flight hold cached blocks; retry when they are done"), 409)


@control.post("/start_profile")
async def start_profile(raw: Request) -> Response:
    """Starts the torch profiler on every rank (needs PAGEDLLM_TORCH_PROFILER_DIR or VLLM_TORCH_PROFILER_DIR)."""
    return await _profiler(raw, start=True)


@control.post("/stop_profile")
async def stop_profile(raw: Request) -> Response:
    """Stops the profiler; each rank writes its trace into the profiler directory."""
    return await _profiler(raw, start=False)


async def _profiler(raw: Request, start: bool) -> Response:
    engine = _engine(raw)
    try:
        await (engine.start_profile() if start else engine.stop_profile())
    except RuntimeError as exc:
        return _error(exc)
    return Response(status_code=200)


@control.post("/sleep")
async def sleep(raw: Request, level: int = 1) -> Response:
    """Frees the KV pool and offloads (``level=1``) or discards (``level=2``) the weights; 409
    while requests are in flight."""
    try:
        await _engine(raw).sleep(level)
    except ValueError as exc:
        return _error(exc)
    except RuntimeError as exc:
        return _error(exc, 409)
    return Response(status_code=200)


@control.post("/wake_up")
async def wake_up(raw: Request, tags: Annotated[list[str] | None, Query()] = None) -> Response:
    """Brings back everything, or ``?tags=weights`` / ``?tags=kv_cache`` (repeatable)."""
    try:
        await _engine(raw).wake_up(tags)
    except ValueError as exc:
        return _error(exc)
    return Response(status_code=200)

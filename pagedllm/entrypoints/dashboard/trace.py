"""Offline dashboards: ``pagedllm generate ... --kv-trace FILE`` records the KV event feed of a run
as JSON lines, and ``pagedllm replay FILE`` serves the dashboard over the recording (for bug
reports and docs).

A line is ``{"t": seconds since the start, "event": "snapshot" | "steps" | "metrics", "data": ...}``
with the data ``/v1/kv_events`` sends under that event name: the first line is the snapshot (with
the config card), then one ``steps`` line per engine step, and ``/metrics``' samples at most once a
second (an offline run has no latency histograms: those are observed by the server).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.kv_cache.events import Subscription, apply_diff
from pagedllm.metrics.prometheus import PrometheusMetrics

from .data import build_config_card, parse_samples, sse_event
from .page import PAGE_PATH, render_page

METRICS_INTERVAL = 1.0  # seconds between two metrics lines


class TraceWriter(Subscription):
    """A subscription that writes every event to ``path`` as it is published (on the engine thread;
    it never overflows). ``close()`` writes the last metrics and closes the file."""

    def __init__(self, engine: LLMEngine, path: str | Path):
        super().__init__(maxlen=1)
        self.engine = engine
        self.prometheus = PrometheusMetrics(engine.model_config.model, engine.model_config.max_model_len)
        self.file = open(path, "w", encoding="utf-8")  # noqa: SIM115 - open until close()
        self.start = time.monotonic()
        self.next_metrics = 0.0
        snapshot = engine.kv_events.attach(self, engine.counters.num_steps)
        self.write("snapshot", {**snapshot, "config": build_config_card(engine), "dropped": 0})
        self.write_metrics()

    def push(self, event: dict) -> None:
        self.write("steps", [event])
        if time.monotonic() >= self.next_metrics:
            self.write_metrics()

    def write(self, name: str, data) -> None:
        line = {"t": round(time.monotonic() - self.start, 4), "event": name, "data": data}
        self.file.write(json.dumps(line, separators=(",", ":")) + "\n")

    def write_metrics(self) -> None:
        samples = parse_samples(self.prometheus.render(self.engine.get_metrics()).decode())
        self.write("metrics", {"time": time.time(), "samples": samples})
        self.next_metrics = time.monotonic() + METRICS_INTERVAL

    def close(self) -> None:
        if not self.closed:
            self.write_metrics()
            self.file.close()
        super().close()


# ---------------------------------------------------------------------- replay
def load_trace(path: str | Path) -> list[dict]:
    """The lines of a ``--kv-trace`` file; ValueError naming the file and line when one is not a trace line."""
    lines = []
    with open(path, encoding="utf-8") as f:
        for number, text in enumerate(f, 1):
            try:
                line = json.loads(text)
                ok = isinstance(line, dict) and {"t", "event", "data"} <= line.keys()
            except ValueError:
                ok = False
            if not ok:
                raise ValueError(f"{path}:{number} is not a --kv-trace line ({{\"t\", \"event\", \"data\"}})")
            lines.append(line)
    if not lines or lines[0]["event"] != "snapshot":
        raise ValueError(f"{path} does not start with a snapshot: record it with `pagedllm generate --kv-trace`")
    return lines


def final_state(lines: list[dict]) -> dict:
    """The snapshot with every recorded step applied (what ``/v1/kv_snapshot`` answers on a replay)."""
    state = json.loads(json.dumps(lines[0]["data"]))
    state["hashes"] = {int(k): v for k, v in state["hashes"].items()}
    for line in lines[1:]:
        for event in line["data"] if line["event"] == "steps" else ():
            apply_diff(state, event)
            state["step"] = event["step"]
            if "requests" in event:
                state["requests"], state["queue_sizes"] = event["requests"], event["queue_sizes"]
    return state


def build_replay_app(path: str | Path, speed: float = 1.0):
    """The dashboard over a recording: ``/dashboard``, ``/v1/kv_events`` (the recording at ``speed``
    times its pace, then kept open) and ``/v1/kv_snapshot`` (the state at its end)."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, StreamingResponse
    if not speed > 0:
        raise ValueError(f"speed={speed} must be > 0")
    lines = load_trace(path)
    app = FastAPI(title="pagedllm replay")

    @app.get(PAGE_PATH)
    async def dashboard():
        return render_page("pagedllm replay", [{"name": Path(path).name, "base": ""}])

    @app.get("/v1/kv_snapshot")
    async def kv_snapshot():
        return JSONResponse(final_state(lines))

    @app.get("/v1/kv_events")
    async def kv_events():
        return StreamingResponse(_replay(lines, speed), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return app


async def _replay(lines: list[dict], speed: float):
    start = time.monotonic()
    for line in lines:
        delay = line["t"] / speed - (time.monotonic() - start)
        if delay > 0:
            await asyncio.sleep(delay)
        yield sse_event(line["event"], line["data"])
    while True:  # the recording is over: stay connected (the page would reconnect and start again)
        await asyncio.sleep(15)
        yield ": end of the recording\n\n"


def register(subparsers) -> None:
    """Adds ``pagedllm replay FILE`` to the pagedllm CLI."""
    p = subparsers.add_parser("replay", help="serve the KV-cache dashboard over a `generate --kv-trace` recording")
    p.add_argument("trace", help="the JSON-lines file `pagedllm generate --kv-trace FILE` wrote")
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=int, default=8000, help="port to bind")
    p.add_argument("--speed", type=float, default=1.0, help="replay this many times faster than recorded")
    p.set_defaults(func=run_replay)


def run_replay(args: argparse.Namespace) -> int:
    import uvicorn
    app = build_replay_app(args.trace, args.speed)
    print(f"pagedllm replay: http://{args.host}:{args.port}{PAGE_PATH}")
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0

"""The server with tensor parallelism: a dead worker fails in-flight requests (500) and /health
(503) within seconds; SIGTERM stops the server and its workers, leaving no orphan."""
from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]


def _live_server_helpers():
    """tests/server/live_server.py (not on this directory's import path)."""
    if "live_server" in sys.modules:  # tests/server ran first in this session
        return sys.modules["live_server"]
    spec = importlib.util.spec_from_file_location("live_server", REPO / "tests" / "server" / "live_server.py")
    module = sys.modules["live_server"] = importlib.util.module_from_spec(spec)  # dataclasses look it up
    spec.loader.exec_module(module)
    return module


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.01)


@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}], ids=["tp2", "pp2"])
def test_dead_worker_fails_in_flight_request_and_health(llama_dir, layout):
    """Rank 1 (TP: the other shard; PP: the last stage) killed mid-request."""
    srv = _live_server_helpers().start_server(llama_dir, num_threads=1, max_num_seqs=4, **layout)
    engine = srv.engine.engine
    pid = engine.executor.worker_pids()[0]
    replies = []
    body = {"model": "tiny", "prompt": "hello world", "max_tokens": 100, "ignore_eos": True}
    request = threading.Thread(target=lambda: replies.append(
        httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60)))
    try:
        assert httpx.get(f"{srv.url}/health").status_code == 200
        request.start()
        _wait_for(lambda: engine.counters.generation_tokens >= 3, 60, "the request to decode")
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        request.join(15)
        assert replies, "the in-flight request did not finish after rank 1 died"
        assert time.monotonic() - killed < 10
        assert replies[0].status_code == 500 and "SIGKILL" in replies[0].json()["error"]["message"]
        health = httpx.get(f"{srv.url}/health")
        assert health.status_code == 503 and "worker rank 1" in health.json()["error"]["message"]
    finally:
        srv.stop()
    assert not _alive(pid)


def _workers(server: psutil.Process) -> list[psutil.Process]:
    """The server's spawned engine workers (not multiprocessing's resource tracker)."""
    kids = []
    for p in server.children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
        except psutil.NoSuchProcess:
            continue
        if "spawn_main" in cmd and "resource_tracker" not in cmd:
            kids.append(p)
    return kids


def test_sigterm_stops_server_and_workers(llama_dir, tmp_path):
    port = _free_port()
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.openai.api_server", "--model", llama_dir,
           "--port", str(port), "--tensor-parallel-size", "2", "--num-threads", "1",
           "--num-gpu-blocks-override", "64", "--max-model-len", "128", "--uvicorn-log-level", "warning"]
    log = (tmp_path / "server.log").open("w")
    proc = subprocess.Popen(cmd, env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=log, stderr=log,
                            start_new_session=True)
    try:
        _wait_for(lambda: _healthy(port) or proc.poll() is not None, 120, "the server to start")
        assert proc.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
        workers = _workers(psutil.Process(proc.pid))
        assert len(workers) == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal after its shutdown
        _wait_for(lambda: not any(_alive(w.pid) for w in workers), 10, "the workers to exit")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def _healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False

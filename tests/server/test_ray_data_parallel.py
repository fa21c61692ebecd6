"""``pagedllm serve --data-parallel-size 2 --data-parallel-backend ray``: two replicas as Ray
actors (a local Ray instance) behind the router, driven by the openai client; a replica killed
is restarted by Ray and re-admitted by the router's health checks; shutdown leaves no actor."""
from __future__ import annotations

import os
import signal

import httpx
import openai
import psutil
import pytest
from live_server import serve_process, server_model_dir, wait_for  # noqa: F401 (a fixture)

pytest.importorskip("ray", reason="--data-parallel-backend ray needs Ray (pip install 'pagedllm[ray]')")
ACTOR = "ray::_ReplicaActor"


def _replica_pids() -> list[int]:
    pids = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or ())
        if cmd.startswith(ACTOR):
            pids.append(proc.info["pid"])
    return pids


def _backends(url: str) -> list[dict]:
    try:
        return httpx.get(f"{url}/router/backends", timeout=5).json()["backends"]
    except (httpx.HTTPError, ValueError):
        return []


def _complete(url: str, prompt: str) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0)
    return out.choices[0].text


def test_ray_replicas_serve_restart_and_leave_nothing(server_model_dir, tmp_path, isolated_ray):  # noqa: F811
    flags = ["--data-parallel-size", "2", "--data-parallel-backend", "ray", "--block-size", "8",
             "--num-gpu-blocks-override", "64", "--max-model-len", "128", "--served-model-name", "tiny",
             "--health-check-interval", "0.5", "--uvicorn-log-level", "warning", "--shutdown-timeout", "2"]
    healthy = lambda url: len([b for b in _backends(url) if b["healthy"]]) == 2  # noqa: E731
    with serve_process(server_model_dir, tmp_path / "server.log", flags, startup_timeout=400, stop_timeout=90,
                       ready=healthy) as server:
        url = server.url
        first = _complete(url, "hello world the quick brown fox")
        assert len(_replica_pids()) == 2
        os.kill(_replica_pids()[0], signal.SIGKILL)
        wait_for(lambda: not healthy(url), 60, "the router to see the killed replica", interval=0.5)
        assert _complete(url, "hello world the quick brown fox") == first  # the other replica serves
        wait_for(lambda: healthy(url), 300, "Ray to restart the replica and the router to re-admit it", interval=0.5)
        assert len(_replica_pids()) == 2
    # uvicorn re-raises the SIGTERM it drained for; Ray's driver handler turns that into exit(15)
    assert server.proc.returncode in (0, 15), server.log_tail()
    wait_for(lambda: not _replica_pids(), 30, "the replica actors to exit", interval=0.5)

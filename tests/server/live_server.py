"""Live-server helpers and fixtures: uvicorn in a background thread, ``pagedllm serve`` in a
process of its own, tiny random Llama."""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from conftest import make_model_dir

CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


@dataclass
class LiveServer:
    """A running server: its base URL, app (engine in ``app.state.engine``) and uvicorn handle."""

    url: str
    app: object
    server: object
    thread: threading.Thread

    @property
    def engine(self):
        return self.app.state.engine

    def on_loop(self, coro, timeout: float = 30):
        """Runs a coroutine on the server's event loop (where the engine's futures live)."""
        loop = self.engine._loop
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    def wait_idle(self, timeout: float = 10):
        """Waits until no request is in flight and returns the KV-cache stats."""
        deadline = time.time() + timeout
        while True:
            stats = self.on_loop(self.engine.get_kv_cache_stats())
            if (stats.num_used_blocks == 0 and self.engine.num_in_flight == 0) or time.time() > deadline:
                return stats
            time.sleep(0.05)

    def stop(self, timeout: float = 20) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)


def raw_http(url: str, head: bytes, body_parts=(), timeout: float = 20) -> RawExchange:
    """Sends a hand-made request over a plain socket: ``head`` (request line and headers), then
    ``body_parts`` from a thread, while another thread reads the response until the server closes."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=timeout)
    sock.sendall(head)
    exchange = RawExchange(sock)
    exchange.sender = threading.Thread(target=exchange.send_all, args=(body_parts,), daemon=True)
    exchange.reader = threading.Thread(target=exchange.read_all, daemon=True)
    exchange.reader.start()
    exchange.sender.start()
    return exchange


@dataclass
class RawExchange:
    sock: socket.socket
    sent: int = 0
    response: bytes = b""
    sender: threading.Thread | None = None
    reader: threading.Thread | None = None

    def send_all(self, parts) -> None:
        try:
            for part in parts:
                self.sock.sendall(part)
                self.sent += len(part)
        except OSError:
            pass  # the server answered and closed the connection without reading the rest

    def read_all(self) -> None:
        try:
            while chunk := self.sock.recv(65536):
                self.response += chunk
        except OSError:
            pass  # reset after the response (the kernel keeps what arrived before the reset)

    def finish(self, timeout: float = 20) -> tuple[int, bytes]:
        """Waits for the server to close; returns (status, response body)."""
        self.reader.join(timeout)
        self.sock.close()
        head, _, body = self.response.partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/1.1 ") else 0
        return status, body


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir: str, api_key: str | None = None, chat_template: str | None = None,
                 limits=None, chat_options=None, response_options=None, http_options=None, lora_modules=None,
                 **engine_kwargs) -> LiveServer:
    """``limits``: the app's ServerLimits (default: the server's defaults); ``chat_options``: its
    ChatOptions (tool-call and reasoning parsers); ``response_options``: its ResponseOptions;
    ``http_options``: its HttpOptions (with TLS the URL is https)."""
    import uvicorn

    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.entrypoints.http_common import HttpOptions, uvicorn_kwargs
    from pagedllm.entrypoints.openai.api_server import build_app
    kwargs = dict(block_size=8, num_gpu_blocks_override=256, max_model_len=128, max_num_seqs=128)
    kwargs.update(engine_kwargs)
    http_options = http_options or HttpOptions(uvicorn_log_level="warning")
    app = build_app(EngineArgs(model=model_dir, **kwargs), served_model_name="tiny", api_key=api_key,
                    chat_template=chat_template, limits=limits, chat_options=chat_options,
                    response_options=response_options, http_options=http_options, lora_modules=lora_modules)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, timeout_graceful_shutdown=2,
                                           **uvicorn_kwargs(http_options)))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        if time.time() > deadline or not thread.is_alive():
            raise RuntimeError("server did not start")
        time.sleep(0.02)
    scheme = "https" if http_options.tls else "http"
    return LiveServer(f"{scheme}://127.0.0.1:{port}", app, server, thread)


def wait_for(condition, timeout: float, what: str, interval: float = 0.2) -> None:
    """Polls ``condition()`` until true; TimeoutError naming ``what`` after ``timeout`` seconds."""
    deadline = time.time() + timeout
    while not condition():
        if time.time() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(interval)


def is_healthy(url: str) -> bool:
    """``GET {url}/health`` answers 200."""
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


@dataclass
class ServeProcess:
    """A ``pagedllm serve`` started by :func:`serve_process`: its URL, process and log file."""

    url: str
    proc: subprocess.Popen
    log: Path

    def log_tail(self) -> str:
        return self.log.read_text()[-3000:]


@contextlib.contextmanager
def serve_process(model_dir: str, log: Path, flags: list[str], startup_timeout: float, stop_timeout: float,
                  ready=is_healthy):
    """``pagedllm serve model_dir --port <free port> *flags`` in a session of its own, output to ``log``;
    yields once ``ready(url)`` (the process exiting first fails, with its log). On exit: SIGTERM, then
    the whole process group SIGKILLed if it has not stopped within ``stop_timeout`` seconds (read
    ``proc.returncode`` after the block)."""
    port = free_port()
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", model_dir, "--port", str(port), *flags]
    repo = Path(__file__).resolve().parents[2]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=dict(os.environ, PYTHONPATH=str(repo)), stdout=out, stderr=out,
                                start_new_session=True)
    server = ServeProcess(f"http://127.0.0.1:{port}", proc, log)
    try:
        wait_for(lambda: proc.poll() is not None or ready(server.url), startup_timeout, f"`{' '.join(cmd[2:])}`")
        assert proc.poll() is None, server.log_tail()
        yield server
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(stop_timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="session")
def server_model_dir(tmp_path_factory) -> str:
    """A tiny Llama whose tokenizer carries a simple chat template."""
    from transformers import AutoTokenizer
    path = make_model_dir(tmp_path_factory.mktemp("server-llama"), "llama")
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def live_server(server_model_dir):
    srv = start_server(server_model_dir)
    yield srv
    srv.stop()

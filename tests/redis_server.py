"""A throwaway ``redis-server`` for the remote KV tier's tests (skips with the install hint when
neither redis-server nor valkey-server is installed; ``.ci/run`` installs it)."""
from __future__ import annotations

import shutil
import subprocess
import time

import pytest

from pagedllm.entrypoints.router.data_parallel import free_port

redis = pytest.importorskip("redis", reason="the remote KV tier needs the redis client (pip install pagedllm[redis])")


class RedisServer:
    """A throwaway ``redis-server`` on a free port (no persistence, LRU under 64 MiB)."""

    def __init__(self):
        binary = shutil.which("redis-server") or shutil.which("valkey-server")
        if binary is None:
            pytest.skip("redis-server (or valkey-server) is not installed: apt-get install redis-server")
        self.binary, self.port = binary, free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen([self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url)
        for _ in range(200):
            try:
                client.ping()
                return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server on port {self.port} did not start")

    def __enter__(self) -> RedisServer:
        """Started; stopped again when the ``with`` block (a fixture's ``yield``) ends."""
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.kill()

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def client(self):
        return redis.Redis.from_url(self.url)

    def keys(self) -> list[bytes]:
        """The remote tier's keys (every fingerprint's)."""
        return list(self.client().scan_iter(match=b"pagedllm:kv:*"))

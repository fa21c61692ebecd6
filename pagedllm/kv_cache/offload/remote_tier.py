"""One rank's remote tier: blocks in a Redis (or Valkey) server shared by every engine pointed at
it, so a prefix one replica prefilled is a hit for every other (another process, another machine).

Keys: ``pagedllm:kv:<fingerprint hex>:<block hash hex>`` (a key space per fingerprint: another
model, dtype, block size or tensor-parallel rank never reads these). A value is exactly a disk
tier file (``disk_tier.encode_block``: header with the fingerprint, block hash, dtype and shape,
CRC, raw payload), checked the same way: a torn, corrupt or mismatched value is a miss, logged
once and deleted.

Bounded by Redis itself: each value is written with ``SET ... NX`` and, with ``ttl_s``, an expiry
(``EX``); the server's ``maxmemory`` with an ``allkeys-lru`` (or ``volatile-lru`` with a TTL)
``maxmemory-policy`` evicts under memory pressure. pagedllm never scans or deletes to make room.

A request's blocks are read in one round trip (``MGET``); a step's writes in one pipeline. No
method raises: a network error or timeout is a miss (or a write that did not land), counted in
``self.health`` (``pagedllm:kv_offload_errors_total{tier="remote",op}``), which disables the
tier after ``tier_fs.MAX_CONSECUTIVE_ERRORS`` failures of one operation in a row, as on disk.
Each call's round trip is timed and each failure to reach the server (refused, lost, timed out,
as opposed to an error reply) counted in ``self.calls`` (``CallLog``), for the
``pagedllm:kv_offload_round_trip_seconds{tier="remote",op}`` histogram and
``pagedllm:kv_offload_unreachable_total{tier="remote"}``.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch

from pagedllm.kv_cache.offload.disk_tier import decode_block, encode_block
from pagedllm.kv_cache.offload.tier_fs import TierHealth

logger = logging.getLogger(__name__)

REMOTE_OPS = ("read", "write", "stat", "unlink", "scan")  # the ``op`` labels of its errors
KEY_PREFIX = "pagedllm:kv:"
SOCKET_TIMEOUT_S = 2.0  # a server that stops answering costs at most this per call, then a miss
_FAILED = object()
# a round trip to the server, seconds: sub-millisecond on a local network to the socket timeout
ROUND_TRIP_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class CallLog:
    """A tier's calls since the last :meth:`take`: ``(op, seconds)`` of each round trip, and how many
    failed for want of the server (connection refused or lost, timeout). Thread-safe: the engine
    thread and the I/O threads call the server."""

    def __init__(self):
        self._lock = threading.Lock()
        self._round_trips: list[tuple[str, float]] = []
        self._unreachable = 0

    def record(self, op: str, seconds: float, reached: bool) -> None:
        with self._lock:
            self._round_trips.append((op, seconds))
            self._unreachable += not reached

    def take(self) -> tuple[list[tuple[str, float]], int]:
        with self._lock:
            out = self._round_trips, self._unreachable
            self._round_trips, self._unreachable = [], 0
        return out


def redacted(url: str) -> str:
    """``url`` without its password (for logs)."""
    head, sep, rest = url.partition("://")
    if "@" not in rest:
        return url
    cred, _, host = rest.rpartition("@")
    user = cred.split(":", 1)[0]
    return f"{head}{sep}{user + ':***' if ':' in cred else '***'}@{host}"


def connect(url: str) -> Any:
    """A Redis client for ``url`` (valkey:// and valkeys:// are redis:// and rediss://); it connects
    lazily, on its first command."""
    import redis

    if url.startswith("valkey"):
        url = "redis" + url[len("valkey"):]
    return redis.Redis.from_url(url, socket_timeout=SOCKET_TIMEOUT_S, socket_connect_timeout=SOCKET_TIMEOUT_S,
                                health_check_interval=0)


class RemoteTier:
    """Blocks of one fingerprint in the Redis server at ``url``; ``ttl_s``: seconds each value
    lives (None: until Redis evicts it). ``client``: a Redis client to use instead (tests)."""

    def __init__(self, url: str, fingerprint_hex: str, ttl_s: int | None = None, client: Any = None):
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"ttl_s={ttl_s} must be > 0 (or None: no expiry)")
        self.url = url
        self.fingerprint = bytes.fromhex(fingerprint_hex)
        self.prefix = f"{KEY_PREFIX}{fingerprint_hex}:".encode()
        self.ttl_s = ttl_s
        self.client = client if client is not None else connect(url)
        self.health = TierHealth("remote", redacted(url))
        self.calls = CallLog()
        self._reported: set[bytes] = set()  # bad values already logged

    @property
    def disabled(self) -> bool:
        return self.health.disabled

    def key(self, block_hash: bytes) -> bytes:
        return self.prefix + block_hash.hex().encode()

    def _call(self, op: str, fn, *args) -> Any:
        """``fn(*args)``, or ``_FAILED`` (counted as an ``op`` error) if it raised a Redis error
        (connection refused or lost, timeout, an error reply) or the tier is disabled."""
        import redis

        if self.health.disabled:
            return _FAILED
        t0 = time.perf_counter()
        try:
            out = fn(*args)
        except (redis.RedisError, OSError) as exc:
            reached = not isinstance(exc, (redis.ConnectionError, redis.TimeoutError, OSError))
            self.calls.record(op, time.perf_counter() - t0, reached)
            self.health.error(op, exc, redacted(self.url))
            return _FAILED
        self.calls.record(op, time.perf_counter() - t0, True)
        self.health.ok(op)
        return out

    # ------------------------------------------------------------------ lookup
    def contains(self, block_hash: bytes) -> bool:
        return self._call("stat", self.client.exists, self.key(block_hash)) == 1

    def contains_many(self, hashes: list[bytes]) -> list[bool]:
        """Which of ``hashes`` are there, in one round trip (a pipeline of ``EXISTS``); all False if
        the call failed."""
        if not hashes or self.disabled:
            return [False] * len(hashes)

        def run() -> list:
            pipe = self.client.pipeline(transaction=False)
            for h in hashes:
                pipe.exists(self.key(h))
            return pipe.execute()

        found = self._call("stat", run)
        return [False] * len(hashes) if found is _FAILED else [n == 1 for n in found]

    # ------------------------------------------------------------------ write
    def write_many(self, items: list[tuple[bytes, torch.Tensor]]) -> int:
        """Stores each ``(block hash, K/V tensor)`` not already there (``SET NX``, one pipeline);
        returns the bytes written (0 if the server could not be reached)."""
        if not items or self.disabled:
            return 0
        blobs = [(self.key(h), encode_block(self.fingerprint, h, t)) for h, t in items]

        def run() -> list:
            pipe = self.client.pipeline(transaction=False)
            for key, blob in blobs:
                pipe.set(key, blob, nx=True, ex=self.ttl_s)
            return pipe.execute()

        done = self._call("write", run)
        if done is _FAILED:
            return 0
        return sum(len(blob) for (_, blob), ok in zip(blobs, done) if ok)

    # ------------------------------------------------------------------ read
    def read_many(self, hashes: list[bytes], shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor | None]:
        """The blocks ``[*shape]`` of ``hashes`` in one round trip (``MGET``), None for each miss
        (absent, evicted, a bad value, which is then deleted, or a failed call: all None)."""
        if not hashes or self.disabled:
            return [None] * len(hashes)
        values = self._call("read", self.client.mget, [self.key(h) for h in hashes])
        if values is _FAILED:
            return [None] * len(hashes)
        out: list[torch.Tensor | None] = []
        for block_hash, data in zip(hashes, values):
            block = None if data is None else decode_block(self.fingerprint, data, block_hash, shape, dtype)
            if isinstance(block, str):
                self._discard(block_hash, block)
                block = None
            out.append(block)
        return out

    def read(self, block_hash: bytes, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        return self.read_many([block_hash], shape, dtype)[0]

    def _discard(self, block_hash: bytes, reason: str) -> None:
        key = self.key(block_hash)
        if key not in self._reported:
            self._reported.add(key)
            logger.warning("KV remote tier (%s): %s: %s; treated as a miss and deleted",
                           redacted(self.url), key.decode(), reason)
        self._call("unlink", self.client.delete, key)

    # ------------------------------------------------------------------ maintenance
    def clear(self) -> None:
        """Deletes every entry of this fingerprint (other fingerprints' keys stay)."""
        def run() -> None:
            batch = []
            for key in self.client.scan_iter(match=self.prefix + b"*", count=1000):
                batch.append(key)
                if len(batch) >= 1000:
                    self.client.delete(*batch)
                    batch = []
            if batch:
                self.client.delete(*batch)

        self._call("scan", run)

    def close(self) -> None:
        self.client.close()

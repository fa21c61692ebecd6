"""Every filesystem call the disk tier makes, behind one small object (the seam fault-injection
tests replace), and the health of a tier whose calls fail.

A disk is shared, slow and fallible: another process may fill it (ENOSPC), remount it read-only
(EROFS), take its permissions (EACCES, EPERM: an immutable directory) or put a file where a
directory was (ENOTDIR, EEXIST). None of that may reach the engine loop: the disk tier turns each
failed call into a miss, counts it by operation (:class:`TierHealth`, exported as
``pagedllm:kv_offload_errors_total{tier,op}``), warns at most once per ``WARN_INTERVAL_S`` per
operation, and after ``MAX_CONSECUTIVE_ERRORS`` failures of one operation with no success of it in
between, disables itself (one error log); the engine keeps serving from the device pool and the
CPU tier.
"""
from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

logger = logging.getLogger(__name__)

# the operations a tier's errors are counted by (the ``op`` label)
OPS = ("read", "write", "rename", "unlink", "mkdir", "stat", "touch", "scan", "lock")
MAX_CONSECUTIVE_ERRORS = 8  # failures of one operation in a row that disable the tier
WARN_INTERVAL_S = 60.0  # at most one warning per operation in this many seconds


class TierFS:
    """The disk tier's filesystem calls; each raises ``OSError`` as the OS reports it, except a
    missing entry where noted. Tests subclass it to raise chosen errors at chosen calls."""

    def read_bytes(self, path: Path) -> bytes:  # op "read"
        return path.read_bytes()

    def write_bytes(self, path: Path, data: bytes) -> None:  # op "write"
        path.write_bytes(data)

    def replace(self, src: Path, dst: Path) -> None:  # op "rename"
        os.replace(src, dst)

    def unlink(self, path: Path) -> None:  # op "unlink"; an entry already gone is fine
        path.unlink(missing_ok=True)

    def mkdir(self, path: Path) -> None:  # op "mkdir"; an existing directory is fine
        path.mkdir(parents=True, exist_ok=True)

    def exists(self, path: Path) -> bool:  # op "stat"
        try:
            os.stat(path)
        except (FileNotFoundError, NotADirectoryError):  # absent, or its directory is not one
            return False
        return True

    def touch(self, path: Path) -> None:  # op "touch"; an entry evicted in between is fine
        try:
            os.utime(path)
        except FileNotFoundError:
            pass

    def scan(self, root: Path) -> list[tuple[Path, float, int]]:  # op "scan"
        """``(path, mtime, size)`` of every entry in each directory under ``root`` (entries that
        vanish while scanned are skipped); files directly in ``root`` are not entries."""
        out = []
        for sub in os.scandir(root):
            if not sub.is_dir(follow_symlinks=False):
                continue
            for entry in os.scandir(sub.path):
                try:
                    st = entry.stat()
                except FileNotFoundError:
                    continue
                out.append((Path(entry.path), st.st_mtime, st.st_size))
        return out

    def list_dir(self, path: Path) -> list[Path]:  # op "scan"
        return [Path(e.path) for e in os.scandir(path)]

    @contextmanager
    def locked(self, path: Path) -> Iterator[None]:  # op "lock"
        """An exclusive ``flock`` on ``path`` (created if absent), held for the block."""
        with open(path, "a+b") as f:
            fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
            yield


LOCAL_FS = TierFS()


class TierHealth:
    """One tier's failed calls: counted per operation, warned about (rate limited), and the tier
    disabled after ``max_consecutive`` failures of one operation with no success between.
    Thread-safe: the engine thread and the tier's I/O threads report here."""

    def __init__(self, tier: str, where: str, max_consecutive: int = MAX_CONSECUTIVE_ERRORS,
                 warn_interval: float = WARN_INTERVAL_S):
        self.tier, self.where = tier, where
        self.max_consecutive, self.warn_interval = max_consecutive, warn_interval
        self.errors: Counter[str] = Counter()  # op -> failures, cumulative
        self.disabled_reason: str | None = None
        self._unreported: Counter[str] = Counter()  # op -> failures not yet taken (take_errors)
        self._streak: Counter[str] = Counter()
        self._last_warn: dict[str, float] = {}
        self._suppressed: Counter[str] = Counter()
        self._lock = threading.Lock()

    @property
    def disabled(self) -> bool:
        return self.disabled_reason is not None

    def ok(self, op: str) -> None:
        """``op`` succeeded: its run of failures ends."""
        if self._streak[op]:
            with self._lock:
                self._streak[op] = 0

    def error(self, op: str, exc: BaseException, path: Path | str) -> None:
        """``op`` on ``path`` failed with ``exc``: the caller treats it as a miss."""
        with self._lock:
            self.errors[op] += 1
            self._unreported[op] += 1
            self._streak[op] += 1
            warn = time.monotonic() - self._last_warn.get(op, -self.warn_interval) >= self.warn_interval
            if warn:
                self._last_warn[op] = time.monotonic()
                suppressed, self._suppressed[op] = self._suppressed[op], 0
            else:
                self._suppressed[op] += 1
            give_up = self._streak[op] >= self.max_consecutive and not self.disabled
        if warn:
            more = f" ({suppressed} more {op} errors since the last warning)" if suppressed else ""
            logger.warning("KV %s tier (%s): %s failed on %s: %s; treated as a miss%s",
                           self.tier, self.where, op, path, exc, more)
        if give_up:
            self.disable(f"{self.max_consecutive} consecutive {op} errors (last: {exc})")

    def disable(self, reason: str) -> None:
        """Turns the tier off for good (logged once): every later call is a miss, with no I/O."""
        with self._lock:
            if self.disabled:
                return
            self.disabled_reason = reason
        logger.error("KV %s tier (%s) disabled: %s; the engine goes on with the device pool and the CPU tier",
                     self.tier, self.where, reason)

    def take_errors(self) -> dict[str, int]:
        """Failures per operation since the last call (for a rank's report to the scheduler)."""
        with self._lock:
            out, self._unreported = dict(self._unreported), Counter()
        return out

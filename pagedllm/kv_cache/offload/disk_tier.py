"""One rank's disk tier: a block's K/V in one file per (fingerprint, block hash), shared safely by
every engine (and every rank, and data-parallel replica) that points at the same directory.

Layout: ``<root>/<fingerprint hex>/<block hash hex>.kv``. A file is a header then the raw tensor
bytes (no pickle)::

    magic "PLKVTIER" | version u32 | fingerprint (32 B) | hash length u16 | block hash
    | dtype length u8 | dtype name | ndim u8 | dims u32 x ndim | payload bytes u64 | crc32 u32
    | payload

The CRC covers the header (up to the CRC) and the payload. A file is written to a temporary
name in its directory and renamed over the final one, so a reader sees a whole file or none; a
file that is torn, corrupt, or carries another fingerprint / hash / shape is a miss: logged
once, deleted (or, where it cannot be, remembered and skipped), never loaded. The byte budget
covers every file under ``root`` (all fingerprints, all processes): writers take an exclusive
``flock`` on ``<root>/.lock`` and evict the least recently used files (by modification time;
a read touches its file) before writing.

Every filesystem call goes through ``self.fs`` (:class:`~.tier_fs.TierFS`) and none raises: a
failed call is a miss (or a write that did not land), counted in ``self.health``, which disables
the tier when one operation keeps failing (``tier_fs.py``).
"""
from __future__ import annotations

import logging
import os
import struct
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pagedllm.kv_cache.offload import tier_fs
from pagedllm.kv_cache.offload.fingerprint import dtype_name
from pagedllm.kv_cache.offload.tier_fs import TierFS, TierHealth

logger = logging.getLogger(__name__)

MAGIC = b"PLKVTIER"
VERSION = 1
SUFFIX = ".kv"
_TMP_MARK = ".tmp."
_STALE_TMP_SECONDS = 600.0  # a temporary file this old belongs to a writer that died
_FAILED = object()  # what DiskTier._call returns for a call that raised


class DiskTier:
    """Block files for one fingerprint under ``root``, within ``budget_bytes`` for all of ``root``.

    No method raises ``OSError``: a failed filesystem call is a miss, counted in ``health``
    (``fs``: the calls, replaceable in tests; default ``tier_fs.LOCAL_FS``)."""

    def __init__(self, root: str | os.PathLike, fingerprint_hex: str, budget_bytes: int, fs: TierFS | None = None):
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes={budget_bytes} must be > 0")
        self.root = Path(root)
        self.fingerprint = bytes.fromhex(fingerprint_hex)
        self.dir = self.root / fingerprint_hex
        self.budget = budget_bytes
        self.fs = fs if fs is not None else tier_fs.LOCAL_FS
        self.health = TierHealth("disk", str(self.dir))
        self._lock_path = self.root / ".lock"
        self._reported: set[str] = set()  # bad files already logged
        self._bad: set[str] = set()  # bad or unreadable files that could not be deleted: skipped
        self._call("mkdir", self.dir, self.fs.mkdir, self.dir)  # retried before each write

    @property
    def disabled(self) -> bool:
        return self.health.disabled

    def _call(self, op: str, path: Path, fn: Callable[..., Any], *args) -> Any:
        """``fn(*args)``, or ``_FAILED`` (counted as an ``op`` error) if it raised ``OSError`` or the
        tier is disabled."""
        if self.health.disabled:
            return _FAILED
        try:
            out = fn(*args)
        except OSError as exc:
            self.health.error(op, exc, path)
            return _FAILED
        self.health.ok(op)
        return out

    # ------------------------------------------------------------------ lookup
    def path(self, block_hash: bytes) -> Path:
        return self.dir / (block_hash.hex() + SUFFIX)

    def contains(self, block_hash: bytes) -> bool:
        path = self.path(block_hash)
        return path.name not in self._bad and self._call("stat", path, self.fs.exists, path) is True

    # ------------------------------------------------------------------ write
    def write_many(self, items: list[tuple[bytes, torch.Tensor]]) -> int:
        """Writes each ``(block hash, K/V tensor)`` not already stored; returns the bytes written.

        One lock and one directory scan for the whole batch; a block that cannot fit the budget
        even in an empty directory is skipped, and so is one whose write fails."""
        if not items or self.disabled:
            return 0
        try:
            with self.fs.locked(self._lock_path):
                self.health.ok("lock")
                return self._write_locked(items)  # never raises OSError: only the lock can
        except OSError as exc:
            self.health.error("lock", exc, self._lock_path)
            return 0

    def _write_locked(self, items: list[tuple[bytes, torch.Tensor]]) -> int:
        if self._call("mkdir", self.dir, self.fs.mkdir, self.dir) is _FAILED:  # removed since?
            return 0
        usage = self._scan()
        if usage is None:
            return 0
        return sum(self._write_one(usage, block_hash, tensor) for block_hash, tensor in items)

    def _write_one(self, usage: list[tuple[float, int, Path]], block_hash: bytes, tensor: torch.Tensor) -> int:
        path = self.path(block_hash)
        present = self._call("stat", path, self.fs.exists, path)
        if present is not False:  # stored already (then it is used again: touched) or unknown
            if present is True:
                self._call("touch", path, self.fs.touch, path)
            return 0
        blob = self.encode(block_hash, tensor)
        if not self._make_room(usage, len(blob)):
            return 0
        tmp = path.with_name(f"{path.name}{_TMP_MARK}{os.getpid()}")
        if (self._call("write", tmp, self.fs.write_bytes, tmp, blob) is _FAILED
                or self._call("rename", path, self.fs.replace, tmp, path) is _FAILED):
            # atomic on POSIX when it works: readers see the old name absent or the whole file
            self._call("unlink", tmp, self.fs.unlink, tmp)  # a partial temporary (ENOSPC) goes
            return 0
        usage.append((time.time(), len(blob), path))
        return len(blob)

    def encode(self, block_hash: bytes, tensor: torch.Tensor) -> bytes:
        """The whole file for one block: header, CRC, payload."""
        return encode_block(self.fingerprint, block_hash, tensor)

    # ------------------------------------------------------------------ read
    def read(self, block_hash: bytes, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """The block's K/V, or None on a miss (absent; a bad file, which is then deleted; a failed read)."""
        path = self.path(block_hash)
        if self.disabled or path.name in self._bad:
            return None
        try:
            data = self.fs.read_bytes(path)
        except FileNotFoundError:  # a plain miss: evicted, or never there
            self.health.ok("read")
            return None
        except OSError as exc:  # an unreadable disk costs the hit, never the engine
            self.health.error("read", exc, path)
            self._bad.add(path.name)
            return None
        self.health.ok("read")
        block = decode_block(self.fingerprint, data, block_hash, shape, dtype)
        if isinstance(block, str):
            self._discard(path, block)
            return None
        self._call("touch", path, self.fs.touch, path)
        return block

    def encode_header(self, block_hash: bytes, shape: tuple[int, ...], dtype: torch.dtype) -> bytes:
        """The header (up to the CRC) a valid file for this block starts with."""
        return encode_header(self.fingerprint, block_hash, shape, dtype)

    def _discard(self, path: Path, reason: str) -> None:
        if path.name not in self._reported:
            self._reported.add(path.name)
            logger.warning("KV disk tier: %s: %s; treated as a miss and deleted", path, reason)
        if self._call("unlink", path, self.fs.unlink, path) is _FAILED:
            self._bad.add(path.name)  # (a read-only or immutable directory) never read again

    # ------------------------------------------------------------------ maintenance
    def clear(self) -> None:
        """Deletes every entry of this fingerprint (other fingerprints' files stay)."""
        if self.disabled:
            return
        try:
            with self.fs.locked(self._lock_path):
                paths = self._call("scan", self.dir, self.fs.list_dir, self.dir)
                for path in paths if paths is not _FAILED else ():
                    self._call("unlink", path, self.fs.unlink, path)
        except OSError as exc:
            self.health.error("lock", exc, self._lock_path)

    def usage_bytes(self) -> int:
        """Bytes of every block file and temporary file under ``root`` (0 if it cannot be scanned)."""
        return sum(size for _, size, _ in self._scan() or ())

    def _scan(self) -> list[tuple[float, int, Path]] | None:
        """``(mtime, size, path)`` of every entry under ``root``, oldest first, stale temporary
        files removed; None if the scan failed."""
        found = self._call("scan", self.root, self.fs.scan, self.root)
        if found is _FAILED:
            return None
        out, now = [], time.time()
        for path, mtime, size in found:
            if _TMP_MARK in path.name and now - mtime > _STALE_TMP_SECONDS:
                self._call("unlink", path, self.fs.unlink, path)
                continue
            out.append((mtime, size, path))
        out.sort(key=lambda e: e[0])
        return out

    def _make_room(self, usage: list[tuple[float, int, Path]], nbytes: int) -> bool:
        """Deletes the oldest block files until ``nbytes`` more fit the budget; False if they never
        can (or a file that had to go could not be deleted)."""
        if nbytes > self.budget:
            return False
        total = sum(size for _, size, _ in usage)
        while total + nbytes > self.budget:
            victim = next((i for i, e in enumerate(usage) if _TMP_MARK not in e[2].name), None)
            if victim is None:
                return False  # only other writers' temporary files left
            _, size, path = usage.pop(victim)
            if self._call("unlink", path, self.fs.unlink, path) is _FAILED:
                return False
            total -= size
        return True


def _payload_size(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


# ---------------------------------------------------------------------- the format (disk and remote tiers)
def encode_header(fingerprint: bytes, block_hash: bytes, shape: tuple[int, ...], dtype: torch.dtype) -> bytes:
    """The header (up to the CRC) a valid entry for this block starts with."""
    dt = dtype_name(dtype).encode()
    return (MAGIC + struct.pack("<I", VERSION) + fingerprint + struct.pack("<H", len(block_hash))
            + block_hash + struct.pack("<B", len(dt)) + dt + struct.pack("<B", len(shape))
            + struct.pack(f"<{len(shape)}I", *shape) + struct.pack("<Q", _payload_size(shape, dtype)))


def encode_block(fingerprint: bytes, block_hash: bytes, tensor: torch.Tensor) -> bytes:
    """One block's whole entry: header, CRC (of header and payload), payload (the raw tensor bytes)."""
    payload = tensor.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
    head = encode_header(fingerprint, block_hash, tuple(tensor.shape), tensor.dtype)
    crc = zlib.crc32(payload, zlib.crc32(head))
    return head + struct.pack("<I", crc) + payload


def decode_block(fingerprint: bytes, data: bytes, block_hash: bytes, shape: tuple[int, ...],
                 dtype: torch.dtype) -> torch.Tensor | str:
    """The block ``[*shape]`` an entry holds, or why it is not a valid entry for this fingerprint,
    block hash and layout (torn, corrupt, another model's or layout's)."""
    expected = encode_header(fingerprint, block_hash, shape, dtype)
    size = len(expected) + 4 + _payload_size(shape, dtype)
    if len(data) != size:
        return f"size {len(data)} != {size} (torn or another layout)"
    if data[:len(expected)] != expected:
        return "header does not match this fingerprint / block hash / layout"
    (crc,) = struct.unpack_from("<I", data, len(expected))
    if zlib.crc32(memoryview(data)[len(expected) + 4:], zlib.crc32(expected)) != crc:
        return "checksum mismatch (corrupt)"
    payload = bytearray(data[len(data) - _payload_size(shape, dtype):])
    return torch.frombuffer(payload, dtype=torch.uint8).view(dtype).reshape(shape)  # [*shape]

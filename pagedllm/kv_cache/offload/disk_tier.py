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
once, deleted, never loaded. The byte budget covers every file under ``root`` (all
fingerprints, all processes): writers take an exclusive ``flock`` on ``<root>/.lock`` and evict
the least recently used files (by modification time; a read touches its file) before writing.
"""
from __future__ import annotations

import fcntl
import logging
import os
import struct
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from pagedllm.kv_cache.offload.fingerprint import dtype_name

logger = logging.getLogger(__name__)

MAGIC = b"PLKVTIER"
VERSION = 1
SUFFIX = ".kv"
_TMP_MARK = ".tmp."
_STALE_TMP_SECONDS = 600.0  # a temporary file this old belongs to a writer that died


class DiskTier:
    """Block files for one fingerprint under ``root``, within ``budget_bytes`` for all of ``root``."""

    def __init__(self, root: str | os.PathLike, fingerprint_hex: str, budget_bytes: int):
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes={budget_bytes} must be > 0")
        self.root = Path(root)
        self.fingerprint = bytes.fromhex(fingerprint_hex)
        self.dir = self.root / fingerprint_hex
        self.dir.mkdir(parents=True, exist_ok=True)
        self.budget = budget_bytes
        self._lock_path = self.root / ".lock"
        self._reported: set[str] = set()  # bad files already logged

    # ------------------------------------------------------------------ lookup
    def path(self, block_hash: bytes) -> Path:
        return self.dir / (block_hash.hex() + SUFFIX)

    def contains(self, block_hash: bytes) -> bool:
        return self.path(block_hash).exists()

    # ------------------------------------------------------------------ write
    def write_many(self, items: list[tuple[bytes, torch.Tensor]]) -> int:
        """Writes each ``(block hash, K/V tensor)`` not already stored; returns the bytes written.

        One lock and one directory scan for the whole batch; a block that cannot fit the budget
        even in an empty directory is skipped."""
        if not items:
            return 0
        written = 0
        with self._locked():
            usage = _scan(self.root)
            for block_hash, tensor in items:
                written += self._write_one(usage, block_hash, tensor)
        return written

    def _write_one(self, usage: list[tuple[float, int, Path]], block_hash: bytes, tensor: torch.Tensor) -> int:
        path = self.path(block_hash)
        if path.exists():
            _touch(path)
            return 0
        blob = self.encode(block_hash, tensor)
        if not _make_room(usage, len(blob), self.budget):
            return 0
        tmp = path.with_name(f"{path.name}{_TMP_MARK}{os.getpid()}")
        tmp.write_bytes(blob)
        os.replace(tmp, path)  # atomic on POSIX: readers see the old name absent or the whole file
        usage.append((time.time(), len(blob), path))
        return len(blob)

    def encode(self, block_hash: bytes, tensor: torch.Tensor) -> bytes:
        """The whole file for one block: header, CRC, payload."""
        payload = tensor.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
        head = self.encode_header(block_hash, tuple(tensor.shape), tensor.dtype)
        crc = zlib.crc32(payload, zlib.crc32(head))
        return head + struct.pack("<I", crc) + payload

    # ------------------------------------------------------------------ read
    def read(self, block_hash: bytes, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """The block's K/V, or None on a miss (absent, or a bad file, which is then deleted)."""
        path = self.path(block_hash)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:  # an unreadable disk costs the hit, never the engine
            self._discard(path, f"unreadable: {exc}")
            return None
        reason = self._check(data, block_hash, shape, dtype)
        if reason is not None:
            self._discard(path, reason)
            return None
        _touch(path)
        payload = bytearray(data[len(data) - _payload_size(shape, dtype):])
        return torch.frombuffer(payload, dtype=torch.uint8).view(dtype).reshape(shape)  # [*shape]

    def _check(self, data: bytes, block_hash: bytes, shape: tuple[int, ...], dtype: torch.dtype) -> str | None:
        expected = self.encode_header(block_hash, shape, dtype)
        if len(data) != len(expected) + 4 + _payload_size(shape, dtype):
            return f"size {len(data)} != {len(expected) + 4 + _payload_size(shape, dtype)} (torn or another layout)"
        if data[:len(expected)] != expected:
            return "header does not match this fingerprint / block hash / layout"
        (crc,) = struct.unpack_from("<I", data, len(expected))
        if zlib.crc32(data[len(expected) + 4:], zlib.crc32(expected)) != crc:
            return "checksum mismatch (corrupt)"
        return None

    def encode_header(self, block_hash: bytes, shape: tuple[int, ...], dtype: torch.dtype) -> bytes:
        """The header (up to the CRC) a valid file for this block starts with."""
        dt = dtype_name(dtype).encode()
        return (MAGIC + struct.pack("<I", VERSION) + self.fingerprint + struct.pack("<H", len(block_hash))
                + block_hash + struct.pack("<B", len(dt)) + dt + struct.pack("<B", len(shape))
                + struct.pack(f"<{len(shape)}I", *shape) + struct.pack("<Q", _payload_size(shape, dtype)))

    def _discard(self, path: Path, reason: str) -> None:
        if path.name not in self._reported:
            self._reported.add(path.name)
            logger.warning("KV disk tier: %s: %s; treated as a miss and deleted", path, reason)
        path.unlink(missing_ok=True)

    # ------------------------------------------------------------------ maintenance
    def clear(self) -> None:
        """Deletes every entry of this fingerprint (other fingerprints' files stay)."""
        with self._locked():
            for path in self.dir.iterdir():
                path.unlink(missing_ok=True)

    def usage_bytes(self) -> int:
        """Bytes of every block file and temporary file under ``root``."""
        return sum(size for _, size, _ in _scan(self.root))

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self._lock_path, "a+b") as f:
            fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
            yield


def _payload_size(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


def _touch(path: Path) -> None:
    try:
        os.utime(path)
    except FileNotFoundError:  # evicted by another process in between
        pass


def _scan(root: Path) -> list[tuple[float, int, Path]]:
    """``(mtime, size, path)`` of every entry under ``root``, oldest first; stale temp files removed."""
    out, now = [], time.time()
    for sub in root.iterdir():
        if not sub.is_dir():
            continue
        for entry in os.scandir(sub):
            try:
                st = entry.stat()
            except FileNotFoundError:
                continue
            if _TMP_MARK in entry.name and now - st.st_mtime > _STALE_TMP_SECONDS:
                Path(entry.path).unlink(missing_ok=True)
                continue
            out.append((st.st_mtime, st.st_size, Path(entry.path)))
    out.sort(key=lambda e: e[0])
    return out


def _make_room(usage: list[tuple[float, int, Path]], nbytes: int, budget: int) -> bool:
    """Deletes the oldest block files until ``nbytes`` more fit ``budget``; False if they never can."""
    if nbytes > budget:
        return False
    total = sum(size for _, size, _ in usage)
    while total + nbytes > budget:
        victim = next((i for i, e in enumerate(usage) if _TMP_MARK not in e[2].name), None)
        if victim is None:
            return False  # only other writers' temporary files left
        _, size, path = usage.pop(victim)
        path.unlink(missing_ok=True)
        total -= size
    return True

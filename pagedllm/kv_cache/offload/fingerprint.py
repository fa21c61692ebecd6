"""What makes one rank's K/V bytes for a block hash differ: a disk-tier entry is only ever read
back by an engine whose fingerprint matches (the directory name and the file header carry it).

Included: the model's weights (per checkpoint file: its name, size, a hash of its whole contents
and, for safetensors, of its header), its config (architecture, rope settings, ...), the
weights' and the KV cache's dtypes, quantization, block size, max_model_len (rope scaling may
depend on it) and the tensor-parallel rank and size (each rank holds its own share of the KV
heads).

The whole contents, because anything less is fooled: a fine-tune overwritten in place by its
next epoch keeps the size, can keep the modification time (``os.utime``) and often the first and
last MiB, and the tier would serve the old model's K/V. Hashing is streamed (SHA-256, 8 MiB
reads; with the CPU's SHA instructions it outruns BLAKE2b about 2x here), runs on a thread
beside the weight loading (``setup.prefetch_tier_fingerprints``), and each file's digest is
cached in the tier directory (``.weight-digests.json``) under its device, inode, size, mtime and
ctime: an unchanged checkpoint is hashed once per machine. The ctime is what makes the key safe:
every write to a file sets it to now, and no system call sets it back (``os.utime`` restores
atime and mtime only).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import struct
from pathlib import Path

import torch

from pagedllm.config import EngineConfig

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1  # the disk layout (disk_tier.py); bumping it orphans every older entry
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_CHUNK = 8 << 20  # bytes per read while hashing a weights file
DIGEST_CACHE = ".weight-digests.json"  # in the tier directory: file identity -> content digest
_MAX_CACHED = 4096  # digests kept in the cache (the oldest go first)
_MAX_SAFETENSORS_HEADER = 100 << 20  # the format's own limit on its JSON header


def kv_fingerprints(config: EngineConfig) -> tuple[str, ...]:
    """Hex SHA-256 naming each tensor-parallel rank's K/V layout and contents for this engine,
    indexed by rank. The weights are read (sampled) and the config serialised once for all
    ranks: the executor computes this once and hands each rank its own (``ModelRunner.init_cache``)."""
    return _fingerprints(config, range(config.parallel.tensor_parallel_size))


def kv_fingerprint(config: EngineConfig, tp_rank: int) -> str:
    """Rank ``tp_rank``'s fingerprint alone (it reads the weights: use ``kv_fingerprints`` when
    several ranks' are needed)."""
    return _fingerprints(config, [tp_rank])[0]


def _fingerprints(config: EngineConfig, ranks) -> tuple[str, ...]:
    mc, cache = config.model, config.cache
    kv_dtype = cache.cache_dtype or mc.dtype
    head = (f"v{FORMAT_VERSION}", mc.architecture, str(mc.dtype), str(kv_dtype), str(mc.quantization),
            f"block={cache.block_size}", f"len={mc.max_model_len}")
    model_json = json.dumps(_config_dict(mc.hf_config), sort_keys=True, default=str)
    weights = weights_identity(mc.model, config.cache.kv_offload_dir)
    size = config.parallel.tensor_parallel_size
    return tuple(_digest((*head, f"tp={rank}/{size}", model_json), weights) for rank in ranks)


def _digest(parts: tuple[str, ...], weights: bytes) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode() + b"\0")
    h.update(weights)
    return h.hexdigest()


def _config_dict(hf_config) -> dict:
    return hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(vars(hf_config))


def weights_identity(model_dir: str, cache_dir: str | os.PathLike | None = None) -> bytes:
    """Digest of every weights file in ``model_dir``: name, size, safetensors header and a hash of
    the whole contents, the latter cached in ``cache_dir`` (the tier directory) when given."""
    h = hashlib.sha256()
    root = Path(model_dir)
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES))
    cache = DigestCache(cache_dir)
    for path in files:
        st = path.stat()
        h.update(f"{path.relative_to(root)}:{st.st_size}".encode() + b"\0")
        h.update(safetensors_header_digest(path) if path.suffix == ".safetensors" else b"")
        h.update(cache.digest(path))
    cache.save()
    return h.digest()


def content_digest(path: Path) -> bytes:
    """SHA-256 of the whole file, read in 8 MiB chunks (hashlib releases the GIL on each)."""
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.digest()


def safetensors_header_digest(path: Path) -> bytes:
    """SHA-256 of a safetensors file's header (its length prefix and JSON: names, dtypes, shapes,
    offsets), read fresh on every start; b"" for a file too short to have one."""
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            return b""
        (n,) = struct.unpack("<Q", prefix)
        return hashlib.sha256(prefix + f.read(min(n, _MAX_SAFETENSORS_HEADER))).digest()


def _file_key(st: os.stat_result) -> str:
    return f"sha256:{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


class DigestCache:
    """Content digests of weight files by ``(device, inode, size, mtime_ns, ctime_ns)``, kept in
    ``<cache_dir>/.weight-digests.json``. Losing it only costs a re-hash, so a cache that cannot
    be read or written is ignored (logged); no ``cache_dir``: nothing is kept."""

    def __init__(self, cache_dir: str | os.PathLike | None):
        self.path = Path(cache_dir) / DIGEST_CACHE if cache_dir is not None else None
        self.entries: dict[str, str] = self._load()
        self._dirty = False

    def _load(self) -> dict[str, str]:
        if self.path is None:
            return {}
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            logger.warning("KV tier weight digest cache %s unreadable (%s): hashing the weights again", self.path, exc)
            return {}
        return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str)} \
            if isinstance(data, dict) else {}

    def digest(self, path: Path) -> bytes:
        """The file's content digest, from the cache when its identity is unchanged, else hashed
        (and cached if the file did not change while it was read)."""
        before = path.stat()
        key = _file_key(before)
        if key in self.entries:
            return bytes.fromhex(self.entries[key])
        digest = content_digest(path)
        if _file_key(path.stat()) == key:
            self.entries[key] = digest.hex()
            self._dirty = True
        return digest

    def save(self) -> None:
        """Writes the cache back (atomically, merged with what another engine saved meanwhile) if
        anything was added."""
        if self.path is None or not self._dirty:
            return
        merged = {**self._load(), **self.entries}
        entries = dict(list(merged.items())[-_MAX_CACHED:])
        tmp = self.path.with_name(f"{self.path.name}.tmp.{os.getpid()}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(entries))
            os.replace(tmp, self.path)
        except OSError as exc:
            logger.warning("KV tier weight digest cache %s not written (%s): the next start hashes again",
                           self.path, exc)
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
        self._dirty = False


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")

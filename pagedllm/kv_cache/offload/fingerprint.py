"""What makes one rank's K/V bytes for a block hash differ: a disk-tier entry is only ever read
back by an engine whose fingerprint matches (the directory name and the file header carry it).

Included: the model's weights (per checkpoint file: name, size, modification time and samples
of its first and last MiB), its config (architecture, rope settings, ...), the weights' and the
KV cache's dtypes, quantization, block size, max_model_len (rope scaling may depend on it) and
the tensor-parallel rank and size (each rank holds its own share of the KV heads).
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from pagedllm.config import EngineConfig

FORMAT_VERSION = 1  # the disk layout (disk_tier.py); bumping it orphans every older entry
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_SAMPLE = 1 << 20  # bytes hashed at each end of a weights file


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
    weights = weights_identity(mc.model)
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


def weights_identity(model_dir: str) -> bytes:
    """Digest of every weights file in ``model_dir`` (cheap: samples, sizes and times, not all bytes)."""
    h = hashlib.sha256()
    root = Path(model_dir)
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES))
    for path in files:
        st = path.stat()
        h.update(f"{path.relative_to(root)}:{st.st_size}:{st.st_mtime_ns}".encode())
        h.update(_ends(path, st.st_size))
    return h.digest()


def _ends(path: Path, size: int) -> bytes:
    with open(path, "rb") as f:
        head = f.read(_SAMPLE)
        if size <= 2 * _SAMPLE:
            return head + f.read()
        f.seek(size - _SAMPLE, os.SEEK_SET)
        return head + f.read(_SAMPLE)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")

"""Chained block hashes for prefix caching.

``hash(block i) = sha256(hash(block i-1) || token ids of block i || extra keys)``. A block's hash
therefore names its whole prefix, not just its own tokens. SHA-256 is used so that a collision
(which would silently return another prompt's K/V) is out of reach; token ids are not re-checked.
"""
from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence

ROOT_HASH = b"pagedllm-root"


def hash_block(parent: bytes | None, token_ids: Sequence[int], extra_keys: tuple = ()) -> bytes:
    payload = pickle.dumps((parent or ROOT_HASH, tuple(token_ids), extra_keys), protocol=5)
    return hashlib.sha256(payload).digest()


def extend_block_hashes(hashes: list[bytes], token_ids: Sequence[int], block_size: int,
                        extra_keys: tuple = (), mm_spans: Sequence[tuple[bytes, int, int]] = ()) -> None:
    """Appends the hashes of every full block of ``token_ids`` not yet hashed in ``hashes``.

    ``mm_spans``: ``(content hash, offset, length)`` of each image's placeholder run; a block
    over any of those tokens also keys on the image hashes (with their offsets), so two images
    behind the same placeholder ids never share K/V and the same image does."""
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hashes[-1] if hashes else None
        end = start + block_size
        images = tuple((h, offset) for h, offset, length in mm_spans if offset < end and start < offset + length)
        hashes.append(hash_block(parent, token_ids[start:end], extra_keys + images if images else extra_keys))

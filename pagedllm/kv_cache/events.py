"""A per-step feed of what changed in the KV cache, for the dashboard (``/v1/kv_events``).

Nothing here runs while nobody listens: the block pool and the manager keep their change sets at
None (``KVCacheManager.track_changes``) and skip one ``is not None`` test per block operation. Once a listener
attaches, :class:`KVEventRecorder` turns them on, and each step's :meth:`KVEventRecorder.take_diff`
reads only the blocks and tables touched since the previous one::

    snapshot(step s) + diff(s+1) + diff(s+2) + ...  ==  snapshot(step s+k)

A block's state is its reference count and its prefix hash (the first 4 bytes, hex); whether it
is free, in use, shared or cached-free follows from those two (``block_state``). Owners come from
the block tables: ``{request id: [block ids]}``, a removed table as ``None``.

The engine thread publishes; viewers read from another thread. :class:`KVEventHub` hands events
over through one bounded queue per :class:`Subscription`: a slow viewer overflows, loses its
queue (counted in ``dropped``) and must start again from a fresh snapshot; the engine never
blocks and memory never grows past ``maxlen`` events per viewer.
"""
from __future__ import annotations

import threading
from collections import deque

from pagedllm.kv_cache.kv_cache_manager import KVCacheManager

# block states, as the dashboard colours them (the page has the same list)
FREE, CACHED, USED, SHARED = "free", "cached", "used", "shared"
HASH_PREFIX_BYTES = 4


def block_state(ref_cnt: int, hash_prefix: str | None) -> str:
    """free (never or no longer hashed), cached (free, its prefix revivable), used by one, shared by several."""
    if ref_cnt == 0:
        return FREE if hash_prefix is None else CACHED
    return USED if ref_cnt == 1 else SHARED


def _hash_prefix(block_hash: bytes | None) -> str | None:
    return None if block_hash is None else block_hash[:HASH_PREFIX_BYTES].hex()


class KVEventRecorder:
    """Snapshots and per-step diffs of one :class:`KVCacheManager` (engine thread only)."""

    def __init__(self, manager: KVCacheManager):
        self.kv = manager

    @property
    def enabled(self) -> bool:
        return self.kv.tracking_changes

    def enable(self) -> None:
        """Starts tracking changes (the next diff holds what changed after this call)."""
        self.kv.track_changes(True)

    def disable(self) -> None:
        self.kv.track_changes(False)

    def snapshot(self) -> dict:
        """Every block's reference count and hash prefix, and every device block table."""
        blocks = self.kv.pool.blocks
        hashes = {b.block_id: _hash_prefix(b.block_hash) for b in blocks if b.block_hash is not None}
        return {"num_blocks": len(blocks), "block_size": self.kv.block_size,
                "ref_cnt": [b.ref_cnt for b in blocks], "hashes": hashes,
                "tables": {rid: self.kv.block_ids(rid) for rid in self.kv.tables}}

    def take_diff(self) -> dict:
        """What changed since the previous diff (or ``enable``): ``blocks`` as ``[id, ref_cnt,
        hash prefix or None]`` in id order, ``tables`` as ``{request id: ids or None}``."""
        kv = self.kv
        changed, tables = kv.take_changes()
        pool_blocks = kv.pool.blocks
        blocks = [[i, pool_blocks[i].ref_cnt, _hash_prefix(pool_blocks[i].block_hash)] for i in sorted(changed)]
        return {"blocks": blocks,
                "tables": {rid: (kv.block_ids(rid) if rid in kv.tables else None) for rid in sorted(tables)}}


def apply_diff(snapshot: dict, diff: dict) -> None:
    """Replays one diff onto a snapshot in place (what the page does; the tests check it with this)."""
    for block_id, ref_cnt, prefix in diff["blocks"]:
        snapshot["ref_cnt"][block_id] = ref_cnt
        if prefix is None:
            snapshot["hashes"].pop(block_id, None)
        else:
            snapshot["hashes"][block_id] = prefix
    for rid, ids in diff["tables"].items():
        if ids is None:
            snapshot["tables"].pop(rid, None)
        else:
            snapshot["tables"][rid] = list(ids)


class Subscription:
    """One viewer's bounded queue of events. ``take`` (any thread) returns what arrived; once the
    queue overflowed, ``overflowed`` is True and the viewer must subscribe again for a snapshot."""

    def __init__(self, maxlen: int):
        if maxlen < 1:
            raise ValueError(f"maxlen={maxlen} must be >= 1")
        self.maxlen = maxlen
        self.dropped = 0  # events lost to overflow
        self.overflowed = False
        self.closed = False
        self._queue: deque[dict] = deque()
        self._lock = threading.Lock()

    def push(self, event: dict) -> None:
        with self._lock:
            if self.overflowed:
                self.dropped += 1
            elif len(self._queue) >= self.maxlen:
                self.dropped += len(self._queue) + 1
                self._queue.clear()
                self.overflowed = True
            else:
                self._queue.append(event)

    def take(self) -> list[dict]:
        with self._lock:
            out = list(self._queue)
            self._queue.clear()
            return out

    def close(self) -> None:
        """The viewer left: the engine thread drops it at its next publish."""
        self.closed = True


class KVEventHub:
    """Fans events out from the engine thread to the subscriptions (see the module docstring).

    ``subscribe`` and ``publish`` run on the engine thread; ``Subscription.close`` anywhere.
    The recorder is on exactly while a subscription is open.
    """

    def __init__(self, recorder: KVEventRecorder):
        self.recorder = recorder
        self._subs: tuple[Subscription, ...] = ()

    @property
    def listening(self) -> bool:
        return bool(self._subs)

    def subscribe(self, maxlen: int) -> Subscription:
        """A new subscription; the caller takes its snapshot right after (same thread, same step)."""
        return self.add(Subscription(maxlen))

    def add(self, sub: Subscription) -> Subscription:
        """Adds a subscription made elsewhere (a subclass whose ``push`` writes a trace file)."""
        if not self.recorder.enabled:
            self.recorder.enable()
        self._subs = (*self._subs, sub)
        return sub

    def publish(self, event: dict) -> None:
        """Queues ``event`` for every open subscription; turns the recorder off once none is left."""
        open_subs = tuple(s for s in self._subs if not s.closed)
        self._subs = open_subs
        for sub in open_subs:
            sub.push(event)
        if not open_subs:
            self.recorder.disable()

"""Physical KV blocks, their reference counts, and the O(1) LRU free queue.

The pool owns every block. A block is *used* while its reference count is > 0, and *free*
otherwise; a free block that still carries a prefix hash is *cached*: a prefix hit can revive
it (``touch``) until it is handed out again and its hash evicted. The free queue is a doubly
linked list threaded through the blocks themselves, so removing a revived block from the
middle is O(1)::

    head <-> b7 <-> b2 <-> b9 <-> tail
    (evicted / handed out first)   (most recently freed)
"""
from __future__ import annotations

from collections.abc import Callable, Iterable


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, hashed={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with O(1) popleft, append and remove."""

    def __init__(self, blocks: list[KVBlock]):
        self.num_free = len(blocks)
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        prev = self._head
        for block in blocks:
            prev.next_free, block.prev_free = block, prev
            prev = block
        prev.next_free, self._tail.prev_free = self._tail, prev

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is self._tail:
            raise ValueError("no free blocks left")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free += 1

    def ids(self) -> list[int]:
        """Block ids from head to tail (for tests and integrity checks)."""
        out, node = [], self._head.next_free
        while node is not self._tail:
            out.append(node.block_id)
            node = node.next_free
        return out


class BlockPool:
    """Owns ``num_blocks`` blocks: allocation, reference counts, free queue and prefix hashes.

    ``on_evict(block_id, block_hash)``, when set, is called as a cached block is handed out again
    (its hash forgotten), while its K/V are still intact: the KV tiers keep them from there.

    ``changed``: None, or (while the dashboard listens, ``kv_cache/events.py``) the set that every
    block whose reference count or hash changes is added to.
    ``on_release(block_id, block_hash)``, when set, is called as a cached block's last reference
    goes (its K/V computed, the block still cached): the remote tier publishes it then.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True,
                 on_evict: Callable[[int, bytes], None] | None = None,
                 on_release: Callable[[int, bytes], None] | None = None):
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} must be >= 1")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, KVBlock] = {}  # block hash -> block holding those tokens
        self.on_evict = on_evict
        self.changed: set[int] | None = None
        self.on_release = on_release

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks that still hold a reusable prefix."""
        return sum(1 for b in self.cached.values() if b.ref_cnt == 0)

    def can_allocate(self, n: int) -> bool:
        return n <= self.free_queue.num_free

    def allocate(self, n: int) -> list[KVBlock]:
        """Takes ``n`` blocks from the head of the free queue (evicting their cached hashes)."""
        if n > self.free_queue.num_free:
            raise ValueError(f"cannot allocate {n} blocks: only {self.free_queue.num_free} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            self._evict_hash(block)
            block.ref_cnt = 1
            out.append(block)
        if self.changed is not None:
            self.changed.update(b.block_id for b in out)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Adds a reference to each block, reviving free (cached) ones out of the free queue."""
        changed = self.changed
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1
            if changed is not None:
                changed.add(block.block_id)

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drops one reference from each block, in eviction order: the first freed is evicted first."""
        changed = self.changed
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)
                if self.on_release is not None and block.block_hash is not None:
                    self.on_release(block.block_id, block.block_hash)
            if changed is not None:
                changed.add(block.block_id)

    def get_cached(self, block_hash: bytes) -> KVBlock | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def cache_block(self, block: KVBlock, block_hash: bytes) -> None:
        """Marks a full block as holding the tokens named by ``block_hash``."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:  # same tokens already cached in another block: keep that one
            return
        block.block_hash = block_hash
        self.cached[block_hash] = block
        if self.changed is not None:
            self.changed.add(block.block_id)

    def _evict_hash(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
                if self.on_evict is not None:
                    self.on_evict(block.block_id, block.block_hash)
            block.block_hash = None
            if self.changed is not None:
                self.changed.add(block.block_id)

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached hash; refused (False) while any block is in use."""
        if self.free_queue.num_free != self.num_blocks:
            return False
        if self.changed is not None:
            self.changed.update(b.block_id for b in self.cached.values())
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        return True

    def usage(self) -> float:
        return 1.0 - self.free_queue.num_free / self.num_blocks

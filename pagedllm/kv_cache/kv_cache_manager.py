"""Per-request block tables on top of the block pool: allocation, prefix hits, fork and CoW.

A request's block table maps logical block ``i`` (context positions ``i*B .. i*B+B-1``) to a
physical block. Blocks are added only as tokens are scheduled, never up front::

    positions:  0 ......... B-1 | B ........ 2B-1 | 2B ... n_computed ... n_computed+n_new
    table:      [ block 7       | block 2         | block 9 (partial) | + new blocks      ]
                  cached/shared     full            written this step, copied first if shared
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from pagedllm.contracts.tier_ops import TIER_REMOTE, LoadItem, LoadJob, TierOps
from pagedllm.kv_cache.block_pool import BlockPool, KVBlock
from pagedllm.kv_cache.offload.manager import OffloadManager
from pagedllm.kv_cache.prefix_hash import extend_block_hashes
from pagedllm.kv_cache.swap import CpuBlockPool
from pagedllm.utils import cdiv


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens found cached

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    """Owns request -> block lists over one :class:`BlockPool`.

    The request objects passed in need ``request_id``, ``all_token_ids``, ``num_tokens``,
    ``num_computed_tokens`` and ``hash_extra_keys()`` (what the block hashes mix in besides the
    tokens: the cache salt, the LoRA adapter).

    With ``offload`` (KV tiers, ``kv_cache/offload/``), evicted prefix blocks go to the CPU and
    disk tiers, and a fresh request's hits there are loaded back (``start_load`` /
    ``finish_load``) into blocks it holds but that are not in the prefix cache until they arrive.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True, num_cpu_blocks: int = 0,
                 offload: OffloadManager | None = None):
        self.block_size = block_size
        self.offload = offload if enable_caching else None
        self.pool = BlockPool(num_blocks, enable_caching, self.offload.on_evict if self.offload else None,
                              self.offload.on_release if self.offload and self.offload.writes(TIER_REMOTE) else None)
        self.cpu_pool = CpuBlockPool(num_cpu_blocks)
        self.cpu_tables: dict[str, list[int]] = {}  # swapped-out request -> its CPU blocks
        self.tables: dict[str, list[KVBlock]] = {}
        self.requests: dict[str, object] = {}
        self._hashes: dict[str, list[bytes]] = {}
        self._num_hashed_blocks: dict[str, int] = {}  # blocks of the table already in the cache
        self.pending_copies: list[tuple[int, int]] = []  # copy-on-write (src, dst) for this step
        # incremental block-table updates for the runner's persistent tables: per request, the
        # first table index changed since its last take_block_update(); requests whose tables
        # were released (finished, preempted, swapped out) since the last take_released()
        self._dirty_from: dict[str, int] = {}
        self._released: list[str] = []
        self.prefix_stats = PrefixCacheStats()
        self._load_base: dict[str, int] = {}  # loading request -> its leading device hits
        # None, or (while the dashboard listens, kv_cache/events.py) the requests whose tables changed
        self.changed_tables: set[str] | None = None

    # ----------------------------------------------------------------- queries
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    @property
    def num_cached_blocks(self) -> int:
        """Free blocks that still hold a reusable prefix."""
        return self.pool.num_cached_free_blocks

    @property
    def num_cpu_blocks(self) -> int:
        return self.cpu_pool.num_blocks

    @property
    def num_cpu_free_blocks(self) -> int:
        return self.cpu_pool.num_free_blocks

    def cpu_usage(self) -> float:
        return self.cpu_pool.usage()

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.tables.get(request_id, ())]

    def take_block_update(self, request_id: str) -> tuple[int, list[int]]:
        """``(start, ids)``: the request's block ids from index ``start`` on, where every entry
        before ``start`` is unchanged since the previous call for it (0 after any release)."""
        table = self.tables.get(request_id, [])
        start = min(self._dirty_from.pop(request_id, 0), len(table))
        self._dirty_from[request_id] = len(table)
        return start, [b.block_id for b in table[start:]]

    def take_released(self) -> list[str]:
        """Requests whose device block tables were dropped since the previous call."""
        released, self._released = self._released, []
        return released

    # ----------------------------------------------------------------- change tracking (kv_cache/events.py)
    @property
    def tracking_changes(self) -> bool:
        return self.changed_tables is not None

    def track_changes(self, on: bool) -> None:
        """Starts (from empty) or stops recording which blocks and block tables change."""
        self.pool.changed = set() if on else None
        self.changed_tables = set() if on else None

    def take_changes(self) -> tuple[set[int], set[str]]:
        """Block ids and request ids changed since the previous call (or ``track_changes(True)``)."""
        changes = (self.pool.changed, self.changed_tables)
        self.track_changes(True)
        return changes

    def _mark_dirty(self, request_id: str, index: int) -> None:
        self._dirty_from[request_id] = min(self._dirty_from.get(request_id, index), index)
        if self.changed_tables is not None:
            self.changed_tables.add(request_id)

    def _drop_table(self, request_id: str) -> list[KVBlock]:
        self._dirty_from.pop(request_id, None)
        if self.changed_tables is not None:
            self.changed_tables.add(request_id)
        if request_id in self.tables:
            self._released.append(request_id)
        return self.tables.pop(request_id, [])

    # ----------------------------------------------------------------- prefix hits
    def get_computed_blocks(self, req) -> tuple[list[KVBlock], int]:
        """Longest run of cached leading blocks for a request with no blocks yet.

        The last token is never taken from the cache, so the step that computes it has logits.
        """
        if not self.pool.enable_caching or req.num_computed_tokens > 0:
            return [], 0
        hashes = self._request_hashes(req)
        max_blocks = (req.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in hashes[:max_blocks]:
            block = self.pool.get_cached(block_hash)
            if block is None:
                break
            hits.append(block)
        self.prefix_stats.queries += req.num_tokens
        self.prefix_stats.hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def _request_hashes(self, req) -> list[bytes]:
        hashes = self._hashes.setdefault(req.request_id, [])
        extra = req.hash_extra_keys()  # cache salt, adapter, LongRoPE factors
        # image hashes key the blocks over their placeholders
        spans = [(item.hash, item.offset, item.length) for item in getattr(req, "mm_items", ())]
        extend_block_hashes(hashes, req.all_token_ids, self.block_size, extra, spans)
        return hashes

    # ----------------------------------------------------------------- tier hits (kv_cache/offload)
    def get_tier_hits(self, req, num_device_hits: int) -> tuple[list[KVBlock | tuple[bytes, str, int]] | None,
                                                                dict[str, int]]:
        """Past a fresh request's ``num_device_hits`` leading hits: the next consecutive blocks
        found in the device pool (a block) or in a tier (``(hash, tier, CPU slot)``); [] if no tier
        holds any; None if another request is loading one of them this step (wait for it, then
        hit it in the device pool). Like ``get_computed_blocks``, never the block of the last token.
        Also the walk's tier misses, for :meth:`count_tier_misses` once the request is admitted."""
        misses: dict[str, int] = {}
        if self.offload is None or req.num_computed_tokens > 0:
            return [], misses
        max_blocks = (req.num_tokens - 1) // self.block_size
        plan: list[KVBlock | tuple[bytes, str, int]] = []
        walk = self._request_hashes(req)[num_device_hits:max_blocks]
        self.offload.check_remote(walk)
        for block_hash in walk:
            if self.offload.is_loading(block_hash):
                return None, {}
            found = self.pool.get_cached(block_hash) or self.offload.lookup(block_hash, misses)
            if found is None:
                break
            plan.append(found if isinstance(found, KVBlock) else (block_hash, *found))
        return (plan if any(not isinstance(p, KVBlock) for p in plan) else []), misses

    def count_tier_misses(self, misses: dict[str, int]) -> None:
        """Counts the tier misses ``get_tier_hits`` found for a request just admitted."""
        if self.offload is not None:
            self.offload.count_misses(misses)

    def start_load(self, req, hits: list[KVBlock], plan: list, reserve: int = 0) -> bool:
        """Gives ``req`` its device ``hits`` and the ``plan`` of ``get_tier_hits``: planned device
        blocks are shared, tier hits get fresh blocks to load into. False (nothing changed) if
        the blocks do not fit above ``reserve`` free blocks."""
        shared = hits + [p for p in plan if isinstance(p, KVBlock)]
        num_fresh = len(plan) + len(hits) - len(shared)
        if num_fresh + sum(1 for b in shared if b.ref_cnt == 0) + reserve > self.pool.num_free_blocks:
            return False
        for _, _, slot in (p for p in plan if not isinstance(p, KVBlock)):
            if slot >= 0:
                self.offload.pin(slot)  # before allocating: the evictions below may spill to the CPU tier
        self.pool.touch(shared)
        fresh = iter(self.pool.allocate(num_fresh))
        table, items = list(hits), []
        for p in plan:
            block = p if isinstance(p, KVBlock) else next(fresh)
            if not isinstance(p, KVBlock):
                items.append(LoadItem(block.block_id, p[1], p[0], p[2]))
            table.append(block)
        rid = req.request_id
        self.tables[rid], self.requests[rid] = table, req
        self._mark_dirty(rid, 0)
        self._num_hashed_blocks[rid] = len(table)  # finish_load registers the loaded blocks
        self._load_base[rid] = len(hits)  # already counted as prefix-cache hits
        self.offload.add_load(LoadJob(rid, tuple(items)))
        return True

    def finish_load(self, req, num_ok: int) -> int:
        """Settles ``req``'s load: its table keeps the blocks up to the first item that did not
        arrive, the loaded ones enter the prefix cache; returns the tokens now computed."""
        job = self.offload.finish_load(req.request_id, num_ok)
        table = self.tables[req.request_id]
        loaded = {i.device_block: i.block_hash for i in job.items[:num_ok]}
        keep = len(table)
        if num_ok < len(job.items):
            keep = next(k for k, b in enumerate(table) if b.block_id == job.items[num_ok].device_block)
        self.pool.free(reversed(table[keep:]))
        del table[keep:]
        if self.changed_tables is not None:
            self.changed_tables.add(req.request_id)
        for block in table:
            if block.block_id in loaded:
                self.pool.cache_block(block, loaded[block.block_id])
        self._num_hashed_blocks[req.request_id] = keep
        self.prefix_stats.hits += (keep - self._load_base.pop(req.request_id)) * self.block_size
        return keep * self.block_size

    def persist_tier_ops(self) -> TierOps | None:
        """Disk writes that keep the cached prefixes of the device pool and the CPU tier (shutdown)."""
        if self.offload is None:
            return None
        free_cached = [(b.block_id, h) for h, b in self.pool.cached.items() if b.ref_cnt == 0]
        return self.offload.persist_ops(free_cached)

    def take_tier_moves(self) -> TierOps | None:
        """The tier moves (no loads) accumulated since the last step, for a flush between steps."""
        return self.offload.take_moves() if self.offload is not None else None

    def take_tier_ops(self) -> TierOps | None:
        """The tier moves and loads of this step (None without tiers)."""
        return self.offload.take_ops() if self.offload is not None else None

    # ----------------------------------------------------------------- allocation
    def blocks_needed(self, req, num_new_tokens: int, new_computed: list[KVBlock] = (),
                      reserve_tokens: int = 0) -> int:
        """Free blocks this allocation would consume (new blocks, CoW copies, revived hits)."""
        table = self.tables.get(req.request_id, [])
        num_computed = req.num_computed_tokens + len(new_computed) * self.block_size
        total_blocks = cdiv(max(num_computed + num_new_tokens, reserve_tokens), self.block_size)
        needed = max(0, total_blocks - len(table) - len(new_computed))
        needed += sum(1 for b in new_computed if b.ref_cnt == 0)
        if self._write_block_is_shared(table, num_computed):
            needed += 1
        return needed

    def allocate_slots(self, req, num_new_tokens: int, new_computed: list[KVBlock] = (),
                       reserve: int = 0, reserve_tokens: int = 0) -> bool:
        """Gives ``req`` room for ``num_new_tokens`` more tokens; False (nothing changed) if not.

        ``new_computed`` are prefix-cache hits for a fresh request; ``reserve`` blocks must stay
        free afterwards (the admission watermark); ``reserve_tokens`` pre-allocates room for that
        many tokens up front (only to emulate pre-PagedAttention systems in benchmarks).
        """
        needed = self.blocks_needed(req, num_new_tokens, new_computed, reserve_tokens)
        if needed + reserve > self.pool.num_free_blocks:
            return False
        rid = req.request_id
        if rid not in self.tables:
            self._mark_dirty(rid, 0)
        table = self.tables.setdefault(rid, [])
        self.requests[rid] = req
        if new_computed:
            self.pool.touch(new_computed)
            table.extend(new_computed)
            self._num_hashed_blocks[rid] = len(table)
        num_computed = req.num_computed_tokens + len(new_computed) * self.block_size
        self._copy_on_write(rid, table, num_computed)
        total_blocks = cdiv(max(num_computed + num_new_tokens, reserve_tokens), self.block_size)
        if total_blocks > len(table):
            self._mark_dirty(rid, len(table))
            table.extend(self.pool.allocate(total_blocks - len(table)))
        # only tokens the request holds: speculative drafts past them are hashed once accepted
        self._cache_full_blocks(req, min(num_computed + num_new_tokens, req.num_tokens))
        return True

    def _write_block_is_shared(self, table: list[KVBlock], num_computed: int) -> bool:
        idx = num_computed // self.block_size
        return num_computed % self.block_size != 0 and idx < len(table) and table[idx].ref_cnt > 1

    def _copy_on_write(self, rid: str, table: list[KVBlock], num_computed: int) -> None:
        """The partial block about to be written is shared: write into a private copy instead."""
        if not self._write_block_is_shared(table, num_computed):
            return
        idx = num_computed // self.block_size
        (copy,) = self.pool.allocate(1)
        self.pending_copies.append((table[idx].block_id, copy.block_id))
        self.pool.free([table[idx]])
        table[idx] = copy
        self._mark_dirty(rid, idx)

    def _cache_full_blocks(self, req, num_tokens_after: int) -> None:
        """Registers blocks that become full with this step's tokens in the prefix cache."""
        if not self.pool.enable_caching:
            return
        rid = req.request_id
        num_full = num_tokens_after // self.block_size
        start = self._num_hashed_blocks.get(rid, 0)
        if num_full <= start:
            return
        hashes = self._request_hashes(req)
        table = self.tables[rid]
        for i in range(start, num_full):
            self.pool.cache_block(table[i], hashes[i])
        self._num_hashed_blocks[rid] = num_full

    def take_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write plan accumulated since the last call."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    # ----------------------------------------------------------------- sharing and release
    def fork(self, parent, child) -> None:
        """``child`` shares every block of ``parent`` (reference count +1 each)."""
        blocks = self.tables.get(parent.request_id, [])
        self.pool.touch(blocks)
        self.tables[child.request_id] = list(blocks)
        self._mark_dirty(child.request_id, 0)
        self.requests[child.request_id] = child
        self._hashes[child.request_id] = list(self._hashes.get(parent.request_id, []))
        self._num_hashed_blocks[child.request_id] = self._num_hashed_blocks.get(parent.request_id, 0)

    def free(self, req) -> None:
        """Returns a request's blocks; its tail blocks are evicted first from the cache."""
        rid = req.request_id
        table = self._drop_table(rid)
        if self.offload is not None and self.offload.publishes_sync:  # a producer's computed blocks, shared or not
            self.offload.publish([(b.block_id, b.block_hash) for b in table if b.block_hash is not None])
        self.pool.free(reversed(table))
        self.cpu_pool.free(self.cpu_tables.pop(rid, []))
        self.requests.pop(rid, None)
        self._hashes.pop(rid, None)
        self._num_hashed_blocks.pop(rid, None)

    def rollback(self, req) -> None:
        """After speculative tokens were verified: frees the blocks past the request's
        ``num_computed_tokens`` (K/V of rejected drafts only) and registers the blocks that
        accepted drafts filled in the prefix cache::

            table:  [ full | full (accepted) | partial (accepted ... rejected) | rejected only ]
                              hashed now       kept: rejected slots are overwritten   freed
        """
        rid = req.request_id
        table = self.tables.get(rid)
        if table is None:
            return
        keep = cdiv(req.num_computed_tokens, self.block_size)
        if len(table) > keep:
            tail = table[keep:]
            del table[keep:]
            self._mark_dirty(rid, keep)
            self.pool.free(reversed(tail))
        self._cache_full_blocks(req, req.num_computed_tokens)

    def reset_prefix_cache(self) -> bool:
        """Forgets the device pool's and the CPU tier's cached prefixes; refused while blocks are in use."""
        if not self.pool.reset_prefix_cache():
            return False
        if self.offload is not None:
            self.offload.reset()
        return True

    # ----------------------------------------------------------------- swapping
    def can_swap_out(self, req) -> bool:
        return self.cpu_pool.can_allocate(len(self.tables.get(req.request_id, ())))

    def swap_out(self, req) -> list[tuple[int, int]]:
        """Moves all of a request's blocks to CPU blocks; returns the (device, cpu) copy plan."""
        rid = req.request_id
        table = self._drop_table(rid)
        cpu_ids = self.cpu_pool.allocate(len(table))
        self.cpu_tables[rid] = cpu_ids
        plan = [(b.block_id, c) for b, c in zip(table, cpu_ids)]
        self.pool.free(reversed(table))
        self._num_hashed_blocks.pop(rid, None)  # swapped-in copies are fresh, unhashed blocks
        return plan

    def can_swap_in(self, req, num_new_tokens: int, reserve: int = 0) -> bool:
        """Room for the swapped blocks plus the blocks ``num_new_tokens`` more tokens need."""
        held = len(self.cpu_tables.get(req.request_id, ()))
        needed = max(held, cdiv(req.num_computed_tokens + num_new_tokens, self.block_size))
        return needed + reserve <= self.pool.num_free_blocks

    def swap_in(self, req) -> list[tuple[int, int]]:
        """Brings a swapped request's blocks back; returns the (cpu, device) copy plan."""
        rid = req.request_id
        cpu_ids = self.cpu_tables.pop(rid)
        table = self.pool.allocate(len(cpu_ids))
        self.tables[rid] = table
        self._mark_dirty(rid, 0)
        self.requests[rid] = req
        self.cpu_pool.free(cpu_ids)
        return [(c, b.block_id) for c, b in zip(cpu_ids, table)]

    # ----------------------------------------------------------------- accounting
    def num_tokens_stored(self) -> int:
        """Distinct tokens whose K/V sit in used blocks (a shared block counts once)."""
        filled: dict[int, int] = {}
        for rid, table in self.tables.items():
            computed = self.requests[rid].num_computed_tokens
            for i, block in enumerate(table):
                n = max(0, min(self.block_size, computed - i * self.block_size))
                filled[block.block_id] = max(filled.get(block.block_id, 0), n)
        return sum(filled.values())

    def check_integrity(self) -> None:
        """Asserts free + used == total, ref counts == table references, cache map consistent."""
        refs = Counter(b.block_id for table in self.tables.values() for b in table)
        for block in self.pool.blocks:
            if block.ref_cnt != refs.get(block.block_id, 0):
                raise AssertionError(f"{block} is held by {refs.get(block.block_id, 0)} tables")
        free_ids = self.pool.free_queue.ids()
        if sorted(free_ids) != sorted(b.block_id for b in self.pool.blocks if b.ref_cnt == 0):
            raise AssertionError("free queue does not hold exactly the unreferenced blocks")
        if len(free_ids) != self.pool.num_free_blocks or len(free_ids) + len(refs) != self.num_blocks:
            raise AssertionError(f"free {len(free_ids)} + used {len(refs)} != total {self.num_blocks}")
        for block_hash, block in self.pool.cached.items():
            if block.block_hash != block_hash:
                raise AssertionError(f"cache entry points at {block} with another hash")
        self._check_cpu_pool()
        if self.offload is not None:
            self.offload.check_integrity()

    def _check_cpu_pool(self) -> None:
        held = [c for ids in self.cpu_tables.values() for c in ids]
        free = self.cpu_pool.free_ids()
        if sorted(held + free) != list(range(self.cpu_pool.num_blocks)):
            raise AssertionError(f"CPU blocks: held {sorted(held)} + free {sorted(free)} "
                                 f"!= all {self.cpu_pool.num_blocks}")
        if set(self.cpu_tables) & set(self.tables):
            raise AssertionError("a request holds device and CPU blocks at once")

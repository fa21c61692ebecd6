"""KV cache manager: allocation on demand, prefix hits, fork and copy-on-write."""
from __future__ import annotations

from pagedllm.engine.request import Request
from pagedllm.kv_cache.kv_cache_manager import KVCacheManager
from pagedllm.sampling_params import SamplingParams


def _req(rid: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8), frozenset(), cache_salt=salt)


def _compute(kv, req, n, hits=()):
    assert kv.allocate_slots(req, n, list(hits))
    req.num_computed_tokens += n + len(hits) * kv.block_size


def test_blocks_are_allocated_as_tokens_arrive():
    kv = KVCacheManager(10, 4)
    req = _req("a", list(range(6)))
    _compute(kv, req, 6)
    assert kv.block_ids("a") == [0, 1]
    req.append_token(100)
    _compute(kv, req, 1)
    assert kv.block_ids("a") == [0, 1]  # position 6 still fits block 1
    req.append_token(101)
    req.append_token(102)
    _compute(kv, req, 2)
    assert kv.block_ids("a") == [0, 1, 2]
    kv.check_integrity()
    kv.free(req)
    assert kv.num_free_blocks == 10
    # tail blocks of the request are first in line for eviction
    assert kv.pool.free_queue.ids()[-3:] == [2, 1, 0]


def test_prefix_hit_reuses_full_blocks_and_never_the_last_token():
    kv = KVCacheManager(10, 4)
    a = _req("a", list(range(10)))
    _compute(kv, a, 10)
    b = _req("b", list(range(8)) + [50, 51])
    hits, n = kv.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [0, 1] and n == 8
    _compute(kv, b, 2, hits)
    assert kv.block_ids("b") == [0, 1, 3]
    assert [kv.pool.blocks[i].ref_cnt for i in (0, 1, 2, 3)] == [2, 2, 1, 1]
    # exactly 8 tokens: only the first block may be reused (the last token must be computed)
    c = _req("c", list(range(8)))
    hits, n = kv.get_computed_blocks(c)
    assert [h.block_id for h in hits] == [0] and n == 4
    assert kv.prefix_stats.queries == 18 and kv.prefix_stats.hits == 12
    kv.check_integrity()


def test_cache_salt_separates_prefixes():
    kv = KVCacheManager(10, 4)
    a = _req("a", list(range(9)), salt="alice")
    _compute(kv, a, 9)
    assert kv.get_computed_blocks(_req("b", list(range(9)), salt="bob"))[1] == 0
    assert kv.get_computed_blocks(_req("c", list(range(9)), salt="alice"))[1] == 8


def test_freed_blocks_stay_cached_until_evicted_lru():
    kv = KVCacheManager(4, 4)
    a = _req("a", list(range(9)))
    _compute(kv, a, 9)
    kv.free(a)
    assert kv.pool.free_queue.ids() == [3, 2, 1, 0]
    b = _req("b", list(range(9)))
    hits, n = kv.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [0, 1]
    # an unrelated request takes blocks from the head: 3 (never cached), then 2 (a's tail block)
    other = _req("x", [99] * 5)
    _compute(kv, other, 5)
    assert kv.block_ids("x") == [3, 2]
    assert kv.get_computed_blocks(_req("c", list(range(9))))[1] == 8  # blocks 0, 1 still cached


def _forked_pair():
    """A 6-token parent in blocks [0, 1] (block 1 half full) and a child forked from it."""
    kv = KVCacheManager(10, 4)
    parent = _req("p", list(range(6)))
    _compute(kv, parent, 6)
    child = _req("p#1", list(range(6)))
    child.num_computed_tokens = 6
    kv.fork(parent, child)
    return kv, parent, child


def test_fork_shares_blocks_and_copy_on_write_copies_only_the_partial_block():
    kv, parent, child = _forked_pair()
    assert kv.block_ids("p#1") == [0, 1]
    assert [kv.pool.blocks[i].ref_cnt for i in (0, 1)] == [2, 2]
    kv.check_integrity()
    child.append_token(7)
    _compute(kv, child, 1)
    assert kv.take_copies() == [(1, 2)]
    assert kv.block_ids("p#1") == [0, 2] and kv.block_ids("p") == [0, 1]
    assert [kv.pool.blocks[i].ref_cnt for i in (0, 1, 2)] == [2, 1, 1]
    parent.append_token(8)
    _compute(kv, parent, 1)
    assert kv.take_copies() == []  # the parent is now the only holder of block 1
    kv.check_integrity()
    kv.free(parent)
    kv.free(child)
    assert kv.num_free_blocks == 10


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(3, 4)
    a = _req("a", list(range(8)))
    _compute(kv, a, 8)
    b = _req("b", list(range(20, 30)))
    assert not kv.allocate_slots(b, 10)
    assert kv.num_free_blocks == 1 and kv.block_ids("b") == []
    assert not kv.allocate_slots(b, 2, reserve=1)
    assert kv.allocate_slots(b, 2)
    kv.check_integrity()


def test_num_tokens_stored_counts_shared_blocks_once():
    kv, parent, child = _forked_pair()
    assert kv.num_tokens_stored() == 6


def test_block_table_updates_carry_only_what_changed():
    kv = KVCacheManager(10, 4)
    req = _req("a", list(range(6)))
    _compute(kv, req, 6)
    assert kv.take_block_update("a") == (0, [0, 1])  # a new table: everything
    assert kv.take_block_update("a") == (2, [])  # nothing changed since
    for t in (100, 101, 102):
        req.append_token(t)
    _compute(kv, req, 3)
    assert kv.take_block_update("a") == (2, [2])  # one block appended
    kv.free(req)
    assert kv.take_released() == ["a"] and kv.take_released() == []
    _compute(kv, _req("a", [1]), 1)  # the same id again: a new table from index 0
    assert kv.take_block_update("a") == (0, [3])


def test_block_table_update_after_copy_on_write_and_swap():
    kv, parent, child = _forked_pair()
    assert kv.take_block_update("p#1") == (0, [0, 1])  # a forked child starts from scratch
    child.append_token(7)
    _compute(kv, child, 1)
    assert kv.take_block_update("p#1") == (1, [2])  # the written partial block was replaced
    kv = KVCacheManager(10, 4, num_cpu_blocks=4)
    req = _req("s", list(range(6)))
    _compute(kv, req, 6)
    kv.take_block_update("s")
    kv.pool.allocate(2)  # blocks 2, 3 taken: swapped-in blocks get other ids
    kv.swap_out(req)
    assert kv.take_released() == ["s"]
    kv.swap_in(req)
    assert kv.take_block_update("s") == (0, kv.block_ids("s")) and kv.block_ids("s") != [0, 1]

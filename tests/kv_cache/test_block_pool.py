"""Block pool: exact block ids, reference counts and free-queue order."""
from __future__ import annotations

import pytest

from pagedllm.kv_cache.block_pool import BlockPool


def test_allocate_takes_from_the_head_in_order():
    pool = BlockPool(6)
    blocks = pool.allocate(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert pool.free_queue.ids() == [3, 4, 5]
    assert pool.num_free_blocks == 3


def test_free_appends_to_the_tail_in_given_order():
    pool = BlockPool(5)
    a = pool.allocate(3)
    pool.free([a[2], a[0]])
    assert pool.free_queue.ids() == [3, 4, 2, 0]
    assert a[1].ref_cnt == 1
    assert pool.allocate(3)[0].block_id == 3


def test_shared_block_is_freed_only_at_zero_references():
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    pool.touch([b])
    assert b.ref_cnt == 2
    pool.free([b])
    assert b.ref_cnt == 1 and 0 not in pool.free_queue.ids()
    pool.free([b])
    assert b.ref_cnt == 0 and pool.free_queue.ids()[-1] == 0


def test_touch_revives_a_cached_free_block_from_the_middle():
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    pool.cache_block(blocks[1], b"h1")
    pool.free(blocks)
    assert pool.free_queue.ids() == [0, 1, 2, 3]
    assert pool.get_cached(b"h1") is blocks[1]
    pool.touch([blocks[1]])
    assert pool.free_queue.ids() == [0, 2, 3] and blocks[1].ref_cnt == 1
    assert pool.num_cached_free_blocks == 0


def test_reallocating_a_cached_block_evicts_its_hash():
    pool = BlockPool(2)
    blocks = pool.allocate(2)
    pool.cache_block(blocks[0], b"h0")
    pool.free(blocks)
    assert pool.num_cached_free_blocks == 1
    again = pool.allocate(1)
    assert again[0] is blocks[0] and again[0].block_hash is None
    assert pool.get_cached(b"h0") is None


def test_over_allocation_and_reset():
    pool = BlockPool(2)
    with pytest.raises(ValueError):
        pool.allocate(3)
    b = pool.allocate(1)
    pool.cache_block(b[0], b"x")
    assert pool.reset_prefix_cache() is False  # a block is in use
    pool.free(b)
    assert pool.reset_prefix_cache() is True and pool.get_cached(b"x") is None

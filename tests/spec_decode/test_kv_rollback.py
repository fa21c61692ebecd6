"""KV blocks of speculative drafts: allocated with the step, hashed only once accepted, freed
past the accepted length (block ids and the prefix cache pinned after each operation)."""
from __future__ import annotations

from pagedllm.engine.request import Request
from pagedllm.kv_cache.kv_cache_manager import KVCacheManager
from pagedllm.sampling_params import SamplingParams


def _decoding_request(kv: KVCacheManager) -> Request:
    """Prompt of 6 tokens (block size 4) computed, one sampled token still to compute."""
    req = Request("a", list(range(10, 16)), SamplingParams(max_tokens=32), frozenset())
    assert kv.allocate_slots(req, 6)
    req.num_computed_tokens = 6
    req.append_token(16)
    return req


def _verify(kv: KVCacheManager, req: Request, drafts: list[int], num_accepted: int, bonus: int) -> None:
    """Schedules the last token + drafts, then appends the accepted drafts and rolls back."""
    assert kv.allocate_slots(req, 1 + len(drafts))
    req.num_computed_tokens += 1 + len(drafts)
    for token in drafts[:num_accepted] + [bonus]:
        req.append_token(token)
    req.num_computed_tokens = req.num_tokens - 1
    kv.rollback(req)


def test_rejected_drafts_free_the_blocks_they_crossed_into():
    kv = KVCacheManager(8, 4)
    req = _decoding_request(kv)
    assert kv.allocate_slots(req, 1 + 5)  # the last token + 5 drafts: positions 6..11
    assert kv.block_ids("a") == [0, 1, 2]
    assert len(kv.pool.cached) == 1  # only block 0 (tokens the request holds) is hashed
    req.num_computed_tokens += 6
    req.append_token(99)  # nothing accepted: the target's own token
    req.num_computed_tokens = req.num_tokens - 1  # 7: positions 0..6 hold real K/V
    kv.rollback(req)
    assert kv.block_ids("a") == [0, 1]  # block 2 held rejected drafts only
    assert kv.num_free_blocks == 6 and len(kv.pool.cached) == 1
    kv.check_integrity()


def test_accepted_drafts_fill_blocks_that_enter_the_prefix_cache():
    kv = KVCacheManager(8, 4)
    req = _decoding_request(kv)
    _verify(kv, req, [17, 18, 19, 20, 21], num_accepted=3, bonus=7)
    # tokens 10..16 + 17 18 19 + 7: positions 0..9 computed (3 blocks), the last token not yet
    assert req.num_computed_tokens == 10 and kv.block_ids("a") == [0, 1, 2]
    assert len(kv.pool.cached) == 2  # blocks 0 and 1 are full of accepted tokens
    # a new request with the same first 8 tokens hits both
    other = Request("b", list(range(10, 17)) + [17, 18], SamplingParams(max_tokens=4), frozenset())
    hits, num_hit = kv.get_computed_blocks(other)
    assert [b.block_id for b in hits] == [0, 1] and num_hit == 8
    kv.check_integrity()
    kv.free(req)
    assert kv.num_free_blocks == 8

"""The engine-side encoder cache: budget per step, references until a run is computed, LRU
eviction of unreferenced images; and block hashes keyed by image content."""
from __future__ import annotations

from pagedllm.kv_cache.prefix_hash import extend_block_hashes
from pagedllm.multimodal.encoder_cache import EncoderCacheManager
from pagedllm.multimodal.inputs import MultiModalItem


def _item(name: str, offset: int, length: int = 10) -> MultiModalItem:
    return MultiModalItem(name.encode(), offset, length, {})


def test_budget_cuts_the_chunk_before_an_image_that_does_not_fit():
    cache = EncoderCacheManager(capacity=100, budget=15)
    items = [_item("a", 2), _item("b", 14)]
    assert cache.fit(items, 0, 30) == 14  # a (10 rows) fits the budget, b would exceed it
    assert [e.hash for e in cache.schedule("r", items, 0, 14)] == [b"a"]
    assert cache.fit(items, 14, 16) == 0  # b needs 10 more rows this step: 5 left
    cache.begin_step()
    assert cache.fit(items, 14, 16) == 16


def test_cached_images_cost_nothing_and_count_as_hits():
    cache = EncoderCacheManager(capacity=100, budget=10)
    cache.schedule("r1", [_item("a", 0)], 0, 10)
    cache.begin_step()
    assert cache.fit([_item("a", 5), _item("b", 20)], 0, 40) == 40
    assert cache.schedule("r2", [_item("a", 5)], 0, 15) == []
    assert cache.stats.cache_hits == 1 and cache.stats.images_encoded == 1


def test_references_hold_entries_until_the_run_is_computed():
    cache = EncoderCacheManager(capacity=20, budget=100)
    a, b, c = _item("a", 0), _item("b", 10), _item("c", 0)
    cache.schedule("r1", [a, b], 0, 15)  # b split by the chunk boundary at 15
    cache.release_done("r1", [a, b], 15)  # a is done, b is still needed
    assert cache.refs == {b"b": {"r1"}}
    assert cache.fit([c], 0, 10) == 10  # a is unreferenced: evictable
    cache.schedule("r2", [c], 0, 10)
    assert cache.take_frees() == [b"a"]
    assert cache.fit([_item("d", 0)], 0, 10) == 0  # b and c referenced: no room
    cache.release("r1")
    assert cache.fit([_item("d", 0)], 0, 10) == 10


def test_block_hashes_key_on_the_images_of_their_placeholders():
    ids = [7] * 4 + [9] * 8 + [5] * 4  # 16 tokens, an 8-token image run at 4..12, block size 4
    def hashes(image: bytes) -> list[bytes]:
        out: list[bytes] = []
        extend_block_hashes(out, ids, 4, (), [(image, 4, 8)])
        return out
    same, other = hashes(b"x"), hashes(b"y")
    assert same == hashes(b"x")
    assert same[0] == other[0]  # the text block before the image is shared
    assert all(s != o for s, o in zip(same[1:], other[1:]))  # from the image's first block on, never


def test_images_and_videos_count_apart():
    """A video counts in the video metrics (with its frames), never in the image ones, and the
    other way round; a cached item counts once, and an evicted video leaves the video gauge."""
    cache = EncoderCacheManager(capacity=30, budget=100)
    video = MultiModalItem(b"v", 0, 10, {}, modality="video", frames=6)
    cache.schedule("r1", [_item("a", 0), video], 0, 20)
    cache.schedule("r2", [video], 0, 10)  # a hit: counted once
    metrics = {m.name: m.value for m in cache.metrics()}
    assert (metrics["pagedllm:mm_images_encoded"], metrics["pagedllm:mm_videos_encoded"],
            metrics["pagedllm:mm_video_frames_encoded"]) == (1, 1, 6)
    assert (metrics["pagedllm:mm_encoder_cache_images"], metrics["pagedllm:mm_encoder_cache_videos"]) == (1, 1)
    cache.release("r1")
    cache.release("r2")
    cache.schedule("r3", [_item("b", 0, 30)], 0, 30)  # evicts the image and the video
    metrics = {m.name: m.value for m in cache.metrics()}
    assert (metrics["pagedllm:mm_encoder_cache_images"], metrics["pagedllm:mm_encoder_cache_videos"]) == (1, 0)
    assert (metrics["pagedllm:mm_images_encoded"], metrics["pagedllm:mm_videos_encoded"]) == (2, 1)

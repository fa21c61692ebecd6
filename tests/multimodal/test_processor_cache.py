"""The processor-output cache (mm_processor_cache_gb, multimodal/processor_cache.py): a repeated
image or video skips the HF processor and gets the same ids and tensors as the uncached path;
processor options that change the tensors miss; a model whose placeholder expansion is not a plain
repeat (Gemma 3) keeps running its processor; greedy outputs on a hit equal transformers'."""
from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import _multimodal_processor
from pagedllm.multimodal.processor_cache import ProcessorCache
from tests.multimodal import gemma3_vl_fixtures, qwen2_vl_fixtures
from tests.multimodal.llava_fixtures import make_image
from tests.multimodal.qwen2_vl_fixtures import PLACEHOLDER, VIDEO, hf_generate, load_hf, make_video

qwen2_vl_dir, gemma3_vl_dir = qwen2_vl_fixtures.qwen2_vl_dir, gemma3_vl_fixtures.gemma3_vl_dir  # fixtures

GREEDY = SamplingParams(temperature=0, max_tokens=6)
MIXED = (f"{PLACEHOLDER} paged {VIDEO} keeps {PLACEHOLDER} a block",
         {"image": [make_image(2, (64, 30)), make_image(3, (20, 40))], "video": [make_video(4, frames=3)]})


class _NoProcessor:
    """Stands in for the HF processor on a cache hit: only its tokenizer may be used."""

    def __init__(self, hf):
        self.tokenizer = hf.tokenizer

    def __call__(self, **kwargs):
        raise AssertionError("the HF processor ran for a prompt whose items were all cached")


def _processor(path: str, cache_gb: float = 1.0):
    return _multimodal_processor(EngineArgs(model=path, mm_processor_cache_gb=cache_gb).create_engine_config())


def _same(got, want) -> None:
    (ids, items), (want_ids, want_items) = got, want
    assert ids == want_ids
    assert items == want_items  # hash, offset, length, grid, temporal spacing
    for item, other in zip(items, want_items):
        assert item.data.keys() == other.data.keys()
        for key, value in item.data.items():
            assert torch.equal(value, other.data[key]), key


def test_repeat_skips_the_processor_with_the_uncached_output(qwen2_vl_dir):
    cached, uncached = _processor(qwen2_vl_dir), _processor(qwen2_vl_dir, cache_gb=0)
    assert uncached.cache is None
    text, data = MIXED
    want = uncached.process(text, data)
    _same(cached.process(text, data), want)
    assert (cached.cache.stats.hits, cached.cache.stats.misses) == (0, 3)
    clone = cached.clone()  # another tokenizer thread's: the cache is shared
    clone.hf = _NoProcessor(clone.hf)
    _same(clone.process(text, data), want)
    other_text = f"hello {PLACEHOLDER} and {VIDEO} then {PLACEHOLDER}"  # same items, other places
    _same(clone.process(other_text, data), uncached.process(other_text, data))
    _same(clone.process(text, data, add_special_tokens=False), uncached.process(text, data, add_special_tokens=False))
    assert cached.cache.stats.hits == 9
    with pytest.raises(AssertionError, match="HF processor ran"):  # one uncached image: the processor runs
        clone.process(text, {**data, "image": [make_image(2, (64, 30)), make_image(9, (20, 40))]})


def test_options_that_change_the_tensors_miss(qwen2_vl_dir):
    proc, uncached = _processor(qwen2_vl_dir), _processor(qwen2_vl_dir, cache_gb=0)
    text, image = f"the quick {PLACEHOLDER} fox", {"image": [make_image(5, (96, 96))]}
    default = proc.process(text, image)
    small = proc.process(text, image, {"max_pixels": 32 * 32})
    assert proc.cache.stats.misses == 2 and proc.cache.stats.hits == 0
    assert small[1][0].grid != default[1][0].grid
    _same(small, uncached.process(text, image, {"max_pixels": 32 * 32}))
    _same(proc.process(text, image), default)
    assert proc.cache.stats.hits == 1


def test_wrong_placeholder_count_is_refused_as_uncached(qwen2_vl_dir):
    proc = _processor(qwen2_vl_dir)
    image = {"image": [make_image(6)]}
    proc.process(f"a {PLACEHOLDER} b", image)
    with pytest.raises(ValueError) as cached_error:
        proc.process("no placeholder here", image)
    with pytest.raises(ValueError) as uncached_error:
        _processor(qwen2_vl_dir, cache_gb=0).process("no placeholder here", image)
    assert str(cached_error.value) == str(uncached_error.value)


def test_lru_bounded_by_bytes(qwen2_vl_dir):
    proc = _processor(qwen2_vl_dir)
    text = f"a {PLACEHOLDER} b"
    item = proc.process(text, {"image": [make_image(7)]})[1][0]
    size = sum(t.nbytes for t in item.data.values())
    proc.cache = ProcessorCache(2 * size)
    for seed in (7, 8, 7, 10):  # 8 is the least recently used when 10 comes
        proc.process(text, {"image": [make_image(seed)]})
    assert proc.cache.used <= 2 * size and len(proc.cache.entries) == 2
    hits = proc.cache.stats.hits
    proc.process(text, {"image": [make_image(7)]})
    assert proc.cache.stats.hits == hits + 1
    proc.process(text, {"image": [make_image(8)]})
    assert proc.cache.stats.hits == hits + 1


def test_gemma3_expansion_is_not_a_repeat_so_its_processor_keeps_running(gemma3_vl_dir):
    proc, uncached = _processor(gemma3_vl_dir), _processor(gemma3_vl_dir, cache_gb=0)
    text, image = "look <start_of_image> here", {"image": [make_image(1)]}
    want = uncached.process(text, image)
    _same(proc.process(text, image), want)
    assert proc.cache.expansion_ok == {"image": False}
    _same(proc.process(text, image), want)
    assert proc.cache.stats.hits == 0


@pytest.mark.parametrize("value", [-1, "4", True])
def test_bad_cache_size_is_refused(qwen2_vl_dir, value):
    with pytest.raises(ValueError, match="mm_processor_cache_gb"):
        _processor(qwen2_vl_dir, cache_gb=value)


def test_greedy_outputs_on_a_hit_equal_transformers(qwen2_vl_dir):
    llm = LLM(model=qwen2_vl_dir, max_model_len=256, kv_cache_memory=2**22, block_size=8, enable_prefix_caching=False)
    try:
        hf = load_hf(qwen2_vl_dir)
        text, images = f"the quick {PLACEHOLDER} brown fox", [make_image(11, (48, 40))]
        want = hf_generate(hf, text, images, GREEDY.max_tokens)
        for _ in range(2):
            out = llm.generate([{"prompt": text, "multi_modal_data": {"image": images}}], GREEDY, use_tqdm=False)
            assert list(out[0].outputs[0].token_ids) == want
        metrics = {m.name: m.value for m in llm.llm_engine.get_metrics()}
        assert metrics["pagedllm:mm_processor_cache_hits"] == 1
        assert metrics["pagedllm:mm_processor_cache_misses"] == 1
    finally:
        llm.llm_engine.shutdown()

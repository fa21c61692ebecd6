"""Qwen2-VL and Qwen2.5-VL end to end, offline: greedy outputs equal transformers' generate on the
same tiny random weights and images (0, 1 and 3 images of different sizes), with M-RoPE positions
through chunked prefill (a chunk boundary inside an image's run), prefix hits and misses by image
content, preemption, mm_processor_kwargs and LLM.chat."""
from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.multimodal import qwen2_vl_fixtures
from tests.multimodal.llava_fixtures import chunks_seen, make_image
from tests.multimodal.qwen2_vl_fixtures import PLACEHOLDER, hf_generate, load_hf

qwen2_vl_dir, qwen2_5_vl_dir = qwen2_vl_fixtures.qwen2_vl_dir, qwen2_vl_fixtures.qwen2_5_vl_dir  # fixtures

MAX_NEW = 8
BUDGET = 40  # max_num_batched_tokens: the largest image (6x6 tokens) fits one step, runs straddle chunks
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW)
LONG_TEXT = "the quick brown fox jumps over the lazy dog paged attention keeps"
CASES = [
    (f"the quick {PLACEHOLDER} brown fox", [make_image(1)]),
    ("hello world, this is a tiny tokenizer", []),
    (f"{PLACEHOLDER} paged {PLACEHOLDER} keeps a {PLACEHOLDER} block",
     [make_image(2, (64, 30)), make_image(3, (20, 40)), make_image(4, (48, 48))]),
    (f"héllo {PLACEHOLDER} the lazy dog", [make_image(5, (90, 24))]),
]


def _engine(path: str, **kwargs) -> LLM:
    options = dict(max_model_len=256, kv_cache_memory=2**22, max_num_batched_tokens=BUDGET, block_size=8,
                   limit_mm_per_prompt={"image": 3})
    return LLM(model=path, **{**options, **kwargs})


@pytest.fixture(scope="module")
def hf(qwen2_vl_dir):
    return load_hf(qwen2_vl_dir)


@pytest.fixture(scope="module")
def llm(qwen2_vl_dir):
    engine = _engine(qwen2_vl_dir)
    yield engine
    engine.llm_engine.shutdown()


def _prompt(text: str, images: list, **kwargs):
    return {"prompt": text, "multi_modal_data": {"image": images}, **kwargs} if images else text


def _generate(llm, text: str, images: list, **kwargs) -> list[int]:
    return list(llm.generate([_prompt(text, images, **kwargs)], GREEDY, use_tqdm=False)[0].outputs[0].token_ids)


def test_greedy_matches_transformers_mixed_batch(llm, hf):
    outs = llm.generate([_prompt(t, imgs) for t, imgs in CASES], GREEDY, use_tqdm=False)
    for (text, images), out in zip(CASES, outs):
        assert list(out.outputs[0].token_ids) == hf_generate(hf, text, images, MAX_NEW), text


def test_qwen2_5_vl_window_attention_tower(qwen2_5_vl_dir):
    """Qwen2.5-VL: windowed + full-attention tower blocks, the same M-RoPE language model."""
    engine, oracle = _engine(qwen2_5_vl_dir), load_hf(qwen2_5_vl_dir)
    try:
        outs = engine.generate([_prompt(t, imgs) for t, imgs in CASES], GREEDY, use_tqdm=False)
        for (text, images), out in zip(CASES, outs):
            assert list(out.outputs[0].token_ids) == hf_generate(oracle, text, images, MAX_NEW), text
    finally:
        engine.llm_engine.shutdown()


def test_tower_rows_equal_transformers(llm, hf):
    """The tower (our forward on packed linears, its patch embedding as one GEMM;
    models/qwen2_vl_tower.py) makes transformers' rows for images of different sizes, twice (the
    second from the cached rotary tables), and for a grid of two frames (a video's temporal
    patches: each frame attends within itself)."""
    from pagedllm.models.qwen2_vl import LinearPatchEmbed
    ours = llm.llm_engine.executor.runner.model
    assert isinstance(ours.visual.patch_embed, LinearPatchEmbed)
    from pagedllm.layers.kernel_tuning import _linear_modules
    tower_linears = [m for m in ours.visual.modules() if isinstance(m, torch.nn.Linear)]
    assert all(m.packed_weight is not None for m in tower_linears)
    assert not set(map(id, tower_linears)) & set(map(id, _linear_modules(ours)))  # packed, not timed at start-up
    model, processor = hf
    for image in (make_image(6, (64, 30)), make_image(7, (48, 48)), make_image(6, (64, 30))):
        inputs = processor(text=[PLACEHOLDER], images=[image], return_tensors="pt")
        data = {"pixel_values": inputs["pixel_values"], "image_grid_thw": inputs["image_grid_thw"]}
        with torch.no_grad():
            want = model.model.get_image_features(**data).pooler_output
        want = torch.cat(list(want)) if isinstance(want, (list, tuple)) else want
        torch.testing.assert_close(ours.encode_image(data), want, atol=1e-5, rtol=1e-5)
    t, h, w = data["image_grid_thw"][0].tolist()
    frames = torch.randn(2 * h * w, data["pixel_values"].shape[1], generator=torch.Generator().manual_seed(0))
    grid = torch.tensor([[2, h, w]])
    with torch.no_grad():
        want = model.model.visual(frames, grid_thw=grid).pooler_output
    torch.testing.assert_close(ours.encode_image({"pixel_values": frames, "image_grid_thw": grid}), want,
                               atol=1e-5, rtol=1e-5)


def test_images_and_their_positions_change_the_output(llm):
    """The oracle comparison means something: the image and where it sits reach the logits."""
    stats = llm.llm_engine.scheduler.encoder.stats
    steps, seconds = stats.encoder_steps, stats.encoder_seconds
    outs = {tuple(_generate(llm, f"the quick {PLACEHOLDER} brown fox", [make_image(seed)])) for seed in (11, 12, 13)}
    assert len(outs) > 1
    metrics = {m.name: m.value for m in llm.llm_engine.get_metrics()}
    assert metrics["pagedllm:mm_encoder_steps"] == steps + 3 and metrics["pagedllm:mm_encoder_seconds"] > seconds


def test_chunk_boundary_inside_an_image_run(llm, hf, monkeypatch):
    text, images = f"{LONG_TEXT} {PLACEHOLDER} over", [make_image(8, (48, 48))]
    ids = hf[1](text=[text], images=images)["input_ids"][0]
    image_token = hf[1].image_token_id
    offset, length = ids.index(image_token), ids.count(image_token)
    assert offset < BUDGET < offset + length  # the first chunk ends inside the run
    seen = chunks_seen(llm, monkeypatch)
    assert _generate(llm, text, images) == hf_generate(hf, text, images, MAX_NEW)
    covering = [c for c in seen if c.mm_spans]
    assert len(covering) >= 2 and covering[0].seq_len < offset + length
    assert covering[0].mrope_positions.shape == (3, covering[0].num_new_tokens)


def test_disable_chunked_mm_input_schedules_each_run_whole(qwen2_vl_dir, hf, monkeypatch):
    """vLLM's disable_chunked_mm_input: the prompt of the test above (whose run a plain chunk boundary
    splits) and a batch of 0 to 3 images: every image run lies inside one chunk, outputs stay exact;
    an image longer than a step's budget is refused up front (it could never run whole: no hang)."""
    engine = _engine(qwen2_vl_dir, disable_chunked_mm_input=True)
    try:
        split = (f"{LONG_TEXT} {PLACEHOLDER} over", [make_image(8, (48, 48))])
        ids = hf[1](text=[split[0]], images=split[1])["input_ids"][0]
        offset, length = ids.index(hf[1].image_token_id), ids.count(hf[1].image_token_id)
        assert offset < BUDGET < offset + length  # without the option the first chunk ends inside the run
        seen = chunks_seen(engine, monkeypatch)
        cases = [split, *CASES]
        outs = engine.generate([_prompt(t, imgs) for t, imgs in cases], GREEDY, use_tqdm=False)
        for (text, images), out in zip(cases, outs):
            assert list(out.outputs[0].token_ids) == hf_generate(hf, text, images, MAX_NEW), text
        spans = [(c.request_id, off, c.start, c.seq_len, off + n) for c in seen for _, off, n in c.mm_spans]
        assert len({s[:2] for s in spans}) == 6  # every run of the batch was scheduled
        assert all(start <= off and end <= seq_len for _, off, start, seq_len, end in spans), spans
        big = make_image(9, (96, 96))  # 12 x 12 tokens with the larger max_pixels: over the budget of 40
        with pytest.raises(ValueError, match="over the 40 that fit in one step"):
            engine.generate([_prompt(f"a {PLACEHOLDER} b", [big], mm_processor_kwargs={"max_pixels": 96 * 96})],
                            GREEDY, use_tqdm=False)
    finally:
        engine.llm_engine.shutdown()


def test_prefix_cache_hit_and_miss_by_image(llm, hf):
    """The same image: the prompt's blocks through the image hit, and decode continues at the right
    M-RoPE positions; another image of the same size (same token ids and positions): no hit past it."""
    text = f"{LONG_TEXT} {PLACEHOLDER} the lazy dog jumps over"
    first = llm.generate([_prompt(text, [make_image(31)])], GREEDY, use_tqdm=False)[0]
    same = llm.generate([_prompt(text, [make_image(31)])], GREEDY, use_tqdm=False)[0]
    other = llm.generate([_prompt(text, [make_image(32)])], GREEDY, use_tqdm=False)[0]
    ids = first.prompt_token_ids
    offset = ids.index(hf[1].image_token_id)
    end = offset + ids.count(hf[1].image_token_id)
    assert same.num_cached_tokens >= end - end % 8 > offset and other.num_cached_tokens <= offset
    assert list(same.outputs[0].token_ids) == list(first.outputs[0].token_ids)
    assert list(first.outputs[0].token_ids) == hf_generate(hf, text, [make_image(31)], MAX_NEW)
    assert list(other.outputs[0].token_ids) == hf_generate(hf, text, [make_image(32)], MAX_NEW)


def test_preemption_keeps_outputs_exact(qwen2_vl_dir, hf):
    """A KV cache too small for every prompt at once: requests are preempted (recompute) and resume
    with the same M-RoPE positions; outputs stay exact."""
    engine = _engine(qwen2_vl_dir, max_model_len=96, num_gpu_blocks_override=16, kv_cache_memory=None)
    try:
        cases = [(f"{LONG_TEXT} {PLACEHOLDER} fox", [make_image(80 + i)]) for i in range(4)]
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        outs = engine.generate([_prompt(t, imgs) for t, imgs in cases], params, use_tqdm=False)
        assert engine.llm_engine.scheduler.stats.num_preemptions > 0
        model, processor = hf
        for (text, images), out in zip(cases, outs):
            inputs = processor(text=[text], images=images, return_tensors="pt")
            with torch.no_grad():  # stops at EOS, where ignore_eos goes on
                ref = model.generate(**inputs, max_new_tokens=24, do_sample=False)[0, inputs["input_ids"].shape[1]:]
            assert list(out.outputs[0].token_ids)[:len(ref)] == ref.tolist()
    finally:
        engine.llm_engine.shutdown()


def test_max_pixels_reaches_the_processor(llm, hf):
    """mm_processor_kwargs={"max_pixels": ...} shrinks the image (fewer tokens), as in transformers."""
    text, image = f"the quick {PLACEHOLDER} brown fox", make_image(51, (48, 48))
    small = llm.generate([_prompt(text, [image], mm_processor_kwargs={"max_pixels": 24 * 24})], GREEDY,
                         use_tqdm=False)[0]
    full = llm.generate([_prompt(text, [image])], GREEDY, use_tqdm=False)[0]
    assert len(small.prompt_token_ids) < len(full.prompt_token_ids)
    assert list(small.outputs[0].token_ids) == hf_generate(hf, text, [image], MAX_NEW, max_pixels=24 * 24)


def test_llm_chat_image_parts_use_the_vision_tokens(llm, hf):
    """LLM.chat: an image_pil part becomes <|vision_start|><|image_pad|><|vision_end|>."""
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    image = make_image(71)
    messages = [{"role": "user", "content": [{"type": "image_pil", "image_pil": image},
                                             {"type": "text", "text": "what is this?"}]}]
    out = llm.chat(messages, GREEDY, use_tqdm=False, chat_template=template)[0]
    text = f"user: {PLACEHOLDER}\nwhat is this?\nassistant:"
    assert list(out.outputs[0].token_ids) == hf_generate(hf, text, [image], MAX_NEW)


def test_tied_lm_head_checkpoint(tmp_path):
    """tie_word_embeddings on the top config (Qwen2-VL-2B's layout): the head is the embedding."""
    path = qwen2_vl_fixtures.make_qwen2_vl_dir(tmp_path / "tied", "2", seed=1, tied=True)
    engine, oracle = _engine(path), load_hf(path)
    try:
        for text, images in CASES[:2]:
            assert _generate(engine, text, images) == hf_generate(oracle, text, images, MAX_NEW)
    finally:
        engine.llm_engine.shutdown()


def test_beam_search_forks_keep_the_positions(llm, hf):
    """Beams (forked requests) carry the image and its M-RoPE positions: transformers' num_beams=2."""
    from pagedllm.sampling_params import BeamSearchParams
    text, image = f"the quick {PLACEHOLDER} brown fox", make_image(91)
    out = llm.beam_search([{"prompt": text, "multi_modal_data": {"image": image}}],
                          BeamSearchParams(beam_width=2, max_tokens=MAX_NEW))[0]
    model, processor = hf
    inputs = processor(text=[text], images=[image], return_tensors="pt")
    with torch.no_grad():
        ref = model.generate(**inputs, num_beams=2, num_return_sequences=2, do_sample=False, max_new_tokens=MAX_NEW,
                             eos_token_id=2, pad_token_id=0)
    beams = [s[inputs["input_ids"].shape[1]:].tolist() for s in ref]
    beams = [b[: b.index(2) + 1] if 2 in b else b for b in beams]
    assert [s.output_token_ids for s in out.sequences] == beams

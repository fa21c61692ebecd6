"""Qwen2-VL and Qwen2.5-VL with videos (frames), offline: greedy outputs equal transformers' generate
on the same tiny random weights and processor output, for a 4-frame video alone, with images, two
videos of different lengths, the frame shapes vLLM takes, Qwen2.5-VL's temporal spacing from the
frame rate, a chunk boundary inside a video's placeholder run, and prefix hits and misses by video
content."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.multimodal import qwen2_vl_fixtures
from tests.multimodal.llava_fixtures import chunks_seen, make_image
from tests.multimodal.qwen2_vl_fixtures import PLACEHOLDER, VIDEO, hf_generate, jpeg_frames_url, load_hf, make_video

qwen2_vl_dir, qwen2_5_vl_dir = qwen2_vl_fixtures.qwen2_vl_dir, qwen2_vl_fixtures.qwen2_5_vl_dir  # fixtures

MAX_NEW = 8
BUDGET = 48  # max_num_batched_tokens: a 4-frame 40x32 video is 2 x 5 x 4 = 40 tokens, so runs straddle chunks
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW)
LONG_TEXT = "the quick brown fox jumps over the lazy dog paged attention keeps"
CASES = [
    (f"the quick {VIDEO} brown fox", [], [make_video(1)]),
    (f"{PLACEHOLDER} and {VIDEO} the lazy dog", [make_image(2)], [make_video(3, size=(24, 48))]),
    (f"{VIDEO} paged {PLACEHOLDER} keeps {VIDEO} a block", [make_image(4, (30, 30))],
     [make_video(5, frames=3), make_video(6, frames=2, size=(16, 16))]),  # 3 frames: the last is repeated
]


@pytest.fixture(scope="module", params=["2", "2.5"])
def model(request, qwen2_vl_dir, qwen2_5_vl_dir):
    """(engine, transformers oracle) on Qwen2-VL, then on Qwen2.5-VL."""
    path = qwen2_vl_dir if request.param == "2" else qwen2_5_vl_dir
    engine = LLM(model=path, max_model_len=256, kv_cache_memory=2**22, max_num_batched_tokens=BUDGET, block_size=8,
                 limit_mm_per_prompt={"image": 2, "video": 2})
    yield engine, load_hf(path)
    engine.llm_engine.shutdown()


def _prompt(text: str, images: list, videos: list) -> dict:
    data = {"image": images, "video": videos} if images else {"video": videos}
    return {"prompt": text, "multi_modal_data": data}


def _generate(llm, prompt) -> list[int]:
    return list(llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids)


def test_videos_match_transformers(model):
    llm, hf = model
    outs = llm.generate([_prompt(*case) for case in CASES], GREEDY, use_tqdm=False)
    for (text, images, videos), out in zip(CASES, outs):
        assert list(out.outputs[0].token_ids) == hf_generate(hf, text, images, MAX_NEW, videos), text


def test_frame_shapes_are_one_video(model):
    """[T, H, W, 3] array, list of PIL frames, [T, 3, H, W] tensor: the same video, the same
    content hash (the second and third prompts hit the first one's prefix blocks)."""
    llm, hf = model
    clip = make_video(11)
    text = f"{LONG_TEXT} {VIDEO} over"
    forms = [clip, [make_frame for make_frame in _pil_frames(clip)], torch.from_numpy(clip).permute(0, 3, 1, 2)]
    outs = [llm.generate([_prompt(text, [], [form])], GREEDY, use_tqdm=False)[0] for form in forms]
    ref = hf_generate(hf, text, [], MAX_NEW, [clip])
    assert all(list(out.outputs[0].token_ids) == ref for out in outs)
    assert outs[1].num_cached_tokens > outs[1].prompt_token_ids.index(hf[1].video_token_id)


def _pil_frames(clip: np.ndarray) -> list:
    from PIL import Image
    return [Image.fromarray(frame) for frame in clip]


def test_video_content_reaches_the_output(model):
    """The oracle comparison means something: another clip of the same shape changes the tokens."""
    llm, _ = model
    outs = {tuple(_generate(llm, _prompt(f"the quick {VIDEO} brown fox", [], [make_video(seed)])))
            for seed in (21, 22, 23)}
    assert len(outs) > 1


def test_chunk_boundary_inside_a_video_run(model, monkeypatch):
    llm, hf = model
    text, videos = f"chunks: {LONG_TEXT} {VIDEO} over", [make_video(31)]  # no prefix hit from another test
    ids = hf[1](text=[text], videos=videos)["input_ids"][0]
    offset, length = ids.index(hf[1].video_token_id), ids.count(hf[1].video_token_id)
    assert offset < BUDGET < offset + length  # the first chunk ends inside the run
    seen = chunks_seen(llm, monkeypatch)
    assert _generate(llm, _prompt(text, [], videos)) == hf_generate(hf, text, [], MAX_NEW, videos)
    covering = [c for c in seen if c.mm_spans]
    assert len(covering) >= 2 and covering[0].seq_len < offset + length
    assert covering[0].mrope_positions.shape == (3, covering[0].num_new_tokens)


def test_prefix_cache_hit_and_miss_by_video(model):
    """The same clip: the blocks through the video hit; another clip of the same shape (same token
    ids and positions): no hit past its start."""
    llm, hf = model
    text = f"{LONG_TEXT} {VIDEO} the lazy dog jumps over"
    first, same, other = (llm.generate([_prompt(text, [], [make_video(seed)])], GREEDY, use_tqdm=False)[0]
                          for seed in (41, 41, 42))
    ids = first.prompt_token_ids
    offset = ids.index(hf[1].video_token_id)
    end = offset + ids.count(hf[1].video_token_id)
    assert same.num_cached_tokens >= end - end % 8 > offset and other.num_cached_tokens <= offset
    assert list(same.outputs[0].token_ids) == list(first.outputs[0].token_ids)
    assert list(other.outputs[0].token_ids) == hf_generate(hf, text, [], MAX_NEW, [make_video(42)])


@pytest.mark.parametrize("fps", [None, 1.0, 3.0])
def test_positions_equal_get_rope_index(model, fps):
    """Every case's M-RoPE positions and decode offset equal transformers' get_rope_index on the
    processor's output; vLLM's (frames, metadata) pair sets the frame rate, which spaces
    Qwen2.5-VL's temporal positions (fps=1: second_per_grid_ts 2, a step of tokens_per_second * 2 = 8)."""
    from pagedllm.multimodal.mrope import MRopePositions
    llm, (oracle, processor) = model
    for text, images, videos in CASES:
        clips = [(v, {"fps": fps}) for v in videos] if fps else videos
        ids, items = llm.llm_engine.multimodal.process(text, _prompt(text, images, clips)["multi_modal_data"])
        metadata = [{"total_num_frames": len(v), "fps": fps, "frames_indices": list(range(len(v)))} for v in videos]
        inputs = processor(text=[text], images=images or None, videos=videos, return_tensors="pt",
                           videos_kwargs={"video_metadata": metadata})
        grids = {k: inputs[k] for k in ("image_grid_thw", "video_grid_thw", "second_per_grid_ts") if k in inputs}
        positions, delta = oracle.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"], **grids)
        ours = MRopePositions.of(len(ids), items)
        assert ids == inputs["input_ids"][0].tolist()
        assert np.array_equal(ours.prompt, positions[:, 0].numpy()) and ours.delta == int(delta), text
    if "second_per_grid_ts" in inputs and fps == 1.0:
        assert {item.time_interval for item in items if item.grid[0] > 1} == {8.0}


def test_frame_rate_reaches_qwen2_5_vl_outputs(model):
    """The frame rate changes the video's hash (its positions), and outputs still equal transformers."""
    llm, hf = model
    text, clip = f"the quick {VIDEO} brown fox", make_video(51)
    slow = llm.llm_engine.multimodal.process(text, {"video": (clip, {"fps": 1.0})})[1][0]
    plain = llm.llm_engine.multimodal.process(text, {"video": clip})[1][0]
    assert slow.hash != plain.hash or slow.time_interval == plain.time_interval  # Qwen2-VL: no spacing
    out = _generate(llm, {"prompt": text, "multi_modal_data": {"video": (clip, {"fps": 1.0})}})
    metadata = [{"total_num_frames": 4, "fps": 1.0, "frames_indices": list(range(4))}]
    assert out == hf_generate(hf, text, [], MAX_NEW, [clip], videos_kwargs={"video_metadata": metadata})


@pytest.mark.parametrize("mm, match", [
    ({"video": [make_video(1), make_video(2), make_video(3)]}, "limit_mm_per_prompt=\\{'video': 2\\}"),
    ({"video": [make_image(1, (8, 8)), make_image(2, (16, 8))]}, "frames of sizes"),
    ({"video": (make_video(1), {"fps": 0})}, "fps=0 must be a number > 0"),
    ({"video": (make_video(1), {"speed": 2})}, "metadata has \\['speed'\\]"),
    ({"video": "clip.mp4"}, "must be a video"),
    ({"video": make_video(1), "image": {"image_embeds": torch.zeros(4, 64), "image_grid_thw": [[1, 4, 4]]}},
     "cannot mix image_embeds with a raw video"),
])
def test_bad_video_inputs_are_refused(model, mm, match):
    llm, _ = model
    with pytest.raises(ValueError, match=match):
        llm.generate([{"prompt": f"a {VIDEO} {PLACEHOLDER}", "multi_modal_data": mm}], GREEDY, use_tqdm=False)


def test_models_without_video_refuse_it(tmp_path):
    """LLaVA takes images only: a video and a limit_mm_per_prompt on videos are refused by name."""
    from pagedllm.multimodal.processor import MultiModalLimits, MultiModalProcessor
    from tests.multimodal.llava_fixtures import IMAGE_TOKENS, make_llava_dir
    path = make_llava_dir(tmp_path / "llava")
    processor = MultiModalProcessor.from_pretrained(path, 368, MultiModalLimits(), lambda data: IMAGE_TOKENS)
    with pytest.raises(ValueError, match="this model takes the modalities \\('image',\\)"):
        processor.process("a <image>", {"video": make_video(1)})
    with pytest.raises(ValueError, match="limit_mm_per_prompt has 'video'"):
        MultiModalProcessor.from_pretrained(path, 368, MultiModalLimits((("video", 1),)), lambda data: IMAGE_TOKENS)


def test_llm_chat_video_url_part(model):
    """LLM.chat: a video_url part (vLLM's data:video/jpeg frames) becomes the video placeholder."""
    llm, hf = model
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    url, frames = jpeg_frames_url(make_video(61))
    messages = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                             {"type": "text", "text": "what is this?"}]}]
    out = llm.chat(messages, GREEDY, use_tqdm=False, chat_template=template)[0]
    text = f"user: {VIDEO}\nwhat is this?\nassistant:"
    assert list(out.outputs[0].token_ids) == hf_generate(hf, text, [], MAX_NEW, [frames])


def test_max_pixels_reaches_the_frames(model):
    """mm_processor_kwargs' max_pixels (the image processor's) resizes every frame, as transformers'
    processor given it for videos does: fewer tokens, and still transformers' output."""
    llm, hf = model
    text, clip, small = f"the quick {VIDEO} brown fox", make_video(91), {"max_pixels": 24 * 24}
    tokens = [sum(item.length for item in llm.llm_engine.multimodal.process(text, {"video": clip}, kwargs)[1])
              for kwargs in (None, small)]
    assert tokens[1] < tokens[0]
    out = _generate(llm, {"prompt": text, "multi_modal_data": {"video": clip}, "mm_processor_kwargs": small})
    assert out == hf_generate(hf, text, [], MAX_NEW, [clip], videos_kwargs=small)


@pytest.mark.parametrize("kwargs", [{"num_frames": 2}, {"fps": 2.0}, {"do_sample_frames": True}])
def test_frame_sampling_options_are_refused(model, kwargs):
    """vLLM's / transformers' frame-sampling options would pick frames; every frame given is kept
    here, so they are refused by name rather than ignored."""
    llm, _ = model
    with pytest.raises(ValueError, match=f"mm_processor_kwargs has \\['{next(iter(kwargs))}'\\]: videos are not "
                                         "resampled here"):
        _generate(llm, {"prompt": f"a {VIDEO}", "multi_modal_data": {"video": make_video(1)},
                        "mm_processor_kwargs": kwargs})


def test_engine_video_options_are_checked_at_start(qwen2_vl_dir):
    """The engine's mm_processor_kwargs are refused when the processor is built (not at the first
    video); vLLM's dummy-input sizes in limit_mm_per_prompt, media loader options and video token
    pruning are refused by name; only a count is a limit."""
    from pagedllm.multimodal.processor import MultiModalLimits, MultiModalProcessor, check_limit_mm_per_prompt
    with pytest.raises(ValueError, match="mm_processor_kwargs has \\['fps'\\]: videos are not resampled"):
        MultiModalProcessor.from_pretrained(qwen2_vl_dir, 0, MultiModalLimits(processor_kwargs=(("fps", 2),)),
                                            lambda data: 1)
    assert check_limit_mm_per_prompt({"video": {"count": 3}}) == (("video", 3),)
    with pytest.raises(ValueError, match="limit_mm_per_prompt\\['video'\\] has \\['num_frames'\\]: only 'count'"):
        check_limit_mm_per_prompt({"video": {"count": 1, "num_frames": 8}})
    with pytest.raises(ValueError, match="media_io_kwargs=.* is not supported: .*32 evenly spaced frames"):
        LLM(model=qwen2_vl_dir, media_io_kwargs={"video": {"num_frames": 8}})
    with pytest.raises(ValueError, match="video_pruning_rate=0.5 is not supported: video token pruning"):
        LLM(model=qwen2_vl_dir, video_pruning_rate=0.5)

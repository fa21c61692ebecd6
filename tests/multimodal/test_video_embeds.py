"""Precomputed ``video_embeds`` (vLLM's input form for the Qwen2-VL family): transformers' own video
features given instead of the frames give transformers' output for the video (Qwen2.5-VL's temporal
spacing from ``second_per_grid_ts`` included), the vision tower never runs, the same embeddings
share prefix blocks, malformed embeddings are refused by name; and the encoder cache counts videos
(and their frames) apart from images."""
from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.multimodal import qwen2_vl_fixtures
from tests.multimodal.llava_fixtures import make_image, no_tower
from tests.multimodal.qwen2_vl_fixtures import PLACEHOLDER, VIDEO, hf_generate, load_hf, make_video

qwen2_vl_dir, qwen2_5_vl_dir = qwen2_vl_fixtures.qwen2_vl_dir, qwen2_vl_fixtures.qwen2_5_vl_dir  # fixtures

MAX_NEW = 6
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW)
LONG_TEXT = "the quick brown fox jumps over the lazy dog paged attention keeps"


@pytest.fixture(scope="module", params=["2", "2.5"])
def model(request, qwen2_vl_dir, qwen2_5_vl_dir):
    """(engine, transformers oracle, version) on Qwen2-VL, then on Qwen2.5-VL."""
    path = qwen2_vl_dir if request.param == "2" else qwen2_5_vl_dir
    engine = LLM(model=path, max_model_len=256, kv_cache_memory=2**22, max_num_batched_tokens=96, block_size=8,
                 limit_mm_per_prompt={"image": 1, "video": 2}, enable_mm_embeds=True)  # as vLLM needs it
    yield engine, load_hf(path), request.param
    engine.llm_engine.shutdown()


def _metadata(videos: list, fps: float) -> list[dict]:
    return [{"total_num_frames": len(v), "fps": fps, "frames_indices": list(range(len(v)))} for v in videos]


def _video_embeds(hf, videos: list, fps: float) -> dict:
    """transformers' video features in vLLM's flat form ([rows of every video, hidden]), with the grids
    (and Qwen2.5-VL's second_per_grid_ts)."""
    model, processor = hf
    inputs = processor(text=[VIDEO * len(videos)], videos=videos, return_tensors="pt",
                       videos_kwargs={"video_metadata": _metadata(videos, fps)})
    with torch.no_grad():
        rows = model.model.get_video_features(inputs["pixel_values_videos"], inputs["video_grid_thw"]).pooler_output
    out = {"video_embeds": torch.cat(list(rows)), "video_grid_thw": inputs["video_grid_thw"]}
    return {**out, "second_per_grid_ts": inputs["second_per_grid_ts"]} if "second_per_grid_ts" in inputs else out


def _image_embeds(hf, image) -> dict:
    model, processor = hf
    inputs = processor(text=[PLACEHOLDER], images=[image], return_tensors="pt")
    with torch.no_grad():
        rows = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output
    return {"image_embeds": list(rows), "image_grid_thw": inputs["image_grid_thw"]}


def _generate(llm, text: str, mm: dict, **extra) -> list[int]:
    out = llm.generate([{"prompt": text, "multi_modal_data": mm, **extra}], GREEDY, use_tqdm=False)[0]
    return list(out.outputs[0].token_ids)


def test_video_embeds_equal_the_videos(model, monkeypatch):
    """Two videos (3 frames: the last repeated; another size) at 1 frame per second beside an
    image: the raw frames, their embeddings and transformers agree."""
    llm, hf, version = model
    text = f"{VIDEO} paged {PLACEHOLDER} keeps {VIDEO} a block"
    image, videos = make_image(4, (30, 30)), [make_video(5, frames=3), make_video(6, frames=2, size=(16, 16))]
    expected = hf_generate(hf, text, [image], MAX_NEW, videos, videos_kwargs={"video_metadata": _metadata(videos, 1.0)})
    raw = {"image": [image], "video": [(v, {"fps": 1.0}) for v in videos]}
    assert _generate(llm, text, raw) == expected
    no_tower(llm, monkeypatch)
    mm = {"image": _image_embeds(hf, image), "video": _video_embeds(hf, videos, 1.0)}
    assert _generate(llm, text, mm) == expected
    # the same token ids and runs, and M-RoPE grids and temporal spacing (Qwen2.5-VL: 8 per temporal patch
    # at 1 fps, from second_per_grid_ts) as the frames
    layout = [(ids, [(m.offset, m.length, m.grid, m.time_interval, m.modality) for m in items])
              for ids, items in (llm.llm_engine.multimodal.process(text, data) for data in (raw, mm))]
    assert layout[0] == layout[1]
    assert {m[3] for m in layout[1][1] if m[4] == "video"} == ({1.0} if version == "2" else {8.0})


def test_video_embeds_share_prefix_blocks(model):
    """The same embeddings hit the first prompt's blocks through the video; other embeddings of the
    same shape do not (the hash is the embeddings' content)."""
    llm, hf, _ = model
    text = f"{LONG_TEXT} {VIDEO} the lazy dog jumps over"
    first, other = _video_embeds(hf, [make_video(41)], 2.0), _video_embeds(hf, [make_video(42)], 2.0)
    outs = [llm.generate([{"prompt": text, "multi_modal_data": {"video": mm}}], GREEDY, use_tqdm=False)[0]
            for mm in (first, first, other)]
    ids, video_token = outs[0].prompt_token_ids, hf[1].video_token_id
    offset, end = ids.index(video_token), ids.index(video_token) + ids.count(video_token)
    assert outs[1].num_cached_tokens >= end - end % 8 > offset and outs[2].num_cached_tokens <= offset
    assert list(outs[1].outputs[0].token_ids) == list(outs[0].outputs[0].token_ids)


def test_videos_and_images_count_apart(model):
    """A video request moves the video metrics (videos, frames) only, an image request the image ones."""
    llm, _, _ = model

    def counts() -> tuple:
        metrics = {m.name: m.value for m in llm.llm_engine.get_metrics()}
        return tuple(metrics[f"pagedllm:mm_{name}_encoded"] for name in ("images", "videos", "video_frames"))
    before = counts()
    _generate(llm, f"count {VIDEO} this", {"video": make_video(71, frames=3)})
    after_video = counts()
    _generate(llm, f"count {PLACEHOLDER} this", {"image": make_image(72)})
    after_image = counts()
    assert [a - b for a, b in zip(after_video, before)] == [0, 1, 3]
    assert [a - b for a, b in zip(after_image, after_video)] == [1, 0, 0]


def _bad(grid=((2, 4, 4),), rows=8, hidden=64, **extra) -> dict:
    return {"video": {"video_embeds": torch.zeros(rows, hidden), "video_grid_thw": torch.tensor(grid), **extra}}


@pytest.mark.parametrize("mm, match", [
    (_bad(hidden=63), "video_embeds\\[0\\] has 63 columns: this model's embeddings have hidden_size=64"),
    ({"video": {"video_embeds": torch.zeros(8, 64)}}, "video_embeds for this model need video_grid_thw"),
    (_bad(grid=((2, 4, 8),)), "video_embeds\\[0\\] has 8 rows; its video_grid_thw \\[2, 4, 8\\] makes 16"),
    (_bad(grid=((2, 4, 4),) * 2, rows=12), "video_grid_thw has 2 rows for 1 video_embeds"),
    ({"video": {"video_embeds": [torch.zeros(8, 64)] * 2, "video_grid_thw": [[2, 4, 4]] * 2}},
     "the prompt has 1 video placeholders and 2 video_embeds"),
    ({"video": {"video_embeds": [torch.zeros(8, 64)] * 3, "video_grid_thw": [[2, 4, 4]] * 3}},
     "the prompt has 3 videos, over limit_mm_per_prompt=\\{'video': 2\\}"),
    (_bad(grid=((2, 0, 4),)), "video_grid_thw must be one \\[t, h, w\\] row of positive integers per video"),
    ({"video": {"video_embeds": torch.zeros(8, 64, dtype=torch.int64), "video_grid_thw": [[2, 4, 4]]}},
     "floating-point"),
    ({"video": {"pixels": torch.zeros(8, 64)}}, "takes the keys \\('video_embeds', 'video_grid_thw'"),
    ({**_bad(), "image": make_image(1)}, "cannot mix video_embeds with a raw image"),
])
def test_bad_video_embeds_are_refused(model, mm, match):
    llm, _, _ = model
    with pytest.raises(ValueError, match=match):
        _generate(llm, f"a {VIDEO} {PLACEHOLDER}" if "image" in mm else f"a {VIDEO}", mm)


def test_second_per_grid_ts_is_qwen2_5_vl_only(model):
    """Qwen2.5-VL reads second_per_grid_ts (one number > 0 per video); Qwen2-VL, whose positions do
    not use it, refuses it rather than ignore it; processor options cannot apply to embeddings."""
    llm, _, version = model
    if version == "2":
        with pytest.raises(ValueError, match="takes the keys \\('video_embeds', 'video_grid_thw'\\)"):
            _generate(llm, f"a {VIDEO}", _bad(second_per_grid_ts=[2.0]))
    else:
        for bad in ([2.0, 1.0], [0.0], "fast"):
            with pytest.raises(ValueError, match="second_per_grid_ts=.* must be one number > 0 per video"):
                _generate(llm, f"a {VIDEO}", _bad(second_per_grid_ts=bad))
    with pytest.raises(ValueError, match="cannot apply to video_embeds"):
        _generate(llm, f"a {VIDEO}", _bad(), mm_processor_kwargs={"max_pixels": 1024})


def test_chat_has_no_video_embeds_part(model):
    """vLLM's chat API has no video_embeds content part, so LLM.chat refuses one by name."""
    llm, _, _ = model
    parts = [{"type": "video_embeds", "video_embeds": torch.zeros(8, 64)}, {"type": "text", "text": "what?"}]
    with pytest.raises(ValueError, match="has a 'video_embeds' part"):
        llm.chat([{"role": "user", "content": parts}], GREEDY, use_tqdm=False,
                 chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")

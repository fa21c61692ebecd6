"""Precomputed ``image_embeds`` (vLLM's input form) for LLaVA and Qwen2-VL: transformers' own
image features given instead of the image give transformers' output for the image, the vision
tower never runs, and malformed embeddings are refused by name."""
from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams
from tests.multimodal import llava_fixtures, qwen2_vl_fixtures
from tests.multimodal.llava_fixtures import make_image, no_tower
from tests.multimodal.qwen2_vl_fixtures import PLACEHOLDER, load_hf

llava_dir, llava_hf = llava_fixtures.llava_dir, llava_fixtures.llava_hf  # fixtures
qwen2_vl_dir = qwen2_vl_fixtures.qwen2_vl_dir

MAX_NEW = 6
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW)


def _features(out) -> torch.Tensor:
    return out.pooler_output if hasattr(out, "pooler_output") else out


@pytest.fixture(scope="module")
def qwen(qwen2_vl_dir):
    engine = LLM(model=qwen2_vl_dir, max_model_len=256, kv_cache_memory=2**22, max_num_batched_tokens=64,
                 block_size=8, limit_mm_per_prompt={"image": 2})
    yield engine, load_hf(qwen2_vl_dir)
    engine.llm_engine.shutdown()


def _qwen_embeds(hf, images):
    model, processor = hf
    inputs = processor(text=[PLACEHOLDER * len(images)], images=images, return_tensors="pt")
    with torch.no_grad():
        rows = _features(model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]))
    return list(rows), inputs["image_grid_thw"]


def test_qwen2_vl_embeds_equal_the_images(qwen, monkeypatch):
    llm, hf = qwen
    images = [make_image(1), make_image(2, (30, 60))]
    text = f"the quick {PLACEHOLDER} brown {PLACEHOLDER} fox"
    expected = qwen2_vl_fixtures.hf_generate(hf, text, images, MAX_NEW)
    rows, grids = _qwen_embeds(hf, images)
    no_tower(llm, monkeypatch)
    mm = {"image": {"image_embeds": rows, "image_grid_thw": grids}}
    out = llm.generate([{"prompt": text, "multi_modal_data": mm}], GREEDY, use_tqdm=False)[0]
    assert list(out.outputs[0].token_ids) == expected

    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    parts = [{"type": "image_embeds", "image_embeds": {"image_embeds": rows[0], "image_grid_thw": grids[0]}},
             {"type": "text", "text": "what is this?"}]
    chat = llm.chat([{"role": "user", "content": parts}], GREEDY, use_tqdm=False, chat_template=template)[0]
    chat_text = f"user: {PLACEHOLDER}\nwhat is this?\nassistant:"
    assert list(chat.outputs[0].token_ids) == qwen2_vl_fixtures.hf_generate(hf, chat_text, images[:1], MAX_NEW)


def test_llava_embeds_equal_the_image(llava_dir, llava_hf, monkeypatch):
    model, processor = llava_hf
    image, text = make_image(3), "the quick <image> brown fox"
    inputs = processor(text=text, images=[image], return_tensors="pt")
    with torch.no_grad():
        rows = _features(model.model.get_image_features(inputs["pixel_values"],
                                                        vision_feature_layer=model.config.vision_feature_layer,
                                                        vision_feature_select_strategy="default"))
    rows = torch.stack(list(rows)) if isinstance(rows, (list, tuple)) else rows  # [1, 25, hidden]
    llm = LLM(model=llava_dir, max_model_len=128, kv_cache_memory=2**22, max_num_batched_tokens=32, block_size=8)
    try:
        no_tower(llm, monkeypatch)
        out = llm.generate([{"prompt": text, "multi_modal_data": {"image": {"image_embeds": rows}}}], GREEDY,
                           use_tqdm=False)[0]
        assert list(out.outputs[0].token_ids) == llava_fixtures.hf_generate(llava_hf, text, [image], MAX_NEW)
        with pytest.raises(ValueError, match="image_grid_thw is for M-RoPE models"):
            llm.generate([{"prompt": text, "multi_modal_data": {"image": {"image_embeds": rows, "image_grid_thw":
                                                                          [[1, 2, 2]]}}}], GREEDY, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("image, match", [
    ({"image_embeds": torch.zeros(4, 63), "image_grid_thw": [[1, 4, 4]]}, "hidden_size=64"),
    ({"image_embeds": torch.zeros(4, 64)}, "need image_grid_thw"),
    ({"image_embeds": torch.zeros(4, 64), "image_grid_thw": [[1, 4, 8]]}, "its image_grid_thw .* makes 8"),
    ({"image_embeds": torch.zeros(4, 64, dtype=torch.int64), "image_grid_thw": [[1, 4, 4]]}, "floating-point"),
    ({"image_embeds": [torch.zeros(4, 64)] * 2, "image_grid_thw": [[1, 4, 4]] * 2}, "2 image_embeds"),
    ({"image_embeds": torch.zeros(4, 64), "image_grid_thw": [[0, 4, 4]]}, "positive integers"),
    ({"pixels": torch.zeros(4, 64)}, "takes the keys"),
])
def test_bad_embeds_are_refused(qwen, image, match):
    llm, _ = qwen
    with pytest.raises(ValueError, match=match):
        llm.generate([{"prompt": f"a {PLACEHOLDER} b", "multi_modal_data": {"image": image}}], GREEDY,
                     use_tqdm=False)


def test_processor_kwargs_do_not_apply_to_embeds(qwen):
    llm, _ = qwen
    mm = {"image": {"image_embeds": torch.zeros(4, 64), "image_grid_thw": [[1, 4, 4]]}}
    with pytest.raises(ValueError, match="cannot apply to image_embeds"):
        llm.generate([{"prompt": f"a {PLACEHOLDER}", "multi_modal_data": mm, "mm_processor_kwargs": {"max_pixels": 1}}],
                     GREEDY, use_tqdm=False)

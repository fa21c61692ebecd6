"""A tiny random-weight LLaVA (CLIP vision tower + projector + Llama) built with transformers,
with its processor (CLIP image processor + the test tokenizer with an ``<image>`` token)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import _config, _tokenizer

IMAGE_TOKENS = 25  # (30 / 6)^2 patches; the CLS row is dropped ("default" strategy)


def _parts():
    """The test tokenizer with an ``<image>`` token, a tiny CLIP tower config and a Llama text config."""
    import transformers as tf
    tok = _tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    vision = tf.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                 image_size=30, patch_size=6, projection_dim=32)
    text = _config("llama")
    text.initializer_range = 0.05
    return tok, dict(vision_config=vision, text_config=text, projector_hidden_act="gelu",
                     image_token_index=tok.convert_tokens_to_ids("<image>"))


def _save(model, processor_cls, image_processor, tok, path) -> str:
    model.save_pretrained(path)
    processor_cls(image_processor=image_processor, tokenizer=tok, patch_size=6, num_additional_image_tokens=1,
                  vision_feature_select_strategy="default", image_token="<image>").save_pretrained(path)
    return str(path)


def make_llava_dir(path, seed: int = 0) -> str:
    import transformers as tf
    tok, fields = _parts()
    cfg = tf.LlavaConfig(**fields)
    cfg.initializer_range = 0.05
    torch.manual_seed(seed)
    image_processor = tf.CLIPImageProcessor(size={"shortest_edge": 30}, crop_size={"height": 30, "width": 30})
    return _save(tf.LlavaForConditionalGeneration(cfg), tf.LlavaProcessor, image_processor, tok, path)


PINPOINTS = [[30, 30], [30, 60], [60, 30], [60, 60]]


def make_llava_next_dir(path, seed: int = 0) -> str:
    """LLaVA-NeXT: 30-pixel tiles, grids up to 2x2 (an image takes 25 base rows + its unpadded grid)."""
    import transformers as tf
    tok, fields = _parts()
    cfg = tf.LlavaNextConfig(**fields, image_grid_pinpoints=PINPOINTS)
    cfg.initializer_range = 0.05
    torch.manual_seed(seed)
    model = tf.LlavaNextForConditionalGeneration(cfg)
    with torch.no_grad():  # transformers leaves it near zero; random, the newline rows matter
        model.model.image_newline.normal_(0, 0.05)
    image_processor = tf.LlavaNextImageProcessor(size={"shortest_edge": 30}, crop_size={"height": 30, "width": 30},
                                                 image_grid_pinpoints=PINPOINTS)
    return _save(model, tf.LlavaNextProcessor, image_processor, tok, path)


def chunks_seen(llm, monkeypatch) -> list:
    """Every ScheduledChunk the scheduler hands out from now on."""
    seen, scheduler = [], llm.llm_engine.scheduler
    original = scheduler.schedule

    def spy():
        out = original()
        seen.extend(out.chunks)
        return out
    monkeypatch.setattr(scheduler, "schedule", spy)
    return seen


def no_tower(llm, monkeypatch) -> None:
    """Makes the vision tower fail the test if it runs (precomputed embeddings must skip it)."""
    def refuse(data):
        raise AssertionError("the vision tower ran for precomputed embeddings")
    monkeypatch.setattr(llm.llm_engine.executor.runner.model, "encode_pixels", refuse)


def make_image(seed: int, size: tuple[int, int] = (40, 50)) -> Image.Image:
    """A random RGB image (height, width)."""
    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (*size, 3), dtype=np.uint8))


@pytest.fixture(scope="session")
def llava_dir(tmp_path_factory):
    return make_llava_dir(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="session")
def llava_hf(llava_dir):
    """transformers' model and processor on the same checkpoint (the oracle)."""
    import transformers as tf
    return (tf.LlavaForConditionalGeneration.from_pretrained(llava_dir, dtype=torch.float32).eval(),
            tf.AutoProcessor.from_pretrained(llava_dir))


def hf_generate(llava_hf, prompt: str, images: list, max_new_tokens: int) -> list[int]:
    model, processor = llava_hf
    inputs = processor(text=prompt, images=images or None, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()

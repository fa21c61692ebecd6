"""Tiny random-weight Qwen2-VL and Qwen2.5-VL checkpoints (vision tower with temporal patches,
2x2 patch merger, M-RoPE language model) built with transformers, with their processors (the
Qwen2-VL image processor + the test tokenizer with the vision special tokens)."""
from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch
from PIL import Image

from pagedllm.multimodal.processor import image_only_processor, load_hf_processor
from tests.conftest import _tokenizer

PATCH, MERGE = 4, 2  # a token covers 8x8 pixels
MIN_PIXELS, MAX_PIXELS = 16 * 16, 48 * 48  # images resize to 2x2 .. 6x6 tokens
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"


def _tok():
    tok = _tokenizer()
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    return tok


def _text_fields(tok) -> dict:
    return dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                initializer_range=0.05, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)


def _ids(tok) -> dict:
    names = ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id")
    return {name: tok.convert_tokens_to_ids(t) for name, t in zip(names, VISION_TOKENS)}


def make_qwen2_vl_dir(path, version: str = "2", seed: int = 0, tied: bool = False) -> str:
    """``version``: "2" (Qwen2-VL) or "2.5" (Qwen2.5-VL: window attention + full-attention layers);
    ``tied``: the LM head is the embedding (as Qwen2-VL-2B), saved once."""
    import transformers as tf
    tok = _tok()
    if version == "2":
        vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=PATCH,
                      spatial_merge_size=MERGE, temporal_patch_size=2, in_channels=3, initializer_range=0.05)
        cfg = tf.Qwen2VLConfig(text_config=_text_fields(tok), vision_config=vision, tie_word_embeddings=tied,
                               **_ids(tok))
        model_cls = tf.Qwen2VLForConditionalGeneration
    else:
        vision = dict(depth=3, hidden_size=32, intermediate_size=64, out_hidden_size=64, num_heads=2,
                      patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=2, in_channels=3,
                      window_size=16, fullatt_block_indexes=[1], initializer_range=0.05)
        cfg = tf.Qwen2_5_VLConfig(text_config=_text_fields(tok), vision_config=vision, **_ids(tok))
        model_cls = tf.Qwen2_5_VLForConditionalGeneration
    cfg.initializer_range = 0.05
    torch.manual_seed(seed)
    model_cls(cfg).save_pretrained(path)
    image_processor = tf.Qwen2VLImageProcessorPil(patch_size=PATCH, merge_size=MERGE, temporal_patch_size=2,
                                               min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    processor_cls = tf.Qwen2VLProcessor if version == "2" else tf.Qwen2_5_VLProcessor
    # saved as processor_class Qwen2VLProcessor, like a released checkpoint (with no video processor:
    # transformers builds one only with torchvision)
    image_only_processor(processor_cls)(image_processor=image_processor, tokenizer=tok).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def qwen2_vl_dir(tmp_path_factory):
    return make_qwen2_vl_dir(tmp_path_factory.mktemp("qwen2_vl"), "2")


@pytest.fixture(scope="session")
def qwen2_5_vl_dir(tmp_path_factory):
    return make_qwen2_vl_dir(tmp_path_factory.mktemp("qwen2_5_vl"), "2.5")


def load_hf(path: str):
    """transformers' model and processor on the same checkpoint (the oracle)."""
    import transformers as tf
    return (tf.AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval(),
            load_hf_processor(path))


def make_video(seed: int, frames: int = 4, size: tuple[int, int] = (40, 32)) -> np.ndarray:
    """A random RGB clip ``[frames, height, width, 3]`` (uint8)."""
    return np.random.RandomState(seed).randint(0, 256, (frames, *size, 3), dtype=np.uint8)


def jpeg_frames_url(clip: np.ndarray) -> tuple[str, list]:
    """vLLM's frames URL and the frames as the server will decode them."""
    payloads = []
    for frame in clip:
        buf = io.BytesIO()
        Image.fromarray(frame).save(buf, format="JPEG")
        payloads.append(base64.b64encode(buf.getvalue()).decode())
    return "data:video/jpeg;base64," + ",".join(payloads), [
        np.asarray(Image.open(io.BytesIO(base64.b64decode(p))).convert("RGB")) for p in payloads]


def hf_generate(hf, prompt: str, images: list, max_new_tokens: int, videos: list | None = None,
                **processor_kwargs) -> list[int]:
    model, processor = hf
    inputs = processor(text=[prompt], images=images or None, videos=videos or None, return_tensors="pt",
                       **processor_kwargs)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()

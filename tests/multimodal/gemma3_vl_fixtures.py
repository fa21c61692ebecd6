"""A tiny random-weight Gemma 3 with images (SigLIP tower + pooling projector + Gemma 3 text, with
sliding-window layers), with its processor (Gemma 3 image processor + the test tokenizer with
``<start_of_image>`` / ``<image_soft_token>`` / ``<end_of_image>`` tokens)."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import _config, _tokenizer

IMAGE_TOKENS = 4  # mm_tokens_per_image: the 4x4 patch grid pooled 2x2 (a run longer than the window, 3)
SPECIALS = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"}


def make_gemma3_vl_dir(path, seed: int = 0, sliding_window: int = 3) -> str:
    import transformers as tf
    base = _tokenizer()  # named extra special tokens: the processor reads tokenizer.boi_token etc.
    tok = tf.PreTrainedTokenizerFast(tokenizer_object=base.backend_tokenizer, bos_token="<s>", eos_token="</s>",
                                     pad_token="<pad>", extra_special_tokens=SPECIALS)
    ids = {k: tok.convert_tokens_to_ids(v) for k, v in SPECIALS.items()}
    text = _config("gemma3", sliding_window=sliding_window, layer_types=["sliding_attention", "full_attention"],
                   final_logit_softcapping=None)
    text.initializer_range = 0.05
    vision = tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                   image_size=32, patch_size=8)
    cfg = tf.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=IMAGE_TOKENS,
                          boi_token_index=ids["boi_token"], eoi_token_index=ids["eoi_token"],
                          image_token_index=ids["image_token"])
    cfg.initializer_range = 0.05
    torch.manual_seed(seed)
    model = tf.Gemma3ForConditionalGeneration(cfg)
    with torch.no_grad():  # transformers initialises it to zeros: random, the images reach the logits
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 0.2)
    model.save_pretrained(path)
    image_processor = tf.Gemma3ImageProcessorPil(size={"height": 32, "width": 32})
    processor = tf.Gemma3Processor(image_processor=image_processor, tokenizer=tok, image_seq_length=IMAGE_TOKENS)
    processor.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def gemma3_vl_dir(tmp_path_factory):
    return make_gemma3_vl_dir(tmp_path_factory.mktemp("gemma3_vl"))


@pytest.fixture(scope="session")
def gemma3_vl_hf(gemma3_vl_dir):
    import transformers as tf
    return (tf.Gemma3ForConditionalGeneration.from_pretrained(gemma3_vl_dir, dtype=torch.float32).eval(),
            tf.AutoProcessor.from_pretrained(gemma3_vl_dir))

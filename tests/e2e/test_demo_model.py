"""The bundled demo model: loads from package data with no arguments and writes English."""
from __future__ import annotations

import re

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.models.loader import demo_model_path

PROMPT = "In the beginning God created"
PINNED = [260, 621, 13, 269, 260, 344, 460, 545, 260, 344, 15, 301, 260, 344, 393, 324]


@pytest.fixture(scope="module")
def demo():
    return LLM()  # no model given: the bundled demo model


def test_demo_greedy_output_is_pinned(demo):
    out = demo.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == PINNED
    assert out.outputs[0].text.startswith(" the earth")


def test_demo_matches_transformers(demo):
    import transformers as tf
    hf = tf.AutoModelForCausalLM.from_pretrained(demo_model_path(), dtype=torch.float32).eval()
    ids = demo.get_tokenizer().encode(PROMPT)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):].tolist()
    assert ref == PINNED


def test_demo_writes_words(demo):
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=0, max_tokens=60)
    text = demo.generate(["And God said"], params, use_tqdm=False)[0].outputs[0].text
    words = re.findall(r"[A-Za-z']+", text)
    common = {"the", "and", "of", "unto", "lord", "he", "i", "shall", "thy", "that", "to", "his", "in", "god"}
    assert len(words) >= 25
    assert sum(w.lower() in common for w in words) >= 8, text


def test_named_demo_model(demo):
    assert LLM("pagedllm-demo", num_gpu_blocks_override=128).get_kv_cache_stats().num_blocks == 128

"""Llama 4 text (models/llama4.py) against transformers on a tiny random checkpoint.

The config (conftest.FAMILY_CONFIGS["llama4"], 4 layers): layers 0-2 use RoPE (llama3-scaled,
interleaved pairs) with the L2 q/k norm and chunked local attention in chunks of 16 positions,
layer 3 is NoPE, global and temperature-tuned (floor_scale 8, so the scale moves from position 7
on); layers 1 and 3 are MoE (4 experts, top-1 sigmoid routing on the expert input, a shared
expert), 0 and 2 dense MLPs of another width. The prompts (test_families.PROMPTS) run to 111
tokens, so prefill chunks and decodes cross chunk boundaries. Checked: greedy tokens and
logprobs at block sizes 8 (chunked prefill, prefix hits) and 16, preemption by recompute and by
swap, two tensor-parallel ranks, and a Llama4ForConditionalGeneration checkpoint run text-only.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from conftest import make_model_dir
from test_families import PROMPTS, SHARED, _assert_logprobs_match, _generate, hf_greedy

from pagedllm import LLM

CHUNK = 16


@pytest.fixture(scope="module")
def llama4(tmp_path_factory):
    import transformers as tf
    path = make_model_dir(tmp_path_factory.mktemp("llama4"), "llama4", num_hidden_layers=4)
    hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert hf.config.layer_types == ["chunked_attention"] * 3 + ["full_attention"]
    assert hf.config.moe_layers == [1, 3] and max(map(len, PROMPTS)) > 6 * CHUNK
    return path, hf, [hf_greedy(hf, p, 8) for p in PROMPTS]


def test_chunked_prefill_with_prefix_hits_matches_transformers(llama4):
    path, hf, refs = llama4
    llm = LLM(path, block_size=8, max_num_batched_tokens=32, num_gpu_blocks_override=400)
    _generate(llm, [SHARED + [7]])  # caches the shared prefix's blocks
    outs = _generate(llm, PROMPTS)
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert llm.get_kv_cache_stats().prefix_cache_hits >= 8 * len(SHARED)
    _assert_logprobs_match(hf, PROMPTS[-6:], outs[-6:])


@pytest.mark.parametrize("backend", ["auto", "sdpa", "torch"])
def test_block_size_16_matches_transformers(llama4, backend):
    """Every CPU backend chunks the attention itself (the C kernel under "auto")."""
    path, _, refs = llama4
    llm = LLM(path, block_size=16, num_gpu_blocks_override=400, attention_backend=backend)
    assert [o.outputs[0].token_ids for o in _generate(llm, PROMPTS)] == refs


def test_the_chunks_and_the_temperature_matter(llama4):
    """Without chunking, or without the NoPE layer's temperature, transformers' own model scores the
    longest prompt differently: the checks above would see a backend that ignored either."""
    import transformers as tf
    path, hf, _ = llama4
    prompt = torch.tensor([PROMPTS[-1]])
    with torch.no_grad():
        ref = hf(prompt).logits
        for change in (dict(layer_types=["full_attention"] * 4), dict(attn_temperature_tuning=False)):
            other = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **change).eval()
            assert (other(prompt).logits - ref).abs().max() > 1e-2, change


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_outputs(llama4, mode):
    path, _, refs = llama4
    tight = LLM(path, block_size=8, num_gpu_blocks_override=24, max_model_len=128, preemption_mode=mode,
                watermark=0.0, swap_space=0.01)
    assert [o.outputs[0].token_ids for o in _generate(tight, PROMPTS)] == refs
    assert tight.get_kv_cache_stats().preemptions_by_mode[mode] > 0


def test_tensor_parallel_matches_transformers(llama4):
    """Two ranks: half the heads each, half of every expert, the shared expert and the dense MLPs."""
    path, hf, refs = llama4
    llm = LLM(path, tensor_parallel_size=2, num_threads=1, block_size=8, num_gpu_blocks_override=200)
    try:
        outs = _generate(llm, PROMPTS[-6:])
    finally:
        llm.llm_engine.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == refs[-6:]
    _assert_logprobs_match(hf, PROMPTS[-6:], outs)


def _conditional_generation_dir(text_dir: str, path: Path) -> str:
    """The text checkpoint as a Llama4ForConditionalGeneration one: its tensors under
    ``language_model.*`` as the hub checkpoints name them, plus vision tensors, in a Llama4Config."""
    import shutil

    import transformers as tf
    from safetensors.torch import load_file, save_file
    shutil.copytree(text_dir, path)
    text = tf.AutoConfig.from_pretrained(text_dir)
    cfg = tf.Llama4Config(text_config=text.to_dict())
    cfg.architectures = ["Llama4ForConditionalGeneration"]
    cfg.save_pretrained(path)
    tensors = {f"language_model.{name}": t for name, t in load_file(f"{text_dir}/model.safetensors").items()}
    tensors["vision_model.patch_embedding.linear.weight"] = torch.zeros(8, 8)
    tensors["multi_modal_projector.linear_1.weight"] = torch.zeros(8, 8)
    save_file(tensors, f"{path}/model.safetensors", metadata={"format": "pt"})
    assert json.loads((path / "config.json").read_text())["architectures"] == ["Llama4ForConditionalGeneration"]
    return str(path)


def test_conditional_generation_checkpoint_runs_text_only(llama4, tmp_path, caplog):
    path, _, refs = llama4
    vlm = _conditional_generation_dir(path, tmp_path / "vlm")
    with caplog.at_level(logging.INFO, logger="pagedllm.models.llama4"):
        llm = LLM(vlm, block_size=8, num_gpu_blocks_override=200)
    assert "runs text-only: skipping the vision tower and projector weights" in caplog.text
    assert [o.outputs[0].token_ids for o in _generate(llm, PROMPTS[:4])] == refs[:4]
    image = {"prompt": "describe <image>", "multi_modal_data": {"image": [torch.zeros(3, 8, 8)]}}
    with pytest.raises(ValueError, match=r"multi_modal_data.*\(this is a text-only model\)"):
        llm.generate([image], use_tqdm=False)

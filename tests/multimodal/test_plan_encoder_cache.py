"""``pagedllm plan`` on a vision-language config: the encoder cache (max_num_batched_tokens rows of
the language model's width) is counted and taken from the KV budget; a text model has none."""
from __future__ import annotations

import json

import pytest

from pagedllm.entrypoints.plan import format_plan, main, plan_kv
from tests.multimodal import qwen2_vl_fixtures

qwen2_vl_dir = qwen2_vl_fixtures.qwen2_vl_dir  # fixture


def test_encoder_cache_is_counted(qwen2_vl_dir, capsys):
    config = json.loads(open(f"{qwen2_vl_dir}/config.json").read())
    plan = plan_kv(config, gpu_memory=2**30, device="cpu", max_num_batched_tokens=1000)
    assert plan.encoder_cache_bytes == 1000 * 64 * 4  # rows x hidden x float32
    text = {key: value for key, value in config.items() if key != "vision_config"}
    text_only = plan_kv(text, gpu_memory=2**30, device="cpu", max_num_batched_tokens=1000)
    assert text_only.encoder_cache_bytes == 0 and text_only.kv_budget - plan.kv_budget == 1000 * 64 * 4
    assert "encoder cache (1000 image rows)" in format_plan(plan)
    assert plan_kv(config, gpu_memory=2**30, device="cpu").max_num_batched_tokens == 2048  # the engine's default
    assert main(["--model", qwen2_vl_dir, "--gpu-memory", "1GiB", "--device", "cpu", "--max-num-batched-tokens",
                 "512", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["encoder_cache_bytes"] == 512 * 64 * 4
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        plan_kv(config, gpu_memory=2**30, device="cpu", max_num_batched_tokens=-1)

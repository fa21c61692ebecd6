"""`pagedllm plan --enable-lora`: the adapter slots' bytes are those the engine allocates (the same
tiny model's LoRAModel), they come out of the KV budget, and the LoRA flags without --enable-lora
are refused by name."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import make_model_dir

from pagedllm import LLM
from pagedllm.config import LoRAConfig
from pagedllm.entrypoints import plan as plan_mod
from pagedllm.entrypoints.plan import lora_adapter_bytes, model_shape, plan_kv


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_slot_bytes_equal_the_engines(tmp_path, arch):
    base = make_model_dir(tmp_path, arch)
    config = json.loads(Path(base, "config.json").read_text())
    with LLM(base, enable_lora=True, max_loras=3, max_lora_rank=8, num_gpu_blocks_override=16, max_model_len=64,
             block_size=8) as llm:
        allocated = llm.llm_engine.executor.runner.lora.nbytes
    assert allocated == 3 * lora_adapter_bytes(model_shape(config), 8, 4)  # float32 slots on the CPU
    planned = plan_kv(config, gpu_memory=2**30, device="cpu", lora=LoRAConfig(max_loras=3, max_lora_rank=8))
    assert planned.lora_bytes == allocated


def test_slots_come_out_of_the_kv_budget(tmp_path):
    config = json.loads(Path(make_model_dir(tmp_path), "config.json").read_text())
    without = plan_kv(config, gpu_memory=2**30)
    lora = LoRAConfig(max_loras=4, max_lora_rank=16, max_cpu_loras=10, lora_dtype="float32")
    with_lora = plan_kv(config, gpu_memory=2**30, lora=lora)
    one = lora_adapter_bytes(model_shape(config), 16, 4)
    assert with_lora.kv_budget == without.kv_budget - 4 * one
    assert (with_lora.lora_bytes, with_lora.lora_host_bytes) == (4 * one, 10 * one)
    assert "LoRA slots (4 x rank 16)" in plan_mod.format_plan(with_lora)


def test_plan_cli_lora_flags(tmp_path, capsys):
    base = make_model_dir(tmp_path)
    assert plan_mod.main(["--model", base, "--gpu-memory", "1GiB", "--enable-lora", "--max-loras", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["lora"]["max_loras"] == 2 and out["lora_bytes"] > 0
    assert plan_mod.main(["--model", base, "--max-loras", "2"]) == 2
    assert "--max-loras=2 applies only with --enable-lora" in capsys.readouterr().err
    assert plan_mod.main(["--model", base, "--enable-lora", "--max-loras", "4", "--max-cpu-loras", "2"]) == 2
    assert "max_cpu_loras=2 must be an integer >= max_loras=4" in capsys.readouterr().err

"""Tests for the KV memory planner (pagedllm plan) and utils.parse_size."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedllm.entrypoints import plan as plan_mod
from pagedllm.entrypoints.plan import ConfigError, count_params, load_config, model_shape, plan_kv
from pagedllm.utils import format_size, parse_size

MiB, GiB = 2**20, 2**30
REPO_ROOT = Path(__file__).resolve().parents[2]

# meta-llama/Llama-2-7b-hf config.json (the fields that matter).
LLAMA2_7B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 11008, "max_position_embeddings": 4096,
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
    "rms_norm_eps": 1e-05, "tie_word_embeddings": False, "torch_dtype": "float16", "vocab_size": 32000,
}

# Synthetic GQA model: explicit head_dim (128) differs from hidden/heads (64).
GQA = {
    "model_type": "llama", "hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 2,
    "head_dim": 128, "num_hidden_layers": 4, "intermediate_size": 1024, "vocab_size": 1000,
    "max_position_embeddings": 1024, "torch_dtype": "bfloat16",
}


# --------------------------------------------------------------------------- parse_size


@pytest.mark.parametrize("text,expected", [
    ("80GiB", 80 * GiB), ("4GB", 4 * 10**9), ("512MiB", 512 * MiB), ("1e9", 10**9),
    (12345, 12345), ("4096", 4096), ("1.5 GiB", 3 * GiB // 2), ("16g", 16 * GiB), ("2kb", 2000),
])
def test_parse_size_accepts(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["lots", "", "GiB", "-1GB", "1.5", "12 parsecs", -5, True, None])
def test_parse_size_rejects_and_names_value(bad):
    with pytest.raises(ValueError) as info:
        parse_size(bad)
    assert repr(bad) in str(info.value)


def test_format_size():
    assert format_size(512 * 1024) == "512.00 KiB"
    assert format_size(GiB) == "1.00 GiB"
    assert format_size(100) == "100 B"


# --------------------------------------------------------------------------- arithmetic


def test_llama2_7b_kv_sizes():
    p = plan_kv(LLAMA2_7B, gpu_memory=80 * GiB, max_model_len=2048, block_size=16, dtype="auto", mean_len=1024)
    assert p.dtype == "float16"
    assert p.kv_bytes_per_token == MiB // 2  # exactly 0.5 MiB / token
    assert p.kv_bytes_per_seq == GiB  # exactly 1 GiB per 2048-token sequence
    assert p.kv_bytes_per_block == 8 * MiB


def test_llama2_7b_param_count_matches_published():
    n = count_params(model_shape(LLAMA2_7B))
    assert n == 6_738_415_616  # the number transformers reports for Llama-2-7b-hf


def test_gqa_hand_computed():
    p = plan_kv(GQA, gpu_memory=GiB, gpu_memory_utilization=0.5, block_size=16, mean_len=100)
    per_token = 2 * 4 * 2 * 128 * 2  # K+V * layers * kv_heads * head_dim * bf16 bytes
    assert p.kv_bytes_per_token == per_token == 4096
    assert p.max_model_len == 1024  # from max_position_embeddings
    assert p.kv_bytes_per_seq == per_token * 1024 == 4 * MiB
    assert p.kv_bytes_per_block == per_token * 16
    attn = 512 * 8 * 128 * 2 + 512 * 2 * 128 * 2  # q,o + k,v
    mlp = 3 * 512 * 1024
    params = 4 * (attn + mlp + 2 * 512) + 512 + 2 * 1000 * 512  # layers + final norm + embed/lm_head
    assert p.num_params == params == 12_562_944
    assert p.weights_bytes == params * 2 and p.weights_estimated
    budget = GiB // 2 - params * 2
    assert p.kv_budget == budget
    assert p.num_blocks == budget // (per_token * 16) == 7808
    assert p.max_seqs_contiguous == budget // (4 * MiB) == 122
    assert p.blocks_per_mean_seq == 100 / 16 + 0.5
    assert p.mean_seqs_paged == int(7808 // 6.75) == 1156


def test_int8_weights_and_half_kv_hand_computed():
    p = plan_kv(GQA, gpu_memory=GiB, dtype="float32", quantization="int8", kv_cache_dtype="float16",
                block_size=16, mean_len=100)
    proj = 4 * (512 * 8 * 128 * 2 + 512 * 2 * 128 * 2 + 3 * 512 * 1024)  # layers x (attention + MLP)
    rest = 12_562_944 - proj  # embeddings, lm_head, norms stay float32
    assert p.weights_bytes == rest * 4 + proj * 1 + 4 * proj // 512  # + a float32 scale per output row
    assert p.kv_bytes_per_token == 2 * 4 * 2 * 128 * 2  # float16 K/V although the weights are float32
    with pytest.raises(ValueError, match="quantization"):
        plan_kv(GQA, gpu_memory=GiB, quantization="fp4")


def test_int4_and_quantized_checkpoint_weights_hand_computed():
    proj = 4 * (512 * 8 * 128 * 2 + 512 * 2 * 128 * 2 + 3 * 512 * 1024)
    rest = 12_562_944 - proj
    int4 = plan_kv(GQA, gpu_memory=GiB, dtype="float32", quantization="int4")
    assert int4.weights_bytes == rest * 4 + proj // 2 + 8 * proj // 128  # float32 scale + zero per 128
    gptq = {**GQA, "quantization_config": {"quant_method": "gptq", "bits": 8, "group_size": 64}}
    p = plan_kv(gptq, gpu_memory=GiB, dtype="float32")  # read from the config, no flag needed
    assert p.quantization == "gptq" and p.weights_bytes == rest * 4 + proj + 8 * proj // 64
    with pytest.raises(ValueError, match="quantized with 'gptq'"):
        plan_kv(gptq, gpu_memory=GiB, quantization="int4")


def test_overrides_and_defaults():
    cfg = {**GQA, "num_key_value_heads": None, "head_dim": None}  # MHA, head_dim = hidden/heads
    p = plan_kv(cfg, gpu_memory=GiB, dtype="float32", weights_bytes=0)
    assert (p.shape.num_kv_heads, p.shape.head_dim) == (8, 64)
    assert p.kv_bytes_per_token == 2 * 4 * 8 * 64 * 4
    assert p.mean_len == 512 and not p.weights_estimated
    assert p.kv_budget == int(GiB * 0.9)


def test_gpt2_style_and_multimodal_configs():
    gpt2 = {"model_type": "gpt2", "n_embd": 768, "n_head": 12, "n_layer": 12, "n_positions": 1024,
            "vocab_size": 50257}
    s = model_shape(gpt2)
    assert s.tie_word_embeddings and not s.gated_mlp and s.intermediate_size == 3072
    assert count_params(s) == pytest.approx(124_439_808, rel=0.002)  # biases ignored
    wrapped = {"model_type": "llava", "text_config": dict(GQA)}
    assert model_shape(wrapped).num_kv_heads == 2


def test_weights_too_large_gives_zero_blocks():
    p = plan_kv(LLAMA2_7B, gpu_memory=8 * GiB)
    assert p.kv_budget < 0 and p.num_blocks == 0 and p.mean_seqs_paged == 0 and p.notes


@pytest.mark.parametrize("kwargs,word", [
    ({"block_size": 7}, "block_size"), ({"mean_len": 5000}, "mean_len"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"), ({"dtype": "int3"}, "dtype"),
])
def test_plan_kv_rejects(kwargs, word):
    with pytest.raises(ValueError, match=word):
        plan_kv(LLAMA2_7B, **{"gpu_memory": 80 * GiB, **kwargs})


# --------------------------------------------------------------------------- CLI


@pytest.fixture
def llama_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA2_7B))
    return tmp_path


def test_register_adds_plan_subcommand(llama_dir, capsys):
    parser = argparse.ArgumentParser(prog="pagedllm")
    plan_mod.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plan", "--model", str(llama_dir), "--max-model-len", "2048"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "512.00 KiB" in out and "1.00 GiB" in out and "blocks" in out


def test_main_json(llama_dir, capsys):
    assert plan_mod.main(["--model", str(llama_dir / "config.json"), "--json", "--gpu-memory", "40GiB"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["kv_bytes_per_token"] == MiB // 2 and data["gpu_memory"] == 40 * GiB


@pytest.mark.parametrize("flags,flag_name", [
    (["--block-size", "7"], "--block-size"),
    (["--gpu-memory", "lots"], "--gpu-memory"),
    (["--gpu-memory-utilization", "2"], "--gpu-memory-utilization"),
    (["--max-model-len", "0"], "--max-model-len"),
])
def test_bad_flags_exit_nonzero_naming_flag(llama_dir, capsys, flags, flag_name):
    with pytest.raises(SystemExit) as info:
        plan_mod.main(["--model", str(llama_dir), *flags])
    assert info.value.code != 0
    assert f"argument {flag_name}" in capsys.readouterr().err


def test_mean_len_over_max_is_an_error(llama_dir, capsys):
    assert plan_mod.main(["--model", str(llama_dir), "--mean-len", "5000"]) == 2
    assert "--mean-len" in capsys.readouterr().err


def test_missing_local_path(capsys):
    with pytest.raises(ConfigError, match="no such file"):
        load_config("./definitely/not/here")


def test_standalone_module_offline_hub_id(tmp_path):
    """`python -m pagedllm.entrypoints.plan` runs; an uncached Hub id offline gives a clear error."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
           "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "pagedllm.entrypoints.plan", "--model", "no-such-org/no-such-model"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=180,  # 20 s measured on a loaded 2-core box
    )
    assert proc.returncode == 2
    assert "not in the local Hugging Face cache" in proc.stderr


# --------------------------------------------------------------------------- plan vs the engine


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bfloat16"])
def test_plan_block_bytes_equal_the_engines(model_dirs, kv_cache_dtype):
    """plan's per-block bytes are what the engine allocates, and a budget of N of them buys N blocks."""
    from pagedllm import LLM
    tiny = model_dirs["llama"]
    p = plan_kv(load_config(tiny), gpu_memory=GiB, device="cpu", block_size=16, kv_cache_dtype=kv_cache_dtype)
    assert p.dtype == "float32"  # "auto" on the CPU, as the engine resolves it
    llm = LLM(tiny, device="cpu", block_size=16, max_model_len=128, kv_cache_dtype=kv_cache_dtype,
              kv_cache_memory=20 * p.kv_bytes_per_block + p.kv_bytes_per_block // 2)
    assert llm.get_kv_cache_stats().num_blocks == 20
    kv = llm.llm_engine.executor.runner.cache.kv  # the pool itself: [layers, 2, blocks, kv_heads, block, head_dim]
    assert kv.numel() * kv.element_size() == 20 * p.kv_bytes_per_block
    assert p.kv_bytes_per_token * 16 == p.kv_bytes_per_block


def test_plan_auto_dtype_follows_the_planned_device():
    """"auto" means what it means to the engine on that device: the checkpoint's half type on a GPU, else
    float16 there; float32 on a CPU."""
    f32 = {**GQA, "torch_dtype": "float32"}
    assert plan_kv(GQA, gpu_memory=GiB).dtype == "bfloat16"
    assert plan_kv(f32, gpu_memory=GiB).dtype == "float16"
    assert plan_kv(GQA, gpu_memory=GiB, device="cpu").dtype == "float32"
    with pytest.raises(ValueError, match="device"):
        plan_kv(GQA, gpu_memory=GiB, device="tpu")


def test_plan_reads_the_bundled_demo_model(capsys):
    assert plan_mod.main(["--model", "pagedllm-demo", "--gpu-memory", "1GiB", "--device", "cpu"]) == 0
    assert "on cpu" in capsys.readouterr().out


def test_fp8_kv_cache_and_fp8_checkpoint_hand_computed():
    """An fp8 KV cache is one byte per element (a quarter of float32); FP8 projections one byte
    per weight plus the float32 scales the runtime keeps (one per row, or per row and block)."""
    f32 = plan_kv(GQA, gpu_memory=GiB, dtype="float32")
    for kv in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        p = plan_kv(GQA, gpu_memory=GiB, dtype="float32", kv_cache_dtype=kv)
        assert p.kv_bytes_per_token * 4 == f32.kv_bytes_per_token == 2 * 4 * 2 * 128 * 4
    proj = 4 * (512 * 8 * 128 * 2 + 512 * 2 * 128 * 2 + 3 * 512 * 1024)
    rest = 12_562_944 - proj
    per_tensor = {**GQA, "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic"}}
    assert plan_kv(per_tensor, gpu_memory=GiB, dtype="float32").weights_bytes == rest * 4 + proj + 4 * proj // 512
    block = {**GQA, "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                                            "weight_block_size": [128, 128]}}
    assert plan_kv(block, gpu_memory=GiB, dtype="float32").weights_bytes == rest * 4 + proj + 4 * proj // 128


@pytest.mark.parametrize("arch", ["llama", "qwen2_moe", "qwen3_moe", "gemma2"])
def test_linear_shapes_are_the_engines_linear_layers(arch, tmp_path):
    """What the panel estimate below sums over: every LinearBase of the loaded model, by shape."""
    from collections import Counter

    from conftest import make_model_dir

    from pagedllm import LLM
    from pagedllm.layers.linear import LinearBase
    path = make_model_dir(tmp_path / arch, arch)
    llm = LLM(path, device="cpu", num_gpu_blocks_override=16, max_model_len=64)
    held = Counter(tuple(m.weight.shape) for m in llm.llm_engine.executor.runner.model.modules()
                   if isinstance(m, LinearBase))
    planned = Counter()
    for out, in_, count in plan_mod.linear_shapes(model_shape(load_config(path))):
        planned[(out, in_)] += count
    assert planned == held


def test_cpu_plan_counts_the_panel_copy_a_loaded_int4_model_holds(tmp_path):
    """On the CPU every group-wise 4/8-bit linear also keeps grouped.pack_panels' copy of its codes
    (what the panel GEMM reads): the plan's estimate holds exactly what the loaded model holds."""
    from conftest import make_model_dir

    from pagedllm import LLM
    from pagedllm.native import bindings
    if not bindings.is_available():
        pytest.skip("no C library: no panel copy")
    path = tmp_path / "llama"  # q/k/v fused: 144 rows, so the last panel is padded
    make_model_dir(path, "llama", hidden_size=128, intermediate_size=256, num_attention_heads=16, num_key_value_heads=1)
    llm = LLM(str(path), device="cpu", quantization="int4", num_gpu_blocks_override=16, max_model_len=64)
    held = sum(b.numel() * b.element_size() for name, b in llm.llm_engine.executor.runner.model.named_buffers()
               if name.rsplit(".", 1)[-1] in ("panel_codes", "panel_scale", "panel_szero"))
    cpu = plan_kv(load_config(str(path)), gpu_memory=GiB, device="cpu", quantization="int4")
    cuda = plan_kv(load_config(str(path)), gpu_memory=GiB, device="cuda", quantization="int4", dtype="float32")
    assert held > 0 and cpu.panel_bytes == held
    assert cuda.panel_bytes == 0 and cpu.weights_bytes == cuda.weights_bytes + held


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_plan_refuses_load_time_quantization_of_a_moe_model_as_the_engine_does(method, tmp_path):
    """The engine quantizes linear projections only and refuses int8 / int4 on a model with experts;
    a plan that counted the experts as quantized would promise memory the engine never frees."""
    from conftest import make_model_dir

    from pagedllm import LLM
    path = make_model_dir(tmp_path / "moe", "qwen2_moe")
    with pytest.raises(ValueError, match=f"quantization='{method}' covers linear projections only") as planned:
        plan_kv(load_config(path), gpu_memory=GiB, device="cpu", quantization=method)
    with pytest.raises(ValueError) as engine:
        LLM(path, device="cpu", quantization=method, num_gpu_blocks_override=16, max_model_len=64)
    assert str(planned.value).split("(")[0] == str(engine.value).split("(")[0]
    assert plan_kv(load_config(path), gpu_memory=GiB, device="cpu").num_blocks > 0  # unquantized: planned

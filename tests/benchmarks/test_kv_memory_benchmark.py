"""Smoke test for benchmarks/kv_memory.py on a very small configuration."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "kv_memory.py"
_spec = importlib.util.spec_from_file_location("pagedllm_bench_kv_memory", _PATH)
kv_memory = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = kv_memory
_spec.loader.exec_module(kv_memory)


def test_kv_memory_small_run(tmp_path):
    out = tmp_path / "res" / "kv"
    results = kv_memory.main([
        "--num-requests", "12", "--max-model-len", "256", "--prompt-median", "24", "--output-median", "24",
        "--budget-seqs", "2", "--block-sizes", "16", "64", "--prefix-requests", "4", "--prefix-len", "100",
        "--prefix-output-len", "4", "--prefix-kv-tokens", "4096", "--sharing-prompts", "2",
        "--beam-max-tokens", "8", "--cache-dir", str(tmp_path / "cache"), "--out", str(out),
        "--experiments", "memory", "prefix", "sharing"])
    assert json.loads(out.with_suffix(".json").read_text())["memory"] == results["memory"]
    assert out.with_suffix(".png").stat().st_size > 0
    by_mode = {r["config"]: r for r in results["memory"]}
    contiguous = by_mode["contiguous max_model_len"]
    assert contiguous["peak_running"] <= 2 and contiguous["preemptions"] == 0
    paged = by_mode["paged block_size=16"]
    assert paged["kv_utilization"] > contiguous["kv_utilization"]
    assert paged["peak_running"] > contiguous["peak_running"]
    assert all(r["output_tokens"] == results["memory"][0]["output_tokens"] for r in results["memory"])
    off, on = results["prefix"]
    assert on["prompt_tokens_computed"] < off["prompt_tokens_computed"] == off["prompt_tokens_total"]
    shared = [r for r in results["sharing"] if "savings" in r]
    assert all(s["peak_saved_pct"] > 0 for s in shared[0]["savings"][:1] + shared[1]["savings"])


def test_latent_kv_holds_over_5x_the_tokens_of_per_head_kv(tmp_path):
    out = tmp_path / "latent"
    results = kv_memory.main(["--experiments", "latent", "--latent-layers", "2", "--latent-kv-mib", "64",
                              "--cache-dir", str(tmp_path / "cache"), "--out", str(out)])
    mla, fp8, per_head = results["latent"]
    assert mla["bytes_per_token"] == 2 * (512 + 64) * 2 and mla["kv_dtype"] == "bfloat16"  # one latent per layer
    assert fp8["bytes_per_token"] == 2 * (512 + 64) and fp8["kv_dtype"] == "float8_e4m3fn"
    assert per_head["bytes_per_token"] == 2 * 2 * 16 * 192 * 2
    assert mla["tokens_per_gib"] >= 5 * per_head["tokens_per_gib"] and mla["max_len_seqs"] > per_head["max_len_seqs"]
    assert fp8["tokens_per_gib"] >= 10 * per_head["tokens_per_gib"]
    assert json.loads(out.with_suffix(".json").read_text())["latent"] == results["latent"]
    assert not out.with_suffix(".png").exists()


def test_latent_decode_step_times_every_method_on_the_same_attention(tmp_path):
    """Experiment 5 at small contexts: each method's output is checked against the float64 MLA
    reference inside the run (its warm-up round), then timed; one row per (context, method)."""
    from pagedllm.native import bindings
    if not bindings.is_available():
        pytest.skip("the C library does not build here")
    out = tmp_path / "decode"
    results = kv_memory.main(["--experiments", "latent-decode", "--latent-contexts", "40", "130",
                              "--latent-repeats", "1", "--cache-dir", str(tmp_path / "cache"), "--out", str(out)])
    rows = results["latent-decode"]
    assert [(r["context"], r["method"]) for r in rows] == [
        (c, m) for c in (40, 130) for m in ("absorbed, C latent kernel", "absorbed, generic C paged attention",
                                            kv_memory.DECOMPRESS)]
    assert all(r["ms"] > 0 for r in rows) and {r["vs_decompress"] for r in rows[2::3]} == {"x1.0"}
    assert json.loads(out.with_suffix(".json").read_text())["latent-decode"] == rows

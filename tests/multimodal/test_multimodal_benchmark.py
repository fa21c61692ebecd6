"""benchmarks/multimodal.py end to end on the tiny LLaVA and Qwen2-VL: both systems agree, the numbers are there."""
from __future__ import annotations

import json

from tests.conftest import load_benchmark
from tests.multimodal import qwen2_vl_fixtures
from tests.multimodal.llava_fixtures import llava_dir  # noqa: F401 - fixture

qwen2_vl_dir = qwen2_vl_fixtures.qwen2_vl_dir  # fixture

bench = load_benchmark("pagedllm_bench_multimodal", "multimodal.py")


def test_benchmark_runs_and_agrees_with_transformers(llava_dir, tmp_path):  # noqa: F811
    out = tmp_path / "mm.json"
    result = bench.main(["--model", llava_dir, "--batch", "1", "3", "--question-len", "6", "--output-len", "4",
                         "--image-size", "40", "--repeats", "2", "--max-model-len", "128", "--kv-cache-memory",
                         "8MiB", "--json", str(out)])
    assert [r["batch"] for r in result["batches"]] == [1, 3]
    assert all(r["same"] and r["pagedllm_tok_s"] > 0 and r["transformers_tok_s"] > 0 and r["cpu_speedup"] > 0
               for r in result["batches"])
    assert result["encoder_cache"]["encoder_cache_hits"] >= 2 * 2  # the "hit" and first image-first turn, per image
    assert result["encoder_cache"]["ttft_hit"] > 0 and json.loads(out.read_text())["model"] == llava_dir
    # the same image and question again: its full blocks come from the prefix cache
    assert result["encoder_cache"]["ttft_repeat"] > 0 and result["encoder_cache"]["repeat_cached_share"] > 0


def test_benchmark_on_qwen2_vl(qwen2_vl_dir):
    result = bench.main(["--model", qwen2_vl_dir, "--batch", "1", "2", "--question-len", "6", "--output-len", "4",
                         "--image-size", "40", "--repeats", "1", "--max-model-len", "128", "--kv-cache-memory",
                         "8MiB", "--threads", "1"])
    assert all(r["same"] and r["pagedllm_tok_s"] > 0 for r in result["batches"])
    assert result["transformers_attention"] == "sdpa" and result["threads"] == 1  # transformers at its best setting
    enc = result["encoder_cache"]
    assert enc["encoder_cache_hits"] >= 2 and 0 < enc["ttft_hit_image_first"] and enc["hit_image_first_over_miss"] > 0

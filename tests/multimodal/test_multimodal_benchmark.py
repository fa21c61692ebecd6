"""benchmarks/multimodal.py end to end on the tiny LLaVA: both systems agree, the numbers are there."""
from __future__ import annotations

import json

from tests.conftest import load_benchmark
from tests.multimodal.llava_fixtures import llava_dir  # noqa: F401 - fixture

bench = load_benchmark("pagedllm_bench_multimodal", "multimodal.py")


def test_benchmark_runs_and_agrees_with_transformers(llava_dir, tmp_path):  # noqa: F811
    out = tmp_path / "mm.json"
    result = bench.main(["--model", llava_dir, "--batch", "1", "3", "--question-len", "6", "--output-len", "4",
                         "--image-size", "40", "--repeats", "2", "--max-model-len", "128", "--kv-cache-memory",
                         "8MiB", "--json", str(out)])
    assert [r["batch"] for r in result["batches"]] == [1, 3]
    assert all(r["same"] and r["pagedllm_tok_s"] > 0 and r["transformers_tok_s"] > 0 for r in result["batches"])
    assert result["encoder_cache"]["encoder_cache_hits"] == 2  # every "hit" request was one
    assert result["encoder_cache"]["ttft_hit"] > 0 and json.loads(out.read_text())["model"] == llava_dir

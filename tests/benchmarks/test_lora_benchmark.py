"""benchmarks/lora.py: one tiny end-to-end run (adapters through fewer slots than adapters)."""
from __future__ import annotations

import json

from conftest import load_benchmark

bench = load_benchmark("pagedllm_bench_lora", "lora.py")


def test_quick_run_end_to_end(llama_dir, tmp_path):
    out = tmp_path / "lora.json"
    bench.main(["--model", llama_dir, "--quick", "--num-threads", "1", "--kv-cache-memory", "16MiB",
                "--max-loras", "2", "--output", str(out)])
    res = json.loads(out.read_text())["results"]
    assert list(res) == ["base", "1_adapters", "2_adapters", "4_adapters"]
    assert all(r["tok_s"] > 0 for r in res.values())
    assert res["4_adapters"]["evictions"] > 0 and res["1_adapters"]["evictions"] == 0

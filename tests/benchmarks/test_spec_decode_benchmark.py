"""benchmarks/spec_decode.py: its helpers and one tiny end-to-end run."""
from __future__ import annotations

import json

from conftest import load_benchmark

bench = load_benchmark("pagedllm_bench_spec_decode", "spec_decode.py")


def test_ngram_share():
    assert bench.ngram_share([1, 2, 3, 4, 5], [2, 3, 4, 5, 9]) == 0.5
    assert bench.ngram_share([1, 2], [1, 2, 3]) == 0.0


def test_quick_run_end_to_end(llama_dir, tmp_path):
    out = tmp_path / "spec.json"
    bench.main(["--model", llama_dir, "--quick", "--input-len", "96", "--lead-len", "80", "--output-len", "24",
                "--num-threads", "1", "--kv-cache-memory", "16MiB",
                "--output", str(out)])
    res = json.loads(out.read_text())["results"]
    assert list(res) == ["copy", "random"]
    for r in res.values():
        assert r["identical"] and r["plain_tok_s"] > 0 and r["ngram_tok_s"] > 0
        assert len(r["runs_tok_s"]["plain"]) == len(r["runs_tok_s"]["ngram"]) == 2
    # the tiny random model's greedy text repeats itself: copy prompts hold more of their answers
    assert res["copy"]["answer_in_prompt"] > res["random"]["answer_in_prompt"]
    assert all(0 <= r["acceptance"] <= 1 and r["draft_tokens"] >= 0 for r in res.values())

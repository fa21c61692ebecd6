"""Tests for benchmarks/throughput.py: helpers, and one end-to-end --quick run on a tiny model."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "throughput.py"
_spec = importlib.util.spec_from_file_location("pagedllm_bench_throughput", _PATH)
tp = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = tp
_spec.loader.exec_module(tp)


def test_mixed_lengths_cover_the_range_and_are_fixed():
    lens = tp.mixed_lengths(32, 16, 256)
    assert sorted(lens) == sorted(tp.mixed_lengths(32, 16, 256, seed=0))
    assert lens == tp.mixed_lengths(32, 16, 256) and min(lens) == 16 and max(lens) == 256
    assert abs(1 - sum(lens) / (32 * 256) - 0.469) < 0.01  # the padding share a static batch pays


def test_full_and_quick_workload_sizes():
    full = tp.build_workloads(quick=False)
    assert (full["batch64"].num_requests, full["batch64"].prompt_len, full["batch64"].output_lens[0]) == (64, 128, 128)
    assert full["batch64"].hf_batch_sizes == [64, 16]
    assert (full["long16"].num_requests, full["long16"].prompt_len) == (16, 512)
    assert full["prefill512"].output_lens == [1] and full["prefill512"].headline == "prompt"
    quick = tp.build_workloads(quick=True)
    assert quick["batch64"].num_requests == 8 and quick["long16"].prompt_len == 64


def test_prefix_agreement_and_table():
    assert tp.prefix_agreement([[1, 2, 3], [4, 5]], [[1, 2, 9], [4, 5, 6]], [3, 2]) == (2 / 3 + 1) / 2
    table = tp.format_table(["a", "bb"], [["x", "1.0"], ["yyy", "22.5"]]).splitlines()
    assert table[0].startswith("a  ") and table[2].endswith(" 1.0") and table[1] == "---  ----"


def test_quick_run_end_to_end(llama_dir, tmp_path):
    out = tmp_path / "t.json"
    results = tp.main(["--model", llama_dir, "--quick", "--repeats", "1", "--output", str(out),
                       "--kv-cache-memory", "64MiB", "--num-threads", "2"])
    data = json.loads(out.read_text())
    assert set(results) == set(data["results"]) == {"single", "batch64", "long16", "mixed32", "prefill512"}
    mixed = data["results"]["mixed32"]
    assert mixed["transformers"]["bs4"]["padding_share"] > 0.4 and mixed["pagedllm"]["padding_share"] == 0
    assert set(data["results"]["batch64"]["transformers"]) == {"bs8", "bs2"}
    for r in data["results"].values():
        assert r["pagedllm"]["engine"]["prefix_hits"] == 0  # repeats never reuse an earlier run's KV
        for m in r["transformers"].values():
            assert m["ratio"] > 0 and m["greedy_agreement"] == 1.0

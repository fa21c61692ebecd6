"""benchmarks/moe.py: the layer baselines compute what FusedMoE computes, and a tiny end-to-end run."""
from __future__ import annotations

import json

from conftest import load_benchmark

moe = load_benchmark("pagedllm_bench_moe", "moe.py")


def test_full_config_is_about_30m_active():
    assert 28e6 < moe.active_params(moe.FULL) < 34e6


def test_quick_run_end_to_end(tmp_path):
    out = tmp_path / "moe.json"
    results = moe.main(["--quick", "--model-dir", str(tmp_path / "model"), "--out", str(out), "--num-threads", "1"])
    # each checked equal to fused
    assert set(results["layer_ms"]) == {"fused", "fused-onednn", "fused-plain", "loop-routed", "loop-dense"}
    e2e = results["end_to_end"]
    assert e2e["greedy_agreement"] == 1.0 and 0 < e2e["moe_share"] < 1
    assert json.loads(out.read_text())["end_to_end"] == e2e

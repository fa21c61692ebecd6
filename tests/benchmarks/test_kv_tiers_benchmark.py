"""Smoke test for benchmarks/kv_tiers.py on the tiny test model: every tier case runs, hits the
tier it names, and gives the tokens a run without any cache gives; the chart is written."""
from __future__ import annotations

import json

from conftest import load_benchmark

kv_tiers = load_benchmark("pagedllm_bench_kv_tiers", "kv_tiers.py")


def test_kv_tiers_quick_run(llama_dir, tmp_path):
    out = tmp_path / "res" / "kv_tiers"
    results = kv_tiers.main(["--model", llama_dir, "--quick", "--doc-len", "300", "--num-threads", "1",
                             "--chat-system-len", "64", "--out", str(out)])
    assert json.loads(out.with_suffix(".json").read_text())["ttft"] == results["ttft"]
    assert out.with_suffix(".png").stat().st_size > 0
    assert results["outputs_match"]
    t = results["ttft"]
    assert t["cold"]["prompt_tokens_computed"] == 300 + 24
    full_blocks = 300 // 16
    for case in ("device", "cpu", "disk", "disk-restart"):
        assert t[case]["prompt_tokens_computed"] == 300 + 24 - full_blocks * 16, case
    assert t["device"]["tier_hits"] == {"cpu": 0, "disk": 0}
    assert t["cpu"]["tier_hits"]["cpu"] > 0 and t["disk"]["tier_hits"]["disk"] > 0
    assert t["disk-restart"]["tier_hits"] == {"cpu": 0, "disk": full_blocks}
    chat = results["chat"]
    assert chat["with CPU tier"]["prefix_hit_rate"] > chat["device only"]["prefix_hit_rate"]
    assert chat["with CPU tier"]["prompt_tokens_computed"] < chat["device only"]["prompt_tokens_computed"]


def test_kv_tiers_startup_run(llama_dir, tmp_path):
    """``--startup-gb`` on a given checkpoint: every start-up case timed, the hash throughput and the
    15 GB estimate derived from it."""
    out = tmp_path / "res" / "kv_tiers"
    results = kv_tiers.main(["--model", llama_dir, "--startup-gb", "0", "--repeats", "1", "--num-threads", "1",
                             "--out", str(out)])
    saved = json.loads(out.with_name("kv_tiers_startup.json").read_text())
    assert saved["median_startup_s"] == results["median_startup_s"]
    assert set(results["median_startup_s"]) == {"no_tier", "tier_hashing", "tier_cached"}
    assert all(v > 0 for v in results["median_startup_s"].values()) and results["hash_gb_per_s"] > 0
    assert set(results["median_ratio_to_no_tier"]) == {"hashing", "cached"}
    assert results["estimate_15gb_hash_alone_s"] == 15 / results["hash_gb_per_s"]

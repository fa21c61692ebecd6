"""benchmarks/lora.py: tiny end-to-end runs (adapters through fewer slots than adapters), the
adapter-switch steps it records, and ``--compare-vllm`` against the fake ``vllm`` (tests/fake_vllm)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import load_benchmark

bench = load_benchmark("pagedllm_bench_lora", "lora.py")
FAKE = Path(__file__).resolve().parents[1] / "fake_vllm"


def test_quick_run_end_to_end(llama_dir, tmp_path):
    out = tmp_path / "lora.json"
    bench.main(["--model", llama_dir, "--quick", "--num-threads", "1", "--kv-cache-memory", "16MiB",
                "--max-loras", "2", "--output", str(out)])
    res = json.loads(out.read_text())["results"]
    assert list(res) == ["base", "1_adapters", "2_adapters", "4_adapters", "4_adapters_2_slots"]
    assert all(r["tok_s"] > 0 for r in res.values())
    # the rows share the 2 slots: the 1-adapter row reloads its adapter at most once per run (the
    # rows before it left others there); 4 adapters through 2 slots keep paging
    assert res["1_adapters"]["loads"] <= 1 and res["4_adapters"]["evictions"] >= 2


def test_switch_steps_are_the_steps_that_loaded_adapters(llama_dir, tmp_path):
    out = tmp_path / "lora.json"
    bench.main(["--model", llama_dir, "--quick", "--num-threads", "1", "--kv-cache-memory", "16MiB",
                "--adapters", "1,4", "--switch-slots", "2", "--output", str(out)])
    res = json.loads(out.read_text())["results"]
    assert list(res) == ["base", "1_adapters", "4_adapters", "4_adapters_2_slots"]
    assert "switch" not in res["base"]
    for name in ("1_adapters", "4_adapters"):  # every adapter resident after the warm-up: nothing to load
        assert res[name]["loads"] == 0 and res[name]["switch"]["switch_steps"] == 0
        # the run starts from an empty prefix cache (the warm-up ran the same first prompts): the
        # 8 prompts of 32 tokens are prefilled whole, in one step
        assert res[name]["switch"]["prefill_steps"] == 1 and res[name]["switch"]["prefill_step_tokens"] == 8 * 32
    paged, s = res["4_adapters_2_slots"], res["4_adapters_2_slots"]["switch"]
    assert paged["slots"] == 2 and paged["loads"] > 0
    assert s["loads"] == paged["loads"] and 0 < s["switch_steps"] < s["steps"]  # the recorder saw every load
    assert s["load_ms_per_adapter"] > 0 and s["switch_step_ms"] > 0 and s["decode_step_ms"] > 0


def test_switch_slots_must_be_below_the_largest_count():
    for bad in ("4", "-1"):
        with pytest.raises(SystemExit):
            bench.parse_args(["--quick", "--switch-slots", bad])
    assert bench.parse_args(["--quick", "--switch-slots", "0"]).switch_slots == 0
    assert bench.vllm_max_lora_rank(16) == 16 and bench.vllm_max_lora_rank(12) == 16
    with pytest.raises(ValueError, match="--rank=600"):
        bench.vllm_max_lora_rank(600)


def test_compare_vllm_alternates_pairs_and_sends_each_requests_adapter(llama_dir, tmp_path, monkeypatch):
    vc = sys.modules["vllm_compare"]
    calls, out = tmp_path / "calls", tmp_path / "lora.json"
    monkeypatch.setenv("PYTHONPATH", str(FAKE))
    monkeypatch.setenv("FAKE_VLLM_RECORD", str(tmp_path / "record.json"))
    monkeypatch.setenv("FAKE_VLLM_CALLS", str(calls))
    events, run_paged, vllm_run = [], bench.run_paged, vc.VllmWorker.run

    def paged(*a):
        events.append("p")
        return run_paged(*a)

    def vllm(self, *a):
        events.append("v")
        return vllm_run(self, *a)

    monkeypatch.setattr(bench, "run_paged", paged)
    monkeypatch.setattr(vc.VllmWorker, "run", vllm)
    data = bench.main(["--model", llama_dir, "--quick", "--num-threads", "1", "--kv-cache-memory", "16MiB",
                       "--adapters", "1,2", "--switch-slots", "1", "--repeats", "2", "--output", str(out),
                       "--compare-vllm", sys.executable])
    rows = ["base", "1_adapters", "2_adapters", "2_adapters_1_slots"]
    assert list(data["results"]) == rows and json.loads(out.read_text())["results"].keys() == set(rows)
    # vLLM's warm-ups (pagedllm's do not go through run_paged), then per round a pair per row: A B in
    # round 0, B A in round 1
    assert events == ["v"] * 4 + ["p", "v"] * 4 + ["v", "p"] * 4
    for r in data["results"].values():
        v = r["vllm"]
        assert len(v["pair_ratios"]) == 2 and v["median_ratio"] == pytest.approx(sum(v["pair_ratios"]) / 2)
        assert v["pair_ratios"][0] == pytest.approx(r["runs_tok_s"][0] / v["runs_tok_s"][0])  # pagedllm / vLLM
        assert 0.0 <= v["greedy_agreement"] < 1.0  # the fake counts up (shifted by the adapter id)
    assert data["results"]["base"]["vllm"]["vs_base"] == 1.0
    loads = [json.loads(line[5:]) for line in calls.read_text().splitlines() if line.startswith("load ")]
    assert loads == [{"dtype": "float32", "block_size": 32, "seed": 0},  # base: no LoRA
                     *({"dtype": "float32", "block_size": 32, "seed": 0, "enable_lora": True, "max_loras": n,
                        "max_cpu_loras": 2, "max_lora_rank": 8} for n in (2, 1))]
    assert set(data["vllm"]) == {"base", "2_slots", "1_slots"}
    n = 8  # --quick's requests (the warm-ups send 2): each request's adapter is i mod N, as pagedllm's
    timed = [line for line in calls.read_text().splitlines() if line.startswith("generate") and line.split()[2] == "8"]
    assert [line.split(" loras=")[-1] if "loras=" in line else None for line in timed] == [
        None, ",".join(["a0"] * n), ",".join(["a0", "a1"] * (n // 2)), ",".join(["a0", "a1"] * (n // 2))] * 2

"""benchmarks/neighbour.py, tiny: every system kept loaded in its own worker, timed alone and
beside the busy loop in pairs; each pair's ratio and their median land in the JSON."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from conftest import load_benchmark

nb = load_benchmark("pagedllm_bench_neighbour", "neighbour.py")


def test_variant_environments():
    base = {"OMP_WAIT_POLICY": "ACTIVE", "VLLM_CPU_OMP_THREADS_BIND": "0", "KEEP": "1"}
    assert nb.variant_env("auto", 2, base) == {"KEEP": "1"}  # pagedllm chooses
    assert nb.variant_env("fixed", 2, base) == {"KEEP": "1", "PAGEDLLM_CPU_OMP_THREADS_BIND": "nobind"}
    assert nb.variant_env("passive", 2, base)["OMP_WAIT_POLICY"] == "PASSIVE"
    assert nb.variant_env("pinned", 2, base)["PAGEDLLM_CPU_OMP_THREADS_BIND"] == "0-1"


def test_pairs_alone_and_beside_a_busy_loop(llama_dir, tmp_path, monkeypatch):
    """One pagedllm worker and the stand-in llama.cpp (tests/fake_llamacpp), 2 pairs at batch 1
    and 2: ratios per pair, their median, the worker's OpenMP set-up."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parents[1] / "fake_llamacpp"),
                                                      os.environ.get("PYTHONPATH", "")]))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    out = tmp_path / "n.json"
    res = nb.main(["--model", str(llama_dir), "--variants", "auto", "--batches", "1,2", "--pairs", "2",
                   "--input-len", "4", "--output-len", "3", "--settle", "0", "--llamacpp", sys.executable,
                   "--llamacpp-gguf", str(gguf), "--output", str(out)])
    data = json.loads(out.read_text())
    assert set(res) == {"pagedllm-auto", "llama.cpp"} and data["results"] == json.loads(json.dumps(res))
    for system in res.values():
        for batch in ("1", "2"):
            r = system[batch]
            assert len(r["pair_ratios"]) == 2 and min(r["alone_tok_s"] + r["beside_tok_s"]) > 0
            assert r["median_ratio"] == pytest.approx(sum(r["pair_ratios"]) / 2)
    info = data["meta"]["workers"]["pagedllm-auto"]
    assert info["variant"] == "auto" and len(info["openmp"]) == 1

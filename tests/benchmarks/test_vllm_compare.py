"""The --compare-vllm plumbing of benchmarks/throughput.py (vllm_compare.py, vllm_runner.py),
run against a fake ``vllm`` package (tests/fake_vllm): the job/result protocol, the environment
vLLM gets, and the process group (with the engine core vLLM leaves behind) killed afterwards."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
from conftest import load_benchmark

tp = load_benchmark("pagedllm_bench_throughput", "throughput.py")
vc = sys.modules["vllm_compare"]  # imported by throughput.py from benchmarks/
FAKE = Path(__file__).resolve().parents[1] / "fake_vllm"


@pytest.fixture
def fake_vllm(monkeypatch, tmp_path):
    record = tmp_path / "record.json"
    monkeypatch.setenv("PYTHONPATH", str(FAKE))
    monkeypatch.setenv("FAKE_VLLM_RECORD", str(record))
    return record


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _model(tmp_path: Path, vocab: int = 50) -> Path:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"vocab_size": vocab}))
    return tmp_path / "m"


def test_runner_protocol_env_and_group_kill(fake_vllm, tmp_path):
    wl = vc.job_workload("w", [[3, 4], [7]], [3, 2], [[5]], [1])
    job = vc.make_job(_model(tmp_path), [wl], repeats=2, block_size=64)
    out = vc.run_vllm(sys.executable, job, tmp_path / "work", num_threads=2, timeout_s=60)
    assert out["vllm_version"] == "0.0-fake" and out["engine_kwargs"]["block_size"] == 64
    assert len(out["results"]["w"]["times_s"]) == 2
    assert out["results"]["w"]["outputs"] == [[5, 6, 7], [8, 9]]
    rec = json.loads(fake_vllm.read_text())
    assert rec["kwargs"] == {"dtype": "float32", "block_size": 64, "seed": 0}
    assert rec["env"] == {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                          "VLLM_CPU_KVCACHE_SPACE": "4"}
    assert rec["pgid"] != os.getpgid(0)  # its own process group ...
    assert not _alive(rec["core_pid"]) and not vc.group_alive(rec["pgid"])  # ... killed with what it left behind


def test_runner_failure_raises_with_log_and_still_kills(fake_vllm, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_FAIL", "1")
    job = vc.make_job(_model(tmp_path), [vc.job_workload("w", [[3]], [1], [[3]], [1])], 1, 32)
    with pytest.raises(RuntimeError, match="(?s)exited with 1.*failing to load as asked"):
        vc.run_vllm(sys.executable, job, tmp_path / "work", num_threads=1, timeout_s=60)


def test_timeout_kills_the_group(tmp_path):
    runner = tmp_path / "hang.py"  # forks a child, then hangs: both must be gone after the timeout
    runner.write_text("import subprocess, sys, time\n"
                      "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
                      f"open({str(tmp_path / 'pid')!r}, 'w').write(str(p.pid))\n"
                      "time.sleep(600)\n")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="timed out"):
        vc.run_vllm(sys.executable, vc.make_job(tmp_path, [], 1, 32), tmp_path / "w", 1, timeout_s=3, runner=runner)
    assert time.monotonic() - t0 < 30 and not _alive(int((tmp_path / "pid").read_text()))


def test_block_size_must_be_a_multiple_of_32():
    for bad in (16, 0, 48):
        with pytest.raises(ValueError, match="multiple of 32"):
            vc.check_block_size(bad)
    with pytest.raises(SystemExit):
        tp.parse_args(["--vllm-block-size", "16"])
    assert tp.parse_args(["--model-size", "200m"]).workloads == "single,batch64"
    with pytest.raises(SystemExit):
        tp.parse_args(["--model", "x", "--model-size", "200m"])


def test_throughput_runs_the_vllm_column_end_to_end(fake_vllm, llama_dir, tmp_path):
    out = tmp_path / "t.json"
    tp.main(["--model", llama_dir, "--quick", "--repeats", "1", "--skip-hf", "--workloads", "single,mixed32",
             "--output", str(out), "--kv-cache-memory", "64MiB", "--num-threads", "2",
             "--compare-vllm", sys.executable])
    data = json.loads(out.read_text())
    assert data["meta"]["vllm"]["vllm_version"] == "0.0-fake"
    for name in ("single", "mixed32"):
        r = data["results"][name]
        v, p = r["vllm"], r["pagedllm"]
        assert v["ratio"] == pytest.approx(v["time_s"] / p["time_s"])  # same tokens: ratio = time ratio
        assert 0.0 <= v["greedy_agreement"] < 1.0  # the fake counts up, the model does not
    mixed = tp.build_workloads(quick=True)["mixed32"]
    job = json.loads((tmp_path / "t-vllm" / "vllm-job.json").read_text())
    sent = {w["name"]: w for w in job["workloads"]}["mixed32"]
    assert sent["output_lens"] == mixed.output_lens  # the same requests pagedllm gets
    assert sent["prompts"] == tp.make_prompts(mixed.prompt_lens, 512, tp.workload_seed("mixed32"))
    assert not _alive(json.loads(fake_vllm.read_text())["core_pid"])

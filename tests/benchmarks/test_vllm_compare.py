"""The --compare-vllm plumbing of benchmarks/throughput.py (vllm_compare.py, vllm_runner.py),
run against a fake ``vllm`` package (tests/fake_vllm): the job/result protocol and the ``--serve``
worker's JSON lines, the environment vLLM gets, the process group (with the engine core vLLM
leaves behind) killed afterwards, and throughput.py alternating pagedllm and vLLM run by run."""
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


def test_worker_answers_json_lines_in_process_and_its_group_is_killed(fake_vllm, tmp_path, monkeypatch):
    calls = tmp_path / "calls"
    monkeypatch.setenv("FAKE_VLLM_CALLS", str(calls))
    kwargs = {"dtype": "float32", "block_size": 32, "seed": 0}
    worker = vc.VllmWorker(sys.executable, _model(tmp_path), kwargs, num_threads=2, timeout_s=60)
    try:
        assert worker.info["vllm_version"] == "0.0-fake" and worker.info["engine_kwargs"] == kwargs
        first = worker.run([[3, 4], [7]], [3, 2])
        second = worker.run([[9]], [1])
    finally:
        worker.close()
    assert first["outputs"] == [[5, 6, 7], [8, 9]] and second["outputs"] == [[10]] and first["time_s"] >= 0
    assert calls.read_text().split("\n")[:-1] == [f"load {json.dumps(kwargs, sort_keys=True)}", "reset",
                                                  "generate 3 2", "reset", "generate 9 1"]
    rec = json.loads(fake_vllm.read_text())
    assert rec["kwargs"] == kwargs
    assert rec["env"]["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # engine in-process: nothing polls while idle
    assert rec["pgid"] != os.getpgid(0)
    assert not _alive(rec["core_pid"]) and not vc.group_alive(rec["pgid"])


def _adapter(tmp_path: Path, name: str) -> str:
    (tmp_path / name).mkdir()
    (tmp_path / name / "adapter_config.json").write_text("{}")
    return str(tmp_path / name)


def test_worker_sends_each_prompts_adapter(fake_vllm, tmp_path, monkeypatch):
    calls = tmp_path / "calls"
    monkeypatch.setenv("FAKE_VLLM_CALLS", str(calls))
    a, b = vc.VllmLoRA("a", 1, _adapter(tmp_path, "a")), vc.VllmLoRA("b", 4, _adapter(tmp_path, "b"))
    kwargs = vc.worker_kwargs("float32", 32, enable_lora=True, max_loras=2, max_lora_rank=16, max_cpu_loras=2)
    worker = vc.VllmWorker(sys.executable, _model(tmp_path), kwargs, num_threads=1, timeout_s=60)
    try:
        with pytest.raises(ValueError, match="loras: 1 entries for 2 prompts"):
            worker.run([[3], [3]], [1, 1], [a])
        out = worker.run([[3], [3], [3]], [2, 2, 2], [a, None, b])
        plain = worker.run([[3]], [1])
    finally:
        worker.close()
    assert out["outputs"] == [[5, 6], [4, 5], [8, 9]] and plain["outputs"] == [[4]]  # the fake shifts by the id
    assert calls.read_text().split("\n")[1:-1] == ["reset", "generate 3 3 loras=a,-,b", "reset", "generate 3 1"]
    assert json.loads(fake_vllm.read_text())["kwargs"] == {"dtype": "float32", "block_size": 32, "seed": 0,
                                                           "enable_lora": True, "max_loras": 2,
                                                           "max_lora_rank": 16, "max_cpu_loras": 2}


def test_worker_without_lora_fails_on_an_adapter(fake_vllm, tmp_path):
    worker = vc.VllmWorker(sys.executable, _model(tmp_path), vc.worker_kwargs("float32", 32), 1, timeout_s=60)
    try:
        with pytest.raises(RuntimeError, match="vLLM worker exited"):
            worker.run([[3]], [1], [vc.VllmLoRA("a", 1, _adapter(tmp_path, "a"))])
    finally:
        worker.close()


def test_worker_timeout_kills_it_and_says_so(tmp_path):
    runner = tmp_path / "hang.py"  # never prints its ready line
    runner.write_text("import time\ntime.sleep(600)\n")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="timeout ran out"):
        vc.VllmWorker(sys.executable, tmp_path, {}, 1, timeout_s=2, runner=runner)
    assert time.monotonic() - t0 < 30


def test_throughput_alternates_pagedllm_and_vllm_and_reports_pairs(fake_vllm, llama_dir, tmp_path, monkeypatch,
                                                                    capsys):
    events, sent = [], {}
    run_paged, worker_run = tp.run_paged, vc.VllmWorker.run

    def paged(llm, wl, prompts):
        events.append("p")
        return run_paged(llm, wl, prompts)

    def vllm(self, prompts, output_lens):
        events.append("v")
        sent[len(prompts)] = (prompts, list(output_lens))
        return worker_run(self, prompts, output_lens)

    monkeypatch.setattr(tp, "run_paged", paged)
    monkeypatch.setattr(vc.VllmWorker, "run", vllm)
    out = tmp_path / "t.json"
    tp.main(["--model", llama_dir, "--quick", "--repeats", "3", "--skip-hf", "--workloads", "single,mixed32",
             "--output", str(out), "--kv-cache-memory", "64MiB", "--num-threads", "2",
             "--compare-vllm", sys.executable])
    # per workload: the warm-ups, then pairs in flipping order (A B, B A, A B)
    assert events[-16:] == ["p", "v", "p", "v", "v", "p", "p", "v"] * 2
    data = json.loads(out.read_text())
    assert data["meta"]["vllm"]["vllm_version"] == "0.0-fake" and data["meta"]["vllm"]["wall_s"] > 0
    report = capsys.readouterr().out
    for name in ("single", "mixed32"):
        r = data["results"][name]
        v, p = r["vllm"], r["pagedllm"]
        assert len(v["pair_ratios"]) == 3 and len(v["times_s"]) == 3 and len(v["pagedllm_times_s"]) == 3
        assert v["ratio"] == v["median_ratio"] == pytest.approx(sorted(v["pair_ratios"])[1])
        assert v["pair_ratios"][0] == pytest.approx(v["times_s"][0] / v["pagedllm_times_s"][0])  # same tokens
        assert 0.0 <= v["greedy_agreement"] < 1.0  # the fake counts up, the model does not
        assert "output_tok_s" in v and "output_tok_s" in p
        pairs = " ".join(f"{x:.2f}" for x in v["pair_ratios"])
        assert f"{name}: pagedllm / vLLM pairs {pairs}, median {v['median_ratio']:.2f}x" in report
        assert pairs in next(line for line in report.splitlines() if line.startswith(name) and "tok/s" in line)
    mixed = tp.build_workloads(quick=True)["mixed32"]
    prompts, lens = sent[mixed.num_requests]
    assert lens == mixed.output_lens  # the same requests pagedllm gets
    assert prompts == tp.make_prompts(mixed.prompt_lens, 512, tp.workload_seed("mixed32"))
    assert not _alive(json.loads(fake_vllm.read_text())["core_pid"])

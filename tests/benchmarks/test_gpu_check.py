"""benchmarks/gpu_check.sh and its helpers, as far as they run without a GPU."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("pagedllm_bench_gpu_check", ROOT / "benchmarks" / "gpu_check.py")
gc = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = gc
_spec.loader.exec_module(gc)

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)


def test_script_parses_and_names_the_gpu_test_files():
    subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "gpu_check.sh")], check=True)
    text = (ROOT / "benchmarks" / "gpu_check.sh").read_text()
    for path in ("tests/layers/triton_ops", "tests/attention/test_triton_attention.py",
                 "tests/e2e/test_cuda_graph_replay.py", "tests/e2e/test_gpu_paths.py",
                 "tests/layers/test_sampler_syncs.py",
                 "tests/distributed/test_tp_cuda_graphs.py", "tests/lora/test_lora_cuda_graphs.py"):
        assert (ROOT / path).exists() and path in text
    # pytest without pyproject's addopts (xdist's -n): the step runs where pytest-xdist is absent
    assert "-m pytest -q -o addopts= " in text


def test_step_limits_fit_the_budget_and_the_budget_fits_6_minutes():
    """6 minutes: a second try fits in the 15 device-minutes with the machine's start-up."""
    import re
    text = (ROOT / "benchmarks" / "gpu_check.sh").read_text()
    limits = [int(n) for n in re.findall(r"^step [\w-]+ (\d+) ", text, flags=re.M)]
    budget = int(re.search(r"BUDGET_S=\$\(\( \$\{BUDGET_S:-(\d+)\} \* LIMIT_SCALE \)\)", text).group(1))
    assert len(limits) == 5 and sum(limits) <= budget <= 6 * 60 - 15  # 15 s: versions, nvidia-smi, kill grace


def test_the_1b_geometry():
    c = gc.LLAMA_1B
    assert (c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"], c["num_key_value_heads"],
            c["vocab_size"]) == (2048, 16, 32, 8, 32000)
    h, i = c["hidden_size"], c["intermediate_size"]
    kv = c["num_key_value_heads"] * h // c["num_attention_heads"]  # K and V widths
    params = c["num_hidden_layers"] * (2 * h * h + 2 * h * kv + 3 * h * i + 2 * h) + 2 * c["vocab_size"] * h + h
    assert 0.9e9 < params < 1.3e9


def test_built_model_loads_in_the_engine_and_counts_its_weight_bytes(tmp_path):
    path = gc.build_model(tmp_path / "m", "cpu", **TINY)
    assert json.loads((path / "config.json").read_text())["hidden_size"] == 64
    h, i, kv = 64, 128, 32
    layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
    assert gc.weight_read_bytes(path) == 2 * (2 * layer + 512 * h + h)  # bf16; all but the embedding
    from pagedllm import LLM, SamplingParams
    llm = LLM(str(path), num_gpu_blocks_override=16, max_model_len=64, block_size=8)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def _write_results(out: Path, kernel_gbs: float, c256_ratios, lognormal_ratio: float, step_ms: float,
                   forward_ms: float) -> None:
    att = dict(meta=dict(kernel="triton"), bandwidth=dict(read_gbs=4000.0),
               cases={"decode-bs64-ctx4096": dict(kernel="triton", backends=dict(triton=dict(gbs=kernel_gbs)))})
    hf = lambda *ratios: {f"bs{i}": dict(ratio=r) for i, r in enumerate(ratios)}  # noqa: E731
    thr = dict(engine=dict(cuda_graphs=True, attention_backend="TritonBackend"),
               results=dict(lognormal=dict(transformers=hf(lognormal_ratio)),
                            # the mean over all steps, prefill included, is not what is judged
                            single=dict(pagedllm=dict(engine=dict(
                                step_ms=dict(step=10 * step_ms),
                                decode_step_ms=dict(step=step_ms, forward=forward_ms, steps=127))))),
               sweep=dict(results=dict(c256=dict(transformers=hf(*c256_ratios)))))
    (out / "attention.json").write_text(json.dumps(att))
    (out / "throughput.json").write_text(json.dumps(thr))


def test_report_puts_each_target_next_to_the_measurement(tmp_path, capsys):
    model = gc.build_model(tmp_path / "m", "cpu", **TINY)
    read_ms = gc.weight_read_bytes(model) / 4000e9 * 1e3
    _write_results(tmp_path, kernel_gbs=3000.0, c256_ratios=(6.0, 3.5), lognormal_ratio=12.0, step_ms=1.2 * read_ms,
                   forward_ms=0.25 * read_ms)
    data = gc.report(tmp_path, model)
    m = data["measured"]
    assert m["attention_hbm_share"] == pytest.approx(0.75)
    assert m["ratio_256x512"] == 3.5  # against the fastest transformers batch size
    assert m["ratio_lognormal"] == 12.0 and m["batch1_step_over_weight_read"] == pytest.approx(1.2)
    decode = data["batch1_decode"]  # decode steps only, the forward call and the host's rest apart
    assert decode["steps"] == 127 and decode["weight_read_ms"] == pytest.approx(read_ms)
    assert (decode["forward_ms"], decode["host_ms"]) == pytest.approx((0.25 * read_ms, 0.95 * read_ms))
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("batch-1 decode step ") and "host rest" in line for line in lines)
    verdicts = {line.split()[0]: line.split()[-1] for line in lines[1:] if line.split()[0] in gc.TARGETS}
    assert verdicts == dict(attention_hbm_share="PASS", ratio_256x512="FAIL", ratio_lognormal="PASS",
                            batch1_step_over_weight_read="PASS")
    assert json.loads((tmp_path / "gpu_check.json").read_text())["measured"] == m


def test_report_marks_missing_parts_not_measured(tmp_path, capsys):
    data = gc.report(tmp_path, None)
    assert data["measured"] == {}
    assert capsys.readouterr().out.count("not measured") == len(gc.TARGETS)


def test_attention_benchmark_takes_the_model_geometry_and_contexts(tmp_path):
    """The flags gpu_check.sh passes to attention.py, exercised on the CPU kernel."""
    spec = importlib.util.spec_from_file_location("pagedllm_bench_attention", ROOT / "benchmarks" / "attention.py")
    att = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = att
    spec.loader.exec_module(att)
    out = tmp_path / "attention.json"
    att.main(["--num-heads", "4", "--num-kv-heads", "2", "--head-dim", "32", "--contexts", "40",
              "--cases", "decode-bs4-ctx40", "--quick", "--repeats", "1", "--skip-ref", "--bw-mib", "8",
              "--warm-cache", "--output", str(out)])
    data = json.loads(out.read_text())
    case = data["cases"]["decode-bs4-ctx40"]
    assert (data["meta"]["kernel"], case["kernel"], case["context"], data["meta"]["num_heads"]) == ("cpu", "cpu", 40, 4)
    assert case["bytes"]["q_read"] == 4 * 4 * 32 * 4 and case["max_abs_diff"] < 1e-4  # vs gather + SDPA
    assert case["backends"]["cpu"]["timing"] == "wall"  # on CUDA: "cuda-graph" (kernels only)


@pytest.mark.parametrize("failing_step", [None, "benchmarks/attention.py"])
def test_script_exits_0_when_every_step_ran_and_names_a_failed_step(tmp_path, failing_step):
    """A stand-in python that succeeds (or fails for one step's script): the exit status says
    whether every step ran, never whether targets were met (the report step only records)."""
    stub = tmp_path / "python"
    fail = f'case "$*" in *{failing_step}*) exit 3;; esac' if failing_step else ""
    stub.write_text(f"#!/bin/sh\n{fail}\nexit 0\n")
    stub.chmod(0o755)
    env = {**os.environ, "PYTHON": str(stub), "OUT": str(tmp_path / "out")}
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh")], capture_output=True, text=True,
                          env=env, timeout=60)
    if failing_step is None:
        assert proc.returncode == 0 and "every step ran" in proc.stdout
    else:
        assert proc.returncode == 1 and "FAILED: attention(exit 3)" in proc.stdout
        assert "=== report: exit 0" in proc.stdout  # the later steps still ran


def test_rehearsal_runs_every_step_of_the_check_on_cpu_without_python_or_xdist(tmp_path):
    """device_rehearsal.sh --shape: gpu_check.sh itself at tiny sizes on the CPU, where the PATH has
    python3 but no `python` and pytest's xdist plugin is off; every step starts, runs and logs,
    and the report is written."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "TRITON_INTERPRET")}
    env["PYTHON3"] = sys.executable
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "device_rehearsal.sh"), "--shape", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "shape rehearsal passed" in proc.stdout and "every step ran" in proc.stdout
    for name in ("gpu-tests", "build-model", "attention", "throughput", "report"):
        assert f"=== {name}: exit 0 after" in proc.stdout
        assert f"=== {name} (limit" in proc.stdout and "python3 " in proc.stdout.split(f"=== {name} (limit")[1][:40]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["attention_kernel"] == "cpu" and report["batch1_decode"]["steps"] > 0
    assert "skipped" in (tmp_path / "gpu-tests.log").read_text()  # collected, and skipped without a GPU


def test_rehearsal_script_parses_and_reads_the_gpu_test_files_from_gpu_check():
    subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "device_rehearsal.sh")], check=True)
    text = (ROOT / "benchmarks" / "device_rehearsal.sh").read_text()
    assert "sed -n '/^step gpu-tests/,/^step build-model/p' benchmarks/gpu_check.sh" in text
    assert "step gpu-tests " in (ROOT / "benchmarks" / "gpu_check.sh").read_text()


def _silu_launch(rows: int, d: int) -> dict:
    import torch
    pytest.importorskip("triton")
    from conftest import load_benchmark
    jv = load_benchmark("pagedllm_bench_jit_variants", "probes/jit_variants.py")
    from pagedllm.layers.triton_ops import activation
    x, out = torch.zeros(rows, 2 * d), torch.zeros(rows, d)
    fn = activation._silu_and_mul_kernel.fn  # the Python function (interpreted or compiled kernel alike)
    return jv.launch_key(fn, (x, out, x.stride(0), out.stride(0)), dict(d=d, BLOCK=1024, num_warps=4))


def test_jit_variants_keys_a_launch_as_the_jit_specializes_it():
    """Ints equal to 1 become constants, ints and pointers divisible by 16 are marked 'D'."""
    key = _silu_launch(3, 16)
    assert key["kernel"] == "pagedllm.layers.triton_ops.activation:_silu_and_mul_kernel"
    assert key["signature"] == [["x_ptr", "*fp32", "D"], ["out_ptr", "*fp32", "D"], ["x_stride", "i32", "D"],
                                ["out_stride", "i32", "D"], ["d", "i32", "D"]]
    assert key["constexprs"] == {"BLOCK": 1024} and key["options"] == {"num_warps": 4}
    odd = _silu_launch(3, 1)  # d and out_stride == 1: constants; x_stride 2: not divisible
    assert odd["constexprs"] == {"out_stride": 1, "d": 1, "BLOCK": 1024}
    assert odd["signature"][2:] == [["x_stride", "i32", ""]]


def test_jit_variants_compiles_each_recorded_key_for_sm90(tmp_path):
    log = tmp_path / "launches.jsonl"
    log.write_text(json.dumps(_silu_launch(3, 16)) + "\n" + json.dumps(_silu_launch(3, 1)) + "\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "probes" / "jit_variants.py"), str(log),
                           "--arch", "90"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {line.split()[0]: line.split()[1:] for line in proc.stdout.splitlines()[1:]}
    assert rows["_silu_and_mul_kernel"][0] == "2" and rows["total"][1] == "2"

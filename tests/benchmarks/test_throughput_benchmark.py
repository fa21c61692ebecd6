"""Tests for benchmarks/throughput.py: helpers, and one end-to-end --quick run on a tiny model."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import check_greedy_against, fp8_act_hook, load_benchmark, make_model_dir, random_prompts

tp = load_benchmark("pagedllm_bench_throughput", "throughput.py")
import quant_variants as qv  # noqa: E402  (benchmarks/ is on sys.path once throughput.py is loaded)


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
    host = data["meta"]["host"]  # the host recorded in every JSON (RESULTS.md: one table per host kind)
    assert {"cpu_model", "cpu_flags", "cpu_count", "torch_threads", "onednn_isa", "torch", "kernel_tuning"} <= set(host)
    assert host["torch_threads"] == 2 and host["cpu_count"] >= 1
    for r in data["results"].values():
        assert r["pagedllm"]["engine"]["prefix_hits"] == 0  # repeats never reuse an earlier run's KV
        for m in r["transformers"].values():
            assert m["ratio"] > 0 and m["greedy_agreement"] == 1.0


def test_lognormal_lengths_are_seeded_clipped_and_spread():
    full = tp.build_workloads(quick=False)["lognormal"]
    assert full.num_requests == 64 and full.hf_batch_sizes == [32] and full.headline == "useful"
    assert full == tp.build_workloads(quick=False)["lognormal"]  # fixed by the seed
    for lens in (full.prompt_lens, full.output_lens):
        assert min(lens) >= 4 and max(lens) <= 1024 and len(set(lens)) > 20
        assert 90 < float(np.median(lens)) < 180  # median 128, sigma 0.7
    assert full.prompt_lens != full.output_lens and full.prompt_len is None
    assert max(p + o for p, o in zip(full.prompt_lens, full.output_lens)) <= 2048  # the model's positions
    quick = tp.build_workloads(quick=True)["lognormal"]
    assert quick.num_requests == 8 and quick.hf_batch_sizes == [4] and max(quick.prompt_lens) <= 128
    other_seed = tp.lognormal_workload(False, tp.LognormalSpec(seed=1))
    assert other_seed.prompt_lens != full.prompt_lens


def test_make_prompts_keeps_uniform_prompts_and_follows_lengths():
    rng = np.random.default_rng(7)
    assert tp.make_prompts([5, 5, 5], 100, 7) == rng.integers(3, 100, size=(3, 5)).tolist()  # as before
    prompts = tp.make_prompts([2, 9, 4], 100, 7)
    assert [len(p) for p in prompts] == [2, 9, 4] and min(min(p) for p in prompts) >= 3


def test_static_batch_tokens_and_left_pad():
    wl = tp.Workload("w", [3, 5, 2], [4, 1, 2], [2])
    assert tp.static_batch_tokens(wl, 2) == (2 * 4 + 2, 2)  # batches (3,5)->4 out, (2)->2 out; one prompt pads 2
    assert tp.static_batch_tokens(wl, 3) == (3 * 4, 2 + 3)
    ids, mask = tp.left_pad([[7, 8], [5, 6, 9]])
    assert ids == [[0, 7, 8], [5, 6, 9]] and mask == [[0, 1, 1], [1, 1, 1]]


def test_left_padded_hf_batch_equals_unpadded_rows(llama_dir):
    hf = tp.load_hf(Path(llama_dir), "cpu")
    prompts = tp.make_prompts([3, 11, 6, 8], 512, 0)
    lens = [2, 7, 5, 1]
    batched = tp.hf_generate(hf, prompts, lens, 4, "cpu")
    assert [len(o) for o in batched] == lens  # only the requested tokens come back
    assert batched == tp.hf_generate(hf, prompts, lens, 1, "cpu")  # pads change nothing


def test_step_log_keeps_each_step_and_decode_steps_follow_the_prefill():
    log = tp.StepLog()
    for schedule, forward in ((0.001, 0.050), (0.001, 0.010), (0.002, 0.012)):  # a prefill step, then 2 decode
        log.add(schedule=schedule)
        log.add(prepare=0.0, forward=forward)
        log.add(update=0.001, steps=1)
    assert log.steps == 3 and log.forwards == pytest.approx([0.050, 0.010, 0.012])
    assert log.totals == pytest.approx([0.052, 0.012, 0.015])
    one = tp.Workload("single", [20], [3], [1])
    assert tp.decode_step_ms(log, one, 2048) == pytest.approx(dict(step=13.5, forward=11.0, steps=2))
    assert tp.decode_step_ms(log, one, 8) is None  # 3 prefill chunks of 8: no decode step left
    assert tp.decode_step_ms(log, tp.Workload("two", [20, 20], [3, 3], [2]), 2048) is None


def test_quick_lognormal_and_sweep_end_to_end(llama_dir, tmp_path):
    out = tmp_path / "t.json"
    results = tp.main(["--model", llama_dir, "--quick", "--repeats", "1", "--output", str(out),
                       "--workloads", "lognormal", "--concurrency", "1,4", "--kv-cache-memory", "64MiB",
                       "--num-threads", "1"])
    data = json.loads(out.read_text())
    assert set(results) == set(data["results"]) == {"lognormal"}
    hf = data["results"]["lognormal"]["transformers"]["bs4"]
    assert hf["greedy_agreement"] == 1.0 and hf["ratio"] > 0  # left padding keeps greedy identical
    assert hf["padding_share"] > 0.3 and hf["prompt_padding_share"] > 0.3
    assert data["results"]["lognormal"]["pagedllm"]["prompt_padding_share"] == 0
    sweep = data["sweep"]
    assert sweep["concurrency"] == [1, 4] and set(sweep["results"]) == {"c1", "c4"}
    for c in (1, 4):
        r = sweep["results"][f"c{c}"]
        assert r["workload"]["num_requests"] == c and r["workload"]["prompt_lens"] == [16] * c
        assert r["transformers"][f"bs{c}"]["ratio"] > 0 and r["transformers"][f"bs{c}"]["greedy_agreement"] == 1.0
    chart = tmp_path / "t-concurrency.png"
    assert sweep["chart"] == str(chart) and chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sweep_is_off_by_default_and_concurrency_is_validated():
    args = tp.parse_args(["--quick"])
    assert not args.sweep and (args.sweep_prompt_len, args.sweep_output_len) == (16, 16)
    assert tp.parse_args(["--concurrency", "2,8"]).concurrency == [2, 8]
    with pytest.raises(SystemExit):
        tp.parse_args(["--concurrency", "0,4"])


# --- --quantization: one method or a list, all measured in one run ------------------------------

def test_quantization_takes_one_method_or_a_list():
    assert tp.parse_args([]).quantization == ["none"]
    assert tp.parse_args(["--quantization", "int4"]).quantization == ["int4"]
    assert tp.parse_args(["-q", "none, int8,int4,gptq-w4g128"]).quantization == ["none", "int8", "int4", "gptq-w4g128"]


@pytest.mark.parametrize("text, match", [("int3", "'int3'"), ("none,int4,fp4", "'fp4'"), ("", "no method"),
                                          ("int4,int4", "named twice")])
def test_bad_quantization_is_refused_naming_the_value_and_the_allowed_ones(text, match, capsys):
    with pytest.raises(ValueError, match=match) as e:
        qv.parse_quantizations(text)
    assert "none" in str(e.value) and "gptq-w4g128" in str(e.value) and repr(text) in str(e.value)
    with pytest.raises(SystemExit):
        tp.parse_args(["--quantization", text])
    assert match in capsys.readouterr().err


def test_compare_vllm_refuses_a_quantization_list(capsys):
    assert tp.parse_args(["--compare-vllm", "py", "-q", "int8"]).quantization == ["int8"]  # one method: as before
    with pytest.raises(SystemExit):
        tp.parse_args(["--compare-vllm", "py", "--quantization", "none,int4"])
    assert "vLLM-CPU runs float32 only" in capsys.readouterr().err


def test_dtypes_take_a_list_and_set_the_baseline_dtype(capsys):
    args = tp.parse_args(["--dtypes", "bfloat16, float32"])
    assert args.dtypes == ["bfloat16", "float32"] and args.dtype == "bfloat16"  # transformers' and vLLM's
    assert tp.parse_args([]).dtypes is None
    for bad, why in (("float32,fp13", "fp13"), ("bfloat16,bfloat16", "each once")):
        with pytest.raises(SystemExit):
            tp.parse_args(["--dtypes", bad])
        assert why in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tp.parse_args(["--dtypes", "bfloat16,float32", "-q", "none,int8"])
    assert "one method per dtype column" in capsys.readouterr().err


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory):
    """Group 128 needs inputs that are multiples of 128."""
    return make_model_dir(tmp_path_factory.mktemp("wide"), "llama", hidden_size=128, intermediate_size=256)


@pytest.mark.parametrize("variant", qv.VARIANTS)
def test_variant_copy_loads_as_its_format_and_matches_transformers(variant, wide_llama, tmp_path, monkeypatch):
    import transformers as tf

    from pagedllm import LLM
    monkeypatch.setattr(qv, "CACHE_DIR", tmp_path)
    path = qv.ensure_variant(Path(wide_llama), variant)
    assert path == tmp_path / f"{Path(wide_llama).name}-{variant}"
    assert qv.ensure_variant(Path(wide_llama), variant) == path  # written once, reused
    qcfg = json.loads((path / "config.json").read_text())["quantization_config"]
    assert qcfg["quant_method"] == ("fp8" if variant == "fp8-b128" else "gptq" if variant.startswith("gptq")
                                    else "compressed-tensors")
    reference = tf.AutoModelForCausalLM.from_pretrained(wide_llama, torch_dtype=torch.float32).eval()
    with torch.no_grad():  # transformers on the weights the codes stand for
        for name, module in reference.named_modules():
            if name.rsplit(".", 1)[-1] in qv.PROJECTIONS:
                module.weight.copy_(qv.dequantize(variant, module.weight))
                if variant == "fp8-b128":  # the format rounds activations to e4m3 per token and 128 inputs
                    module.register_forward_pre_hook(fp8_act_hook("group", qv.FP8_BLOCK[1], None))
    llm = LLM(str(path), block_size=8, num_gpu_blocks_override=64)
    check_greedy_against(llm, reference, random_prompts(4, seed=3, hi=20), 6)


def test_quantization_list_end_to_end(wide_llama, tmp_path, monkeypatch):
    monkeypatch.setattr(qv, "CACHE_DIR", tmp_path)
    out = tmp_path / "t.json"
    tp.main(["--model", wide_llama, "--quick", "--repeats", "2", "--output", str(out), "--workloads", "single,batch64",
             "--skip-hf", "--kv-cache-memory", "16MiB", "--num-threads", "1", "-q", "none,int8,int4,gptq-w4g128"])
    data = json.loads(out.read_text())
    assert data["meta"]["quantizations"] == ["none", "int8", "int4", "gptq-w4g128"]
    by_q = data["meta"]["weight_read_by_quantization"]
    assert by_q["int8"]["weight_mb"] < by_q["none"]["weight_mb"]
    assert by_q["int4"]["read_gbs"] == by_q["none"]["read_gbs"]  # one bandwidth probe per run
    assert data["meta"]["weight_read"] == by_q["none"] and by_q["int4"]["decode_x_read"] > 0
    single = data["results"]["single"]["quantization"]["int4"]["engine"]
    assert single["decode_step_ms"]["steps"] == single["steps"] - 1  # every step after the prefill
    assert by_q["int4"]["single_decode_step_ms"] == single["decode_step_ms"]["step"]
    for r in data["results"].values():
        q = r["quantization"]
        assert list(q) == ["none", "int8", "int4", "gptq-w4g128"] and q["none"]["ratio"] == 1.0
        assert all(len(m["times_s"]) == 2 and m["baseline"] == "none" for m in q.values())
        assert r["pagedllm"]["time_s"] == q["none"]["time_s"] and q["none"]["greedy_agreement"] == 1.0
        assert q["int4"]["engine"]["steps"] > 0


def test_dtype_list_end_to_end(wide_llama, tmp_path):
    out = tmp_path / "t.json"
    tp.main(["--model", wide_llama, "--quick", "--repeats", "1", "--output", str(out), "--workloads", "single",
             "--skip-hf", "--kv-cache-memory", "16MiB", "--num-threads", "1", "--dtypes", "bfloat16,float32"])
    data = json.loads(out.read_text())
    assert data["meta"]["dtypes"] == ["bfloat16", "float32"] and data["meta"]["engine_kwargs"]["dtype"] == "bfloat16"
    by_d = data["meta"]["weight_read_by_quantization"]
    assert by_d["bfloat16"]["weight_mb"] == pytest.approx(by_d["float32"]["weight_mb"] / 2, rel=1e-3)
    single = data["results"]["single"]["quantization"]
    assert list(single) == ["bfloat16", "float32"] and single["float32"]["baseline"] == "bfloat16"


def test_quantization_results_compute_each_methods_metrics_once(monkeypatch):
    wl = tp.Workload("w", [4, 6], [3, 2], [1])
    run = lambda t, outs: dict(time_s=t, times_s=[t], engine={}, outputs=outs)  # noqa: E731
    paged = {"none": run(2.0, [[1, 2, 3], [4, 5]]), "int8": run(1.0, [[1, 2, 3], [4, 6]]), "int4": run(0.5, [[9], [4]])}
    calls, real = [], tp.metrics
    monkeypatch.setattr(tp, "metrics", lambda *a: calls.append(a[1]) or real(*a))
    res = tp.quantization_results(wl, paged)
    assert calls == [2.0, 1.0, 0.5]  # the baseline's too, once
    assert [res[q]["ratio"] for q in paged] == [1.0, 2.0, 4.0] and {r["baseline"] for r in res.values()} == {"none"}
    for q, r in paged.items():
        assert res[q]["greedy_agreement"] == tp.prefix_agreement(r["outputs"], paged["none"]["outputs"], [3, 2])


def test_cpu_lock_is_shared_for_the_run_and_exclusive_while_timing(tmp_path):
    import fcntl
    path = tmp_path / "cpu.lock"
    lock = tp.CpuLock(path)
    with open(path) as other:
        fcntl.flock(other, fcntl.LOCK_SH | fcntl.LOCK_NB)  # another shared holder (a test run) may work
        fcntl.flock(other, fcntl.LOCK_UN)
        with lock.exclusive():
            with pytest.raises(BlockingIOError):  # while timing, nobody else
                fcntl.flock(other, fcntl.LOCK_SH | fcntl.LOCK_NB)
        with pytest.raises(BlockingIOError):  # back to shared: another timing run waits
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    with tp.CpuLock(None).exclusive():  # no file: no locking
        pass


def test_compare_llamacpp_alternates_a_loaded_worker_and_reports_pair_ratios(llama_dir, tmp_path, monkeypatch):
    """--compare-llamacpp with a stand-in llama_cpp (tests/fake_llamacpp): one worker process
    kept loaded, one ratio per repeat, their median; a missing GGUF is refused by name."""
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parents[1] / "fake_llamacpp"))
    import sys
    argv = ["--model", llama_dir, "--quick", "--repeats", "3", "--workloads", "single", "--skip-hf",
            "--kv-cache-memory", "64MiB", "--num-threads", "2", "--compare-llamacpp", sys.executable]
    with pytest.raises(SystemExit, match="--llamacpp-gguf FILE or --llamacpp-converter"):
        tp.main([*argv, "--output", str(tmp_path / "x.json")])
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    out = tmp_path / "t.json"
    tp.main([*argv, "--llamacpp-gguf", str(gguf), "--output", str(out)])
    lc = json.loads(out.read_text())["results"]["single"]["llamacpp"]
    assert len(lc["pair_ratios"]) == 3 and lc["median_ratio"] == float(np.median(lc["pair_ratios"]))
    assert len(lc["times_s"]) == len(lc["pagedllm_times_s"]) == 3 and lc["output_tok_s"] > 0
    assert lc["worker"]["llama_cpp"] == "fake" and 0 <= lc["greedy_agreement"] <= 1


def test_llamacpp_conversion_without_sentencepiece_says_what_to_install(llama_dir, tmp_path, monkeypatch):
    """The converter's stand-in vocabulary needs sentencepiece: its absence is named, not a bare
    CalledProcessError."""
    import llamacpp_runner  # benchmarks/ is on sys.path once throughput.py is loaded (above)
    monkeypatch.setattr(llamacpp_runner, "STAND_IN_VOCAB", "import sentencepiece_missing_for_this_test")
    with pytest.raises(RuntimeError, match="pip install sentencepiece"):
        llamacpp_runner.stage_with_stand_in_vocab(Path(llama_dir), tmp_path / "model-f32.gguf", {})

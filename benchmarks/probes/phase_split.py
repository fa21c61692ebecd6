"""Where a high-batch run's time goes, prefill vs decode, for pagedllm and vLLM-CPU in one invocation.

A ``throughput.py`` batch64 run (64 x 128 -> 128) is a few prefill steps and 127 decode steps of 64
rows; its end-to-end figure does not say in which phase one system beats the other. This runs, for
both systems on the same model directory and prompt token ids (greedy, ``ignore_eos``; vLLM first,
in its own process group, killed before pagedllm loads, as in ``throughput.py --compare-vllm``):

- ``b64``: 64 x 128 -> 128 (throughput.py's batch64 prompts), ``b64_prefill``: the same prompts -> 1;
- ``b64_dec``: 64 x 1 -> 128 (decode-dominated: contexts 1-128, one 64-token first step);
- ``l16`` / ``l16_prefill``: 16 x 512 -> 128 / -> 1 (throughput.py's long16 prompts).

and derives, from medians of ``--repeats``: prefill seconds = T(x -> 1); decode seconds = T(x -> 128)
- T(x -> 1); ms per decode step = that / 127; and T(b64_dec) / 128. ``--profile-vllm`` also runs
64 x 128 -> 32 once under vLLM's torch profiler after the timed runs (its op table lands in
``<output stem>-vllm/profile``).

    python benchmarks/probes/phase_split.py --repeats 3 --compare-vllm /path/to/V/bin/python [--profile-vllm]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common, attention, ...

import torch  # noqa: E402
from common import (  # noqa: E402  (common also puts this checkout's pagedllm first on sys.path)
    MODEL_CONFIGS,
    RESULTS_DIR,
    add_engine_args,
    default_model_dir,
    engine_kwargs,
    ensure_model,
    format_table,
    make_prompts,
    save_json,
)
from throughput import Workload, median_run, run_paged, warm_workload, workload_seed  # noqa: E402
from vllm_compare import check_block_size, job_workload, make_job, run_vllm  # noqa: E402

from pagedllm.platform import physical_cores  # noqa: E402

VLLM_RUNNER = Path(__file__).resolve().parent / "phase_split_vllm.py"
# name -> (requests, prompt length, output length, prompt seed: throughput.py's workload of that name)
VARIANTS = {
    "b64": (64, 128, 128, "batch64"),
    "b64_prefill": (64, 128, 1, "batch64"),
    "b64_dec": (64, 1, 128, "b64_dec"),
    "l16": (16, 512, 128, "long16"),
    "l16_prefill": (16, 512, 1, "long16"),
}
PHASES = (("b64", "b64_prefill"), ("l16", "l16_prefill"))  # (full, prefill only)
PROFILE_SHAPE = (64, 128, 32)


def workloads(names: list[str]) -> list[Workload]:
    return [Workload(n, [VARIANTS[n][1]] * VARIANTS[n][0], [VARIANTS[n][2]] * VARIANTS[n][0], [])
            for n in names]


def prompts_of(wl: Workload, vocab: int) -> list[list[int]]:
    return make_prompts(wl.prompt_lens, vocab, workload_seed(VARIANTS[wl.name][3]))


def vllm_job(wls: list[Workload], model_dir: Path, vocab: int, args) -> dict:
    jobs = []
    for wl in wls:
        small, warm_prompts = warm_workload(wl, vocab)
        jobs.append(job_workload(wl.name, prompts_of(wl, vocab), wl.output_lens, warm_prompts, small.output_lens))
    job = make_job(model_dir, jobs, args.repeats, args.vllm_block_size, args.dtype)
    if args.profile_vllm:
        n, p, o = PROFILE_SHAPE
        profile_dir = (args.output.parent / f"{args.output.stem}-vllm" / "profile").resolve()
        job["profile"] = dict(dir=str(profile_dir), prompts=make_prompts([p] * n, vocab, 7), output_lens=[o] * n)
    return job


def vllm_side(wls: list[Workload], model_dir: Path, vocab: int, args) -> dict[str, list[float]]:
    t0 = time.perf_counter()
    out = run_vllm(args.compare_vllm, vllm_job(wls, model_dir, vocab, args),
                   args.output.parent / f"{args.output.stem}-vllm", args.num_threads, args.vllm_timeout,
                   runner=VLLM_RUNNER)
    print(f"[vllm] done in {time.perf_counter() - t0:.0f}s (load {out['load_s']:.0f}s); its processes are gone",
          flush=True)
    return {name: r["times_s"] for name, r in out["results"].items()}


def paged_side(wls: list[Workload], model_dir: Path, vocab: int, args) -> dict[str, dict]:
    """Each variant warmed, then ``repeats`` rounds over all variants (alternated); per variant the
    times and the median run's per-step totals and forwards (ms)."""
    from pagedllm import LLM
    llm = LLM(str(model_dir), **engine_kwargs(args))
    for wl in wls:
        small, warm_prompts = warm_workload(wl, vocab)
        run_paged(llm, small, warm_prompts)
    runs: dict[str, list[dict]] = {wl.name: [] for wl in wls}
    for _ in range(args.repeats):
        for wl in wls:
            r = run_paged(llm, wl, prompts_of(wl, vocab))
            log = llm.llm_engine.step_times
            r["steps_ms"] = [1e3 * t for t in log.totals]
            r["forwards_ms"] = [1e3 * t for t in log.forwards]
            runs[wl.name].append(r)
    return {name: _paged_summary(median_run(rs)) for name, rs in runs.items()}


def _paged_summary(run: dict) -> dict:
    return dict(times_s=run["times_s"], steps_ms=run["steps_ms"], forwards_ms=run["forwards_ms"])


def median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def split(times: dict[str, list[float]]) -> dict[str, float]:
    """Prefill s, decode s and ms per decode step from the medians of the full / prefill-only pairs."""
    out = {}
    for full, pre in PHASES:
        if full in times and pre in times:
            t_full, t_pre = median(times[full]), median(times[pre])
            steps = VARIANTS[full][2] - 1
            out.update({f"{full}_s": t_full, f"{full}_prefill_s": t_pre, f"{full}_decode_s": t_full - t_pre,
                        f"{full}_decode_step_ms": 1e3 * (t_full - t_pre) / steps})
    if "b64_dec" in times:
        out["b64_dec_s"] = median(times["b64_dec"])
        out["b64_dec_step_ms"] = 1e3 * out["b64_dec_s"] / VARIANTS["b64_dec"][2]
    return out


def paged_step_split(paged: dict[str, dict]) -> dict[str, float]:
    """From pagedllm's own step log of the full runs: the steps before the last 127 (prefill, possibly
    with decode rows mixed in) and the mean of the last 127 (pure decode), ms."""
    out = {}
    for full, _ in PHASES:
        if full in paged:
            steps, n = paged[full]["steps_ms"], VARIANTS[full][2] - 1
            out[f"{full}_prefill_steps"] = len(steps) - n
            out[f"{full}_prefill_steps_ms"] = sum(steps[:-n])
            out[f"{full}_decode_step_ms_log"] = sum(steps[-n:]) / n
            out[f"{full}_decode_forward_ms_log"] = sum(paged[full]["forwards_ms"][-n:]) / n
    return out


def report(vllm: dict[str, float] | None, paged: dict[str, float]) -> None:
    rows = []
    for key in paged:
        v = None if vllm is None else vllm.get(key)
        p = paged[key]
        unit = "ms" if key.endswith("_ms") else "s"
        rows.append([key, "-" if v is None else f"{v:.3f}", f"{p:.3f}", unit,
                     "-" if v is None else f"{v / p:.2f}x"])
    print(format_table(["quantity", "vLLM-CPU", "pagedllm", "unit", "vLLM time / pagedllm time"], rows))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the random Llama of --model-size)")
    ap.add_argument("--model-size", choices=sorted(MODEL_CONFIGS), default="34m")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--output", type=Path, default=RESULTS_DIR / "phase_split.json")
    ap.add_argument("--compare-vllm", metavar="PYTHON", default=None, help="the python of a venv with vllm-cpu")
    ap.add_argument("--vllm-block-size", type=int, default=32)
    ap.add_argument("--vllm-timeout", type=float, default=1800.0)
    ap.add_argument("--profile-vllm", action="store_true", help="also profile 64 x 128 -> 32 in vLLM")
    add_engine_args(ap)
    args = ap.parse_args(argv)
    args.variants = args.variants.split(",")
    unknown = [v for v in args.variants if v not in VARIANTS]
    if unknown:
        ap.error(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
    try:
        check_block_size(args.vllm_block_size)
    except ValueError as e:
        ap.error(str(e))
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    args.num_threads = args.num_threads or physical_cores()
    torch.set_num_threads(args.num_threads)
    model_dir = Path(args.model) if args.model else ensure_model(default_model_dir(args.model_size),
                                                                 MODEL_CONFIGS[args.model_size])
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    wls = workloads(args.variants)
    vllm_times = vllm_side(wls, model_dir, vocab, args) if args.compare_vllm else None
    paged = paged_side(wls, model_dir, vocab, args)
    paged_split = split({n: r["times_s"] for n, r in paged.items()})
    vllm_split = None if vllm_times is None else split(vllm_times)
    report(vllm_split, paged_split)
    log_split = paged_step_split(paged)
    print("pagedllm step log:", ", ".join(f"{k} {v:.2f}" for k, v in log_split.items()))
    data = dict(model=str(model_dir), engine=engine_kwargs(args), vllm_times_s=vllm_times,
                paged=paged, split=dict(vllm=vllm_split, paged=paged_split, paged_log=log_split))
    save_json(data, args.output)
    print(f"saved {args.output}")
    return data


if __name__ == "__main__":
    main()

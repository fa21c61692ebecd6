"""Engine overhead per step: scheduler, input preparation, model, sampler, output processing.

Runs decode-heavy workloads (batch 1 and batch 64 by default, 128-token prompts) on the
~34M-parameter random Llama (``--model-size 200m``: the ~200M one; ``--quantization int4``: its
projections in 4 bits) and prints where each step's time goes, with the share that is
not model math ("overhead"). Optionally dumps a torch profiler table.

    python benchmarks/profile_step.py [--batches 1,64] [--output-len 64] [--torch-profile]
    python benchmarks/profile_step.py --ops [--ops-batch 64] [--prefill-tokens 2048]
    python benchmarks/profile_step.py --ab-fused --batches 16,32,64,96 --output-len 96

``--ops``: op by op (benchmarks/op_profile.py) for a batch-64 decode step and a 2048-token
prefill step (4 prompts of 512) through the module path: ms per step of each module role, and
for every projection its achieved GFLOP/s next to the best GEMM measured for that shape here.

``--ab-fused``: per batch, decode steps alternated between the one-call C decoder and the
module path in one engine (medians of the step's wall time, and module / decoder).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import MODEL_CONFIGS, default_model_dir, ensure_model, format_table  # noqa: E402  (the random Llamas)
from op_profile import ModuleTimer, best_gemm  # noqa: E402

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.engine.arg_utils import add_engine_args  # noqa: E402


def run(llm: LLM, batch: int, prompt_len: int, output_len: int) -> dict:
    engine = llm.llm_engine
    g = torch.Generator().manual_seed(batch)
    prompts = [{"prompt_token_ids": torch.randint(10, 8000, (prompt_len,), generator=g).tolist()} for _ in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"b{batch}-{i}", p, params)
    sched = engine.scheduler
    while sched.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running):
        engine.step()  # prefill first: we time decode steps only
    from pagedllm.metrics.stats import StepTimes
    engine.step_times = StepTimes()
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    wall = time.perf_counter() - start
    t = engine.step_times
    return dict(batch=batch, steps=t.steps, ms_per_step=1000 * wall / max(1, t.steps),
                tok_s=batch * (output_len - 1) / wall, **{k: 1000 * getattr(t, k) / max(1, t.steps)
                for k in ("schedule", "prepare", "forward", "sample", "update")}, overhead=t.overhead_share)


def ab_fused(llm: LLM, batch: int, prompt_len: int, output_len: int) -> dict:
    """Decode steps alternated in pairs between the one-call C decoder and the module path
    (``fused_decoder`` unset for the step) inside one engine, so both see the same contexts and
    the same machine state; medians of the engine step's wall time."""
    engine, inner = llm.llm_engine, llm.llm_engine.executor.runner.model.model
    fused = inner.fused_decoder
    if fused is None or batch > fused.max_tokens:
        raise SystemExit(f"batch {batch}: the one-call decoder does not take it "
                         f"(limit {None if fused is None else fused.max_tokens})")
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    vocab = min(8000, llm.llm_engine.executor.runner.model.config.vocab_size)
    for i, p in enumerate(_prompts(batch, prompt_len, batch, vocab)):
        engine.add_request(f"ab{batch}-{i}", p, params)
    sched = engine.scheduler
    while sched.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running):
        engine.step()
    times: dict[bool, list[float]] = {True: [], False: []}
    k = 0
    try:
        while engine.has_unfinished_requests():
            on = (k // 2) % 2 == 0  # on, on, off, off, ...: each mode follows each about equally often
            inner.fused_decoder = fused if on else None
            t = time.perf_counter()
            engine.step()
            times[on].append(time.perf_counter() - t)
            k += 1
    finally:
        inner.fused_decoder = fused
    a, b = (1e3 * statistics.median(times[m]) for m in (True, False))
    return dict(batch=batch, fused_ms=a, module_ms=b, speedup=b / a, steps=k)


def _prompts(n: int, length: int, seed: int, vocab: int = 8000) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(10, vocab, (length,), generator=g).tolist()} for _ in range(n)]


def op_decode(llm: LLM, timer: ModuleTimer, batch: int, prompt_len: int, steps: int) -> float:
    """Times ``steps`` decode steps of ``batch`` requests into ``timer``; returns forward ms per step."""
    from pagedllm.metrics.stats import StepTimes
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=steps + 16, ignore_eos=True)  # none ends while timed
    ids = [f"ops-d{i}" for i in range(batch)]
    for rid, p in zip(ids, _prompts(batch, prompt_len, batch)):
        engine.add_request(rid, p, params)
    sched = engine.scheduler
    while sched.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running):
        engine.step()
    engine.step()  # first all-decode step: warm
    timer.reset()
    engine.step_times = StepTimes()
    for _ in range(steps):
        engine.step()
    forward = engine.step_times.forward / steps
    engine.abort_request(ids)
    return 1e3 * forward


def op_prefill(llm: LLM, timer: ModuleTimer, tokens: int, prompt_len: int, repeats: int) -> float:
    """Times ``repeats`` prefill steps of ``tokens`` prompt tokens; returns forward ms per step."""
    from pagedllm.metrics.stats import StepTimes
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    forward = 0.0
    for r in range(repeats + 1):  # the first: warm
        llm.reset_prefix_cache()
        for i, p in enumerate(_prompts(tokens // prompt_len, prompt_len, 1000 + r)):
            engine.add_request(f"ops-p{r}-{i}", p, params)
        if r == 1:
            timer.reset()
        engine.step_times = StepTimes()
        engine.step()
        if engine.step_times.steps != 1 or engine.has_unfinished_requests():
            raise SystemExit(f"{tokens} prompt tokens did not fit one step: raise --max-num-batched-tokens")
        forward += engine.step_times.forward if r else 0.0
    return 1e3 * forward / repeats


def op_rows(timer: ModuleTimer, per: int, forward_ms: float) -> list[list[str]]:
    """One row per (module role, rows): ms per step, share of the forward, GFLOP/s vs the best GEMM."""
    rows, best_cache = [], {}
    for (key, n), sec in sorted(timer.seconds.items(), key=lambda kv: -kv[1]):
        ms = 1e3 * sec / per
        cells = [key, str(n), f"{timer.calls[key, n] / per:g}", f"{ms:.3f}", f"{100 * ms / forward_ms:.1f}%"]
        if key in timer.shapes:
            k, out = timer.shapes[key]
            got = 2 * n * k * out * timer.calls[key, n] / sec / 1e9
            best = best_cache.setdefault((n, k, out), best_gemm(n, k, out))
            name = max(best, key=best.get)
            cells += [f"{got:.0f}", f"{best[name]:.0f} {name}", f"{100 * got / best[name]:.0f}%",
                      " ".join(f"{m}={v:.0f}" for m, v in best.items())]
        rows.append(cells + [""] * (9 - len(cells)))
    return rows


def print_ops(title: str, timer: ModuleTimer, per: int, forward_ms: float) -> None:
    hooked = 1e3 * sum(timer.seconds.values()) / per
    print(f"\n{title}: forward {forward_ms:.2f} ms per step (engine timer; includes input preparation), "
          f"hooked modules {hooked:.2f} ms")
    print(format_table(["op", "rows", "calls", "ms/step", "share", "GFLOP/s", "best here", "of best",
                        "all methods (GFLOP/s, median)"], op_rows(timer, per, forward_ms)))


def run_ops(llm: LLM, args) -> None:
    timer = ModuleTimer(llm.llm_engine.executor.runner.model)
    fwd = op_decode(llm, timer, args.ops_batch, args.prompt_len, args.ops_steps)
    print_ops(f"decode, batch {args.ops_batch}, context {args.prompt_len}+", timer, args.ops_steps, fwd)
    fwd = op_prefill(llm, timer, args.prefill_tokens, args.prefill_prompt_len, args.ops_steps // 4 or 1)
    print_ops(f"prefill, {args.prefill_tokens} tokens ({args.prefill_tokens // args.prefill_prompt_len} x "
              f"{args.prefill_prompt_len})", timer, args.ops_steps // 4 or 1, fwd)
    timer.remove()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--model-size", choices=sorted(MODEL_CONFIGS), default="34m")
    add_engine_args(ap, ["attention_backend", "quantization"])
    ap.add_argument("--torch-profile", action="store_true", help="print torch.profiler's top ops for the last batch")
    ap.add_argument("--ops", action="store_true", help="op-by-op table with GFLOP/s against the best GEMM here")
    ap.add_argument("--ab-fused", action="store_true",
                    help="alternate decode steps between the one-call C decoder and the module path")
    ap.add_argument("--ops-batch", type=int, default=64)
    ap.add_argument("--ops-steps", type=int, default=16, help="decode steps timed (prefill: a quarter as many)")
    ap.add_argument("--prefill-tokens", type=int, default=2048)
    ap.add_argument("--prefill-prompt-len", type=int, default=512)
    args = ap.parse_args(argv)
    model = ensure_model(default_model_dir(args.model_size), MODEL_CONFIGS[args.model_size])
    llm = LLM(str(model), kv_cache_memory="1GiB", attention_backend=args.attention_backend,
              quantization=args.quantization)
    print(f"attention backend: {llm.llm_engine.executor.runner.backend.name}, threads: {torch.get_num_threads()}")
    if args.ops:
        run_ops(llm, args)
        return 0
    if args.ab_fused:
        rows = [ab_fused(llm, int(b), args.prompt_len, args.output_len) for b in args.batches.split(",")]
        print(format_table(["batch", "decode steps", "one-call decoder ms", "module path ms", "module / decoder"],
                           [[r["batch"], r["steps"], f"{r['fused_ms']:.2f}", f"{r['module_ms']:.2f}",
                             f"{r['speedup']:.3f}x"] for r in rows]))
        return 0
    rows = [run(llm, int(b), args.prompt_len, args.output_len) for b in args.batches.split(",")]
    cols = ["batch", "ms_per_step", "tok_s", "schedule", "prepare", "forward", "sample", "update", "overhead"]
    print("  ".join(f"{c:>11}" for c in cols) + "   (phase columns: ms per decode step)")
    for r in rows:
        print("  ".join(f"{r[c]:>11.3f}" if isinstance(r[c], float) else f"{r[c]:>11}" for c in cols))
    if args.torch_profile:
        with torch.profiler.profile() as prof:
            run(llm, int(args.batches.split(",")[-1]), args.prompt_len, 8)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    return 0


if __name__ == "__main__":
    sys.exit(main())

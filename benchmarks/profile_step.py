"""Engine overhead per step: scheduler, input preparation, model, sampler, output processing.

Runs decode-heavy workloads (batch 1 and batch 64 by default, 128-token prompts) on the
~34M-parameter random Llama and prints where each step's time goes, with the share that is
not model math ("overhead"). Optionally dumps a torch profiler table.

    python benchmarks/profile_step.py [--batches 1,64] [--output-len 64] [--torch-profile]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from common import default_model_dir, ensure_model  # noqa: E402  (the shared ~34M random Llama)

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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    add_engine_args(ap, ["attention_backend"])
    ap.add_argument("--torch-profile", action="store_true", help="print torch.profiler's top ops for the last batch")
    args = ap.parse_args(argv)
    llm = LLM(str(ensure_model(default_model_dir())), kv_cache_memory="1GiB", attention_backend=args.attention_backend)
    print(f"attention backend: {llm.llm_engine.executor.runner.backend.name}, threads: {torch.get_num_threads()}")
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

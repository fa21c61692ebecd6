"""Where a workload's time goes, prefill steps vs decode steps, in CPU seconds (issue 39, long16).

On a shared 2-core host, wall-clock step times move 2-3x with the neighbours' load, so this
times each engine step in the process's CPU time instead (``time.process_time``): with one
thread (``--num-threads 1``, the default here) that is the work the step did, whatever else
runs beside it (memory bandwidth contention still shows). The engine's own per-step timers
(``throughput.StepLog``) are read with that clock; the first ``ceil(prompt tokens /
max_num_batched_tokens)`` steps are the prefill steps (their chunks also carry the decodes of
requests whose prompt is done), the rest decode steps::

    python benchmarks/probes/cpu_time_split.py --workload 16x512x128 --repeats 2
    PAGEDLLM_KERNEL_TUNING=off python benchmarks/probes/cpu_time_split.py  # fixed kernel choice

With one thread the start-up's kernel table is a 1-thread one: measured at start-up (and not
cached on a busy host), so ``PAGEDLLM_KERNEL_TUNING=off`` keeps two checkouts' runs on the same
kernels. Greedy outputs are hashed, so runs of two checkouts can be checked for identical tokens.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common, throughput

from common import default_model_dir, ensure_model, make_prompts  # noqa: E402
from throughput import StepLog, paged_generate, workload_seed  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="16x512x128", help="NxPxO: N requests of P prompt and O output tokens")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--num-threads", type=int, default=1)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--seed-name", default="long16", help="throughput.py workload whose prompt seed to use")
    args = ap.parse_args(argv)
    n, prompt_len, output_len = (int(x) for x in args.workload.split("x"))
    time.perf_counter = time.process_time  # the engine's step timers read this clock
    from pagedllm import LLM
    model = default_model_dir()
    ensure_model(model)
    llm = LLM(str(model), dtype="float32", kv_cache_memory="1GiB", seed=0, num_threads=args.num_threads,
              max_num_batched_tokens=args.max_num_batched_tokens)
    vocab = llm.llm_engine.model_config.hf_config.vocab_size
    prompts = make_prompts([prompt_len] * n, vocab, workload_seed(args.seed_name))
    paged_generate(llm, make_prompts([prompt_len] * min(n, 4), vocab, 1), [4] * min(n, 4))  # warm-up
    prefill_steps = -(-n * prompt_len // args.max_num_batched_tokens)
    for _ in range(args.repeats):
        llm.reset_prefix_cache()
        llm.llm_engine.step_times = log = StepLog()
        start = time.process_time()
        out = paged_generate(llm, prompts, [output_len] * n)
        total = time.process_time() - start
        pre, dec = log.forwards[:prefill_steps], log.forwards[prefill_steps:]
        print(f"CPU s: total {total:.2f}, {len(log.forwards)} steps; prefill forward {sum(pre):.2f} "
              f"({' '.join(f'{1e3 * x:.0f}' for x in pre)} ms); decode forward {sum(dec):.2f} (median "
              f"{1e3 * statistics.median(dec):.1f} ms); outside forward {total - sum(log.forwards):.2f}; "
              f"load {os.getloadavg()[0]:.1f}; tokens md5 {hashlib.md5(str(out).encode()).hexdigest()[:12]}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

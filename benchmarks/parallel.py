"""Engine step time: one rank vs tensor parallelism (TP=2) vs pipeline parallelism (PP=2).

Runs the shared ~34M random Llama (common.py) through ``LLMEngine.step()`` in each layout and
times every step: the prefill step (all prompts in one batch), and the decode steps after it.
The cores are split evenly: one rank gets all of them, each of two ranks half. Example::

    python benchmarks/parallel.py --quick        # tiny sizes, a sanity check
    python benchmarks/parallel.py                # 8 x 128 -> 64 and 1 x 128 -> 64
    python benchmarks/parallel.py --layouts 1x1,1x2 --batch 16

What to expect on one host: TP=2 splits every matmul (two all-reduces per layer on gloo); PP=2
splits the layers and a step's batch into two micro-batches that overlap across the stages, so a
step costs at least one stage's share plus the fill / drain bubble and the hidden-state sends. At
batch 1 there is one micro-batch and nothing overlaps: PP only adds a hop. Greedy outputs must be
equal in every layout (``agree``).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))  # benchmarks/common.py

import common  # noqa: E402  (puts this checkout's pagedllm first on sys.path)

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.platform import physical_cores  # noqa: E402


def run_layout(model_dir: Path, tp: int, pp: int, prompts: list[list[int]], max_tokens: int,
               threads: int | None) -> dict:
    """Steps one batch to completion; the prefill step's time and the decode steps' times."""
    threads = threads or max(1, physical_cores() // (tp * pp))
    with LLM(str(model_dir), tensor_parallel_size=tp, pipeline_parallel_size=pp, num_threads=threads,
             kv_cache_memory="512MiB", max_model_len=512, seed=0) as llm:
        engine = llm.llm_engine
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
        times, outputs = [], {}
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = out.outputs[0].token_ids
            times.append(time.perf_counter() - t0)
    decode = times[1:]
    return dict(prefill_s=times[0], decode_p50_s=statistics.median(decode), decode_mean_s=statistics.mean(decode),
                tokens_per_s=len(prompts) * max_tokens / sum(times), threads_per_rank=threads,
                outputs=[outputs[f"r{i}"] for i in range(len(prompts))])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="32-token prompts, 8 new tokens")
    ap.add_argument("--layouts", default="1x1,2x1,1x2", help="TPxPP layouts to compare")
    ap.add_argument("--batch", default="8,1", help="batch sizes (requests in one step)")
    ap.add_argument("--prompt-len", type=int, default=None, help="(default 128; --quick 32)")
    ap.add_argument("--max-tokens", type=int, default=None, help="(default 64; --quick 8)")
    ap.add_argument("--threads-per-rank", type=int, default=None,
                    help="torch threads of every rank (default: the physical cores shared evenly)")
    ap.add_argument("--out", type=Path, default=common.RESULTS_DIR / "parallel.json")
    args = ap.parse_args(argv)
    common.fill_unset(args, dict(prompt_len=32, max_tokens=8), dict(prompt_len=128, max_tokens=64))
    model_dir = common.ensure_model(common.default_model_dir())
    layouts = [tuple(int(x) for x in item.split("x")) for item in args.layouts.split(",")]
    rows, results = [], []
    for batch in (int(b) for b in args.batch.split(",")):
        prompts = common.make_prompts([args.prompt_len] * batch, common.MODEL_CONFIG["vocab_size"], seed=batch)
        base = None
        for tp, pp in layouts:
            r = run_layout(model_dir, tp, pp, prompts, args.max_tokens, args.threads_per_rank)
            base = base or r
            agree = common.prefix_agreement(r["outputs"], base["outputs"], [args.max_tokens] * batch)
            timings = {k: v for k, v in r.items() if k != "outputs"}
            results.append(dict(batch=batch, tp=tp, pp=pp, agree=agree, **timings))
            rows.append([f"{batch}", f"TP={tp} PP={pp}", f"{r['threads_per_rank']}", f"{1e3 * r['prefill_s']:.1f}",
                         f"{1e3 * r['decode_p50_s']:.1f}", f"{r['tokens_per_s']:.1f}", f"{agree:.2f}"])
    print(common.format_table(["batch", "layout", "threads/rank", "prefill ms", "decode p50 ms", "tok/s", "agree"],
                              rows))
    common.save_json(dict(prompt_len=args.prompt_len, max_tokens=args.max_tokens, commit=common.git_commit(),
                          cores=physical_cores(), results=results), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

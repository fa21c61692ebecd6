"""Batch-64 runs of the 34M Llama from a fresh engine, by how its CPU KV pool's pages get faulted
in (``PAGEDLLM_KV_PREFAULT``): ``background`` timed at once (the nice-19 prefault thread still
going), ``background`` after waiting for that thread, and ``startup``. Each mode in its own
process (a fresh pool), one after another::

    python benchmarks/probes/kv_prefault.py [--runs 5]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common, throughput

MODES = [("background", False), ("background", True), ("startup", False)]  # (mode, wait for the prefault)


def one(wait: bool, runs: int) -> None:
    """In the child: start-up time, then ``runs`` timed batch-64 runs."""
    from common import default_model_dir, ensure_model, make_prompts
    from throughput import paged_generate, workload_seed

    from pagedllm import LLM
    start = time.perf_counter()
    model = default_model_dir()
    ensure_model(model)
    llm = LLM(str(model), dtype="float32", seed=0)
    cache = llm.llm_engine.executor.runner.cache
    print(f"start-up {time.perf_counter() - start:.1f} s", flush=True)
    if wait:
        start = time.perf_counter()
        cache.wait_prefaulted()
        print(f"waited {time.perf_counter() - start:.1f} s for the prefault", flush=True)
    vocab = llm.llm_engine.model_config.hf_config.vocab_size
    prompts = make_prompts([128] * 64, vocab, workload_seed("batch64"))
    paged_generate(llm, make_prompts([128] * 4, vocab, 1), [4] * 4)  # warm-up
    for i in range(runs):
        llm.reset_prefix_cache()
        start = time.perf_counter()
        paged_generate(llm, prompts, [128] * 64)
        print(f"run {i}: {time.perf_counter() - start:.2f} s, pool populated: {cache.wait_prefaulted(0)}", flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--child", choices=["wait", "now"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        one(args.child == "wait", args.runs)
        return
    for mode, wait in MODES:
        print(f"== PAGEDLLM_KV_PREFAULT={mode}" + (" (waited for)" if wait else ""), flush=True)
        subprocess.run([sys.executable, __file__, "--runs", str(args.runs), "--child", "wait" if wait else "now"],
                       env=dict(os.environ, PAGEDLLM_KV_PREFAULT=mode), check=True)


if __name__ == "__main__":
    main()

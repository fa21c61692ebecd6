"""Whole-request speed of two checkouts of pagedllm, alternated run by run (issue 39).

Each checkout runs in its own process with its engine loaded (the 34M random Llama of
``benchmarks/common.py``, greedy, EOS ignored); the runs alternate A, B, B, A, ... so both see
the same machine state, and each pair's ratio B / A is reported with the median of the pairs::

    python benchmarks/probes/checkout_ab.py --a /work/main --b . --workloads 1x128x128,64x128x128 --pairs 5

A workload ``NxPxO`` is N requests of P prompt tokens and O output tokens in one ``LLM.generate``
(its set-up and output building included); tok/s counts output tokens over the call's wall time.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

WORKER = r"""
import json, os, sys, time
sys.path.insert(0, os.path.join(sys.argv[1], "benchmarks"))
import common
from pagedllm import LLM, SamplingParams
llm = LLM(str(common.ensure_model(common.default_model_dir())), kv_cache_memory="1GiB", seed=0,
          num_threads=int(sys.argv[2]) or None)
print("@@" + json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    n, p, o = map(int, line.split("x"))
    prompts = [{"prompt_token_ids": x} for x in common.make_prompts([p] * n, 8192, n)]
    params = SamplingParams(temperature=0, max_tokens=o, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = [list(x.outputs[0].token_ids) for x in outs]
    print("@@" + json.dumps({"tok_s": n * o / wall, "tokens": tokens}), flush=True)
"""


class Checkout:
    """A worker process with one checkout's engine loaded."""

    def __init__(self, root: Path, threads: int):
        env = dict(os.environ, PYTHONPATH=str(root))
        self.proc = subprocess.Popen([sys.executable, "-c", WORKER, str(root), str(threads)], env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=root)
        self._read()

    def _read(self) -> dict:
        for line in self.proc.stdout:  # the engine's own prints pass by
            if line.startswith("@@"):
                return json.loads(line[2:])
        raise SystemExit(f"worker exited with {self.proc.wait()}")

    def run(self, workload: str) -> dict:
        self.proc.stdin.write(workload + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", type=Path, required=True, help="baseline checkout")
    ap.add_argument("--b", type=Path, required=True, help="checkout under test")
    ap.add_argument("--workloads", default="1x128x128,64x128x128")
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads in both (0: the engine's default)")
    args = ap.parse_args(argv)
    a, b = Checkout(args.a.resolve(), args.threads), Checkout(args.b.resolve(), args.threads)
    try:
        for w in args.workloads.split(","):
            a.run(w), b.run(w)  # warm-up
            pairs = []
            for i in range(args.pairs):
                first, second = (a, b) if i % 2 == 0 else (b, a)
                r1, r2 = first.run(w), second.run(w)
                ra, rb = (r1, r2) if first is a else (r2, r1)
                if ra["tokens"] != rb["tokens"]:
                    raise SystemExit(f"{w}: the two checkouts' greedy tokens differ")
                pairs.append((ra["tok_s"], rb["tok_s"]))
                print(f"{w} pair {i}: A {ra['tok_s']:.1f} tok/s, B {rb['tok_s']:.1f} tok/s, "
                      f"B/A {rb['tok_s'] / ra['tok_s']:.3f}", flush=True)
            print(f"{w}: A median {statistics.median(p[0] for p in pairs):.1f} tok/s, B median "
                  f"{statistics.median(p[1] for p in pairs):.1f} tok/s, median B/A "
                  f"{statistics.median(p[1] / p[0] for p in pairs):.3f} ({time.strftime('%H:%M:%S')})", flush=True)
    finally:
        a.close(), b.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

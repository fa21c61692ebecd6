"""Does libgomp's wait policy change CPU throughput? The base model's offline throughput (and, with
``--lora N``, the same requests over N adapters) under each ``OMP_WAIT_POLICY`` given, one fresh
process per run (the policy is read when the OpenMP runtime starts), the policies interleaved run
after run, medians. Also prints which libgomp the process maps (torch's and the C library's
``libgomp.so.1`` share one soname, so the loader maps one of them: one OpenMP runtime).

    python benchmarks/probes/omp_wait_policy.py --policies default,passive --repeats 3
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH_DIR.parent))
sys.path.insert(0, str(BENCH_DIR))


def one_run(args: argparse.Namespace) -> dict:
    """In the child: build the engine, warm up, time one generate; JSON on stdout."""
    import re
    import time

    import common

    from pagedllm import LLM, LoRARequest, SamplingParams
    model = common.ensure_model(common.default_model_dir(args.size), common.MODEL_CONFIGS[args.size])
    prompts = [{"prompt_token_ids": p} for p in common.make_prompts([args.input_len] * args.num_requests, 256, 0)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True, detokenize=False)
    kwargs = dict(enable_lora=True, max_loras=args.lora, max_lora_rank=16) if args.lora else {}
    with LLM(str(model), **kwargs) as llm:
        loras = None
        if args.lora:
            from lora import write_adapter
            hf = llm.llm_engine.model_config.hf_config
            paths = [write_adapter(common.CACHE_DIR / f"lora-adapters-{model.name}-r16" / f"a{i}", hf, 16, i)
                     for i in range(args.lora)]
            loras = [LoRARequest(f"a{i % args.lora}", i % args.lora + 1, paths[i % args.lora])
                     for i in range(args.num_requests)]
        llm.generate(prompts[:2], params, lora_request=loras[:2] if loras else None, use_tqdm=False)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
        tok_s = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)
    gomp = sorted(set(re.findall(r"\S*libgomp\S*", Path("/proc/self/maps").read_text())))
    return dict(tok_s=tok_s, libgomp=gomp)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", default="default,passive", help="OMP_WAIT_POLICY values (default: unset)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--size", default="34m")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--lora", type=int, default=0, help="run the requests over this many adapters (0: base)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(one_run(args)))
        return
    import common
    policies = args.policies.split(",")
    runs: dict[str, list[float]] = {p: [] for p in policies}
    maps = set()
    child = [sys.executable, __file__, "--child", "--size", args.size, "--num-requests", str(args.num_requests),
             "--input-len", str(args.input_len), "--output-len", str(args.output_len), "--lora", str(args.lora)]
    for _ in range(args.repeats):
        for policy in policies:
            env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
            if policy != "default":
                env["OMP_WAIT_POLICY"] = policy
            out = subprocess.run(child, env=env, capture_output=True, text=True, check=True).stdout
            result = json.loads(out.strip().splitlines()[-1])
            runs[policy].append(result["tok_s"])
            maps.update(result["libgomp"])
    first = statistics.median(runs[policies[0]])
    rows = [[p, f"{statistics.median(r):.1f}", " ".join(f"{x:.1f}" for x in r), f"{statistics.median(r) / first:.2f}"]
            for p, r in runs.items()]
    print(common.format_table(["OMP_WAIT_POLICY", "median tok/s", "runs", f"vs {policies[0]}"], rows))
    print("libgomp mapped:", ", ".join(sorted(maps)))


if __name__ == "__main__":
    main()

"""Beside a noisy neighbour: each system's speed with one busy-looping process next to it, as a
share of its speed alone (on 2 cores the fair share is 0.5x).

Every system is kept loaded in its own process (a JSON-line worker: ``neighbour.py --serve``
for each pagedllm variant, ``llamacpp_runner.py`` for llama.cpp) and the neighbour is one
``while True: pass`` process, started once and switched with SIGSTOP / SIGCONT. Each pair times
every system alone and beside the neighbour back to back (the order flips every pair, the
systems rotate), so drift on the host moves both halves of a pair; the table gives each pair's
ratio (beside / alone tok/s) and their median, per batch size. Example::

    python benchmarks/neighbour.py --pairs 5 \\
        --llamacpp /work/venvs/llamacpp/bin/python --llamacpp-gguf benchmarks/.cache/llama-34m/model-f32.gguf

pagedllm variants (``--variants``):
  auto    as shipped: pagedllm imported first (``OMP_WAIT_POLICY=PASSIVE`` when the host is
          oversubscribed at start-up) and the thread count following the free cores
  fixed   the behaviour before: torch imported first (libgomp's default wait policy: spin, then
          sleep), ``PAGEDLLM_CPU_OMP_THREADS_BIND=nobind`` (the physical cores, always)
  passive ``fixed`` with ``OMP_WAIT_POLICY=PASSIVE``: the wait policy alone
  pinned  ``PAGEDLLM_CPU_OMP_THREADS_BIND=0-{cores-1}``: one thread pinned per core (vLLM's way)

A batch of B is B requests of ``--input-len`` -> ``--output-len`` tokens (greedy, EOS ignored)
handed over at once: pagedllm batches them, llama-cpp-python serves one sequence at a time, so
its batch 16 is 16 requests in a row. tok/s counts output tokens over the run's wall time.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR.parent))
sys.path.insert(0, str(BENCH_DIR))

VARIANTS = ("auto", "fixed", "passive", "pinned")
BUSY_LOOP = "while True: pass"


def variant_env(variant: str, cores: int, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a pagedllm worker of ``variant`` starts in."""
    env = {k: v for k, v in (os.environ if base is None else base).items()
           if k not in ("OMP_WAIT_POLICY", "PAGEDLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_OMP_THREADS_BIND")}
    if variant in ("fixed", "passive"):
        env["PAGEDLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    if variant == "passive":
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    if variant == "pinned":
        env["PAGEDLLM_CPU_OMP_THREADS_BIND"] = f"0-{cores - 1}" if cores > 1 else "0"
    return env


# --------------------------------------------------------------------------- the pagedllm worker
def serve(args: argparse.Namespace) -> None:
    """``--serve``: one pagedllm engine, loaded once, answering JSON lines on stdin."""
    # fixed / passive: torch first, so libgomp loads with the environment as given (as before);
    # auto / pinned: pagedllm first, so it can choose the wait policy
    order = ("torch", "pagedllm") if args.variant in ("fixed", "passive") else ("pagedllm", "torch")
    for name in order:
        importlib.import_module(name)
    import torch

    from pagedllm import LLM, SamplingParams, cpu_threads
    setup = cpu_threads.configure_openmp()
    llm = LLM(args.model, max_num_seqs=max(16, args.max_batch), kv_cache_memory="512MiB", enable_prefix_caching=False)
    print(json.dumps({"ready": True, "variant": args.variant, "wait_policy": setup.wait_policy, "why": setup.why,
                      "threads": torch.get_num_threads(), "openmp": cpu_threads.openmp_runtimes()}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)
                  for n in job["output_lens"]]
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in job["prompts"]], params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        print(json.dumps({"time_s": elapsed, "outputs": [list(o.outputs[0].token_ids) for o in outs],
                          "threads": torch.get_num_threads()}), flush=True)


# --------------------------------------------------------------------------- the driver
class Neighbour:
    """One busy-looping process, stopped until ``on()``."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", BUSY_LOOP])
        os.kill(self.proc.pid, signal.SIGSTOP)

    def on(self, settle_s: float) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)
        time.sleep(settle_s)

    def off(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def start_workers(args, model_dir: Path, cores: int) -> dict:
    from common import JsonLineWorker
    workers = {}
    for v in args.variants:
        cmd = [sys.executable, __file__, "--serve", "--variant", v, "--model", str(model_dir),
               "--max-batch", str(max(args.batches))]
        workers[f"pagedllm-{v}"] = JsonLineWorker(cmd, f"pagedllm-{v}", variant_env(v, cores))
    if args.llamacpp:
        from throughput import LlamaCppWorker
        n_ctx = args.input_len + args.output_len + 16
        workers["llama.cpp"] = LlamaCppWorker(args.llamacpp, args.llamacpp_gguf, args.llamacpp_threads or cores, n_ctx)
    return workers


def one_pair(workers: dict, neighbour: Neighbour, jobs: dict, pair: int, args) -> dict:
    """Every system at every batch size, alone and beside the neighbour: ``{(system, batch): {alone,
    beside: tok/s, alone_threads, beside_threads}}``."""
    out = {}
    names = list(workers)
    names = names[pair % len(names):] + names[:pair % len(names)]  # rotate who goes first
    for batch, (prompts, lens) in jobs.items():
        for name in names:
            got = {}
            for cond in (("alone", "beside") if pair % 2 == 0 else ("beside", "alone")):
                neighbour.on(args.settle) if cond == "beside" else neighbour.off()
                r = workers[name].run(prompts, lens)
                got[cond] = sum(lens) / r["time_s"]
                got[cond + "_threads"] = r.get("threads")
            neighbour.off()
            out[(name, batch)] = got
            print(f"pair {pair} batch {batch} {name}: alone {got['alone']:.1f} beside {got['beside']:.1f} tok/s "
                  f"-> {got['beside'] / got['alone']:.2f}x (threads {got['alone_threads']}/{got['beside_threads']})",
                  flush=True)
    return out


def summarize(pairs: list[dict]) -> dict:
    keys = list(pairs[0])
    res = {}
    for name, batch in keys:
        rows = [p[(name, batch)] for p in pairs]
        ratios = [r["beside"] / r["alone"] for r in rows]
        res.setdefault(name, {})[str(batch)] = dict(
            alone_tok_s=[r["alone"] for r in rows], beside_tok_s=[r["beside"] for r in rows], pair_ratios=ratios,
            median_ratio=statistics.median(ratios), median_alone=statistics.median(r["alone"] for r in rows),
            median_beside=statistics.median(r["beside"] for r in rows),
            threads_alone=[r["alone_threads"] for r in rows], threads_beside=[r["beside_threads"] for r in rows])
    return res


def table(res: dict, batches: list[int]) -> str:
    from common import format_table
    rows = []
    for name, by_batch in res.items():
        for b in batches:
            r = by_batch[str(b)]
            rows.append([name, str(b), f"{r['median_alone']:.1f}", f"{r['median_beside']:.1f}",
                         " ".join(f"{x:.2f}" for x in r["pair_ratios"]), f"{r['median_ratio']:.2f}x"])
    return format_table(["system", "batch", "alone tok/s", "beside tok/s", "pair ratios", "median"], rows)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint dir (default: build/reuse the random 34M Llama)")
    ap.add_argument("--variants", default="auto,fixed", help=f"pagedllm variants, comma-separated, of {VARIANTS}")
    ap.add_argument("--batches", default="1,16", help="batch sizes, comma-separated")
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--pairs", type=int, default=5, help="alone/beside pairs per system and batch")
    ap.add_argument("--settle", type=float, default=1.0, help="seconds the neighbour runs before a timed run")
    ap.add_argument("--llamacpp", metavar="PYTHON", default=None, help="Python of a venv with llama-cpp-python")
    ap.add_argument("--llamacpp-gguf", type=Path, default=None, help="F32 GGUF of the same checkpoint")
    ap.add_argument("--llamacpp-threads", type=int, default=None, help="llama.cpp's n_threads (default: the cores)")
    ap.add_argument("--output", type=Path, default=None, help="JSON (default benchmarks/results/neighbour.json)")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--variant", default="auto", help=argparse.SUPPRESS)
    ap.add_argument("--max-batch", type=int, default=16, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        return args
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad:
        ap.error(f"--variants: {bad} not among {VARIANTS}")
    args.batches = [int(b) for b in args.batches.split(",")]
    if min(args.batches) < 1 or args.pairs < 1:
        ap.error("--batches and --pairs must be >= 1")
    if args.llamacpp and args.llamacpp_gguf is None:
        ap.error("--llamacpp needs --llamacpp-gguf (convert with throughput.py --compare-llamacpp "
                 "--llamacpp-converter ...)")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.serve:
        serve(args)
        return {}
    import common

    from pagedllm import cpu_threads
    from pagedllm.platform import physical_cores
    cores = min(physical_cores(), len(cpu_threads.allowed_cpus()))
    model_dir = Path(args.model) if args.model else common.ensure_model(common.default_model_dir("34m"),
                                                                        common.MODEL_CONFIGS["34m"])
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    jobs = {b: (common.make_prompts([args.input_len] * b, vocab, b), [args.output_len] * b) for b in args.batches}
    load_before = os.getloadavg()
    neighbour, workers = Neighbour(), {}
    try:
        workers = start_workers(args, model_dir, cores)
        for w in workers.values():  # warm: first-call costs out of the timed runs
            w.run(*jobs[min(args.batches)])
        pairs = [one_pair(workers, neighbour, jobs, i, args) for i in range(args.pairs)]
    finally:
        for w in workers.values():
            w.close()
        neighbour.close()
    res = summarize(pairs)
    meta = dict(date=datetime.now(timezone.utc).isoformat(timespec="seconds"), git_commit=common.git_commit(),
                cpu=_cpu_model(), cores=cores, cpus=os.cpu_count(), load_before=load_before,
                load_after=os.getloadavg(), input_len=args.input_len, output_len=args.output_len,
                workers={k: w.info for k, w in workers.items()})
    print(f"\n{meta['cpu']}, {cores} cores; load average before {load_before[0]:.1f}, after "
          f"{meta['load_after'][0]:.1f}; {args.input_len} -> {args.output_len} tokens per request")
    print(table(res, args.batches))
    out = args.output or common.RESULTS_DIR / "neighbour.json"
    common.save_json(dict(meta=meta, results=res), out)
    print(f"\nsaved {out}")
    return res


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    main()

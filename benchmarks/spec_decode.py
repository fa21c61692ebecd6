"""Speculative decoding at batch 1: n-gram proposals on copy-heavy and on random prompts,
speculation on vs off in the same run. Example::

    python benchmarks/spec_decode.py --quick     # tiny sizes, a sanity check
    python benchmarks/spec_decode.py             # defaults below
    python benchmarks/spec_decode.py --model pagedllm-demo --num-speculative-tokens 6

Workloads (``--num-prompts`` requests each, run one at a time, greedy, EOS ignored, ``--output-len``
tokens each):
  copy    prompts whose answer repeats text from the prompt. A model with random weights does not
          follow "repeat the following text", so each prompt is built from the model's own greedy
          text: a random seed of ``--input-len`` - ``--lead-len`` tokens is continued for
          ``--lead-len`` + ``--output-len`` tokens (plain engine, not timed); the prompt is the seed
          plus the first ``--lead-len`` of them, so the answer is the rest (greedy is
          deterministic), and it repeats the prompt wherever the model's text repeats itself.
          ``answer in prompt`` is the share of the answer's 4-grams found in its prompt. (The random
          34M Llama's greedy text never repeats itself; the bundled demo model, trained on the KJV,
          loops like small trained models do.)
  random  random token ids of ``--input-len``.

Each (workload, speculation on/off) pair is timed ``--repeats`` times (3), alternating engines,
and the median is reported; both engines share the process (same weights, threads).
``out tok/s`` = output tokens / request time (prefill included, as throughput.py's batch-1 figure);
``decode tok/s`` = tokens after the first / time after the first token. ``same``: the two
engines' outputs are identical (greedy: they must be).
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR.parent))  # this checkout's pagedllm, not whatever is installed
sys.path.insert(0, str(BENCH_DIR))  # benchmarks/common.py

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import common  # noqa: E402  (the shared 34M random Llama, engine options, tables, JSON)
import numpy as np  # noqa: E402
import torch  # noqa: E402

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.platform import physical_cores  # noqa: E402

QUICK_DIV = 8


# --------------------------------------------------------------------------- workloads


def copy_prompts(plain: LLM, seeds: list[list[int]], lead: int, out_len: int) -> list[list[int]]:
    """Seed + the first ``lead`` tokens of the model's own greedy continuation of it."""
    params = SamplingParams(temperature=0, max_tokens=lead + out_len, ignore_eos=True, detokenize=False)
    outs = plain.generate([{"prompt_token_ids": s} for s in seeds], params, use_tqdm=False)
    return [s + list(o.outputs[0].token_ids[:lead]) for s, o in zip(seeds, outs)]


def ngram_share(prompt: list[int], answer: list[int], n: int = 4) -> float:
    """Share of the answer's n-grams that occur in the prompt."""
    seen = {tuple(prompt[i:i + n]) for i in range(len(prompt) - n + 1)}
    grams = [tuple(answer[i:i + n]) for i in range(len(answer) - n + 1)]
    return sum(g in seen for g in grams) / len(grams) if grams else 0.0


# --------------------------------------------------------------------------- timing


def run_once(llm: LLM, prompts: list[list[int]], out_len: int) -> tuple[float, float, list[list[int]]]:
    """Output tok/s and decode tok/s over the prompts served one at a time, and their outputs."""
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True, detokenize=False)
    outputs, elapsed, decoding = [], 0.0, 0.0
    for p in prompts:
        t0 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0]
        elapsed += time.perf_counter() - t0
        decoding += out.metrics.last_token_time - out.metrics.first_token_time
        outputs.append(list(out.outputs[0].token_ids))
    return len(prompts) * out_len / elapsed, len(prompts) * (out_len - 1) / decoding, outputs


def spec_counters(llm: LLM) -> tuple[float, float]:
    m = {x.name: x.value for x in llm.get_metrics() if not x.labels}
    return m.get("pagedllm:spec_decode_num_draft_tokens", 0), m.get("pagedllm:spec_decode_num_accepted_tokens", 0)


def bench_workload(engines: dict[str, LLM], prompts: list[list[int]], args) -> dict:
    """Median tok/s of each engine over ``repeats`` alternating runs, acceptance, output identity."""
    speeds = {name: [] for name in engines}  # per run: (output tok/s, decode tok/s)
    outputs = {}
    before = spec_counters(engines["ngram"])
    for _ in range(args.repeats):
        for name, llm in engines.items():
            *tok_s, outputs[name] = run_once(llm, prompts, args.output_len)
            speeds[name].append(tok_s)
    after = spec_counters(engines["ngram"])
    drafted, accepted = after[0] - before[0], after[1] - before[1]
    med = {name: np.median(np.array(v), axis=0).tolist() for name, v in speeds.items()}
    return dict(plain_tok_s=med["plain"][0], ngram_tok_s=med["ngram"][0], speedup=med["ngram"][0] / med["plain"][0],
                plain_decode_tok_s=med["plain"][1], ngram_decode_tok_s=med["ngram"][1],
                decode_speedup=med["ngram"][1] / med["plain"][1],
                runs_tok_s=speeds, draft_tokens=drafted, acceptance=accepted / drafted if drafted else 0.0,
                identical=outputs["plain"] == outputs["ngram"],
                answer_in_prompt=float(np.mean([ngram_share(p, o) for p, o in zip(prompts, outputs["plain"])])))


# --------------------------------------------------------------------------- main


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint dir or 'pagedllm-demo' (default: build/reuse the "
                    "random 34M Llama)")
    ap.add_argument("--quick", action="store_true", help=f"lengths / {QUICK_DIV}, 2 prompts, 2 repeats")
    ap.add_argument("--input-len", type=int, default=None, help="prompt tokens (default 128)")
    ap.add_argument("--lead-len", type=int, default=None, help="copy workload: model text at the end of the "
                    "prompt (default 96)")
    ap.add_argument("--output-len", type=int, default=None, help="output tokens per request (default 128)")
    ap.add_argument("--num-prompts", type=int, default=None, help="prompts per workload (default 4)")
    ap.add_argument("--repeats", type=int, default=None, help="timed runs per engine, median taken (default 3)")
    ap.add_argument("--num-speculative-tokens", type=int, default=8)
    ap.add_argument("--prompt-lookup-max", type=int, default=4)
    ap.add_argument("--prompt-lookup-min", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", type=Path, default=None,
                    help="JSON path (default results/spec_decode[-MODEL].json, -quick before .json with --quick)")
    common.add_engine_args(ap)
    args = ap.parse_args(argv)
    q = QUICK_DIV if args.quick else 1
    args.input_len = args.input_len or 128 // q
    args.lead_len = args.lead_len or 96 // q
    if not 0 < args.lead_len < args.input_len:
        raise SystemExit(f"--lead-len {args.lead_len} must be in (0, --input-len {args.input_len})")
    args.output_len = args.output_len or 128 // q
    args.num_prompts = args.num_prompts or (2 if args.quick else 4)
    args.repeats = args.repeats or (2 if args.quick else 3)
    # one file per model: the demo model's run and the random Llama's must not overwrite each other
    stem = "spec_decode" if args.model is None else f"spec_decode-{Path(args.model).name}"
    name = f"{stem}-quick.json" if args.quick else f"{stem}.json"
    args.output = args.output or common.RESULTS_DIR / name
    return args


def make_engines(model: str, args) -> dict[str, LLM]:
    spec = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
            "prompt_lookup_max": args.prompt_lookup_max, "prompt_lookup_min": args.prompt_lookup_min}
    # no prefix caching: every repeat recomputes its prompt, as the first run did
    kwargs = {**common.engine_kwargs(args), "enable_prefix_caching": False}
    return {"plain": LLM(model, **kwargs), "ngram": LLM(model, speculative_config=spec, **kwargs)}


def main(argv=None) -> dict:
    args = parse_args(argv)
    args.num_threads = args.num_threads or physical_cores()
    torch.set_num_threads(args.num_threads)
    model = args.model or str(common.ensure_model(common.default_model_dir()))
    engines = make_engines(model, args)
    vocab = engines["plain"].llm_engine.model_config.vocab_size
    seeds = common.make_prompts([args.input_len - args.lead_len] * args.num_prompts, vocab, args.seed)
    workloads = {"copy": copy_prompts(engines["plain"], seeds, args.lead_len, args.output_len),
                 "random": common.make_prompts([args.input_len] * args.num_prompts, vocab, args.seed + 1)}
    for llm in engines.values():  # warm-up: first-call costs out of the timings
        run_once(llm, workloads["random"][:1], min(8, args.output_len))
    results = {}
    for name, prompts in workloads.items():
        t0 = time.perf_counter()
        results[name] = bench_workload(engines, prompts, args)
        print(f"[{name}] done in {time.perf_counter() - t0:.1f}s", flush=True)
    meta = run_meta(args, model)
    print_report(results, meta)
    common.save_json(dict(meta=meta, results=results), args.output)
    print(f"\nsaved {args.output}")
    return results


def print_report(results: dict, meta: dict) -> None:
    print(f"\nbatch 1, n-gram k={meta['num_speculative_tokens']} (lookup {meta['prompt_lookup_min']}.."
          f"{meta['prompt_lookup_max']}), {meta['output_len']} output tokens, median of {meta['repeats']}, "
          f"{meta['threads']} threads, {meta['model']}")
    headers = ["workload", "plain out tok/s", "ngram out tok/s", "speedup", "plain decode tok/s",
               "ngram decode tok/s", "speedup", "acceptance", "answer in prompt", "same"]
    rows = [[name, f"{r['plain_tok_s']:.1f}", f"{r['ngram_tok_s']:.1f}", f"{r['speedup']:.2f}x",
             f"{r['plain_decode_tok_s']:.1f}", f"{r['ngram_decode_tok_s']:.1f}", f"{r['decode_speedup']:.2f}x",
             f"{100 * r['acceptance']:.0f}%", f"{100 * r['answer_in_prompt']:.0f}%", "yes" if r["identical"] else "NO"]
            for name, r in results.items()]
    print(common.format_table(headers, rows))


def run_meta(args, model: str) -> dict:
    return dict(date=datetime.now(timezone.utc).isoformat(timespec="seconds"), model=model, quick=args.quick,
                threads=args.num_threads, input_len=args.input_len, lead_len=args.lead_len,
                output_len=args.output_len, num_prompts=args.num_prompts, repeats=args.repeats,
                num_speculative_tokens=args.num_speculative_tokens, prompt_lookup_max=args.prompt_lookup_max,
                prompt_lookup_min=args.prompt_lookup_min, seed=args.seed, torch=torch.__version__,
                python=platform.python_version(), cpu=platform.processor() or platform.machine(),
                cpu_count=os.cpu_count(), engine_kwargs=common.engine_kwargs(args), git_commit=common.git_commit())


if __name__ == "__main__":
    main()

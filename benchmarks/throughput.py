"""Offline throughput: pagedllm ``LLM.generate`` vs Hugging Face transformers ``generate``.

Both systems run the same random-weight checkpoint on the same random prompt token ids, greedy,
with EOS ignored, in one process, alternating run by run. Example::

    python benchmarks/throughput.py --quick              # tiny sizes, < 3 min on 2 cores
    python benchmarks/throughput.py                      # full sizes (see benchmarks/README.md)
    python benchmarks/throughput.py --workloads batch64,mixed32 --max-num-seqs 32

Workloads (full sizes; ``--quick`` divides request counts and lengths by 8):
  single      1 request, 128 -> 128              HF: batch 1
  batch64     64 requests, 128 -> 128            HF: static batches of 64 and of 16
  long16      16 requests, 512 -> 128            HF: batch 16
  mixed32     32 requests, 128 -> 16..256        HF: batch 32, every row runs to the longest
  prefill512  1 request, 512 -> 1 (prompt tok/s) HF: batch 1
The headline metric is output tok/s (for mixed32: *useful* output tok/s = requested tokens /
time; for prefill512: prompt tok/s). Ratio = pagedllm / transformers on that metric.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import zlib
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's pagedllm, not whatever is installed

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from pagedllm.metrics.stats import StepTimes  # noqa: E402

BENCH_DIR = Path(__file__).resolve().parent
CACHE_DIR = BENCH_DIR / ".cache"
RESULTS_DIR = BENCH_DIR / "results"
QUICK_DIV = 8

# ~34M parameters: 8 x 3.15M (layers) + 2 x 4.19M (untied embeddings and lm_head).
MODEL_CONFIG = dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                    num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
                    rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                    pad_token_id=0, initializer_range=0.05)
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")


# --------------------------------------------------------------------------- workloads


@dataclass
class Workload:
    name: str
    num_requests: int
    prompt_len: int
    output_lens: list[int]
    hf_batch_sizes: list[int]
    headline: str = "output"  # "output" | "useful" | "prompt"
    description: str = ""

    @property
    def prompt_tokens(self) -> int:
        return self.num_requests * self.prompt_len

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def _q(x: int, quick: bool, lo: int = 1) -> int:
    return max(lo, x // QUICK_DIV) if quick else x


def mixed_lengths(n: int, lo: int, hi: int, seed: int = 0) -> list[int]:
    """n lengths evenly spread over [lo, hi] (both ends included), shuffled with a fixed seed."""
    lens = np.rint(np.linspace(lo, hi, n)).astype(int).tolist()
    np.random.default_rng(seed).shuffle(lens)
    return lens


def build_workloads(quick: bool) -> dict[str, Workload]:
    q = lambda x, lo=1: _q(x, quick, lo)  # noqa: E731
    p128, o128, p512 = q(128, 4), q(128, 2), q(512, 4)
    n64, n16, n32 = q(64, 2), q(16, 2), q(32, 4)
    wls = [
        Workload("single", 1, p128, [o128], [1], description="1 request, decode-bound latency path"),
        Workload("batch64", n64, p128, [o128] * n64, [n64, q(16, 2)], description="many equal requests"),
        Workload("long16", n16, p512, [o128] * n16, [n16], description="long prompts"),
        Workload("mixed32", n32, p128, mixed_lengths(n32, q(16, 2), q(256, 4)), [n32], "useful",
                 description="output lengths spread evenly; static batches pad to the longest"),
        Workload("prefill512", 1, p512, [1], [1], "prompt", description="prompt processing only"),
    ]
    return {w.name: w for w in wls}


def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Random ids in [len(SPECIAL_TOKENS), vocab): no pad/bos/eos inside a prompt."""
    rng = np.random.default_rng(seed)
    return rng.integers(len(SPECIAL_TOKENS), vocab, size=(n, length)).tolist()


def workload_seed(name: str) -> int:
    return zlib.crc32(name.encode())


# --------------------------------------------------------------------------- model


def _tokenizer(vocab_size: int):
    """Word-level tokenizer ``<pad> <s> </s> t3 t4 ...``: every model id decodes to a word."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    vocab.update({f"t{i}": i for i in range(len(SPECIAL_TOKENS), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<pad>")


def default_model_dir() -> Path:
    key = zlib.crc32(json.dumps(MODEL_CONFIG, sort_keys=True).encode())
    return CACHE_DIR / f"llama-34m-random-{key:08x}"


def ensure_model(path: Path) -> Path:
    """Builds the random checkpoint once (seed 0) into ``path``; a finished one is reused."""
    if (path / "config.json").exists():
        return path
    import transformers as tf
    tmp = path.with_name(path.name + ".tmp")
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**MODEL_CONFIG)).to(torch.float32)
    model.save_pretrained(tmp, safe_serialization=True)
    _tokenizer(MODEL_CONFIG["vocab_size"]).save_pretrained(tmp)
    os.replace(tmp, path)
    print(f"built {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M-parameter model in {path}")
    return path


# --------------------------------------------------------------------------- pagedllm side


def engine_kwargs(args) -> dict:
    kw = dict(kv_cache_memory=args.kv_cache_memory, block_size=args.block_size, seed=0, dtype="float32",
              attention_backend=args.attention_backend, num_threads=args.num_threads, device=args.device)
    if args.max_num_seqs is not None:
        kw["max_num_seqs"] = args.max_num_seqs
    if args.max_num_batched_tokens is not None:
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    return kw


def make_llm(model_dir: Path, args):
    from pagedllm import LLM
    return LLM(str(model_dir), **engine_kwargs(args))


def paged_generate(llm, prompts, output_lens) -> list[list[int]]:
    from pagedllm import SamplingParams
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outs]
    assert [len(g) for g in got] == list(output_lens), "pagedllm returned the wrong number of tokens"
    return got


def _engine_snapshot(engine) -> dict:
    c = engine.counters
    return dict(steps=c.num_steps, prompt_tokens=c.prompt_tokens, generation_tokens=c.generation_tokens,
                preemptions=engine.scheduler.stats.num_preemptions,
                prefix_hits=engine.get_kv_cache_stats().prefix_cache_hits)


def per_step_ms(t) -> dict[str, float]:
    """The engine's StepTimes as ms per step. On CUDA, kernels still running after the forward
    call are counted in ``sample`` (its .tolist() is the first synchronisation)."""
    parts = {k: getattr(t, k) for k in ("schedule", "prepare", "forward", "sample", "update")}
    parts["step"] = t.total
    return {k: 1e3 * v / max(1, t.steps) for k, v in parts.items()}


def run_paged(llm, wl: Workload, prompts) -> dict:
    """One timed pagedllm run from an empty cache; returns time, outputs and engine stats."""
    engine = llm.llm_engine
    llm.reset_prefix_cache()  # repeats reuse the prompts: no run may hit an earlier run's blocks
    engine.counters.peak_used_blocks = 0
    engine.step_times = StepTimes()  # the engine's own per-phase timers
    before = _engine_snapshot(engine)
    t0 = time.perf_counter()
    outputs = paged_generate(llm, prompts, wl.output_lens)
    elapsed = time.perf_counter() - t0
    after = _engine_snapshot(engine)
    stats = {k: after[k] - before[k] for k in after}
    stats["peak_used_blocks"] = engine.counters.peak_used_blocks  # recorded right after scheduling
    stats["step_ms"] = per_step_ms(engine.step_times)
    stats["outside_step_ms_total"] = 1e3 * (elapsed - engine.step_times.total)
    return dict(time_s=elapsed, outputs=outputs, engine=stats)


def engine_info(llm) -> dict:
    e = llm.llm_engine
    kv = e.get_kv_cache_stats()
    return dict(num_blocks=kv.num_blocks, block_size=kv.block_size,
                attention_backend=type(e.executor.runner.backend).__name__,
                max_num_seqs=e.config.scheduler.max_num_seqs,
                max_num_batched_tokens=e.config.scheduler.max_num_batched_tokens,
                enable_prefix_caching=e.config.cache.enable_prefix_caching, device=str(e.config.device))


# --------------------------------------------------------------------------- transformers side


def load_hf(model_dir: Path, device: str):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    # ignore_eos as pagedllm/vLLM mean it: EOS may be generated and does not stop. (min_new_tokens
    # would instead mask EOS, and greedy outputs would differ wherever EOS is the argmax.)
    model.generation_config.eos_token_id = None
    return model


def hf_generate(model, prompts, output_lens, batch_size: int, device: str) -> list[list[int]]:
    """Static batches in request order; each batch runs to its longest requested length."""
    outs = []
    for i in range(0, len(prompts), batch_size):
        ids = torch.tensor(prompts[i:i + batch_size], device=device)  # equal lengths: no padding
        new = max(output_lens[i:i + batch_size])
        with torch.inference_mode():
            seq = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=new, pad_token_id=0)
        assert seq.shape[1] == ids.shape[1] + new, "transformers stopped early"
        outs += seq[:, ids.shape[1]:].tolist()
    return outs


def run_hf(model, wl: Workload, prompts, batch_size: int, device: str) -> dict:
    t0 = time.perf_counter()
    outputs = hf_generate(model, prompts, wl.output_lens, batch_size, device)
    _sync_fn(device)()
    return dict(time_s=time.perf_counter() - t0, outputs=outputs)


# --------------------------------------------------------------------------- measuring


def _sync_fn(device: str):
    if str(device).startswith("cuda") or (device == "auto" and torch.cuda.is_available()):
        return torch.cuda.synchronize
    return lambda: None


def metrics(wl: Workload, time_s: float, generated: int) -> dict:
    """Throughputs for one run; ``generated`` counts every token produced (incl. padding rows)."""
    return dict(time_s=time_s, output_tok_s=generated / time_s, useful_output_tok_s=wl.output_tokens / time_s,
                total_tok_s=(wl.prompt_tokens + generated) / time_s, prompt_tok_s=wl.prompt_tokens / time_s,
                generated_tokens=generated, padding_share=1 - wl.output_tokens / generated)


def headline(wl: Workload, m: dict) -> float:
    return m[{"output": "output_tok_s", "useful": "useful_output_tok_s", "prompt": "prompt_tok_s"}[wl.headline]]


def prefix_agreement(a: list[list[int]], b: list[list[int]], lens: list[int]) -> float:
    """Mean fraction of each request's requested tokens on which the two greedy outputs agree."""
    fracs = []
    for x, y, n in zip(a, b, lens):
        k = next((i for i, (u, v) in enumerate(zip(x[:n], y[:n])) if u != v), n)
        fracs.append(k / n)
    return float(np.mean(fracs))


def median_run(runs: list[dict]) -> dict:
    """The run with the median time (upper median for an even count), with all times attached."""
    ranked = sorted(runs, key=lambda r: r["time_s"])
    best = dict(ranked[len(ranked) // 2])
    best["times_s"] = [r["time_s"] for r in runs]
    return best


def bench_workload(wl: Workload, llm, hf, vocab: int, args) -> dict:
    prompts = make_prompts(wl.num_requests, wl.prompt_len, vocab, workload_seed(wl.name))
    warm(wl, llm, hf, vocab, args)
    paged_runs, hf_runs = [], defaultdict(list)
    for _ in range(args.repeats):  # alternate the systems so machine noise hits both alike
        paged_runs.append(run_paged(llm, wl, prompts))
        for bs in ([] if hf is None else wl.hf_batch_sizes):
            hf_runs[bs].append(run_hf(hf, wl, prompts, bs, args.device))
    return summarize(wl, median_run(paged_runs), {bs: median_run(r) for bs, r in hf_runs.items()})


def warm(wl: Workload, llm, hf, vocab: int, args) -> None:
    """A small untimed run of each system on this workload's shapes (other prompts)."""
    n = min(wl.num_requests, 4)
    prompts = make_prompts(n, wl.prompt_len, vocab, workload_seed(wl.name) + 1)
    small = Workload(wl.name, n, wl.prompt_len, [min(4, x) for x in wl.output_lens[:n]], [n])
    run_paged(llm, small, prompts)
    if hf is not None:
        run_hf(hf, small, prompts, n, args.device)


def summarize(wl: Workload, paged: dict, hf: dict[int, dict]) -> dict:
    p = metrics(wl, paged["time_s"], wl.output_tokens)
    res = dict(workload=_wl_json(wl), pagedllm=dict(**p, times_s=paged["times_s"], engine=paged["engine"]),
               transformers={})
    for bs, run in hf.items():
        generated = sum(max(wl.output_lens[i:i + bs]) * len(wl.output_lens[i:i + bs])
                        for i in range(0, wl.num_requests, bs))
        m = metrics(wl, run["time_s"], generated)
        m.update(times_s=run["times_s"], batch_size=bs,
                 ratio=headline(wl, p) / headline(wl, m),
                 greedy_agreement=prefix_agreement(paged["outputs"], run["outputs"], wl.output_lens))
        res["transformers"][f"bs{bs}"] = m
    return res


def _wl_json(wl: Workload) -> dict:
    return dict(num_requests=wl.num_requests, prompt_len=wl.prompt_len, output_lens=wl.output_lens,
                hf_batch_sizes=wl.hf_batch_sizes, headline=wl.headline, description=wl.description)


# --------------------------------------------------------------------------- reporting


def format_table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]
    line = lambda r: "  ".join(str(x).rjust(w) if i else str(x).ljust(w)  # noqa: E731
                               for i, (x, w) in enumerate(zip(r, widths))).rstrip()
    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])


def _shape(wl: dict) -> str:
    lens = wl["output_lens"]
    out = str(lens[0]) if min(lens) == max(lens) else f"{min(lens)}..{max(lens)}"
    return f"{wl['num_requests']}x {wl['prompt_len']}->{out}"


def throughput_rows(results: dict) -> list[list[str]]:
    rows = []
    for name, r in results.items():
        wl, p = r["workload"], r["pagedllm"]
        rows.append([name, _shape(wl), "pagedllm", f"{p['time_s']:.2f}", f"{p['output_tok_s']:.1f}",
                     f"{p['total_tok_s']:.1f}", _headline_cell(wl, p), "", ""])
        for key, m in r["transformers"].items():
            note = f"pad {100 * m['padding_share']:.0f}%" if m["padding_share"] > 0 else ""
            rows.append(["", "", f"hf {key}", f"{m['time_s']:.2f}", f"{m['output_tok_s']:.1f}",
                         f"{m['total_tok_s']:.1f}", _headline_cell(wl, m), f"{m['ratio']:.2f}x",
                         f"agree {100 * m['greedy_agreement']:.0f}% {note}".strip()])
    return rows


def _headline_cell(wl: dict, m: dict) -> str:
    key = {"output": "output_tok_s", "useful": "useful_output_tok_s", "prompt": "prompt_tok_s"}[wl["headline"]]
    return f"{m[key]:.1f} ({wl['headline']})"


def engine_rows(results: dict, info: dict) -> list[list[str]]:
    rows = []
    for name, r in results.items():
        e = r["pagedllm"]["engine"]
        ms = e["step_ms"]
        rows.append([name, str(e["steps"]), f"{e['peak_used_blocks']}/{info['num_blocks']}",
                     str(e["preemptions"]), f"{ms['step']:.2f}", f"{ms['forward']:.2f}",
                     f"{ms['schedule']:.2f}", f"{ms['prepare']:.2f}", f"{ms['sample']:.2f}",
                     f"{ms['update']:.2f}",
                     f"{100 * (1 - ms['forward'] / ms['step']) if ms['step'] else 0:.0f}%"])
    return rows


def print_report(results: dict, info: dict, meta: dict) -> None:
    print(f"\nmodel {meta['model']} ({meta['model_params_m']:.1f}M params, float32), "
          f"{meta['threads']} threads, repeats={meta['repeats']} (median), quick={meta['quick']}")
    print("\nThroughput (tok/s). ratio = pagedllm / transformers on the headline metric")
    print(format_table(["workload", "shape", "system", "time s", "out tok/s", "total tok/s", "headline",
                        "ratio", "notes"], throughput_rows(results)))
    print(f"\npagedllm engine stats (median run; backend {info['attention_backend']}, block_size "
          f"{info['block_size']}, max_num_seqs {info['max_num_seqs']}, max_num_batched_tokens "
          f"{info['max_num_batched_tokens']}). Per-step ms from the engine's own timers (LLMEngine.step_times):")
    print(format_table(["workload", "steps", "peak blocks", "preempt", "step", "forward", "schedule", "prepare",
                        "sample", "update", "non-fwd"], engine_rows(results, info)))


def save_json(data: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


# --------------------------------------------------------------------------- main


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint dir (default: build/reuse the random 34M Llama)")
    ap.add_argument("--workloads", default="single,batch64,long16,mixed32,prefill512")
    ap.add_argument("--quick", action="store_true", help=f"sizes divided by {QUICK_DIV}; repeats default 3")
    ap.add_argument("--repeats", type=int, default=None, help="timed runs per system (median); 3 quick, 1 full")
    ap.add_argument("--skip-hf", action="store_true", help="pagedllm only")
    ap.add_argument("--output", type=Path, default=None,
                    help="JSON path (default results/throughput.json, or results/throughput-quick.json)")
    g = ap.add_argument_group("pagedllm engine")
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=None)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "sdpa", "cpu"])
    g.add_argument("--num-threads", type=int, default=None,
                   help="torch threads for both systems (default: physical cores)")
    g.add_argument("--kv-cache-memory", default="1GiB")
    g.add_argument("--device", default="cpu", help="cpu or cuda, for both systems")
    args = ap.parse_args(argv)
    args.repeats = args.repeats or (3 if args.quick else 1)
    args.output = args.output or RESULTS_DIR / ("throughput-quick.json" if args.quick else "throughput.json")
    return args


def physical_cores() -> int:
    try:
        with open("/proc/cpuinfo") as f:
            cores = {(p, c) for p, c in _core_ids(f)}
        return len(cores) or os.cpu_count() or 1
    except OSError:
        return os.cpu_count() or 1


def _core_ids(lines):
    phys = "0"
    for line in lines:
        if line.startswith("physical id"):
            phys = line.split(":")[1].strip()
        elif line.startswith("core id"):
            yield phys, line.split(":")[1].strip()


def select_workloads(args) -> list[Workload]:
    all_wls = build_workloads(args.quick)
    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    unknown = [n for n in names if n not in all_wls]
    if unknown:
        raise SystemExit(f"unknown workload(s) {unknown}; choose from {list(all_wls)}")
    return [all_wls[n] for n in names]


def main(argv=None) -> dict:
    args = parse_args(argv)
    workloads = select_workloads(args)
    args.num_threads = args.num_threads or physical_cores()
    torch.set_num_threads(args.num_threads)
    model_dir = Path(args.model) if args.model else ensure_model(default_model_dir())
    llm = make_llm(model_dir, args)
    hf = None if args.skip_hf else load_hf(model_dir, args.device)
    vocab = llm.llm_engine.model_config.vocab_size
    results = {}
    for wl in workloads:
        t0 = time.perf_counter()
        results[wl.name] = bench_workload(wl, llm, hf, vocab, args)
        print(f"[{wl.name}] done in {time.perf_counter() - t0:.1f}s", flush=True)
    info, meta = engine_info(llm), run_meta(args, model_dir, llm)
    print_report(results, info, meta)
    save_json(dict(meta=meta, engine=info, results=results), args.output)
    print(f"\nsaved {args.output}")
    return results


def run_meta(args, model_dir: Path, llm) -> dict:
    import transformers
    params = sum(p.numel() for p in llm.llm_engine.executor.runner.model.parameters())
    return dict(date=datetime.now(timezone.utc).isoformat(timespec="seconds"), model=str(model_dir),
                model_params_m=params / 1e6, quick=args.quick, repeats=args.repeats, threads=args.num_threads,
                torch=torch.__version__, transformers=transformers.__version__, python=platform.python_version(),
                cpu=platform.processor() or platform.machine(), cpu_count=os.cpu_count(),
                engine_kwargs=engine_kwargs(args), skip_hf=args.skip_hf, git_commit=_git_commit(),
                env={k: os.environ[k] for k in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS") if k in os.environ})


def _git_commit() -> str | None:
    import subprocess
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


if __name__ == "__main__":
    main()

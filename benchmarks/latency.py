"""Latency: time to first token and time per output token, at batch 1 and under Poisson load.

pagedllm's offline engine (``LLMEngine.add_request`` / ``step``) against Hugging Face
transformers ``generate`` on the same weights, in one process. Example::

    python benchmarks/latency.py --quick      # tiny sizes, a sanity check (~15 s on 2 cores)
    python benchmarks/latency.py              # defaults below (a few minutes on 2 cores)
    python benchmarks/latency.py --rates 0.5,1,2,4 --num-requests 48

Scenarios (defaults; ``--quick`` divides lengths by 8, runs 8 requests and multiplies rates by 8):
  batch1     one request at a time, 128 -> 128, ``--repeats`` times (5), alternating systems
  rate-R     ``--num-requests`` (32) requests of 128 -> 128 arriving as a seeded Poisson process
             at R requests/s, for each R in ``--rates`` (1,2,4)

Every request is greedy with EOS ignored, so it produces exactly its requested tokens.

Definitions (per request; seconds on ``time.perf_counter``):
  arrival  when the request is due: batch1, just before it is handed over; under load, its
           scheduled Poisson time. A request is handed to a system only once its arrival has
           passed, so waiting for a busy system counts in TTFT and E2E.
  token    the moment a token comes out of ``engine.step()`` (transformers: the moment
           ``generate`` hands it to its streamer)
  TTFT     first token - arrival
  TPOT     (last token - first token) / (tokens - 1): the mean gap over the decode tokens
  ITL      every gap between two consecutive tokens of a request
  E2E      last token - arrival
  queue    first scheduled - arrival (pagedllm, from ``RequestOutput.metrics``)
  tok/s    output tokens / (last token of the run - first arrival); batch1: / sum of E2E

How transformers serves load: it has no way to add a request to a running ``generate``, so it
runs FIFO *static batches*: when idle it waits for the next arrival, then generates everything
that has arrived by then (up to ``--hf-max-batch``) to completion; requests arriving meanwhile
wait for the whole batch. All prompts have the same length, so batches need no padding.

Ratios in the table are transformers / pagedllm on the p50 of TTFT, TPOT and E2E (> 1: pagedllm
is faster). ``agree`` is the share of greedy tokens on which the two systems agree.
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
sys.path.insert(0, str(ROOT))  # this checkout's pagedllm, not whatever is installed
sys.path.insert(0, str(BENCH_DIR))  # benchmarks/common.py

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import common  # noqa: E402  (the shared 34M random Llama, engine options, tables, JSON, thread count)
import numpy as np  # noqa: E402
import torch  # noqa: E402

from pagedllm.platform import physical_cores  # noqa: E402  (after common set up sys.path)

RESULTS_DIR = common.RESULTS_DIR
QUICK_DIV = 8
PERCENTILES = (50, 90, 99)


# --------------------------------------------------------------------------- request timelines


@dataclass
class Trace:
    """One request's timeline (seconds on ``time.perf_counter``) and the tokens it produced."""

    arrival: float
    token_times: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    queue: float | None = None  # first scheduled - arrival; pagedllm only

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival

    @property
    def tpot(self) -> float | None:
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None

    @property
    def itls(self) -> list[float]:
        return np.diff(self.token_times).tolist()

    @property
    def e2e(self) -> float:
        return self.token_times[-1] - self.arrival

    def stamp(self, new_ids: list[int], now: float) -> None:
        self.token_ids += new_ids
        self.token_times += [now] * len(new_ids)


def percentiles(values, ps=PERCENTILES) -> dict[str, float] | None:
    """``{"p50": .., "p90": .., "p99": .., "mean": ..}`` (linear interpolation), None if empty."""
    arr = np.asarray([v for v in values if v is not None], dtype=float)
    if arr.size == 0:
        return None
    out = {f"p{p}": float(np.percentile(arr, p)) for p in ps}
    out["mean"] = float(arr.mean())
    return out


def poisson_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Arrival times (s from the start) of n requests of a Poisson process at ``rate`` per
    second; the first arrives at 0 so no run starts idle. ``rate=inf`` sends all at once."""
    if math.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])]).tolist()


def _sleep_until(t: float) -> None:
    delay = t - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


# --------------------------------------------------------------------------- pagedllm side


def serve_paged(engine, prompts: list[list[int]], out_len: int, offsets: list[float], tag: str) -> list[Trace]:
    """Feeds requests to the engine at their arrival times and stamps every token as it comes
    out of ``engine.step()``. An idle engine sleeps until the next arrival."""
    from pagedllm import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True, output_kind="delta")
    start = time.perf_counter()
    traces = [Trace(start + o) for o in offsets]
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    by_id = dict(zip(ids, traces))
    nxt = 0
    while nxt < len(prompts) or engine.has_unfinished_requests():
        nxt = _admit_due(engine, prompts, params, ids, traces, nxt)
        if not engine.has_unfinished_requests():
            _sleep_until(traces[nxt].arrival)
            continue
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            _record_paged(by_id[out.request_id], out, now)
    return traces


def _admit_due(engine, prompts, params, ids: list[str], traces: list[Trace], nxt: int) -> int:
    """Adds every request whose arrival has passed; returns the index of the next one."""
    wall = time.time() - time.perf_counter()  # perf_counter -> the engine's time.time() clock
    now = time.perf_counter()
    while nxt < len(prompts) and traces[nxt].arrival <= now:
        # the scheduled arrival, not "now": time spent waiting for step() to return is queueing
        engine.add_request(ids[nxt], {"prompt_token_ids": prompts[nxt]}, params,
                           arrival_time=wall + traces[nxt].arrival)
        nxt += 1
    return nxt


def _record_paged(trace: Trace, out, now: float) -> None:
    new_ids = list(out.outputs[0].token_ids)  # delta outputs: only this step's tokens
    if not trace.token_times and out.metrics is not None and out.metrics.first_scheduled_time:
        trace.queue = out.metrics.first_scheduled_time - out.metrics.arrival_time
    trace.stamp(new_ids, now)


# --------------------------------------------------------------------------- transformers side


def _token_clock_class():
    from transformers.generation.streamers import BaseStreamer

    class TokenClock(BaseStreamer):
        """Stamps each step's tokens as ``generate`` hands them over; its first put() is the prompt."""

        def __init__(self):
            self.times: list[float] = []
            self._prompt_seen = False

        def put(self, value) -> None:
            if self._prompt_seen:
                self.times.append(time.perf_counter())
            self._prompt_seen = True

        def end(self) -> None:
            pass

    return TokenClock


def hf_generate_timed(model, prompts: list[list[int]], out_len: int, device: str):
    """One static batch: (token timestamps, shared by every row, and each row's new token ids)."""
    clock = _token_clock_class()()
    ids = torch.tensor(prompts, device=device)  # equal prompt lengths: no padding
    with torch.inference_mode():
        seq = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=out_len, pad_token_id=0, streamer=clock)
    assert len(clock.times) == out_len == seq.shape[1] - ids.shape[1], "transformers stopped early"
    return clock.times, seq[:, ids.shape[1]:].tolist()


def serve_hf(model, prompts: list[list[int]], out_len: int, offsets: list[float], max_batch: int,
             device: str) -> list[Trace]:
    """FIFO static batches: when idle, wait for the next arrival, then run everything that has
    arrived (up to ``max_batch``) to completion. Later arrivals wait for the whole batch."""
    start = time.perf_counter()
    traces = [Trace(start + o) for o in offsets]
    i = 0
    while i < len(prompts):
        _sleep_until(traces[i].arrival)
        j = _due_until(traces, i, max_batch)
        times, outputs = hf_generate_timed(model, prompts[i:j], out_len, device)
        for trace, ids in zip(traces[i:j], outputs):
            trace.token_times, trace.token_ids = list(times), ids
        i = j
    return traces


def _due_until(traces: list[Trace], i: int, max_batch: int) -> int:
    now, j = time.perf_counter(), i + 1
    while j < len(traces) and j - i < max_batch and traces[j].arrival <= now:
        j += 1
    return j


# --------------------------------------------------------------------------- summarising


def summarize(traces: list[Trace], duration: float) -> dict:
    """Latency percentiles (ms) and throughput of one system's run of a scenario."""
    ms = lambda xs: percentiles([None if x is None else 1e3 * x for x in xs])  # noqa: E731
    tokens = sum(len(t.token_ids) for t in traces)
    return dict(
        num_requests=len(traces), output_tokens=tokens, duration_s=duration, output_tok_s=tokens / duration,
        ttft_ms=ms(t.ttft for t in traces), tpot_ms=ms(t.tpot for t in traces),
        itl_ms=ms(x for t in traces for x in t.itls), e2e_ms=ms(t.e2e for t in traces),
        queue_ms=ms(t.queue for t in traces if t.queue is not None),
        requests=[dict(arrival_s=round(t.arrival - traces[0].arrival, 6), tokens=len(t.token_ids),
                       ttft_ms=1e3 * t.ttft, tpot_ms=None if t.tpot is None else 1e3 * t.tpot,
                       e2e_ms=1e3 * t.e2e) for t in traces],
    )


def span(traces: list[Trace]) -> float:
    """First arrival to last token: the wall time a load run kept the system busy or waiting."""
    return max(t.token_times[-1] for t in traces) - min(t.arrival for t in traces)


def compare(paged: dict, hf: dict, agree: float) -> dict:
    """transformers / pagedllm on the latency p50s (> 1: pagedllm faster) and tok/s ratio."""
    ratio = lambda k: hf[k]["p50"] / paged[k]["p50"] if paged[k] and hf[k] else None  # noqa: E731
    return dict(ttft=ratio("ttft_ms"), tpot=ratio("tpot_ms"), e2e=ratio("e2e_ms"),
                tok_s=paged["output_tok_s"] / hf["output_tok_s"], greedy_agreement=agree)


def agreement(a: list[Trace], b: list[Trace]) -> float:
    return common.prefix_agreement([t.token_ids for t in a], [t.token_ids for t in b],
                               [len(t.token_ids) for t in a])


# --------------------------------------------------------------------------- scenarios


def bench_batch1(engine, hf, args, vocab: int) -> dict:
    """One request at a time, the systems alternating so machine drift hits both alike."""
    prompts = common.make_prompts([args.input_len] * args.repeats, vocab, seed=args.seed)
    paged, ref = [], []
    for r, prompt in enumerate(prompts):
        engine.reset_prefix_cache()
        paged += serve_paged(engine, [prompt], args.output_len, [0.0], f"b1.{r}")
        if hf is not None:
            ref += serve_hf(hf, [prompt], args.output_len, [0.0], 1, args.device)
    workload = dict(kind="batch1", num_requests=args.repeats, input_len=args.input_len,
                    output_len=args.output_len)
    return _scenario(workload, paged, ref, lambda ts: sum(t.e2e for t in ts))


def bench_rate(engine, hf, args, vocab: int, rate: float) -> dict:
    """``--num-requests`` Poisson arrivals at ``rate``; both systems get the same schedule."""
    seed = args.seed + 1 + int(1000 * rate if math.isfinite(rate) else 0)
    prompts = common.make_prompts([args.input_len] * args.num_requests, vocab, seed=seed)
    offsets = poisson_offsets(args.num_requests, rate, seed)
    engine.reset_prefix_cache()
    paged = serve_paged(engine, prompts, args.output_len, offsets, f"rate{rate}")
    ref = [] if hf is None else serve_hf(hf, prompts, args.output_len, offsets, args.hf_max_batch, args.device)
    workload = dict(kind="poisson", rate=_json_rate(rate), num_requests=args.num_requests, input_len=args.input_len,
                    output_len=args.output_len, arrival_offsets_s=offsets, hf_max_batch=args.hf_max_batch)
    return _scenario(workload, paged, ref, span)


def _json_rate(rate: float) -> float | str:
    return rate if math.isfinite(rate) else "inf"  # strict JSON has no Infinity


def _scenario(workload: dict, paged: list[Trace], ref: list[Trace], duration) -> dict:
    res = dict(workload=workload, pagedllm=summarize(paged, duration(paged)))
    if ref:
        res["transformers"] = summarize(ref, duration(ref))
        res["ratio"] = compare(res["pagedllm"], res["transformers"], agreement(paged, ref))
    return res


def warm(engine, hf, args, vocab: int) -> None:
    """Small untimed runs of both systems on the benchmark's prompt length (other prompts)."""
    prompts = common.make_prompts([args.input_len] * 2, vocab, seed=args.seed + 999)
    serve_paged(engine, prompts, 4, [0.0, 0.0], "warm")
    if hf is not None:
        serve_hf(hf, prompts, 4, [0.0, 0.0], 2, args.device)


# --------------------------------------------------------------------------- reporting


def table_rows(results: dict) -> list[list[str]]:
    rows = []
    for name, r in results.items():
        for system in ("pagedllm", "transformers"):
            if system in r:
                rows.append(_row(name if system == "pagedllm" else "", system, r[system],
                                 r.get("ratio") if system == "transformers" else None))
    return rows


def _row(name: str, system: str, m: dict, ratio: dict | None) -> list[str]:
    f = lambda d, k: "-" if d is None else f"{d[k]:.1f}"  # noqa: E731
    x = lambda v: "" if v is None else f"{v:.2f}x"  # noqa: E731
    cells = [name, system, f(m["ttft_ms"], "p50"), f(m["ttft_ms"], "p90"), f(m["tpot_ms"], "p50"),
             f(m["tpot_ms"], "p90"), f(m["e2e_ms"], "p50"), f"{m['output_tok_s']:.1f}"]
    if ratio is None:
        return cells + ["", "", "", ""]
    return cells + [x(ratio["ttft"]), x(ratio["tpot"]), x(ratio["e2e"]), f"{100 * ratio['greedy_agreement']:.0f}%"]


def print_report(results: dict, meta: dict) -> None:
    print(f"\nmodel {meta['model']} ({meta['model_params_m']:.1f}M params, float32), {meta['threads']} threads, "
          f"quick={meta['quick']}")
    print("\nLatency (ms). TTFT/TPOT/E2E x = transformers / pagedllm at p50 (> 1: pagedllm faster)")
    print(common.format_table(["scenario", "system", "TTFT p50", "TTFT p90", "TPOT p50", "TPOT p90", "E2E p50",
                           "tok/s", "TTFT x", "TPOT x", "E2E x", "agree"], table_rows(results)))
    print("\npagedllm tails and queueing (ms):")
    rows = [[name, _p(r["pagedllm"]["ttft_ms"], 99), _p(r["pagedllm"]["tpot_ms"], 99),
             _p(r["pagedllm"]["itl_ms"], 50), _p(r["pagedllm"]["itl_ms"], 99), _p(r["pagedllm"]["queue_ms"], 50),
             _p(r.get("transformers", {}).get("ttft_ms"), 99)] for name, r in results.items()]
    print(common.format_table(["scenario", "TTFT p99", "TPOT p99", "ITL p50", "ITL p99", "queue p50",
                           "hf TTFT p99"], rows))


def _p(d: dict | None, p: int) -> str:
    return "-" if d is None else f"{d[f'p{p}']:.1f}"


# --------------------------------------------------------------------------- main


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint dir (default: build/reuse the random 34M Llama)")
    ap.add_argument("--quick", action="store_true",
                    help=f"lengths / {QUICK_DIV}, 2 repeats, 8 requests, rates x {QUICK_DIV}")
    ap.add_argument("--input-len", type=int, default=None, help="prompt tokens (default 128)")
    ap.add_argument("--output-len", type=int, default=None, help="output tokens per request (default 128)")
    ap.add_argument("--repeats", type=int, default=None, help="batch-1 requests (default 5, quick 2)")
    ap.add_argument("--num-requests", type=int, default=None, help="requests per load rate (default 32, quick 8)")
    ap.add_argument("--rates", default=None, help="Poisson rates in requests/s, comma-separated; "
                    "'inf' = all at once; '' = no load scenarios (default 1,2,4; quick 8,16,32)")
    ap.add_argument("--hf-max-batch", type=int, default=64, help="largest transformers static batch")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-hf", action="store_true", help="pagedllm only")
    ap.add_argument("--output", type=Path, default=None,
                    help="JSON path (default results/latency.json, or results/latency-quick.json)")
    common.add_engine_args(ap)
    return _fill_defaults(ap.parse_args(argv))


def _fill_defaults(args):
    q = QUICK_DIV if args.quick else 1
    args.input_len = args.input_len or 128 // q
    args.output_len = args.output_len or 128 // q
    args.repeats = args.repeats or (2 if args.quick else 5)
    args.num_requests = args.num_requests or (8 if args.quick else 32)
    rates = args.rates if args.rates is not None else ",".join(str(r * q) for r in (1, 2, 4))
    args.rates = [float(r) for r in rates.split(",") if r.strip()]
    if any(r <= 0 for r in args.rates):
        raise SystemExit(f"--rates {rates!r}: every rate must be > 0 (or inf)")
    args.output = args.output or RESULTS_DIR / ("latency-quick.json" if args.quick else "latency.json")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    args.num_threads = args.num_threads or physical_cores()
    torch.set_num_threads(args.num_threads)
    model_dir = Path(args.model) if args.model else common.ensure_model(common.default_model_dir())
    llm = common.make_llm(model_dir, args)
    engine = llm.llm_engine
    hf = None if args.skip_hf else common.load_hf(model_dir, args.device, args.dtype)
    vocab = engine.model_config.vocab_size
    warm(engine, hf, args, vocab)
    results = {}
    for name, run in [("batch1", lambda: bench_batch1(engine, hf, args, vocab))] + [
            (f"rate-{r:g}", lambda r=r: bench_rate(engine, hf, args, vocab, r)) for r in args.rates]:
        t0 = time.perf_counter()
        results[name] = run()
        print(f"[{name}] done in {time.perf_counter() - t0:.1f}s", flush=True)
    meta = run_meta(args, model_dir, llm)
    print_report(results, meta)
    common.save_json(dict(meta=meta, engine=common.engine_info(llm), results=results), args.output)
    print(f"\nsaved {args.output}")
    return results


def run_meta(args, model_dir: Path, llm) -> dict:
    import transformers
    params = sum(p.numel() for p in llm.llm_engine.executor.runner.model.parameters())
    return dict(date=datetime.now(timezone.utc).isoformat(timespec="seconds"), model=str(model_dir),
                model_params_m=params / 1e6, quick=args.quick, threads=args.num_threads,
                input_len=args.input_len, output_len=args.output_len, repeats=args.repeats,
                num_requests=args.num_requests, rates=[_json_rate(r) for r in args.rates],
                hf_max_batch=args.hf_max_batch,
                seed=args.seed, torch=torch.__version__, transformers=transformers.__version__,
                python=platform.python_version(), cpu=platform.processor() or platform.machine(),
                cpu_count=os.cpu_count(), engine_kwargs=common.engine_kwargs(args), skip_hf=args.skip_hf,
                git_commit=common.git_commit(),
                env={k: os.environ[k] for k in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS") if k in os.environ})


if __name__ == "__main__":
    main()

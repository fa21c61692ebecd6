"""What the KV-cache dashboard costs: the engine's step time with 0 and 3 viewers of its KV event
feed at batch 64, and the page's frame time with 100k blocks in headless Chromium.

Step time: the same batch (64 requests, all at once) runs with no viewer and with 3, interleaved
``--repeats`` times; each viewer is a thread that takes its events every 100 ms and encodes them
as the ``/v1/kv_events`` route does. Reported: mean step time per run and the median of the
per-repeat ratios (3 viewers / none).

Frame time: the page (``render_page``, no server) gets a synthetic 100k-block snapshot, then one
step event per animation frame with ``--changed`` blocks touched and a few in motion; reported:
the page's own apply + paint time per frame and the browser's frame interval (p50 / p95).

    python benchmarks/dashboard.py --quick
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import threading
import time
from pathlib import Path

import common
from common import RESULTS_DIR

from pagedllm import LLM, SamplingParams  # noqa: E402  (after common set up sys.path)
from pagedllm.engine.kv_events import KVEventFeed  # noqa: E402
from pagedllm.engine.llm_engine import LLMEngine  # noqa: E402
from pagedllm.entrypoints.dashboard.page import render_page  # noqa: E402


class Viewer(threading.Thread):
    """Takes a subscription's events every ``interval`` seconds and JSON-encodes them (the SSE route's work)."""

    def __init__(self, engine: LLMEngine, interval: float = 0.1):
        super().__init__(daemon=True)
        self.sub, _ = engine.kv_events.subscribe(512, engine.counters.num_steps)
        self.interval, self.events, self.bytes = interval, 0, 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(self.interval):
            self.drain()
        self.drain()

    def drain(self) -> None:
        events = self.sub.take()
        self.events += len(events)
        self.bytes += len(json.dumps(events, separators=(",", ":"))) if events else 0

    def close(self) -> None:
        self.stop.set()
        self.join()
        self.sub.close()


class TimedPublish:
    """Wraps ``engine.kv_events.publish`` to add up the engine thread's seconds in it."""

    def __init__(self, engine: LLMEngine):
        self.seconds, self.inner = 0.0, engine.kv_events.publish
        engine.kv_events.publish = self

    def __call__(self, *args, **kwargs) -> None:
        t0 = time.perf_counter()
        self.inner(*args, **kwargs)
        self.seconds += time.perf_counter() - t0


def run_batch(llm: LLM, prompts: list[list[int]], params: SamplingParams, viewers: int) -> dict:
    engine = llm.llm_engine
    timed = TimedPublish(engine)
    watching = [Viewer(engine) for _ in range(viewers)]
    for v in watching:
        v.start()
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}-{time.monotonic_ns()}", {"prompt_token_ids": p}, params)
    steps, t0, cpu0 = 0, time.perf_counter(), time.thread_time()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    elapsed, cpu = time.perf_counter() - t0, time.thread_time() - cpu0
    for v in watching:
        v.close()
    engine.kv_events.publish = timed.inner
    engine.kv_events.publish(engine.counters.num_steps)  # drops the closed subscriptions: the recorder stops
    assert not engine.kv_events.listening
    # engine_cpu_ms: the engine thread's own CPU time per step (Python, dispatch; the forward's math runs
    # on torch's threads), steadier than wall time on a shared machine
    return {"steps": steps, "step_ms": 1000 * elapsed / steps, "engine_cpu_ms": 1000 * cpu / steps,
            "publish_ms": 1000 * timed.seconds / steps,
            "publish_share": timed.seconds / elapsed, "events": sum(v.events for v in watching),
            "bytes": sum(v.bytes for v in watching), "dropped": sum(v.sub.dropped for v in watching)}


def bench_steps(args) -> dict:
    model_dir = Path(args.model) if args.model else common.ensure_model(common.default_model_dir())
    llm = LLM(str(model_dir), max_num_seqs=args.batch, block_size=16, kv_cache_memory="512MiB", seed=0,
              max_num_batched_tokens=max(2048, args.batch * args.input_len), enable_prefix_caching=True)
    prompts = common.make_prompts([args.input_len] * args.batch, llm.llm_engine.model_config.vocab_size, 0)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0)
    run_batch(llm, prompts, params, 0)  # warm-up
    runs: dict[int, list[dict]] = {0: [], 3: []}
    for r in range(args.repeats):
        order = (0, 3) if r % 2 == 0 else (3, 0)  # interleaved, alternating which goes first
        for viewers in order:
            runs[viewers].append(run_batch(llm, prompts, params, viewers))
    ratios = [w["step_ms"] / n["step_ms"] for n, w in zip(runs[0], runs[3])]
    cpu_ratios = [w["engine_cpu_ms"] / n["engine_cpu_ms"] for n, w in zip(runs[0], runs[3])]
    return {"median_engine_cpu_ratio_3_viewers": statistics.median(cpu_ratios), "engine_cpu_ratios": cpu_ratios,
            "batch": args.batch, "input_len": args.input_len, "output_len": args.output_len,
            "num_blocks": llm.llm_engine.executor.num_blocks, "runs": {str(k): v for k, v in runs.items()},
            "median_ratio_3_viewers": statistics.median(ratios), "ratios": ratios,
            "median_publish_share_3_viewers": statistics.median(r["publish_share"] for r in runs[3])}


def bench_scheduler_only(args) -> dict:
    """The feed's bookkeeping against the scheduler's alone (no model: random tokens), the harshest
    denominator: batch ``args.batch`` to completion, no viewer vs one, interleaved, median ratio."""
    from pagedllm.config import CacheConfig, SchedulerConfig
    from pagedllm.contracts.sampled_tokens import SampledTokens
    from pagedllm.engine.request import Request
    from pagedllm.engine.scheduler import Scheduler

    def run(listen: bool) -> float:
        sched = Scheduler(SchedulerConfig(max_num_seqs=args.batch, max_num_batched_tokens=8192, max_model_len=4096),
                          CacheConfig(block_size=16), 20_000)
        feed = KVEventFeed(sched)
        sub = feed.subscribe(1 << 20, 0)[0] if listen else None
        rng = random.Random(0)
        for i in range(args.batch):
            prompt = [rng.randrange(3, 1000) for _ in range(args.input_len)]
            sched.add_request(Request(str(i), prompt, SamplingParams(max_tokens=args.output_len * 4, ignore_eos=True),
                                      frozenset()))
        t0, step = time.perf_counter(), 0
        while sched.has_unfinished():
            out = sched.schedule()
            sched.update([SampledTokens(c.request_id, [rng.randrange(3, 1000)] * c.num_samples, [0.0] * c.num_samples)
                          for c in out.chunks if c.num_samples])
            step += 1
            if feed.listening:
                feed.publish(step, out)
            if sub is not None and step % 5 == 0:
                json.dumps(sub.take(), separators=(",", ":"))  # what the SSE route does with them
        return (time.perf_counter() - t0) / step

    pairs = []
    for r in range(args.repeats * 2 + 1):  # interleaved, alternating which goes first
        first = run(r % 2 == 1)
        second = run(r % 2 == 0)
        pairs.append((first, second) if r % 2 == 0 else (second, first))  # (off, on)
    ratios = [on / off for off, on in pairs]
    return {"batch": args.batch, "steps_ms_off": [1000 * p[0] for p in pairs],
            "steps_ms_on": [1000 * p[1] for p in pairs], "median_ratio_1_viewer": statistics.median(ratios)}


FRAME_SCRIPT = """async ([numBlocks, changed, frames]) => {
  const main = document.getElementById('panels');
  const p = new window.pagedllmDashboard.Panel(main, {name: 'bench', base: ''});
  const rnd = (n) => Math.floor(Math.random() * n);
  const tables = {};
  for (let r = 0; r < 64; r++) tables['r' + r] = Array.from({length: 64}, (_, i) => r * 64 + i);
  const refs = Array.from({length: numBlocks}, () => rnd(3));
  p.loadSnapshot({num_blocks: numBlocks, block_size: 16, step: 0, ref_cnt: refs, hashes: {}, tables, requests: [],
                  queue_sizes: {running: 64, waiting: 0, swapped: 0, loading: 0}});
  const work = [], gaps = [];
  let last = performance.now();
  for (let f = 0; f < frames; f++) {
    await new Promise((done) => requestAnimationFrame(done));
    const now = performance.now();
    gaps.push(now - last);
    last = now;
    const blocks = Array.from({length: changed}, () => [rnd(numBlocks), rnd(3), rnd(2) ? 'abcd1234' : null]);
    const ev = {step: f + 1, blocks, tables: {['r' + (f % 64)]: tables['r' + (f % 64)]},
                moves: {swap_out: [rnd(numBlocks)], swap_in: [], copy: [], load: [[rnd(numBlocks), 'disk']]},
                requests: [], queue_sizes: {running: 64}};
    const t0 = performance.now();
    p.applySteps([ev]);
    p.render(performance.now());
    work.push(performance.now() - t0);
  }
  return {work, gaps, cell: p.cell, cols: p.cols, width: p.canvas.width, height: p.canvas.height};
}"""


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def bench_frames(args) -> dict:
    from playwright.sync_api import sync_playwright
    executable = shutil.which("chromium") or shutil.which("chromium-browser")
    html = render_page("bench", []).body.decode()
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=executable, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_content(html)
        out = page.evaluate(FRAME_SCRIPT, [args.blocks, args.changed, args.frames])
        browser.close()
    work, gaps = out["work"][5:], out["gaps"][5:]  # the first frames warm the JIT up
    return {"blocks": args.blocks, "changed_per_frame": args.changed, "frames": len(work),
            "work_ms_p50": _pct(work, 0.5), "work_ms_p95": _pct(work, 0.95),
            "frame_interval_ms_p50": _pct(gaps, 0.5), "frame_interval_ms_p95": _pct(gaps, 0.95),
            "cell_px": out["cell"], "canvas": [out["width"], out["height"]]}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 repeats, 16 output tokens, 60 frames")
    ap.add_argument("--model", default=None, help="checkpoint dir (default: build/reuse the random 34M Llama)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--blocks", type=int, default=100_000, help="blocks on the page's map")
    ap.add_argument("--changed", type=int, default=2000, help="blocks one step event touches")
    ap.add_argument("--frames", type=int, default=None)
    ap.add_argument("--skip-steps", action="store_true")
    ap.add_argument("--skip-frames", action="store_true")
    args = ap.parse_args(argv)
    args.output_len = args.output_len or (16 if args.quick else 64)
    args.repeats = args.repeats or (2 if args.quick else 5)
    args.frames = args.frames or (60 if args.quick else 300)
    random.seed(0)
    results = {}
    if not args.skip_frames:
        results["frames"] = bench_frames(args)
        print(json.dumps(results["frames"], indent=1), flush=True)
    if not args.skip_steps:
        results["scheduler_only"] = bench_scheduler_only(args)
        ratio = results["scheduler_only"]["median_ratio_1_viewer"]
        print(f"scheduler-only step, 1 viewer / none: median ratio {ratio:.4f}", flush=True)
        results["steps"] = bench_steps(args)
        s = results["steps"]
        print(f"step ms, no viewer: {[round(r['step_ms'], 2) for r in s['runs']['0']]}; 3 viewers: "
              f"{[round(r['step_ms'], 2) for r in s['runs']['3']]}; median ratio {s['median_ratio_3_viewers']:.4f}; "
              f"publish {100 * s['median_publish_share_3_viewers']:.3f}% of step time; engine-thread CPU ratio "
              f"{s['median_engine_cpu_ratio_3_viewers']:.4f}")
    out = RESULTS_DIR / ("dashboard-quick.json" if args.quick else "dashboard.json")
    common.save_json({"meta": {"commit": common.git_commit()}, **results}, out)
    print(f"saved {out}")
    return results


if __name__ == "__main__":
    main()

"""Does ``torch.compile`` of the model body help on CPU? Start-up cost and step time, measured.

Times the model forward (the runner's ``execute``, no sampling) for a decode batch and a
prefill chunk on the ~34M benchmark Llama, first eagerly (the engine's default path, which
includes the one-call C decoder for small batches), then with ``torch.compile`` applied to
every decoder layer (inductor, dynamic shapes), and reports compile time and the ratio.
The C ops (paged attention, fused RMSNorm/rotary) are opaque to dynamo, so each layer
compiles into the graphs between them.

    python benchmarks/probes/compile_probe.py [--batches 1,16,64] [--prefill 512] [--repeats 20]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common, attention, ...
from common import default_model_dir, ensure_model, format_table  # noqa: E402

from pagedllm import LLM, SamplingParams  # noqa: E402


def decode_output(llm: LLM, batch: int, prompt_len: int):
    """A scheduled decode step for ``batch`` requests whose prompts are already computed."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    for i in range(batch):
        ids = [10 + (i + j) % 4000 for j in range(prompt_len)]
        engine.add_request(f"d{batch}-{i}", {"prompt_token_ids": ids}, params)
    sched = engine.scheduler
    while sched.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running):
        engine.step()
    return engine.scheduler.schedule()


def prefill_output(llm: LLM, length: int):
    engine = llm.llm_engine
    engine.add_request(f"p{length}", {"prompt_token_ids": list(range(10, 10 + length))},
                       SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    return engine.scheduler.schedule()


def time_execute(runner, out, repeats: int) -> float:
    """Median ms of the runner's execute (re-running the same step rewrites the same KV slots)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        runner.execute(out)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def use(runner, layers) -> None:
    for i, layer in enumerate(layers):
        runner.model.model.layers[i] = layer


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args(argv)
    llm = LLM(str(ensure_model(default_model_dir())), kv_cache_memory="1GiB")
    runner = llm.llm_engine.executor.runner
    eager_layers = list(runner.model.model.layers)
    compiled_layers = [torch.compile(layer, dynamic=True) for layer in eager_layers]
    makers = [(f"decode bs={b}", lambda b=int(b): decode_output(llm, b, 128)) for b in args.batches.split(",")]
    makers.append((f"prefill {args.prefill}", lambda: prefill_output(llm, args.prefill)))
    rows = []
    for name, make in makers:
        out = make()
        use(runner, eager_layers)
        eager = time_execute(runner, out, args.repeats)
        use(runner, compiled_layers)
        t0 = time.perf_counter()
        runner.execute(out)  # first call of this shape: traces and compiles (or reuses a graph)
        first = time.perf_counter() - t0
        compiled = time_execute(runner, out, args.repeats)
        rows.append([name, f"{eager:.2f}", f"{compiled:.2f}", f"{eager / compiled:.2f}x", f"{first:.1f}"])
        for rid in list(llm.llm_engine.scheduler.requests):
            llm.llm_engine.abort_request(rid)
        use(runner, eager_layers)
        llm.llm_engine.step()  # releases the aborted requests' blocks and persistent rows
    print(f"threads {torch.get_num_threads()}, median of {args.repeats} forward passes (ms)")
    print(format_table(["case", "eager ms", "compiled ms", "speed-up", "first call s"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

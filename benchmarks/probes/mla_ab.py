"""The C latent kernel (``native/csrc/mla_decode.c``) against the generic C paged-attention kernel
with the latent as its one KV head for both K and V (what MLA ran on before the latent kernel),
kernel calls only, on DeepSeek-V2-Lite decode shapes (16 heads, kv_lora_rank 512 + rope 64): the
A/B behind a change to ``mla_decode.c``.

    git worktree add /tmp/before <commit>      # a build of the latent kernel to compare against
    python benchmarks/probes/mla_ab.py --csrc /tmp/before/pagedllm/native/csrc,pagedllm/native/csrc
    python benchmarks/probes/mla_ab.py --cases 1x2048,8x2048 --dtype bfloat16 --threads 2

Each case ``BxC`` is a decode step of B requests at context C (one new token each) over
``--layers`` distinct latent pools (so the latents stream from memory as in a model's forward,
not from the L3). Every timed round runs each method over every layer, the methods in a rotating
order; the table gives medians and the median of the rounds' ratios to the generic kernel (from
the first ``--csrc`` build). Every latent build's output must match the generic kernel's before
anything is timed.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's pagedllm first

import torch  # noqa: E402
from attention_ab import parse_case  # noqa: E402  (benchmarks/probes/, this script's folder)

from pagedllm.attention.testing import make_paged_batch  # noqa: E402
from pagedllm.native.bindings import NativeLibrary  # noqa: E402
from pagedllm.native.build import CSRC, build_library  # noqa: E402

HEADS, RANK, ROPE = 16, 512, 64  # DeepSeek-V2-Lite
GENERIC = "generic paged attention"


def layer_inputs(batch: int, context: int, args: argparse.Namespace) -> list[tuple]:
    """Per layer: (query [B, heads, rank + rope], latent pool, block tables, query_start_loc, seq_lens)."""
    out = []
    for layer in range(args.layers):
        b = make_paged_batch([(context - 1, 1)] * batch, 1, 1, RANK + ROPE, 16, seed=layer,
                             cache_dtype=getattr(torch, args.dtype))
        query = torch.randn(batch, HEADS, RANK + ROPE, generator=torch.Generator().manual_seed(layer))
        meta = b.meta
        out.append((query, b.key_cache, meta.block_tables.to(torch.int32).contiguous(),
                    meta.query_start_loc.to(torch.int32), meta.seq_lens.to(torch.int32)))
    return out


def methods(libs: dict[str, NativeLibrary], generic: NativeLibrary, threads: int) -> dict:
    """name -> step(layer inputs) returning the latent-space output [B, heads, rank]."""
    scale = (128 + ROPE) ** -0.5

    def run_generic(inputs):
        q, cache, tables, qsl, seq_lens = inputs
        o = torch.empty_like(q)
        generic.attention(q, o, cache, cache, tables, qsl, seq_lens, scale, 0, threads, 1 << 19)
        return o[..., :RANK]

    def latent(lib):
        def run(inputs):
            q, cache, tables, qsl, seq_lens = inputs
            o = q.new_empty(q.shape[0], HEADS, RANK)
            lib.mla_latent_attention(q, o, cache, tables, qsl, seq_lens, RANK, scale, threads)
            return o
        return run

    return {GENERIC: run_generic, **{name: latent(lib) for name, lib in libs.items()}}


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--csrc", default=str(CSRC), help="comma-separated csrc folders; the first builds the generic "
                                                     "kernel too")
    p.add_argument("--cases", default="1x512,1x2048,1x8192,8x2048")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "float8_e4m3fn"])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    dirs = [Path(d) for d in args.csrc.split(",")]
    for d in dirs:
        if not (d / "mla_decode.c").is_file():
            raise SystemExit(f"--csrc: {d} has no mla_decode.c")
    libs = {f"latent {str(d)[-40:]}": NativeLibrary(build_library(csrc=d)) for d in dirs}
    steps = methods(libs, next(iter(libs.values())), args.threads)
    names = list(steps)
    print(f"{HEADS} heads, latent {RANK} + {ROPE}, {args.dtype} cache, block 16, {args.layers} layers' pools, "
          f"{args.threads} thread(s), median of {args.rounds} rounds")
    print(f"{'case':>8}  {'method':<52} {'ms':>8} {'vs generic':>10}")
    results: dict[str, dict[str, float]] = {}
    for batch, context in (parse_case(c) for c in args.cases.split(",")):
        layers = layer_inputs(batch, context, args)
        ref = steps[GENERIC](layers[0])
        for name in names[1:]:
            diff = (steps[name](layers[0]) - ref).abs().max().item()
            if diff > 1e-4:
                raise SystemExit(f"{name}: output differs from the generic kernel's by {diff:.2e} at {batch}x{context}")
        times: dict[str, list[float]] = {name: [] for name in names}
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                start = time.perf_counter()
                for inputs in layers:
                    steps[name](inputs)
                times[name].append(time.perf_counter() - start)
        case = results[f"{batch}x{context}"] = {}
        for i, name in enumerate(names):
            ratio = statistics.median(g / t for g, t in zip(times[GENERIC], times[name]))
            case[name] = statistics.median(times[name])
            label = f"{batch}x{context}" if i == 0 else ""
            print(f"{label:>8}  {name:<52} {1e3 * case[name]:8.2f} {ratio:9.2f}x")
    return results


if __name__ == "__main__":
    main()

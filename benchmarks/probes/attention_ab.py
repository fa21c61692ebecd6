"""Two or more builds of the C library's paged attention, alternated in one process on the same
decode batches: the A/B behind a change to ``native/csrc/paged_attention.c``.

    git worktree add /tmp/before <commit>      # the build to compare against
    python benchmarks/probes/attention_ab.py --csrc /tmp/before/pagedllm/native/csrc,pagedllm/native/csrc
    python benchmarks/probes/attention_ab.py --csrc A,B --cases 64x192,16x512,1x2048 --kv-heads 4

Each case ``BxC`` is a decode step of B requests at context C (one new token each) over
``--layers`` distinct pools (16 by default, as many as a model has layers), so K/V stream from
memory as in a model's forward rather than staying in the L3 (pools in 2 MiB pages where the host
gives them, as the engine's). Each timed round runs every layer
once per build; builds alternate order every round (medians of ``--rounds``). GB/s counts the
K and V the step must read. The first build's output is the reference: every other build must
match it (atol 1e-5) before anything is timed. Builds are compiled with
``pagedllm.native.build.build_library(csrc=...)`` and cached like the engine's.
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common, attention, ...

import torch  # noqa: E402
from attention import measure_bandwidth  # noqa: E402  (puts this checkout's pagedllm first on sys.path)

from pagedllm.attention.cpu import CpuAttentionBackend  # noqa: E402
from pagedllm.attention.testing import PagedBatch, make_paged_batch  # noqa: E402
from pagedllm.native.bindings import NativeLibrary  # noqa: E402
from pagedllm.native.build import build_library  # noqa: E402
from pagedllm.platform import huge_page_copies, huge_pages_supported  # noqa: E402


def parse_case(text: str) -> tuple[int, int]:
    """``"64x192"`` -> (64 requests, context 192)."""
    try:
        batch, context = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--cases: {text!r} is not BATCHxCONTEXT (e.g. 64x192)") from None
    if batch < 1 or context < 1:
        raise SystemExit(f"--cases: {text!r} needs a batch and a context of at least 1")
    return batch, context


def layer_pools(reqs: list[tuple[int, int]], args: argparse.Namespace) -> list[PagedBatch]:
    """One paged batch per layer, its pool in 2 MiB pages where the host gives them (as the
    engine's pool is: platform.huge_page_empty)."""
    out = []
    for layer in range(args.layers):
        b = make_paged_batch(reqs, args.heads, args.kv_heads, args.head_dim, args.block_size, seed=layer)
        if huge_pages_supported():
            kc, vc = huge_page_copies([b.key_cache, b.value_cache])
            b = dataclasses.replace(b, key_cache=kc, value_cache=vc)
        out.append(b)
    return out


def step(backend: CpuAttentionBackend, b: PagedBatch) -> torch.Tensor:
    return backend.forward(b.query, b.key, b.value, b.key_cache, b.value_cache, b.meta, b.scale)


def time_case(backends: list[CpuAttentionBackend], batches: list[PagedBatch], rounds: int) -> list[float]:
    """Median seconds per step over all layers, per backend, rounds alternated."""
    times: list[list[float]] = [[] for _ in backends]
    for r in range(rounds):
        order = range(len(backends)) if r % 2 else reversed(range(len(backends)))
        for i in order:
            start = time.perf_counter()
            for b in batches:
                step(backends[i], b)
            times[i].append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--csrc", required=True, help="comma-separated csrc folders; the first is the baseline")
    p.add_argument("--cases", default="64x192,16x512,4x1024,1x2048")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--bw-mib", type=int, default=512)
    args = p.parse_args(argv)
    dirs = [Path(d) for d in args.csrc.split(",")]
    if len(dirs) < 2:
        raise SystemExit("--csrc: give at least two folders (baseline first)")
    for d in dirs:
        if not (d / "paged_attention.c").is_file():
            raise SystemExit(f"--csrc: {d} has no paged_attention.c")
    cases = [parse_case(c) for c in args.cases.split(",")]
    backends = [CpuAttentionBackend(num_threads=args.threads, library=NativeLibrary(build_library(csrc=d)))
                for d in dirs]
    read_gbs = measure_bandwidth(args.bw_mib, 5)["read_gbs"]
    print(f"read bandwidth {read_gbs:.1f} GB/s; {args.heads} heads / {args.kv_heads} kv heads, head_dim "
          f"{args.head_dim}, block {args.block_size}, {args.layers} layers' pools, {args.threads} threads")
    print(f"{'case':>10}  {'build':<48} {'ms':>8} {'GB/s':>6} {'vs first':>8}")
    results: dict[str, list[float]] = {}
    for batch, context in cases:
        reqs = [(context - 1, 1)] * batch
        batches = layer_pools(reqs, args)
        first = step(backends[0], batches[0])
        for d, be in zip(dirs[1:], backends[1:]):
            diff = (step(be, batches[0]) - first).abs().max().item()
            if diff > 1e-5:
                raise SystemExit(f"{d}: output differs from {dirs[0]} by {diff:.2e} at {batch}x{context}")
        secs = time_case(backends, batches, args.rounds)
        kv_bytes = args.layers * batch * context * args.kv_heads * args.head_dim * 2 * 4
        for i, (d, s) in enumerate(zip(dirs, secs)):
            name = f"{batch}x{context}" if i == 0 else ""
            print(f"{name:>10}  {str(d)[-48:]:<48} {1e3 * s:8.2f} {kv_bytes / s / 1e9:6.1f} {secs[0] / s:7.2f}x")
        results[f"{batch}x{context}"] = secs
    return results


if __name__ == "__main__":
    main()

"""The decode projections' panel GEMM over a chain of layers, its weight copies in 4 KiB pages
against 2 MiB pages (what ``cpu_ops.pack_model`` gives them): the measurement behind keeping the
panel copies in huge pages.

A chain is the 34M benchmark Llama's 8 layers' four projections (qkv 1024 x 512, o 512 x 512,
gate_up 3072 x 512, down 512 x 1536) at ``--rows`` rows, distinct weights per layer (they stream
from memory as in a decode step), output buffers shared across layers as the one-call decoder's
are; ``hot`` runs one layer's weights 8 times (they stay in the cache: the kernel's own ceiling).
The variants alternate round by round; medians::

    python benchmarks/probes/panel_chain.py [--rows 64] [--rounds 30]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedllm.layers.cpu_ops import pack_panels
from pagedllm.native import bindings
from pagedllm.platform import huge_page_copies, huge_pages_supported

SHAPES = [(1024, 512), (512, 512), (3072, 512), (512, 1536)]  # [out, in] of qkv, o, gate_up, down
LAYERS = 8


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args(argv)
    lib, g = bindings.library(), torch.Generator().manual_seed(0)
    plain = [[pack_panels(torch.randn(n, k, generator=g) * 0.05) for n, k in SHAPES] for _ in range(LAYERS)]
    variants = {"4 KiB pages": plain, "hot (one layer 8x)": [plain[0]] * LAYERS}
    if huge_pages_supported():
        flat = huge_page_copies([w for layer in plain for w in layer])
        variants["2 MiB pages"] = [flat[len(SHAPES) * i:len(SHAPES) * (i + 1)] for i in range(LAYERS)]
    xs = [torch.randn(args.rows, k, generator=g) for _, k in SHAPES]
    outs = [torch.empty(args.rows, n) for n, _ in SHAPES]

    def chain(weights) -> float:
        start = time.perf_counter()
        for layer in weights:
            for x, w, out in zip(xs, layer, outs):
                lib.dense_gemm(x, w, None, out, args.threads)
        return time.perf_counter() - start

    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, weights in variants.items():
            times[name].append(chain(weights))
    flops = 2 * args.rows * LAYERS * sum(n * k for n, k in SHAPES)
    result = {name: flops / statistics.median(t) / 1e9 for name, t in times.items()}
    print(f"{args.rows} rows, {args.threads} threads, {LAYERS} layers x {len(SHAPES)} projections, "
          f"median of {args.rounds}")
    for name, gflops in result.items():
        print(f"  {name:<20} {1e3 * flops / gflops / 1e9:7.2f} ms  {gflops:6.1f} GFLOP/s")
    return result


if __name__ == "__main__":
    main()

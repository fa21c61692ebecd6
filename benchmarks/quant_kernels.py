"""The projections of one decode step of the ~200M benchmark Llama (16 layers of qkv, o, gate_up
and down; distinct random weights per layer, so they stream from memory as in the engine),
through each CPU weight kernel alone, against the time reading their bytes once takes::

    python benchmarks/quant_kernels.py                      # batch 1: f32,int8,int4,fp8
    python benchmarks/quant_kernels.py --tokens 32 --kinds int4,int4-gemm,int8,int8-gemm

Kinds: ``f32`` (the register-tile kernel up to cpu_decode.DEFAULT_MAX_TOKENS, else torch's GEMM), ``f32-packed``
(oneDNN's prepacked GEMM, what the engine's float32 linears run for 4..512 rows:
cpu_ops.linear), ``int4`` / ``int8`` (group-wise codes, group 128: quant_linear.c's kernel),
``int4-gemm`` / ``int8-gemm`` (the same weights widened into a float32 buffer + torch's GEMM),
``int4-panel`` / ``int8-panel`` (the panel GEMM of quant_gemm.c on grouped.pack_panels'
layout), ``int4-auto`` / ``int8-auto`` (whichever of these grouped.grouped_matmul routes the
row count to), ``fp8`` (e4m3 with per-row scales: fp8_linear.c), ``fp8-b128`` (block-wise
scales, one per 128 inputs), ``fp8-gemm`` (fp8 widened + GEMM, the path past fp8.C_MAX_ROWS).
Read bandwidth: ``torch.sum`` over 512 MiB, median of 5 (benchmarks/attention.py).
Times: median of 7 steps after one warm-up, ``--threads`` threads.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from attention import measure_bandwidth  # noqa: E402  (puts this checkout's pagedllm first on sys.path)

from pagedllm.layers import cpu_ops  # noqa: E402
from pagedllm.layers.quantization import grouped  # noqa: E402
from pagedllm.layers.quantization.base import scratch_buffer  # noqa: E402
from pagedllm.models.cpu_decode import DEFAULT_MAX_TOKENS  # noqa: E402
from pagedllm.native import bindings  # noqa: E402

HIDDEN, INTER, LAYERS, GROUP = 1024, 2816, 16, 128
SHAPES = [(2048, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)]  # [out, in]: qkv, o, gate_up, down


def make_weight(kind: str, out_f: int, in_f: int) -> tuple[tuple, int]:
    """One projection's tensors for ``kind`` and the bytes a step reads from them."""
    if kind.startswith("f32"):
        w = torch.randn(out_f, in_f)
        return (w, cpu_ops.pack_weight(w) if kind == "f32-packed" else None), w.numel() * 4
    if kind.startswith("fp8"):
        w = (torch.randn(out_f, in_f) * 0.1).to(torch.float8_e4m3fn).view(torch.uint8)
        groups = in_f // GROUP if kind == "fp8-b128" else 1
        return (w, torch.rand(out_f, groups)), w.numel() + 4 * out_f * groups
    bits = 4 if kind.startswith("int4") else 8
    codes = torch.randint(0, 2**bits, (out_f, in_f), dtype=torch.uint8)
    scale, szero = torch.rand(out_f, in_f // GROUP), torch.rand(out_f, in_f // GROUP)
    q = grouped.pack_codes(codes, bits)
    panels = None
    if kind.endswith(("-panel", "-auto")):
        panels = grouped.pack_panels(codes, scale, szero, bits, bindings.library().qg_panel)
    return (q, scale, szero, bits, panels), q.numel() + 8 * scale.numel()


def apply(lib, kind: str, tensors: tuple, x: torch.Tensor, y: torch.Tensor, threads: int) -> None:
    """y = x . W^T through the kernel of ``kind``."""
    tokens = x.shape[0]
    if kind == "f32-packed":
        cpu_ops.linear(x, tensors[0], None, tensors[1])
    elif kind == "f32":
        if tokens <= DEFAULT_MAX_TOKENS:  # the engine's limit for the C decoder's float32 tile
            lib.linear(x, tensors[0], None, None, y, threads)
        else:
            torch.nn.functional.linear(x, tensors[0])
    elif kind in ("fp8", "fp8-b128"):
        lib.fp8_linear(x, tensors[0], tensors[1], None, x.shape[1] // tensors[1].shape[1], y, threads)
    elif kind == "fp8-gemm":
        w = scratch_buffer(x.shape[1] * y.shape[1]).view(y.shape[1], x.shape[1])  # [out, in]
        lib.dequantize_fp8(tensors[0], tensors[1], w, x.shape[1], threads)
        torch.nn.functional.linear(x, w)
    elif kind.endswith("-auto"):
        grouped.grouped_matmul(x, *tensors[:3], None, GROUP, tensors[3], tensors[4])
    elif kind.endswith("-panel"):
        lib.grouped_gemm(x, *tensors[4], None, GROUP, tensors[3], y, threads)
    elif kind.endswith("-gemm"):
        q, scale, szero, bits, _ = tensors
        w = scratch_buffer(q.shape[0] * x.shape[1]).view(q.shape[0], x.shape[1])  # [out, in]
        lib.dequantize_grouped(q, scale, szero, w, GROUP, bits, threads)
        torch.nn.functional.linear(x, w)
    else:
        q, scale, szero, bits, _ = tensors
        lib.grouped_linear(x, q, scale, szero, None, GROUP, bits, y, threads)


def time_kind(lib, kind: str, tokens: int, threads: int) -> tuple[float, int]:
    """Median seconds of one step's projections and the bytes they read."""
    layers, nbytes = [], 0
    for _ in range(LAYERS):
        for out_f, in_f in SHAPES:
            tensors, n = make_weight(kind, out_f, in_f)
            layers.append((tensors, in_f, out_f))
            nbytes += n
    xs = {in_f: torch.randn(tokens, in_f) for _, in_f in SHAPES}
    ys = {out_f: torch.empty(tokens, out_f) for out_f, _ in SHAPES}

    def step():
        for tensors, in_f, out_f in layers:
            apply(lib, kind, tensors, xs[in_f], ys[out_f], threads)

    times = []
    for i in range(8):
        t0 = time.perf_counter()
        step()
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times), nbytes


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--kinds", default="f32,int8,int4,fp8")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)  # MKL / oneDNN kinds: as many threads as the C kernels
    lib = bindings.library()
    bw = measure_bandwidth(512, 5)["read_gbs"]
    print(f"read bandwidth {bw:.1f} GB/s; {args.tokens} token(s), {args.threads} threads")
    print(f"{'kind':10s} {'ms':>8s} {'MB':>7s} {'GB/s':>6s} {'x read':>7s}")
    for kind in args.kinds.split(","):
        sec, nbytes = time_kind(lib, kind, args.tokens, args.threads)
        x_read = sec / (nbytes / bw / 1e9)
        print(f"{kind:10s} {1e3 * sec:8.2f} {nbytes / 1e6:7.1f} {nbytes / sec / 1e9:6.1f} {x_read:7.2f}")


if __name__ == "__main__":
    main()

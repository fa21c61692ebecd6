"""The projections of one decode step of the ~200M benchmark Llama (16 layers of qkv, o, gate_up
and down; distinct random weights per layer, so they stream from memory as in the engine),
through each CPU weight kernel alone, against the time reading their bytes once takes::

    python benchmarks/probes/quant_kernels.py                      # batch 1: f32,int8,int4,fp8
    python benchmarks/probes/quant_kernels.py --tokens 32 --kinds int4,int4-gemm,int8,int8-gemm

Kinds: ``f32`` (the register-tile kernel up to cpu_decode.DEFAULT_MAX_TOKENS, else torch's GEMM), ``f32-packed``
(oneDNN's prepacked GEMM, what the engine's float32 linears run for 4..512 rows:
cpu_ops.linear), ``int4`` / ``int8`` (group-wise codes, group 128: quant_linear.c's kernel),
``int8-row`` (our own ``quantization="int8"``: signed
codes, one scale per row, through ``ld_linear`` as the one-call decoder runs them),
``int4-gemm`` / ``int8-gemm`` (the same weights widened into a float32 buffer + the engine's GEMM
for it, ``cpu_ops.unpacked_linear``),
``int4-panel`` / ``int8-panel`` (the panel GEMM of quant_gemm.c on grouped.pack_panels'
layout), ``int4-auto`` / ``int8-auto`` (whichever of these grouped.grouped_matmul routes the
row count to), ``fp8`` (e4m3 with per-row scales: fp8_linear.c), ``fp8-b128`` (block-wise
scales, one per 128 inputs), ``fp8-gemm`` (fp8 widened + GEMM, the path past fp8.C_MAX_ROWS).
Each kind is first checked against ``x . W^T`` in float64 from the weight's own values
(``check_kind``) on every projection shape; ``--hidden`` / ``--inter`` / ``--layers`` shrink the
model (tests/benchmarks/test_quant_kernels_benchmark.py runs it tiny).
Read bandwidth: ``torch.sum`` over 512 MiB, median of 5 (benchmarks/attention.py).
Times: median of 7 steps after one warm-up, ``--threads`` threads.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common, attention, ...

import torch  # noqa: E402
from attention import measure_bandwidth  # noqa: E402  (puts this checkout's pagedllm first on sys.path)

from pagedllm.layers import cpu_ops  # noqa: E402
from pagedllm.layers.quantization import grouped, int8  # noqa: E402
from pagedllm.layers.quantization.base import scratch_buffer  # noqa: E402
from pagedllm.models.cpu_decode import DEFAULT_MAX_TOKENS  # noqa: E402
from pagedllm.native import bindings  # noqa: E402
from pagedllm.platform import huge_page_copies, huge_pages_enabled  # noqa: E402

HIDDEN, INTER, LAYERS, GROUP = 1024, 2816, 16, 128
KINDS = ("f32", "f32-packed", "int4", "int8", "int8-row", "int4-gemm", "int8-gemm", "int4-panel", "int8-panel",
         "int4-auto", "int8-auto", "fp8", "fp8-b128", "fp8-gemm")


def shapes(hidden: int, inter: int) -> list[tuple[int, int]]:
    """[out, in] of one layer's projections: qkv, o, gate_up, down."""
    return [(2 * hidden, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter)]


SHAPES = shapes(HIDDEN, INTER)


def random_weight(kind: str, out_f: int, in_f: int) -> dict[str, torch.Tensor]:
    """One projection's random weight before any kernel layout: float32 ``w``; FP8 bytes ``w8``
    with float32 ``scale [out, groups]``; or ``codes`` with ``scale`` / ``szero [out, in / GROUP]``."""
    if kind.startswith("f32"):
        return dict(w=torch.randn(out_f, in_f))
    if kind == "int8-row":
        return dict(q=torch.randint(-127, 128, (out_f, in_f), dtype=torch.int8), scale=torch.rand(out_f))
    if kind.startswith("fp8"):
        groups = in_f // GROUP if kind == "fp8-b128" else 1
        w8 = (torch.randn(out_f, in_f) * 0.1).to(torch.float8_e4m3fn).view(torch.uint8)
        return dict(w8=w8, scale=torch.rand(out_f, groups))
    bits = 4 if kind.startswith("int4") else 8
    return dict(codes=torch.randint(0, 2**bits, (out_f, in_f), dtype=torch.uint8),
                scale=torch.rand(out_f, in_f // GROUP), szero=torch.rand(out_f, in_f // GROUP))


def kernel_tensors(kind: str, raw: dict[str, torch.Tensor]) -> tuple[tuple, int]:
    """``raw`` in the layout the kernel of ``kind`` reads, and the bytes a step reads from it."""
    if kind.startswith("f32"):
        w = raw["w"]
        return (w, cpu_ops.pack_weight(w) if kind == "f32-packed" else None), w.numel() * 4
    if kind == "int8-row":
        return (raw["q"], raw["scale"]), raw["q"].numel() + 4 * raw["scale"].numel()
    if kind.startswith("fp8"):
        return (raw["w8"], raw["scale"]), raw["w8"].numel() + 4 * raw["scale"].numel()
    bits = 4 if kind.startswith("int4") else 8
    codes, scale, szero = raw["codes"], raw["scale"], raw["szero"]
    q = grouped.pack_codes(codes, bits)
    panels = None
    if kind.endswith(("-panel", "-auto")):
        panels = grouped.pack_panels(codes, scale, szero, bits, bindings.library().qg_panel)
    return (q, scale, szero, bits, panels), q.numel() + 8 * scale.numel()


def make_weight(kind: str, out_f: int, in_f: int) -> tuple[tuple, int]:
    """One projection's tensors for ``kind`` and the bytes a step reads from them."""
    return kernel_tensors(kind, random_weight(kind, out_f, in_f))


def to_huge_pages(layers: list[tuple[tuple, int, int]]) -> list[tuple[tuple, int, int]]:
    """The projections' plain tensors moved into one mapping in 2 MiB pages, as the engine places
    its weights (platform.module_to_huge_pages; PAGEDLLM_HUGE_PAGES=0: left where they are)."""
    if not huge_pages_enabled():
        return layers
    flat = [t for tensors, _, _ in layers for t in tensors if isinstance(t, torch.Tensor) and t.layout == torch.strided]
    moved = dict(zip(map(id, flat), huge_page_copies(flat)))
    return [(tuple(moved.get(id(t), t) for t in tensors), in_f, out_f) for tensors, in_f, out_f in layers]


def dense_weight(kind: str, raw: dict[str, torch.Tensor]) -> torch.Tensor:
    """The float32 ``[out, in]`` weight ``raw`` stands for, in plain torch: the reference."""
    if "w" in raw:
        return raw["w"]
    if "q" in raw:
        return raw["q"].float() * raw["scale"][:, None]
    if "w8" in raw:
        w, scale = raw["w8"].view(torch.float8_e4m3fn).float(), raw["scale"]
        return w * scale.repeat_interleave(w.shape[1] // scale.shape[1], dim=1)
    return raw["codes"].float() * raw["scale"].repeat_interleave(GROUP, 1) - raw["szero"].repeat_interleave(GROUP, 1)


def check_kind(lib, kind: str, tokens: int, threads: int, out_f: int, in_f: int) -> float:
    """The kernel of ``kind`` against ``x . dense_weight^T`` in float64 on one random projection:
    raises AssertionError past float32 rounding; returns the error relative to the largest output."""
    raw = random_weight(kind, out_f, in_f)
    x, y = torch.randn(tokens, in_f), torch.empty(tokens, out_f)
    got = apply(lib, kind, kernel_tensors(kind, raw)[0], x, y, threads).double()
    ref = x.double() @ dense_weight(kind, raw).double().T  # [tokens, out]
    err = ((got - ref).abs().max() / ref.abs().max()).item()
    assert err < 1e-5, f"quant_kernels.py: {kind} at {tokens} token(s), [{out_f}, {in_f}]: relative error {err:.3g}"
    return err


def apply(lib, kind: str, tensors: tuple, x: torch.Tensor, y: torch.Tensor, threads: int) -> torch.Tensor:
    """x . W^T through the kernel of ``kind``: ``y``, or the tensor a torch path returned."""
    tokens = x.shape[0]
    if kind == "f32-packed":
        return cpu_ops.linear(x, tensors[0], None, tensors[1])
    if kind == "f32":
        if tokens > DEFAULT_MAX_TOKENS:  # the engine's limit for the C decoder's float32 tile
            return torch.nn.functional.linear(x, tensors[0])
        lib.linear(x, tensors[0], None, None, y, threads)
    elif kind == "int8-row":
        if tokens > int8.C_MAX_ROWS:  # the engine's route past it (int8.int8_linear): widen + GEMM
            w = scratch_buffer(tensors[0].numel()).view(tensors[0].shape)  # [out, in]
            lib.dequantize_int8(tensors[0], tensors[1], w, threads)
            return torch.nn.functional.linear(x, w)
        lib.linear(x, tensors[0], tensors[1], None, y, threads)
    elif kind in ("fp8", "fp8-b128"):
        lib.fp8_linear(x, tensors[0], tensors[1], None, x.shape[1] // tensors[1].shape[1], y, threads)
    elif kind == "fp8-gemm":
        w = scratch_buffer(x.shape[1] * y.shape[1]).view(y.shape[1], x.shape[1])  # [out, in]
        lib.dequantize_fp8(tensors[0], tensors[1], w, x.shape[1], threads)
        return torch.nn.functional.linear(x, w)
    elif kind.endswith("-auto"):
        return grouped.grouped_matmul(x, *tensors[:3], None, GROUP, tensors[3], tensors[4])
    elif kind.endswith("-panel"):
        lib.grouped_gemm(x, *tensors[4], None, GROUP, tensors[3], y, threads)
    elif kind.endswith("-gemm"):
        q, scale, szero, bits, _ = tensors
        w = scratch_buffer(q.shape[0] * x.shape[1]).view(q.shape[0], x.shape[1])  # [out, in]
        lib.dequantize_grouped(q, scale, szero, w, GROUP, bits, threads)
        return cpu_ops.unpacked_linear(x, w, None)  # the engine's GEMM for a widened weight
    else:
        q, scale, szero, bits, _ = tensors
        lib.grouped_linear(x, q, scale, szero, None, GROUP, bits, y, threads)
    return y


def time_kind(lib, kind: str, tokens: int, threads: int, step_shapes: list[tuple[int, int]] = SHAPES,
              num_layers: int = LAYERS) -> tuple[float, int]:
    """Median seconds of one step's projections and the bytes they read."""
    layers, nbytes = [], 0
    for _ in range(num_layers):
        for out_f, in_f in step_shapes:
            tensors, n = make_weight(kind, out_f, in_f)
            layers.append((tensors, in_f, out_f))
            nbytes += n
    layers = to_huge_pages(layers)
    xs = {in_f: torch.randn(tokens, in_f) for _, in_f in step_shapes}
    ys = {out_f: torch.empty(tokens, out_f) for out_f, _ in step_shapes}

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


def main(argv=None) -> dict[str, float]:
    """Prints one line per kind (each first checked against the float32 reference: check_kind)
    and returns the milliseconds per step by kind."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--kinds", default="f32,int8,int4,fp8", help=f"comma-separated, of {','.join(KINDS)}")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=HIDDEN, help="model width (a multiple of 128)")
    ap.add_argument("--inter", type=int, default=INTER, help="MLP width (a multiple of 128)")
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--bandwidth-mib", type=int, default=512, help="buffer the read bandwidth is measured on")
    args = ap.parse_args(argv)
    kinds = args.kinds.split(",")
    if unknown := sorted(set(kinds) - set(KINDS)):
        ap.error(f"--kinds: unknown {unknown}; allowed: {','.join(KINDS)}")
    torch.set_num_threads(args.threads)  # MKL / oneDNN kinds: as many threads as the C kernels
    lib, step_shapes = bindings.library(), shapes(args.hidden, args.inter)
    bw = measure_bandwidth(args.bandwidth_mib, 5)["read_gbs"]
    print(f"read bandwidth {bw:.1f} GB/s; {args.tokens} token(s), {args.threads} threads; weights in "
          f"{'2 MiB' if huge_pages_enabled() else '4 KiB'} pages")
    print(f"{'kind':10s} {'ms':>8s} {'MB':>7s} {'GB/s':>6s} {'x read':>7s}")
    results = {}
    for kind in kinds:
        for out_f, in_f in step_shapes:
            check_kind(lib, kind, args.tokens, args.threads, out_f, in_f)
        sec, nbytes = time_kind(lib, kind, args.tokens, args.threads, step_shapes, args.layers)
        x_read = sec / (nbytes / bw / 1e9)
        print(f"{kind:10s} {1e3 * sec:8.2f} {nbytes / 1e6:7.1f} {nbytes / sec / 1e9:6.1f} {x_read:7.2f}")
        results[kind] = 1e3 * sec
    return results


if __name__ == "__main__":
    main()

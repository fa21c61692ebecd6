"""The paged-attention kernel alone: time, achieved GB/s against measured memory bandwidth, and
speed against the torch reference backend and a gather + SDPA baseline.

    python benchmarks/attention.py                 # ~1-2 min on 2 cores
    python benchmarks/attention.py --quick         # small cases, a sanity check (seconds)
    python benchmarks/attention.py --threads 1 --cases decode-bs64-ctx2048 --warm-cache

Each timed call is a full backend step (write the new K/V, then attend), on a pool of shuffled
blocks; 8 query heads, 4 KV heads, head_dim 64. Cases: decode at batch 1 and 64 with contexts
256, 1024 and 2048, and one 512-token prefill. Before every timed call the caches are flushed
by reading a buffer twice the size of the L3 (``--warm-cache`` skips this), so K/V come from
memory as they do in a model forward, where the other layers' weights evict them.

Bytes the step must move at minimum (``min_bytes``):
  read   K and V of every request's visible context (seq_len tokens) in the cache dtype; the
         new tokens' K/V are read once, from the step's inputs, so they are part of seq_len
  read   the queries
  write  the outputs, and the new K/V into the cache
Block tables and other metadata are ignored (a few KiB). Achieved GB/s = bytes / median time.

Memory bandwidth is measured in the same run on one buffer of ``--bw-mib`` (default 256 MiB,
well past the 48 MiB L3), filled first (untouched pages read as the shared zero page):
``dst.copy_(src)`` counting read + write bytes, and ``src.sum()`` counting the bytes read.
``% read`` = kernel GB/s / sum() GB/s is the relevant ceiling for this read-dominated kernel.

On a GPU (``--device cuda``) the kernel is the engine's attention backend for CUDA
(``--backend``, default auto), activations are in the cache dtype, bandwidth is measured on a
device buffer, and nothing is flushed (the K/V of a decode batch is far larger than the L2; at
batch 1 a context of 4096 fits in an H200's 50 MiB L2, so read that case as an upper bound).
What is timed is the kernels alone, as a model forward runs them under a CUDA graph: a
graph-safe backend's step (``supports_cuda_graphs``) is captured once and replayed
``--replays`` times back to back between two CUDA events, so the host's checks and launch
building are not counted; other backends (the gather + SDPA baseline, which reads lengths back
to the host) are called back to back between the events instead. ``timing`` in each case's
result says which::

    python benchmarks/attention.py --device cuda --cache-dtype bfloat16 --num-heads 32 --num-kv-heads 8 \
        --contexts 4096 --cases decode-bs64-ctx4096 --skip-ref
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR.parent))  # this checkout, not an installed copy
sys.path.insert(0, str(BENCH_DIR))  # benchmarks/common.py

import common  # noqa: E402  (format_table, save_json, git_commit)

from pagedllm.attention.backend import write_kv  # noqa: E402
from pagedllm.attention.cpu import CpuAttentionBackend  # noqa: E402
from pagedllm.attention.metadata import AttentionMetadata  # noqa: E402
from pagedllm.attention.selector import get_attention_backend  # noqa: E402
from pagedllm.attention.testing import PagedBatch, make_paged_batch  # noqa: E402
from pagedllm.attention.torch_ref import TorchReferenceBackend  # noqa: E402
from pagedllm.platform import huge_page_copies, huge_page_empty, huge_pages_enabled, huge_pages_supported  # noqa: E402

RESULTS_DIR = common.RESULTS_DIR
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 8, 4, 64
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
MiB = 2**20


def build_cases(quick: bool, contexts: tuple[int, ...] | None = None) -> dict[str, list[tuple[int, int]]]:
    """name -> per request (num_cached, q_len): decode at every (batch, context), one prefill."""
    batches, default_contexts, prefill = ((1, 4), (64, 256), 64) if quick else ((1, 64), (256, 1024, 2048), 512)
    contexts = contexts or default_contexts
    cases = {f"decode-bs{b}-ctx{c}": [(c - 1, 1)] * b for b in batches for c in contexts}
    cases[f"prefill-{prefill}"] = [(0, prefill)]
    return cases


# --------------------------------------------------------------------------- bytes and bandwidth


def min_bytes(reqs: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int,
              cache_itemsize: int, act_itemsize: int = 4) -> dict[str, int]:
    """The bytes a full step (write new K/V, attend) must move at minimum; see the module doc."""
    tokens = sum(q for _, q in reqs)
    context = sum(c + q for c, q in reqs)
    kv_row = num_kv_heads * head_dim * cache_itemsize * 2  # one token's K and V
    parts = dict(kv_read=context * kv_row, q_read=tokens * num_heads * head_dim * act_itemsize,
                 out_write=tokens * num_heads * head_dim * act_itemsize, kv_write=tokens * kv_row)
    parts["total"] = sum(parts.values())
    return parts


def filled(numel: int, device: str = "cpu", huge_pages: bool = True) -> torch.Tensor:
    """A float32 buffer whose pages are really backed (torch.empty pages that were never written
    map the shared zero page and read at absurd speeds). On the CPU in 2 MiB pages where the
    kernel offers them, as the engine keeps its weights and KV pool (platform.huge_page_empty):
    the best this machine reads, 1.0-1.4x the 4 KiB-page figure on this project's hosts."""
    if device == "cpu" and huge_pages and huge_pages_supported():
        return huge_page_empty((numel,), torch.float32).fill_(1.0)
    return torch.empty(numel, device=device).fill_(1.0)


def measure_bandwidth(mib: int, repeats: int, device: str = "cpu") -> dict[str, float]:
    """Median GB/s of ``dst.copy_(src)`` (read + write bytes) and ``src.sum()`` (read bytes);
    where those buffers are in 2 MiB pages also ``read_gbs_4k``, the sum over one in 4 KiB pages."""
    src, dst = filled(mib * MiB // 4, device), filled(mib * MiB // 4, device)
    copy_s = _median_time(lambda: dst.copy_(src), repeats, device=device)
    read_s = _median_time(lambda: src.sum(), repeats, device=device)
    nbytes = src.numel() * 4
    out = dict(buffer_mib=mib, copy_gbs=2 * nbytes / copy_s / 1e9, read_gbs=nbytes / read_s / 1e9,
               copy_ms=1e3 * copy_s, read_ms=1e3 * read_s)
    if device == "cpu" and huge_pages_supported():
        del dst
        small = filled(mib * MiB // 4, device, huge_pages=False)
        out["read_gbs_4k"] = nbytes / _median_time(lambda: small.sum(), repeats) / 1e9
    return out


def _median_time(fn, repeats: int, warmup: int = 1, device: str = "cpu") -> float:
    times = []
    for i in range(warmup + repeats):
        elapsed = _timed(fn, device)
        if i >= warmup:
            times.append(elapsed)
    return statistics.median(times)


def _timed(fn, device: str = "cpu") -> float:
    """Seconds ``fn()`` takes; on a GPU between CUDA events (kernels run asynchronously)."""
    if device == "cpu":
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def l3_bytes() -> int:
    """The L3 size from sysfs (48 MiB on the project machine); 32 MiB if it cannot be read."""
    try:
        text = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
        return int(text[:-1]) * {"K": 2**10, "M": MiB}[text[-1]]
    except (OSError, ValueError, KeyError):
        return 32 * MiB


# --------------------------------------------------------------------------- backends and timing


class GatherSdpaBackend:
    """Baseline: copy every request's context out of the pool into a padded dense batch, then
    one masked SDPA call (what you would write without a paged kernel)."""

    name = "gather+sdpa"

    def forward(self, query, key, value, key_cache, value_cache, meta, scale, sliding_window=None):
        write_kv(key, value, key_cache, value_cache, meta.slot_mapping)
        num_heads, block_size = query.shape[1], key_cache.shape[2]
        group = num_heads // key_cache.shape[1]
        q_lens, seq_lens = meta.query_lens.long(), meta.seq_lens.long()
        max_q, max_s = int(q_lens.max()), int(seq_lens.max())
        dev = query.device
        pos = torch.arange(max_s, device=dev)
        blocks = meta.block_tables.long()[:, : (max_s + block_size - 1) // block_size]
        logical = (pos // block_size).clamp(max=blocks.shape[1] - 1).expand(len(seq_lens), -1)
        slot_blocks = blocks.gather(1, logical)  # [R, max_s] physical block of every position
        # [R, max_s, Hkv, D] -> [R, H, max_s, D]: the gather copy the paged kernel avoids
        k = key_cache[slot_blocks.clamp(min=0), :, pos % block_size].transpose(1, 2).to(query.dtype)
        v = value_cache[slot_blocks.clamp(min=0), :, pos % block_size].transpose(1, 2).to(query.dtype)
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        q_idx = meta.query_start_loc[:-1].long()[:, None] + torch.arange(max_q, device=dev)  # [R, max_q]
        q_valid = torch.arange(max_q, device=dev)[None, :] < q_lens[:, None]
        q = query[q_idx.clamp(max=query.shape[0] - 1)].transpose(1, 2)  # [R, H, max_q, D]
        q_pos = seq_lens[:, None] - q_lens[:, None] + torch.arange(max_q, device=dev)  # [R, max_q]
        key_pos = pos[None, None, :]
        mask = (key_pos <= q_pos[:, :, None]) & (key_pos < seq_lens[:, None, None])
        mask |= ~q_valid[:, :, None]  # padded query rows: any non-empty mask avoids NaNs
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=scale)
        return o.transpose(1, 2)[q_valid]  # [num_tokens, H, D]


def time_backend(backend, batch: PagedBatch, repeats: int, flush: torch.Tensor | None, warmup: int = 2,
                 replays: int = 20):
    """(median seconds, last output, how it was timed) of full forward steps on a private copy of
    the pool; ``flush`` (if given) is read before each CPU call to evict the caches, outside the
    timing. On CUDA: kernel time per step (``cuda_kernel_seconds``)."""
    kc, vc = batch.fresh_caches()
    if batch.query.device.type == "cpu" and huge_pages_enabled():
        kc, vc = huge_page_copies([kc, vc])  # where the engine keeps its pool (worker/cache_engine.py)
    times, out = [], None

    def step():
        nonlocal out
        out = backend.forward(batch.query, batch.key, batch.value, kc, vc, batch.meta, batch.scale)

    if batch.query.device.type == "cuda":
        graph = getattr(backend, "supports_cuda_graphs", False)
        seconds = cuda_kernel_seconds(step, repeats, replays, graph)
        return seconds, out, "cuda-graph" if graph else "cuda-events"
    for i in range(warmup + repeats):
        if flush is not None:
            flush.sum()
        elapsed = _timed(step, batch.query.device.type)
        if i >= warmup:
            times.append(elapsed)
    return statistics.median(times), out, "wall"


def cuda_kernel_seconds(fn, repeats: int, replays: int, graph: bool) -> float:
    """Median over ``repeats`` of the seconds per call of ``fn``'s kernels: ``replays`` calls
    back to back between two CUDA events. With ``graph``, ``fn`` (graph-safe) is captured once and
    the graph is replayed, so no host work sits between the kernels; without, each call's host
    work is counted wherever it outlasts the kernels queued before it."""
    fn()  # the JIT compiles, the allocator's first blocks
    torch.cuda.synchronize()
    run = fn
    if graph:
        side = torch.cuda.Stream()  # capture after a call on a side stream, as torch's graph docs do
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            fn()  # the outputs fn keeps are the graph's: every replay rewrites them
        run = cuda_graph.replay
    run()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / replays)
    return statistics.median(times)


def on_device(batch: PagedBatch, device: str, dtype: torch.dtype) -> PagedBatch:
    """The batch on ``device``, activations in ``dtype`` (the cache keeps its dtype)."""
    if device == "cpu":
        return batch
    m = batch.meta
    meta = AttentionMetadata(query_start_loc=m.query_start_loc.to(device), seq_lens=m.seq_lens.to(device),
                             block_tables=m.block_tables.to(device), slot_mapping=m.slot_mapping.to(device),
                             max_query_len=m.max_query_len, max_seq_len=m.max_seq_len, block_size=m.block_size)
    act = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    return dataclasses.replace(batch, query=act(batch.query), key=act(batch.key), value=act(batch.value),
                               key_cache=batch.key_cache.to(device), value_cache=batch.value_cache.to(device),
                               meta=meta)


def bench_case(name: str, reqs, backends, args, flush) -> dict:
    """Times every backend on one case; GB/s from the minimum bytes of the step."""
    cache_dtype = DTYPES[args.cache_dtype]
    batch = make_paged_batch(reqs, args.num_heads, args.num_kv_heads, args.head_dim, args.block_size, seed=0,
                             cache_dtype=cache_dtype)
    act_dtype = torch.float32 if args.device == "cpu" else cache_dtype
    batch = on_device(batch, args.device, act_dtype)
    nbytes = min_bytes(reqs, args.num_heads, args.num_kv_heads, args.head_dim, cache_dtype.itemsize,
                       act_dtype.itemsize)
    res, outs = {}, {}
    for b in backends:
        t, outs[b.name], timing = time_backend(b, batch, _repeats(b, name, args.repeats), flush,
                                               replays=args.replays)
        res[b.name] = dict(ms=1e3 * t, gbs=nbytes["total"] / t / 1e9, timing=timing)
    kernel = backends[0].name  # the others are compared with it
    diffs = [(outs[kernel].float() - o.float()).abs().max().item() for k, o in outs.items() if k != kernel]
    return dict(batch=len(reqs), context=reqs[0][0] + reqs[0][1], q_len=reqs[0][1], bytes=nbytes, kernel=kernel,
                backends=res, max_abs_diff=max(diffs, default=0.0),
                speedup={k: r["ms"] / res[kernel]["ms"] for k, r in res.items() if k != kernel})


def _repeats(backend, case: str, repeats: int) -> int:
    # the torch reference is ~100x slower and prefill calls are long: fewer repeats keep the run short
    slow = isinstance(backend, TorchReferenceBackend) or case.startswith("prefill")
    return max(3, repeats // 4) if slow else repeats


# --------------------------------------------------------------------------- reporting


def _ms(backends: dict, key: str) -> str:
    return f"{backends[key]['ms']:.3f}" if key in backends else "-"


def _speedup(case: dict, key: str) -> str:
    return f"{case['speedup'][key]:.1f}x" if key in case["speedup"] else "-"


def table_rows(cases: dict, bw: dict) -> list[list[str]]:
    rows = []
    for name, c in cases.items():
        cpu, b = c["backends"][c["kernel"]], c["backends"]
        rows.append([name, f"{c['bytes']['total'] / MiB:.2f}", f"{cpu['ms']:.3f}", f"{cpu['gbs']:.1f}",
                     f"{100 * cpu['gbs'] / bw['read_gbs']:.0f}%", f"{100 * cpu['gbs'] / bw['copy_gbs']:.0f}%",
                     *(_ms(b, k) for k in ("torch", "gather+sdpa")),
                     *(_speedup(c, k) for k in ("torch", "gather+sdpa")), f"{c['max_abs_diff']:.1e}"])
    return rows


def print_report(cases: dict, bw: dict, meta: dict) -> None:
    print(f"\n{meta['device']} kernel={meta['kernel']} threads={meta['threads']} block_size={meta['block_size']} "
          f"heads={meta['num_heads']} kv_heads={meta['num_kv_heads']} "
          f"head_dim={meta['head_dim']} cache={meta['cache_dtype']}; median over {meta['repeats']} repeats "
          f"({max(3, meta['repeats'] // 4)} for torch ref and prefill); caches "
          f"{'warm' if meta['warm_cache'] else 'flushed before each call'}")
    print(f"memory bandwidth ({bw['buffer_mib']} MiB buffer): copy {bw['copy_gbs']:.1f} GB/s (read + write), "
          f"sum() read {bw['read_gbs']:.1f} GB/s")
    headers = ["case", "min MiB", f"{meta['kernel']} ms", "GB/s", "% read", "% copy", "torch ms", "sdpa ms",
               "ref/cpu", "sdpa/cpu", "max|diff|"]
    print(common.format_table(headers, table_rows(cases, bw)))


# --------------------------------------------------------------------------- main


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--repeats", type=int, default=None, help="timed calls per case (default 12, quick 4)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--cache-dtype", default="float32", choices=list(DTYPES))
    ap.add_argument("--cases", default=None, help="comma-separated subset of the case names")
    ap.add_argument("--quick", action="store_true", help="small cases (batch 1 and 4, contexts 64 and 256)")
    ap.add_argument("--bw-mib", type=int, default=256, help="bandwidth buffer size in MiB (>> L3)")
    ap.add_argument("--warm-cache", action="store_true", help="do not flush the caches before each call")
    ap.add_argument("--skip-ref", action="store_true", help="skip the (slow) torch reference backend")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--backend", default="auto", help="on cuda: the engine's attention backend to time")
    ap.add_argument("--replays", type=int, default=20, help="on cuda: steps back to back per timed repeat")
    ap.add_argument("--num-heads", type=int, default=NUM_HEADS)
    ap.add_argument("--num-kv-heads", type=int, default=NUM_KV_HEADS)
    ap.add_argument("--head-dim", type=int, default=HEAD_DIM)
    ap.add_argument("--contexts", default=None, help="comma-separated decode contexts (default 256,1024,2048)")
    ap.add_argument("--output", type=Path, default=None,
                    help="JSON path (default results/attention.json, or results/attention-quick.json)")
    args = ap.parse_args(argv)
    if args.replays < 1:
        ap.error(f"--replays={args.replays}: must be >= 1")
    args.repeats = args.repeats or (4 if args.quick else 12)
    args.output = args.output or RESULTS_DIR / ("attention-quick.json" if args.quick else "attention.json")
    args.contexts = tuple(int(c) for c in args.contexts.split(",")) if args.contexts else None
    return args


def select_cases(args) -> dict[str, list[tuple[int, int]]]:
    cases = build_cases(args.quick, args.contexts)
    if args.cases is None:
        return cases
    names = [n.strip() for n in args.cases.split(",") if n.strip()]
    unknown = [n for n in names if n not in cases]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; choose from {list(cases)}")
    return {n: cases[n] for n in names}


def main(argv=None) -> dict:
    args = parse_args(argv)
    cases = select_cases(args)
    torch.set_num_threads(args.threads)
    backends = [_kernel(args), GatherSdpaBackend()]
    if not args.skip_ref:
        backends.insert(1, TorchReferenceBackend())
    bw = measure_bandwidth(args.bw_mib, repeats=7, device=args.device)
    flush = None if args.warm_cache or args.device != "cpu" else filled(2 * l3_bytes() // 4)
    results = {}
    for name, reqs in cases.items():
        results[name] = bench_case(name, reqs, backends, args, flush)
    meta = dict(run_meta(args), kernel=backends[0].name)
    print_report(results, bw, meta)
    common.save_json(dict(meta=meta, bandwidth=bw, cases=results), args.output)
    print(f"\nsaved {args.output}")
    return dict(bandwidth=bw, cases=results)


def _kernel(args):
    if args.device == "cpu":
        return CpuAttentionBackend(num_threads=args.threads)
    return get_attention_backend(args.backend, torch.device(args.device))


def run_meta(args) -> dict:
    return dict(date=datetime.now(timezone.utc).isoformat(timespec="seconds"), threads=args.threads,
                block_size=args.block_size, cache_dtype=args.cache_dtype, repeats=args.repeats,
                warm_cache=args.warm_cache or args.device != "cpu", l3_bytes=l3_bytes(), num_heads=args.num_heads,
                num_kv_heads=args.num_kv_heads, head_dim=args.head_dim, quick=args.quick, device=args.device,
                gpu=torch.cuda.get_device_name() if args.device == "cuda" else None,
                torch=torch.__version__, python=platform.python_version(),
                cpu=platform.processor() or platform.machine(), cpu_count=os.cpu_count(),
                git_commit=common.git_commit())


if __name__ == "__main__":
    main()

"""Which float32 GEMM kernel runs each CPU linear layer, measured on this host at start-up.

The fixed thresholds in ``cpu_ops`` (``PACKED_MIN_ROWS``, ``PANEL_MAX_ROWS``,
``DECODE_PANEL_MIN_ROWS``) were chosen on the development hosts; on another CPU a different
kernel can win at a given shape (issue 39: the batch-64 margin over vLLM vanished on an
AVX-512 Xeon without AMX). So, once the weights are packed, every distinct projection shape
``[out, in]`` of the model is timed at the token counts the scheduler produces (``ROW_BUCKETS``)
on each kernel this build has for it:

- ``tile``: the one-call decoder's register tile (``ld_linear``, up to ``max_decode_tokens`` rows),
- ``panel``: the panel GEMM (``dense_gemm.c``, where the weight has its panel copy),
- ``onednn``: oneDNN on the prepacked weight (``torch.ops.mkldnn._linear_pointwise``),
- ``mm``: ``torch.nn.functional.linear`` (torch's BLAS: MKL on x86 builds).

The fastest per (shape, bucket) goes into a ``KernelTable`` that ``cpu_ops.linear`` consults, and
the one-call decoder's tile/panel switch (``LdModel.panel_min``) is the token count from which the
panel GEMM is faster summed over its projections. The table is cached as JSON under
``PAGEDLLM_CACHE_DIR/kernels/<key>.json``, the key hashing what the timings depend on (CPU model
and flags, cores, torch threads, dtype, shapes, mode, torch and library build), so a restart on
the same host and settings measures nothing. ``PAGEDLLM_KERNEL_TUNING``: ``off`` keeps the fixed
thresholds, ``fast`` (default) times buckets up to 256 rows for ~2 ms per candidate (more rows keep the
thresholds), ``full`` adds 512 and 2048 rows and ~10 ms per candidate. Every candidate computes
the same product (float32, summed in a different order), so the choice changes speed, not
results beyond rounding.
"""
from __future__ import annotations

import bisect
import hashlib
import json
import logging
import os
import platform as py_platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedllm import envs
from pagedllm.layers import cpu_ops
from pagedllm.native import bindings

logger = logging.getLogger(__name__)

MODES = ("off", "fast", "full")
# token counts measured, and the largest count each one stands for (4 for 2-8 tokens)
ROW_BUCKETS = (1, 4, 16, 32, 64, 96, 128, 256, 512, 2048)
BUCKET_BOUNDS = (1, 8, 16, 32, 64, 96, 128, 256, 512, 1 << 62)
KERNELS = cpu_ops.GEMM_KERNELS
# seconds of timed calls per candidate and mode (after one untimed warm-up call), and the buckets
TIME_BUDGET_S = {"fast": 0.002, "full": 0.010}
LONG_CALL = 20
# a kernel replaces the fixed thresholds' choice only when it is this much faster
MARGIN = 0.05
# fast: up to 256 rows (more keep the fixed thresholds); the big buckets cost most of the time
MODE_BUCKETS = {"fast": ROW_BUCKETS[:-2], "full": ROW_BUCKETS}
TABLE_VERSION = 2


def tuning_mode() -> str:
    """``PAGEDLLM_KERNEL_TUNING``, checked against ``MODES``."""
    mode = envs.PAGEDLLM_KERNEL_TUNING
    if mode not in MODES:
        raise ValueError(f"PAGEDLLM_KERNEL_TUNING={mode!r} must be one of {', '.join(MODES)}")
    return mode


def bucket_index(rows: int) -> int:
    """The ``ROW_BUCKETS`` entry that stands for ``rows`` tokens."""
    return bisect.bisect_left(BUCKET_BOUNDS, rows)


@dataclass(frozen=True)
class KernelTable:
    """The measured kernel per weight shape and row bucket, and the decoder's tile/panel switch.

    ``choices[(out, in)][i]``: the kernel for ``ROW_BUCKETS[i]`` tokens (past the measured
    buckets the fixed thresholds apply: a choice at 256 rows says little about 2048);
    ``decode_panel_min``: ``LdModel.panel_min``, or None to
    keep ``cpu_ops.DECODE_PANEL_MIN_ROWS``."""
    choices: dict[tuple[int, int], tuple[str, ...]]
    decode_panel_min: int | None = None

    def choose(self, out_features: int, in_features: int, rows: int) -> str | None:
        per_bucket = self.choices.get((out_features, in_features))
        index = bucket_index(rows)
        return per_bucket[index] if per_bucket and index < len(per_bucket) else None

    def describe(self) -> str:
        """One line per shape, for the start-up log."""
        lines = [f"decoder panel GEMM from {self.decode_panel_min} tokens" if self.decode_panel_min else
                 "decoder tile/panel switch: fixed threshold"]
        for (out_f, in_f), kernels in sorted(self.choices.items()):
            cells = " ".join(f"{ROW_BUCKETS[i]}:{k}" for i, k in enumerate(kernels))
            lines.append(f"[{out_f}x{in_f}] {cells}")
        return "\n".join(lines)


def host_info() -> dict:
    """What kernel speed depends on besides the shapes: CPU model and flags, cores, threads,
    torch version and ATen's CPU capability (also recorded by ``benchmarks/throughput.py``)."""
    model, flags = "", ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and not model:
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return {"cpu_model": model or py_platform.processor(), "cpu_flags": flags, "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def _linear_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules whose float32 weight has a packed copy (``cpu_ops.pack_model``)."""
    return [m for m in model.modules()
            if getattr(m, "packed_weight", None) is not None and m.weight.dtype == torch.float32]


def candidates(weight: torch.Tensor, packed, rows: int) -> list[str]:
    """The kernels this build has for ``weight`` (with its packed copy) at ``rows`` tokens (the
    tile where it takes every token count of the bucket)."""
    names = ["mm"]
    onednn = packed.onednn if isinstance(packed, cpu_ops.PanelWeight) else packed
    if onednn is not None:
        names.append("onednn")
    if isinstance(packed, cpu_ops.PanelWeight):
        names.append("panel")
    if bindings.is_available() and BUCKET_BOUNDS[bucket_index(rows)] <= bindings.library().max_decode_tokens:
        names.append("tile")
    return names


def time_kernel(name: str, x: torch.Tensor, weight: torch.Tensor, packed, budget_s: float) -> float:
    """Seconds per call of ``name`` on ``x``: the fastest of at least two calls, repeated until
    ``budget_s`` is spent (the minimum: the first call's one-time costs and other processes' load
    only add to it). A first call longer than ``LONG_CALL`` budgets stands alone: its one-time
    costs are small beside it, and a second call would double the start-up time it costs."""
    best, spent, calls = float("inf"), 0.0, 0
    while spent < budget_s or calls < 2:
        start = time.perf_counter()
        cpu_ops.run_gemm(name, x, weight, None, packed)
        elapsed = time.perf_counter() - start
        best, spent, calls = min(best, elapsed), spent + elapsed, calls + 1
        if calls == 1 and elapsed > LONG_CALL * budget_s:
            break
    return best


Timer = Callable[[str, torch.Tensor, torch.Tensor, object, float], float]


def measure(modules: list[torch.nn.Module], mode: str, timer: Timer = time_kernel) -> dict:
    """``{"out x in": {rows: {kernel: seconds, "threshold": the fixed thresholds' kernel}}}``
    for every distinct shape of ``modules``."""
    by_shape = {tuple(m.weight.shape): m for m in modules}
    times: dict[str, dict[str, dict[str, float]]] = {}
    generator = torch.Generator().manual_seed(0)
    for (out_f, in_f), module in sorted(by_shape.items()):
        per_rows = times.setdefault(f"{out_f}x{in_f}", {})
        for rows in MODE_BUCKETS[mode]:
            x = torch.randn(rows, in_f, generator=generator)
            weight, packed = module.weight.detach(), module.packed_weight
            per_rows[str(rows)] = {k: timer(k, x, weight, packed, TIME_BUDGET_S[mode])
                                   for k in candidates(weight, packed, rows)}
            per_rows[str(rows)]["threshold"] = cpu_ops.threshold_kernel(packed, rows)
    return times


def decoder_shapes(model: torch.nn.Module) -> list[tuple[int, int]]:
    """The one-call decoder's projection shapes (one layer's: every layer has them), or []."""
    layers = getattr(getattr(model, "model", model), "layers", None)
    if not layers:
        return []
    try:
        attn, mlp = layers[0].self_attn, layers[0].mlp
        return [tuple(p.weight.shape) for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
    except AttributeError:
        return []


def decode_panel_min(times: dict, shapes: list[tuple[int, int]]) -> int | None:
    """The token count from which the panel GEMM beats the tile on the decoder's projections
    (summed over them) in every measured bucket where both apply; None where they never both do."""
    both = []
    for rows in ROW_BUCKETS:
        cells = [times.get(f"{o}x{i}", {}).get(str(rows), {}) for o, i in shapes]
        if shapes and all("tile" in c and "panel" in c for c in cells):
            both.append((rows, sum(c["panel"] for c in cells) <= sum(c["tile"] for c in cells)))
    if not both:
        return None
    panel_min = None
    for rows, panel_wins in reversed(both):  # from the biggest bucket down, while the panel GEMM keeps winning
        if not panel_wins:
            break
        panel_min = 1 if bucket_index(rows) == 0 else BUCKET_BOUNDS[bucket_index(rows) - 1] + 1
    return panel_min if panel_min is not None else bindings.library().max_decode_tokens + 1


def pick(cell: dict) -> str:
    """The fastest kernel of a measured cell; the fixed thresholds' one unless another beats it
    by more than ``MARGIN`` (a closer race is the timing's noise, and would flip from one
    start-up to the next)."""
    kernels = {k: t for k, t in cell.items() if k in KERNELS}
    best = min(kernels, key=kernels.get)
    default = cell.get("threshold")
    return default if default in kernels and kernels[default] <= kernels[best] * (1 + MARGIN) else best


def build_table(times: dict, shapes: list[tuple[int, int]]) -> KernelTable:
    choices = {}
    for shape, per_rows in times.items():
        out_f, in_f = map(int, shape.split("x"))
        ordered = sorted(per_rows.items(), key=lambda kv: int(kv[0]))
        choices[(out_f, in_f)] = tuple(pick(cell) for _, cell in ordered)
    return KernelTable(choices, decode_panel_min(times, shapes))


def cache_key(modules: list[torch.nn.Module], mode: str) -> tuple[str, dict]:
    """The cache file's name and what it hashes."""
    lib = bindings.library() if bindings.is_available() else None
    key = {"version": TABLE_VERSION, "mode": mode, "buckets": MODE_BUCKETS[mode], "dtype": "float32", **host_info(),
           "shapes": sorted({tuple(m.weight.shape) for m in modules}),
           "panels": sorted({tuple(m.weight.shape) for m in modules
                             if isinstance(m.packed_weight, cpu_ops.PanelWeight)}),
           "library": None if lib is None else [lib.abi_version, lib.max_decode_tokens, lib.dg_rows, lib.dg_panel]}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=list).encode()).hexdigest()[:24]
    return digest, key


def cache_path(digest: str) -> Path:
    return Path(envs.PAGEDLLM_CACHE_DIR) / "kernels" / f"{digest}.json"


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())["times"]
    except (OSError, ValueError, KeyError):
        return None


def _save(path: Path, key: dict, times: dict) -> None:
    """Written to a temporary name and renamed: a concurrent start-up reads a whole file or none."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, "times": times}, indent=1, default=list))
        tmp.replace(path)
    except OSError as e:  # a read-only cache dir: the table still applies to this process
        logger.warning("kernel table not cached at %s: %s", path, e)


def tune_model(model: torch.nn.Module, timer: Timer | None = None) -> KernelTable | None:
    """Measures (or loads from the cache) the kernel table for ``model``'s packed linear layers
    and installs it in ``cpu_ops`` (``PAGEDLLM_KERNEL_TUNING=off``, or nothing packed: removes
    any, so the fixed thresholds apply). Call after ``cpu_ops.pack_model``; ``timer``: seconds
    per call of a kernel (default ``time_kernel``; tests pass fake ones)."""
    mode = tuning_mode()
    modules = _linear_modules(model)
    if mode == "off" or not modules:
        cpu_ops.set_kernel_table(None)
        return None
    digest, key = cache_key(modules, mode)
    path = cache_path(digest)
    times = _load(path)
    if times is None:
        start = time.perf_counter()
        times = measure(modules, mode, timer or time_kernel)
        _save(path, key, times)
        logger.info("kernel table measured in %.2f s (%s mode), cached at %s", time.perf_counter() - start, mode, path)
    else:
        logger.info("kernel table loaded from %s", path)
    table = build_table(times, decoder_shapes(model))
    logger.info("CPU linear kernels per shape and tokens:\n%s", table.describe())
    cpu_ops.set_kernel_table(table)
    return table

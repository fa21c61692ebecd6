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

Attention (the C kernel, ``native/csrc/paged_attention.c``, when the engine runs the ``cpu``
backend) gets its work split measured the same way, on the model's head shape with a random
float32 cache, and kept in the same cache file (``AttentionSplit``):

- ``parallel_work``: from how much work (query rows x keys x head_dim) a step runs on the thread
  team rather than the calling thread (decode steps of 1-16 requests at 64-2048 keys, timed on one
  thread and on the team; fixed: ``CpuAttentionBackend.DEFAULT_PARALLEL_WORK``; with one thread
  nothing to choose);
- ``tile_rows``: query rows per prefill work item (``tile_rows / head_dim`` tokens; fixed 4096),
  timed on prefill chunks of 128 and 256 tokens (``full``: 256 and 512);
- ``decode_items_per_thread``: under how many work items per thread a decode token's kv heads
  are split over more items (fixed 1), timed on decode batches of 1 x 1024 and 4 x 256.

Every split computes the same attention (each row's keys in the same order), so again only the
speed changes.
"""
from __future__ import annotations

import bisect
import dataclasses
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
TABLE_VERSION = 3
# attention: the block size measured (the engine's default; the split depends little on it), the
# candidates of each knob (0: the kernel's fixed default), and the shapes timed for each
ATTN_BLOCK = 16
TILE_ROWS = (1024, 2048, 4096, 8192)
DECODE_ITEMS = (1, 2, 4)
# (requests, context): decode steps of growing work, for parallel_work; then the tile and items cases
WORK_LADDER = ((1, 64), (1, 256), (1, 1024), (1, 2048), (4, 512), (16, 1024))
# one prompt chunk of this many tokens from position 0, per mode (512 tokens cost most of the time)
TILE_CASES = {"fast": (128, 256), "full": (256, 512)}
ITEM_CASES = ((1, 1024), (4, 256))
ALWAYS, NEVER = 0, 1 << 62  # parallel_work that always / never wakes the team


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
class AttentionSplit:
    """The C attention kernel's work split measured on this host (see the module docstring);
    ``parallel_work`` None: keep the backend's."""
    parallel_work: int | None
    tile_rows: int
    decode_items_per_thread: int

    def describe(self) -> str:
        team = "fixed" if self.parallel_work is None else f"{self.parallel_work}"
        return (f"attention: thread team from {team} work, prefill items of {self.tile_rows} query rows x "
                f"head_dim, decode items per thread {self.decode_items_per_thread}")


@dataclass(frozen=True)
class KernelTable:
    """The measured kernel per weight shape and row bucket, and the decoder's tile/panel switch.

    ``choices[(out, in)][i]``: the kernel for ``ROW_BUCKETS[i]`` tokens (past the measured
    buckets the fixed thresholds apply: a choice at 256 rows says little about 2048);
    ``decode_panel_min``: ``LdModel.panel_min``, or None to
    keep ``cpu_ops.DECODE_PANEL_MIN_ROWS``."""
    choices: dict[tuple[int, int], tuple[str, ...]]
    decode_panel_min: int | None = None
    attention: AttentionSplit | None = None  # None: attention not measured (not the C kernel)

    def choose(self, out_features: int, in_features: int, rows: int) -> str | None:
        per_bucket = self.choices.get((out_features, in_features))
        index = bucket_index(rows)
        return per_bucket[index] if per_bucket and index < len(per_bucket) else None

    def describe(self) -> str:
        """One line per shape, for the start-up log."""
        lines = [f"decoder panel GEMM from {self.decode_panel_min} tokens" if self.decode_panel_min else
                 "decoder tile/panel switch: fixed threshold"]
        if self.attention is not None:
            lines.append(self.attention.describe())
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
    """The modules whose float32 weight has a packed copy (``cpu_ops.pack_model``), less those
    marked ``untimed`` (a vision tower's: an image's rows are past the timed buckets, so timing
    its shapes would only add start-up time; the thresholds pick their kernel)."""
    return [m for m in model.modules() if getattr(m, "packed_weight", None) is not None
            and m.weight.dtype == torch.float32 and not getattr(m, "untimed", False)]


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
    """Seconds per call of ``name`` on ``x`` (``best_time``)."""
    return best_time(lambda: cpu_ops.run_gemm(name, x, weight, None, packed), budget_s)


def best_time(call: Callable[[], object], budget_s: float) -> float:
    """Seconds per ``call()``: the fastest of at least two calls, repeated until
    ``budget_s`` is spent (the minimum: the first call's one-time costs and other processes' load
    only add to it). A first call longer than ``LONG_CALL`` budgets stands alone: its one-time
    costs are small beside it, and a second call would double the start-up time it costs."""
    best, spent, calls = float("inf"), 0.0, 0
    while spent < budget_s or calls < 2:
        start = time.perf_counter()
        call()
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


# --------------------------------------------------------------------------- attention


@dataclass(frozen=True)
class AttentionCase:
    """One timed attention call: ``tokens`` new tokens of each of ``requests`` requests at
    ``context`` keys each, under a split (``parallel_work``, ``tile_rows``, ``decode_items``)."""
    requests: int
    tokens: int
    context: int
    parallel_work: int
    tile_rows: int = 0
    decode_items: int = 0


AttentionTimer = Callable[[AttentionCase, tuple[int, int, int], float], float]


def attention_shape(model: torch.nn.Module) -> tuple[int, int, int] | None:
    """``(num_heads, num_kv_heads, head_dim)`` of the first decoder layer's attention, or None."""
    layers = getattr(getattr(model, "model", model), "layers", None)
    attn = getattr(layers[0], "self_attn", None) if layers else None
    dims = tuple(getattr(attn, name, None) for name in ("num_heads", "num_kv_heads", "head_dim"))
    return dims if all(isinstance(d, int) and d > 0 for d in dims) else None


def time_attention(case: AttentionCase, shape: tuple[int, int, int], budget_s: float) -> float:
    """Seconds per ``pa_attention`` call of ``case`` on a random float32 cache of ``shape``'s heads
    (the split set for the call, the defaults restored after it)."""
    heads, kv_heads, head_dim = shape
    lib, g = bindings.library(), torch.Generator().manual_seed(0)
    per_req = -(-case.context // ATTN_BLOCK)
    num_blocks = case.requests * per_req
    key_cache = torch.randn(num_blocks, kv_heads, ATTN_BLOCK, head_dim, generator=g)
    value_cache = torch.randn(num_blocks, kv_heads, ATTN_BLOCK, head_dim, generator=g)
    tables = torch.arange(num_blocks, dtype=torch.int32).reshape(case.requests, per_req)
    qsl = torch.arange(case.requests + 1, dtype=torch.int32) * case.tokens
    seq_lens = torch.full((case.requests,), case.context, dtype=torch.int32)
    query = torch.randn(case.requests * case.tokens, heads, head_dim, generator=g)
    out = torch.empty_like(query)
    threads = torch.get_num_threads()
    lib.set_attention_split(case.tile_rows, case.decode_items)
    try:
        return best_time(lambda: lib.attention(query, out, key_cache, value_cache, tables, qsl, seq_lens,
                                               head_dim ** -0.5, 0, threads, case.parallel_work), budget_s)
    finally:
        lib.set_attention_split(0, 0)


def measure_attention(shape: tuple[int, int, int], mode: str, timer: AttentionTimer = time_attention) -> dict:
    """``{"team": [[work, one thread s, team s], ...], "tile_rows": {rows: s}, "decode_items":
    {items: s}}`` (seconds summed over each knob's cases; no "team" with one thread)."""
    budget, heads, head_dim = TIME_BUDGET_S[mode], shape[0], shape[2]
    times: dict = {}
    if torch.get_num_threads() > 1:
        # work as the kernel counts it for a decode step: query rows (tokens x heads) x keys x head_dim
        times["team"] = [[r * heads * c * head_dim,
                          timer(AttentionCase(r, 1, c, NEVER), shape, budget),
                          timer(AttentionCase(r, 1, c, ALWAYS), shape, budget)] for r, c in WORK_LADDER]
    times["tile_rows"] = {str(rows): sum(timer(AttentionCase(1, n, n, ALWAYS, tile_rows=rows), shape, budget)
                                         for n in TILE_CASES[mode]) for rows in TILE_ROWS}
    times["decode_items"] = {str(k): sum(timer(AttentionCase(r, 1, c, ALWAYS, decode_items=k), shape, budget)
                                         for r, c in ITEM_CASES) for k in DECODE_ITEMS}
    return times


def team_threshold(ladder: list[list[float]]) -> int:
    """The smallest measured work from which the thread team beats one thread (by ``MARGIN``) at
    every larger work measured; past the largest when it never does."""
    threshold = None
    for work, one, team in sorted(ladder, reverse=True):  # from the most work down, while the team keeps winning
        if team * (1 + MARGIN) >= one:
            break
        threshold = int(work)
    return threshold if threshold is not None else int(2 * max(w for w, _, _ in ladder))


def _fastest(times: dict[str, float], default: int) -> int:
    """The fastest candidate, the kernel's default unless another beats it by ``MARGIN``."""
    best = min(times, key=times.get)
    return default if times.get(str(default), float("inf")) <= times[best] * (1 + MARGIN) else int(best)


def build_attention(times: dict) -> AttentionSplit:
    team = times.get("team")
    return AttentionSplit(team_threshold(team) if team else None, _fastest(times["tile_rows"], 4096),
                          _fastest(times["decode_items"], 1))


def apply_attention(split: AttentionSplit | None, backend) -> None:
    """Sets the kernel's split process-wide (None: its defaults) and ``backend.parallel_work``."""
    if not bindings.is_available():
        return
    bindings.library().set_attention_split(*((split.tile_rows, split.decode_items_per_thread) if split else (0, 0)))
    if split is not None and split.parallel_work is not None and backend is not None:
        backend.parallel_work = split.parallel_work


def _attention_to_tune(model: torch.nn.Module, backend) -> tuple[int, int, int] | None:
    """The model's attention shape when the engine runs the C kernel (``cpu`` backend), else None."""
    if backend is None or getattr(backend, "name", None) != "cpu" or not bindings.is_available():
        return None
    return attention_shape(model)


# --------------------------------------------------------------------------- the cache


def cache_key(modules: list[torch.nn.Module], mode: str, attention: tuple[int, int, int] | None = None) -> tuple[
        str, dict]:
    """The cache file's name and what it hashes."""
    lib = bindings.library() if bindings.is_available() else None
    key = {"version": TABLE_VERSION, "mode": mode, "buckets": MODE_BUCKETS[mode], "dtype": "float32", **host_info(),
           "attention": attention and [*attention, ATTN_BLOCK],
           "shapes": sorted({tuple(m.weight.shape) for m in modules}),
           "panels": sorted({tuple(m.weight.shape) for m in modules
                             if isinstance(m.packed_weight, cpu_ops.PanelWeight)}),
           "library": None if lib is None else [lib.abi_version, lib.max_decode_tokens, lib.dg_rows, lib.dg_panel]}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=list).encode()).hexdigest()[:24]
    return digest, key


def cache_path(digest: str) -> Path:
    return Path(envs.PAGEDLLM_CACHE_DIR) / "kernels" / f"{digest}.json"


def _load(path: Path) -> dict | None:
    """The cached ``{"times": ..., "attention": ...}``, or None."""
    try:
        cached = json.loads(path.read_text())
        return {"times": cached["times"], "attention": cached["attention"]}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def busy_reason() -> str | None:
    """Why timings taken now should not be kept for later start-ups, or None: more runnable
    processes (1-minute load average) than this process's cores plus one. Measured on a machine
    that busy, the winners are the noise's (a table measured at load 17 on 2 cores chose a C
    decoder kernel 1.6x slower than the fixed thresholds' one, and a cached table never
    re-measures)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except OSError:  # no load average on this platform: nothing to judge by
        return None
    return f"load average {load:.1f} on {cores} cores" if load > cores + 1 else None


def _save(path: Path, key: dict, measured: dict) -> None:
    """Written to a temporary name and renamed: a concurrent start-up reads a whole file or none."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, **measured}, indent=1, default=list))
        tmp.replace(path)
    except OSError as e:  # a read-only cache dir: the table still applies to this process
        logger.warning("kernel table not cached at %s: %s", path, e)


def tune_model(model: torch.nn.Module, timer: Timer | None = None, backend=None,
               attention_timer: AttentionTimer | None = None) -> KernelTable | None:
    """Measures (or loads from the cache) the kernel table for ``model``'s packed linear layers
    and installs it in ``cpu_ops`` and, when ``backend`` is the C attention kernel's, its
    attention split in the kernel and ``backend`` (``PAGEDLLM_KERNEL_TUNING=off``, or nothing
    packed: removes any, so the fixed thresholds apply). Call after ``cpu_ops.pack_model`` and
    before the one-call decoder is built (it reads both); ``timer`` / ``attention_timer``: seconds
    per call of a GEMM kernel / an attention case (defaults ``time_kernel`` / ``time_attention``;
    tests pass fake ones)."""
    mode = tuning_mode()
    modules = _linear_modules(model)
    if mode == "off" or not modules:
        cpu_ops.set_kernel_table(None)
        apply_attention(None, None)
        return None
    shape = _attention_to_tune(model, backend)
    digest, key = cache_key(modules, mode, shape)
    path = cache_path(digest)
    measured = _load(path)
    if measured is None:
        busy = busy_reason()
        start = time.perf_counter()
        measured = {"times": measure(modules, mode, timer or time_kernel), "attention": None}
        gemm_s = time.perf_counter() - start
        if shape is not None:
            measured["attention"] = measure_attention(shape, mode, attention_timer or time_attention)
        busy = busy or busy_reason()
        if busy is None:
            _save(path, key, measured)
        else:  # this process uses the table; the next start-up measures again
            logger.warning("kernel table measured on a busy machine (%s): used, not cached", busy)
        logger.info("kernel table measured in %.2f s (%s mode; GEMMs %.2f s, attention %.2f s), cached at %s",
                    time.perf_counter() - start, mode, gemm_s, time.perf_counter() - start - gemm_s, path)
    else:
        logger.info("kernel table loaded from %s", path)
    attention = build_attention(measured["attention"]) if measured["attention"] else None
    table = dataclasses.replace(build_table(measured["times"], decoder_shapes(model)), attention=attention)
    logger.info("CPU kernels per shape and tokens:\n%s", table.describe())
    cpu_ops.set_kernel_table(table)
    apply_attention(attention, backend)
    return table

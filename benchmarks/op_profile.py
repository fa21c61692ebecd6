"""Op-by-op time of the model's module path, and each projection's GFLOP/s against the best GEMM
this machine reaches for the same shape (used by ``profile_step.py --ops``).

``ModuleTimer`` puts a forward pre/post hook on every module of the model and charges each
call's *exclusive* time (its own time minus that of hooked modules called inside it) to the
module's role (``qkv_proj``, ``down_proj``, ``self_attn``, ``lm_head``, ...) and its input row
count. ``self_attn`` exclusive of its projections, norms and rotary is the attention backend
(KV write + paged attention) plus the q/k/v split. Hook overhead is a few microseconds a call.

``best_gemm`` times the ways torch can run ``x [M, K] . W^T`` on the CPU, alternated, median:
  F.linear      MKL sgemm on the [N, K] weight (transposed operand)
  mm(x, W^T)    MKL sgemm on a contiguous [K, N] copy
  onednn-packed ``torch.ops.mkldnn._linear_pointwise`` on a oneDNN-reordered weight
  mkl-packed    ``torch.ops.mkl._mkl_linear`` on ``cblas_sgemm_pack``-ed weights for exactly M rows
  C ld_linear   the one-call decoder's AVX2 matmul (pagedllm/native), at most 64 rows
"""
from __future__ import annotations

import re
import statistics
import time
from collections import defaultdict
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

_LAYER_INDEX = re.compile(r"\.\d+(?=\.|$)")


def role(name: str) -> str:
    """``model.layers.3.self_attn.qkv_proj`` -> ``self_attn.qkv_proj``: the module's place in any layer."""
    if not name:
        return "forward"  # the whole model's forward (LM head excluded: the runner calls it apart)
    return _LAYER_INDEX.sub("", name).removeprefix("model.layers.").removeprefix("model.")


class ModuleTimer:
    """Exclusive wall time and call count per (role, input rows), over every forward while attached."""

    def __init__(self, model: nn.Module):
        self.seconds: dict[tuple[str, int], float] = defaultdict(float)
        self.calls: dict[tuple[str, int], int] = defaultdict(int)
        self.shapes: dict[str, tuple[int, int]] = {}  # role -> (in, out) of its weight
        self._stack: list[list[float]] = []  # per open call: [start, time spent in hooked children]
        self._handles = []
        for name, module in model.named_modules():
            self._attach(role(name), module)

    def _attach(self, key: str, module: nn.Module) -> None:
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dim() == 2 and key != "embed_tokens":
            self.shapes[key] = (weight.shape[1], weight.shape[0])
        self._handles.append(module.register_forward_pre_hook(self._pre))
        self._handles.append(module.register_forward_hook(lambda m, args, out, key=key: self._post(key, args)))

    def _pre(self, module, args) -> None:
        self._stack.append([time.perf_counter(), 0.0])

    def _post(self, key: str, args) -> None:
        start, inner = self._stack.pop()
        total = time.perf_counter() - start
        # the first argument is [num_tokens, ...] everywhere (positions for layers and attention)
        rows = args[0].shape[0] if args and isinstance(args[0], torch.Tensor) and args[0].dim() else 0
        self.seconds[key, rows] += total - inner
        self.calls[key, rows] += 1
        if self._stack:
            self._stack[-1][1] += total

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def gemm_methods(x: torch.Tensor, w: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    """The ways to compute ``x . w^T`` that apply to this shape (see the module docstring)."""
    wt = w.t().contiguous()  # [K, N]
    fns = {"F.linear": lambda: F.linear(x, w), "mm(x, W^T)": lambda: torch.mm(x, wt)}
    if torch.backends.mkldnn.is_available():
        packed = torch.ops.mkldnn._reorder_linear_weight(w, x.shape[0])
        fns["onednn-packed"] = lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    if torch._C.has_mkl:
        mkl = torch.ops.mkl._mkl_reorder_linear_weight(w, x.shape[0])
        fns["mkl-packed"] = lambda: torch.ops.mkl._mkl_linear(x, mkl, w, None, x.shape[0])
    fns.update(_native_linear(x, w))
    return fns


def _native_linear(x: torch.Tensor, w: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    from pagedllm.native import bindings
    if not bindings.is_available() or x.shape[0] > 64:
        return {}
    lib, out = bindings.library(), torch.empty(x.shape[0], w.shape[0])
    return {"C ld_linear": lambda: lib.linear(x, w, None, None, out, torch.get_num_threads()) or out}


def best_gemm(rows: int, k: int, n: int, repeats: int = 15) -> dict[str, float]:
    """GFLOP/s of each method for ``[rows, k] . [n, k]^T`` (median of ``repeats``, alternated)."""
    torch.manual_seed(0)
    x, w = torch.randn(rows, k), torch.randn(n, k) * 0.05
    fns = gemm_methods(x, w)
    ref = F.linear(x, w)
    for name, fn in fns.items():
        torch.testing.assert_close(fn(), ref, atol=1e-3, rtol=1e-3, msg=lambda m, name=name: f"{name}: {m}")
    times = interleaved_times(fns, repeats)
    flops = 2 * rows * k * n
    return {name: flops / statistics.median(ts) / 1e9 for name, ts in times.items()}


def interleaved_times(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Seconds of each call, the functions run in turn so load on a shared machine hits all alike."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times

"""Fused float32 CPU ops (C, in the CPU library of ``pagedllm/native``) with torch fallbacks.

Used by RMSNorm, the rotary embedding and the linear layers (packed weights) when the tensors
are float32 on the CPU and the kernel library is available; everything else takes the plain
torch path.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm import envs, platform
from pagedllm.native import bindings


def usable(*tensors: torch.Tensor) -> bool:
    """The C op applies: float32 CPU tensors, library built, and not inside torch.compile
    (inductor fuses the plain torch version into its own kernels)."""
    if torch.compiler.is_compiling():
        return False
    # PAGEDLLM_FUSED_CPU_OPS=0: escape hatch (and A/B switch for benchmarks) to plain torch ops
    on_cpu = all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)
    return envs.PAGEDLLM_FUSED_CPU_OPS and on_cpu and bindings.is_available()


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``residual += x`` (if given) then RMSNorm of the result; x: [rows, dim], unit inner stride."""
    rows, dim = x.shape
    out = torch.empty(rows, dim, dtype=torch.float32)
    bindings.library().add_rms_norm(x, residual, weight, out, eps, torch.get_num_threads())
    return out


def rotary_neox_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotates x ([tokens, heads, head_dim] view, unit inner stride) in place."""
    bindings.library().rotary_neox_(x, positions, cos, sin, torch.get_num_threads())


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a contiguous ``[rows, 2 * d]`` gate_up output in one pass (torch's
    ``F.silu(gate).mul_(up)`` makes two over a strided view)."""
    rows, width = x.shape
    out = torch.empty(rows, width // 2, dtype=torch.float32)
    bindings.library().silu_and_mul(x, out, torch.get_num_threads())
    return out


# Which float32 GEMM takes how many rows. MKL runs its tuned kernels only on Intel CPUs (on
# others it dispatches to its generic "def" code). Measured per shape (benchmarks/RESULTS.md):
# - Intel Xeon (AVX-512): oneDNN's prepacked GEMM beats MKL's by 1.3-4x for 4..512 rows (decode
#   batches); MKL stays ahead of oneDNN for 1-2 rows and for big prefill chunks.
# - AMD EPYC (Zen 5): MKL is 2-4x slower than oneDNN at every row count, 1 to 2048 (the 34M
#   model's 8192 x 512 LM head at one row: MKL 1.68 ms, oneDNN 0.58, the panel GEMM 0.47), so
#   every row count goes to the packed copies there.
# Packing keeps a second copy of each weight. Where the library's panel GEMM
# (csrc/dense_gemm.c) has its AVX-512 tile, linear layers also keep a copy in its layout, used
# for 1 to PANEL_MAX_ROWS rows on every vendor: 3-14% faster than oneDNN's at 16-96 rows with the
# weights streamed from memory as in a decode step (equal when the host's memory bandwidth is
# contended), slower from ~128 rows; at 1-3 rows, on a Xeon with AMX, as fast as MKL on the
# 200M model's big shapes and 10-30% faster on the 34M model's (its LM head 0.80 -> 0.71 ms,
# 2.5% of a batch-1 step; RESULTS.md).
#
# DECODE_PANEL_MIN_ROWS: the one-call decoder's float32 projections run on the panel GEMM from
# this many tokens (models/cpu_decode.py), below on its register tile (llama_decode.c). Decode
# steps alternated between the two in one engine (RESULTS.md): on a Xeon without AMX the 16-lane
# tile is 6% faster at 12 tokens, equal at 16, and the panel GEMM 20-30% faster from 18; on a
# Xeon with AMX at 16 tokens the panel GEMM is 8% faster on the 34M model (weights mostly in the
# L3) and within 2% either way on the 200M one (DRAM-bound), where the tile stays 2-7% ahead at
# 2-12 tokens; on Zen 5 the panel GEMM is 1.4-2.9x faster than the tile from one token (one
# contiguous stream per thread, prefetched in software, against the tile's four weight rows at a
# time).
PANEL_MAX_ROWS = 96


def mkl_tuned(vendor: str) -> bool:
    """MKL's GEMMs are the ones measured (and kept) for this vendor id (/proc/cpuinfo's
    ``vendor_id``): Intel, or none (other architectures, where torch's BLAS is not MKL: not
    measured, and routed as before)."""
    return vendor in ("GenuineIntel", "")


def gemm_routing(vendor: str) -> tuple[int, int, int]:
    """``(PACKED_MIN_ROWS, PACKED_MAX_ROWS, DECODE_PANEL_MIN_ROWS)`` for a vendor id: the table
    measured on a Xeon where MKL is tuned; every row count on the packed copies for other x86
    vendors (measured on AMD Zen 5)."""
    return (4, 512, 16) if mkl_tuned(vendor) else (1, 1 << 62, 1)


_VENDOR = platform.cpu_vendor()
MKL_TUNED = mkl_tuned(_VENDOR)
PACKED_MIN_ROWS, PACKED_MAX_ROWS, DECODE_PANEL_MIN_ROWS = gemm_routing(_VENDOR)
# bfloat16 weights: up to this many rows csrc/bf16_linear.c (float32 math on the widened weight,
# at the weights' read time) beats oneDNN's bf16 GEMM (AMX), which wins on compute from there
# (benchmarks/RESULTS.md, "bfloat16 on the CPU"); also the one-call decoder's bf16 limit.
BF16_C_MAX_ROWS = 8


@dataclass(frozen=True)
class PanelWeight:
    """A float32 weight ``[out, in]`` in ``dense_gemm.c``'s layout ``[out / panel, in, panel]``,
    with the oneDNN-packed copy for more rows (None: F.linear there)."""
    panels: torch.Tensor
    out_features: int
    onednn: torch.Tensor | None


def panels_apply(weight: torch.Tensor) -> bool:
    """The panel GEMM takes this weight: 2-D, whole panels, an AVX-512 build of the library."""
    if weight.dim() != 2 or not bindings.is_available():
        return False
    lib = bindings.library()
    return lib.dg_rows >= 8 and weight.shape[0] % lib.dg_panel == 0


def panels_shape(weight: torch.Tensor) -> tuple[int, int, int]:
    """The panel layout's shape for a weight ``[out, in]``: ``[out / panel, in, panel]``."""
    panel = bindings.library().dg_panel
    return weight.shape[0] // panel, weight.shape[1], panel


def pack_panels(weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``[out / panel, in, panel]``: panel p, input k holds ``weight[p * panel : (p + 1) * panel, k]``
    (written into ``out`` when given: contiguous, of ``panels_shape``)."""
    num_panels, in_features, panel = panels_shape(weight)
    panels = weight.detach().reshape(num_panels, panel, in_features).transpose(1, 2)  # [P, in, panel]
    return panels.contiguous() if out is None else out.copy_(panels)


def _packable(weight: torch.Tensor) -> bool:
    return envs.PAGEDLLM_PACKED_LINEAR and weight.device.type == "cpu" and weight.dtype == torch.float32


def _gets_panels(weight: torch.Tensor) -> bool:
    """``pack_weight(weight, panels=True)`` makes a panel copy of it."""
    return _packable(weight) and panels_apply(weight)


def pack_weight(weight: torch.Tensor, panels: bool = False,
                panel_out: torch.Tensor | None = None) -> PanelWeight | torch.Tensor | None:
    """A oneDNN-packed copy of a float32 CPU weight [out, in] (with ``panels``, where they apply:
    a PanelWeight holding it and the panel copy, written into ``panel_out`` when given), or None
    where not applicable."""
    if not _packable(weight):
        return None
    onednn = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 64) if torch.backends.mkldnn.is_available() \
        else None
    if panels and _gets_panels(weight):
        return PanelWeight(pack_panels(weight, panel_out), weight.shape[0], onednn)
    return onednn


def _huge_page_panels(modules: list[torch.nn.Module]) -> dict[int, torch.Tensor]:
    """Destinations for the panel copies of ``modules``' weights (by module id), side by side in
    2 MiB pages where the host gives them (``platform.huge_page_views``), else none. A decode step
    streams every panel from memory, and with 4 KiB pages its TLB misses showed: a chain of the
    34M model's 8 layers' four projections at 64 rows on 2 threads ran at 193-198 GFLOP/s from 4 KiB
    pages, 209-220 from 2 MiB pages, 217-221 with one layer's weights hot in the cache (AMD Zen 4;
    benchmarks/probes/panel_chain.py)."""
    wanted = {id(m): panels_shape(m.weight) for m in modules if _gets_panels(m.weight)}
    if not wanted or not platform.huge_pages_enabled():
        return {}
    views = platform.huge_page_views([(shape, torch.float32) for shape in wanted.values()])
    return dict(zip(wanted, views))


def panel_linear(x: torch.Tensor, packed: PanelWeight, bias: torch.Tensor | None) -> torch.Tensor:
    out = torch.empty(x.shape[0], packed.out_features, dtype=torch.float32)
    bindings.library().dense_gemm(x.contiguous(), packed.panels, bias, out, torch.get_num_threads())
    return out


def bf16_usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The C bf16 kernel takes this call: a bfloat16 CPU weight, 1..BF16_C_MAX_ROWS rows of x."""
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or x.device.type != "cpu" or x.dim() != 2:
        return False
    return 0 < x.shape[0] <= BF16_C_MAX_ROWS and not torch.compiler.is_compiling() and bindings.is_available()


def bf16_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x . weight^T + bias`` with float32 math on the bf16 weight (csrc/bf16_linear.c), in x's
    dtype: a bfloat16 x (the module path) gets its output rounded as oneDNN's would be; a float32
    x (the one-call decoder's hidden states, into the LM head) gets float32 out."""
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    b = None if bias is None else bias.float().contiguous()
    bindings.library().bf16_linear(x.float().contiguous(), weight.contiguous(), b, out, torch.get_num_threads())
    return out.to(x.dtype)


# the kernels a float32 linear layer can run on (kernel_tuning.py times them per shape)
GEMM_KERNELS = ("tile", "panel", "onednn", "mm")
# kernel_tuning.KernelTable measured at start-up (PAGEDLLM_KERNEL_TUNING), or None: the thresholds above
_kernel_table = None


def set_kernel_table(table) -> None:
    """Installs the measured dispatch table (``kernel_tuning.tune_model``); None restores the
    fixed thresholds."""
    global _kernel_table
    _kernel_table = table


def kernel_table():
    return _kernel_table


def decode_panel_min() -> int:
    """The one-call decoder's float32 tile/panel switch: the measured one, else
    ``DECODE_PANEL_MIN_ROWS``."""
    measured = None if _kernel_table is None else _kernel_table.decode_panel_min
    return DECODE_PANEL_MIN_ROWS if measured is None else measured


def run_gemm(name: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             packed: PanelWeight | torch.Tensor) -> torch.Tensor:
    """``x . weight^T + bias`` (float32, x [rows, in]) on kernel ``name`` of ``GEMM_KERNELS``:
    the one-call decoder's register tile (``ld_linear``, up to ``max_decode_tokens`` rows), the
    panel GEMM, oneDNN on the packed copy, or F.linear."""
    if name == "panel":
        return panel_linear(x, packed, bias)
    if name == "onednn":
        onednn = packed.onednn if isinstance(packed, PanelWeight) else packed
        return torch.ops.mkldnn._linear_pointwise(x, onednn, bias, "none", [], "")
    if name == "tile":
        out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
        bindings.library().linear(x.contiguous(), weight, None, bias, out, torch.get_num_threads())
        return out
    if name == "mm":
        return torch.nn.functional.linear(x, weight, bias)
    raise ValueError(f"kernel {name!r} is not one of {', '.join(GEMM_KERNELS)}")


def threshold_kernel(packed: PanelWeight | torch.Tensor, rows: int) -> str:
    """The kernel of ``GEMM_KERNELS`` the fixed thresholds below give a packed float32 weight at
    ``rows`` rows (``PAGEDLLM_KERNEL_TUNING=off``; "mm" also where they take oneDNN on the plain weight)."""
    if isinstance(packed, PanelWeight):
        if rows <= PANEL_MAX_ROWS:
            return "panel"
        packed = packed.onednn
    return "onednn" if packed is not None and PACKED_MIN_ROWS <= rows <= PACKED_MAX_ROWS else "mm"


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: PanelWeight | torch.Tensor | None):
    """F.linear, through a packed copy when the row count is in the range where it wins; bf16
    weights at a few rows through the C kernel (float32 activations may meet bf16 weights there)."""
    if bf16_usable(x, weight):
        return bf16_linear(x, weight, bias)
    if x.dtype == torch.float32 and weight.dtype == torch.bfloat16:  # the one-call decoder's hidden states,
        x = x.to(weight.dtype)  # past the C kernel's rows: as the module path computes
    # under torch.compile inductor picks (and prepacks) the GEMM itself
    if packed is not None and x.dim() == 2 and not torch.compiler.is_compiling():
        rows = x.shape[0]
        chosen = None if _kernel_table is None or x.dtype != torch.float32 or rows == 0 \
            else _kernel_table.choose(weight.shape[0], weight.shape[1], rows)
        if chosen is not None:
            return run_gemm(chosen, x, weight, bias, packed)
        if isinstance(packed, PanelWeight):
            if rows <= PANEL_MAX_ROWS:
                return panel_linear(x, packed, bias)
            packed = packed.onednn
        if packed is not None and PACKED_MIN_ROWS <= rows <= PACKED_MAX_ROWS:
            return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return unpacked_linear(x, weight, bias)


def unpacked_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear for a weight without a packed copy for these rows (a quantized layer's weight
    widened into a scratch buffer for this call, or an unpacked one): for float32 CPU tensors
    where MKL is not tuned, oneDNN on the plain weight, 1.7-2.7x faster than MKL at 1-2048 rows
    on AMD Zen 5 (RESULTS.md); F.linear otherwise."""
    on_cpu_f32 = x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32
    if MKL_TUNED or not on_cpu_f32 or x.dim() != 2 or not torch.backends.mkldnn.is_available() \
            or torch.compiler.is_compiling():
        return torch.nn.functional.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def pack_model(model: torch.nn.Module, ram_bytes: int | None = None) -> int:
    """Attaches packed weights to every linear-like module (``packed_weight``) and packs the
    modules that hold several (``pack_weights()``, FusedMoE); returns how many weights were packed.

    Skipped when the second copy would take more than a quarter of the available RAM; the panel
    copies (a third) only where both fit in that quarter.
    """
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.dim() >= 2)  # + stacked experts
    if ram_bytes is not None and weight_bytes > ram_bytes // 4:
        return 0
    panels = ram_bytes is None or 2 * weight_bytes <= ram_bytes // 4
    linears = [m for m in model.modules() if hasattr(m, "packed_weight")]
    panel_out = _huge_page_panels(linears) if panels else {}
    count = 0
    for module in model.modules():
        if hasattr(module, "packed_weight"):
            module.packed_weight = pack_weight(module.weight, panels, panel_out.get(id(module)))
            count += module.packed_weight is not None
        elif hasattr(module, "pack_weights"):  # several weights per module (FusedMoE's experts)
            count += module.pack_weights()
    return count


def drop_packed(model: torch.nn.Module) -> None:
    """Frees the packed copies ``pack_model`` attached (the weights they copy were discarded);
    ``pack_model`` makes them again."""
    for module in model.modules():
        if hasattr(module, "packed_weight"):
            module.packed_weight = None

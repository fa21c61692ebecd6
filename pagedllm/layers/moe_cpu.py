"""The routed experts of a float32 SiLU MoE layer on the CPU in one C call
(``native/csrc/moe_experts.c``), over expert weights packed once at load into column panels.

At batch 64 with 8 experts and top-2 each expert gets ~16 rows: the torch path runs 16 small
GEMMs with Python in between; the kernel streams every weight panel once for all of its
expert's rows and does the gather, SiLU(gate) * up, routing weight and scatter-add in the same
pass (benchmarks/moe.py, RESULTS.md MoE section). Packing keeps a second copy of the experts.

Packed layout (G, D = the library's ``moe_panels``, 16 and 32)::

    w13 [E, 2 * inter, hidden]  ->  w13p [E, inter / G, hidden, 2G]   panel p, input k: gate rows
                                                                       pG..pG+G-1, then up rows
    w2  [E, hidden, inter]      ->  w2p  [E, hidden / D, inter, D]     panel p, input k: rows pD..pD+D-1
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.layers import cpu_ops
from pagedllm.native import bindings

SILU_NAMES = ("silu", "swish")  # transformers' names of the one activation the kernel computes


@dataclass(frozen=True)
class PackedExperts:
    w13: torch.Tensor  # [E, inter / G, hidden, 2G]
    w2: torch.Tensor  # [E, hidden / D, inter, D]


def can_pack(w13: torch.Tensor, w2: torch.Tensor, act: str) -> bool:
    """The kernel covers these experts: float32 on the CPU, library built, SiLU, and the
    intermediate / hidden sizes multiples of the panel widths."""
    if act not in SILU_NAMES or not cpu_ops.usable(w13, w2):
        return False
    gate_panel, down_panel = bindings.library().moe_panels
    return (w13.shape[1] // 2) % gate_panel == 0 and w13.shape[2] % down_panel == 0


def pack_experts(w13: torch.Tensor, w2: torch.Tensor) -> PackedExperts:
    """The panel layout of the module docstring; check :func:`can_pack` first."""
    gate_panel, down_panel = bindings.library().moe_panels
    experts, two_inter, hidden = w13.shape
    inter = two_inter // 2
    gate = w13[:, :inter].reshape(experts, inter // gate_panel, gate_panel, hidden)  # [E, P, G, hidden]
    up = w13[:, inter:].reshape(experts, inter // gate_panel, gate_panel, hidden)
    w13p = torch.cat([gate, up], dim=2).transpose(2, 3).contiguous()  # [E, P, hidden, 2G]
    w2p = w2.reshape(experts, hidden // down_panel, down_panel, inter).transpose(2, 3).contiguous()  # [E, P, inter, D]
    return PackedExperts(w13p, w2p)


def run_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, packed: PackedExperts) -> torch.Tensor:
    """``[tokens, hidden]``: sum over k of ``weights[t, k] * expert ids[t, k] (x[t])``."""
    out = torch.empty_like(x)
    bindings.library().moe_experts(x.contiguous(), ids.contiguous(), weights.float().contiguous(), packed.w13,
                                   packed.w2, out, torch.get_num_threads())
    return out

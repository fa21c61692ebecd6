"""Mixture-of-experts MLP: route each token to its top-k experts, run every active expert once
over all of its tokens, and sum the weighted outputs.

All experts' weights live in two stacked tensors, ``w13 [experts, 2 * inter, hidden]`` (gate and
up) and ``w2 [experts, hidden, inter]``, filled expert by expert at load. Tensor parallelism
splits every expert's intermediate dimension (like a column- then row-parallel MLP), so each
rank's partial output is summed with one all-reduce.

    tokens   t0 t1 t2          top-2 ids   (t0: e3 e0) (t1: e3 e5) (t2: e0 e3)
    sorted by expert:  e0 [t0 t2] | e3 [t0 t1 t2] | e5 [t1]      -> 3 GEMM pairs, not 6 token loops

On the CPU (float32) the loaded experts are packed once (``pack_weights``): for SiLU layers whose
sizes fit the panels, one C call does all of the above (``moe_cpu.py``); otherwise the GEMMs run
on oneDNN-packed per-expert copies. Built for the Triton ops (``ops="triton"``, the default on
CUDA) the layer runs ``triton_ops/fused_moe.py``: the sort by expert on the device and one grouped
GEMM pair over all experts, no host sync, so decode steps can be captured in CUDA graphs. Other
devices with the native ops take the torch path on the stacked tensors, which reads the expert
counts on the host (``cuda_graph_blocker`` says so).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.layers import cpu_ops, moe_cpu
from pagedllm.layers.gated_activation import gated_activation


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [tokens, k] float32, expert ids [tokens, k]): softmax over all experts, then top-k,
    renormalised to sum to one when ``renormalize`` (Mixtral, Qwen3-MoE ``norm_topk_prob``).
    Softmax after top-k over the k logits equals the renormalised form, so it needs no own mode."""
    probs = torch.softmax(router_logits.float(), dim=-1)  # [tokens, experts]
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class FusedMoE(nn.Module):
    """The experts of one MoE layer; ``forward(x, router_logits)`` returns ``[tokens, hidden]``."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, act: str = "silu", act_field: str = "hidden_act", *,
                 tp: TensorParallelGroup, ops: str = "native"):
        super().__init__()
        self.tp = tp
        self.tp_rank, self.tp_size = tp.rank, tp.size
        if intermediate_size % self.tp_size:
            raise ValueError(f"moe intermediate size {intermediate_size} is not divisible by "
                             f"tensor_parallel_size={self.tp_size}")
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, num_experts={num_experts}]")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.inter = intermediate_size // self.tp_size  # this rank's share of each expert
        self.act, self.ops = act, ops
        self.act_and_mul: Callable[[torch.Tensor], torch.Tensor] = gated_activation(act, act_field, ops)
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.inter, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, self.inter), requires_grad=False)
        self.w13.weight_loader = self.weight_loader
        self.w2.weight_loader = self.weight_loader
        # set by pack_weights once loaded (CPU float32): the C kernel's panels (moe_cpu.py), else per
        # expert oneDNN-packed copies of (w13[e], w2[e])
        self.kernel_weights: moe_cpu.PackedExperts | None = None
        self.packed: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, str]) -> None:
        """``shard_id = (expert, "gate" | "up" | "down")``: one expert's checkpoint matrix, this rank's slice."""
        expert, kind = shard_id
        start = self.tp_rank * self.inter
        if kind == "down":  # [hidden, inter]: split the input dimension
            param.data[expert].copy_(loaded.narrow(1, start, self.inter))
            return
        offset = 0 if kind == "gate" else self.inter
        param.data[expert].narrow(0, offset, self.inter).copy_(loaded.narrow(0, start, self.inter))

    def pack_weights(self, kernel: bool = True) -> int:
        """Keeps a packed copy of the experts (``cpu_ops.pack_model`` calls this once the weights
        are loaded); returns how many matrices were packed, 0 where packing does not apply.
        Preferred: the C kernel's panels (``moe_cpu``; ``kernel=False`` skips it, for A/B runs);
        else every expert's two matrices packed for oneDNN, which at ~16 rows per expert (batch
        64) runs about twice as fast as MKL on the plain layout (benchmarks/RESULTS.md, MoE).
        The Triton path reads the stacked tensors: nothing to pack."""
        if self.ops == "triton":
            return 0
        if kernel and moe_cpu.can_pack(self.w13, self.w2, self.act):
            self.kernel_weights = moe_cpu.pack_experts(self.w13.detach(), self.w2.detach())
            return 2 * self.num_experts
        packed = [(cpu_ops.pack_weight(w13), cpu_ops.pack_weight(w2)) for w13, w2 in zip(self.w13, self.w2)]
        if any(p13 is None or p2 is None for p13, p2 in packed):
            return 0
        self.packed = packed
        return 2 * self.num_experts

    def cuda_graph_blocker(self) -> str | None:
        """Why this layer's forward cannot be captured in a CUDA graph, or None (the model
        runner asks every module that has this method)."""
        if self.ops == "triton":
            return None
        return "the MoE experts built with fused_ops='native' read their token counts on the host"

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        return self.forward_routed(x, *route(router_logits, self.top_k, self.renormalize))

    def forward_routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The experts for a routing decided elsewhere (DeepSeek's grouped top-k, layers/moe_routing.py):
        ``weights`` float32 and expert ``ids``, both ``[tokens, top_k]``."""
        if self.ops == "triton":
            from pagedllm.layers.triton_ops.fused_moe import fused_experts
            return self.tp.all_reduce(fused_experts(x, self.w13, self.w2, weights, ids, self.act_and_mul))
        if self.kernel_weights is not None and cpu_ops.usable(x):
            return self.tp.all_reduce(moe_cpu.run_experts(x, weights, ids, self.kernel_weights))
        flat_ids = ids.flatten()  # [tokens * k], slot s belongs to token s // k
        order = torch.argsort(flat_ids, stable=True)  # slots grouped by expert
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()  # the one host sync
        token_of = order // self.top_k  # [tokens * k]
        out = self._run_experts(x[token_of], counts)  # [tokens * k, hidden], in sorted order
        out.mul_(weights.flatten()[order].to(out.dtype).unsqueeze(1))
        y = torch.zeros_like(x).index_add_(0, token_of, out)  # [tokens, hidden]
        return self.tp.all_reduce(y)

    def _run_experts(self, grouped: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """One gate/up and one down GEMM per expert that has tokens, over its contiguous rows."""
        out = torch.empty_like(grouped)
        start = 0
        for expert, n in enumerate(counts):
            if n == 0:
                continue
            rows = grouped[start:start + n]  # [n, hidden]
            p13, p2 = self.packed[expert] if self.packed else (None, None)
            h = self.act_and_mul(cpu_ops.linear(rows, self.w13[expert], None, p13))  # [n, inter]
            out[start:start + n] = cpu_ops.linear(h, self.w2[expert], None, p2)
            start += n
        return out

"""Mixture-of-experts families: Mixtral, Qwen2-MoE (plus a shared expert behind a sigmoid gate)
and Qwen3-MoE (``norm_topk_prob``, ``decoder_sparse_step``, ``mlp_only_layers``). They are the
Llama / Qwen decoder with the MLP of some layers replaced by a router and a FusedMoE."""
from __future__ import annotations

import re
from collections.abc import Iterator

import torch
from torch import nn

from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.layers.fused_moe import FusedMoE
from pagedllm.layers.linear import ReplicatedLinear
from pagedllm.models.decoder import DecoderForCausalLM, DecoderSpec, GatedMLP

# per-expert checkpoint matrices -> (FusedMoE parameter, which part); Mixtral's w1 / w3 / w2 and Qwen's names
_EXPERT = re.compile(r"\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_EXPERT_PART = {"w1": ("w13", "gate"), "w3": ("w13", "up"), "w2": ("w2", "down"),
                "gate_proj": ("w13", "gate"), "up_proj": ("w13", "up"), "down_proj": ("w2", "down")}


class SparseMoeBlock(nn.Module):
    """Router (``gate``), routed experts, and optionally a shared expert every token goes through."""

    def __init__(self, cfg, spec: DecoderSpec, num_experts: int, intermediate_size: int, renormalize: bool,
                 tp: TensorParallelGroup, ops: str = "native", shared_intermediate_size: int = 0):
        super().__init__()
        self.gate = ReplicatedLinear(cfg.hidden_size, num_experts, bias=False)
        self.experts = FusedMoE(num_experts, cfg.num_experts_per_tok, cfg.hidden_size, intermediate_size,
                                renormalize, spec.hidden_act, spec.act_field, tp=tp, ops=ops)
        self.shared_expert = None
        if shared_intermediate_size:
            self.shared_expert = GatedMLP(cfg.hidden_size, shared_intermediate_size, spec.hidden_act, tp,
                                          spec.act_field, ops=ops)
            self.shared_expert_gate = ReplicatedLinear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate(x))  # [num_tokens, hidden]
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class MoeForCausalLM(DecoderForCausalLM):
    """Loads per-expert checkpoint matrices into the stacked FusedMoE tensors."""

    checkpoint_renames: dict[str, str] = {}

    def checkpoint_weights(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor, object]]:
        for old, new in self.checkpoint_renames.items():
            name = name.replace(old, new)
        match = _EXPERT.search(name)
        if match is None:
            yield from super().checkpoint_weights(name, tensor)
            return
        param, part = _EXPERT_PART[match.group(2)]
        yield f"{name[:match.start()]}.experts.{param}", tensor, (int(match.group(1)), part)


class MixtralForCausalLM(MoeForCausalLM):
    checkpoint_renames = {".block_sparse_moe.": ".mlp."}

    @classmethod
    def decoder_spec(cls, cfg) -> DecoderSpec:
        return DecoderSpec(hidden_act=cfg.hidden_act)

    def make_mlp(self, cfg, spec: DecoderSpec, layer_idx: int) -> nn.Module:
        return SparseMoeBlock(cfg, spec, cfg.num_local_experts, cfg.intermediate_size, True, self.tp, self.ops)


def is_sparse_layer(layer_idx: int, decoder_sparse_step: int | None, mlp_only_layers) -> bool:
    """Qwen-MoE's rule: sparse unless listed in ``mlp_only_layers``, every ``decoder_sparse_step``-th
    layer (also the KV planner's count, entrypoints/plan.py)."""
    return layer_idx not in (mlp_only_layers or ()) and (layer_idx + 1) % (decoder_sparse_step or 1) == 0


def qwen_layer_is_sparse(cfg, layer_idx: int) -> bool:
    return cfg.num_experts > 0 and is_sparse_layer(layer_idx, getattr(cfg, "decoder_sparse_step", 1),
                                                   getattr(cfg, "mlp_only_layers", None))


class Qwen2MoeForCausalLM(MoeForCausalLM):
    @classmethod
    def decoder_spec(cls, cfg) -> DecoderSpec:
        return DecoderSpec(qkv_bias=bool(getattr(cfg, "qkv_bias", True)), hidden_act=cfg.hidden_act)

    def make_mlp(self, cfg, spec: DecoderSpec, layer_idx: int) -> nn.Module:
        if not qwen_layer_is_sparse(cfg, layer_idx):
            return super().make_mlp(cfg, spec, layer_idx)
        return SparseMoeBlock(cfg, spec, cfg.num_experts, cfg.moe_intermediate_size, bool(cfg.norm_topk_prob),
                              self.tp, self.ops, getattr(cfg, "shared_expert_intermediate_size", 0) or 0)


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    @classmethod
    def decoder_spec(cls, cfg) -> DecoderSpec:
        bias = bool(getattr(cfg, "attention_bias", False))
        return DecoderSpec(qkv_bias=bias, o_bias=bias, qk_norm="head", hidden_act=cfg.hidden_act)

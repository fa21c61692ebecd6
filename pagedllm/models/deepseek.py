"""DeepSeek V2 / V3: multi-head latent attention (attention/mla.py) and a MoE with shared experts
and grouped top-k routing (layers/moe_routing.py), on the shared decoder skeleton.

Per layer: pre-norm attention then pre-norm MLP, as Llama. What differs:

- attention caches one latent per token (``kv_lora_rank + qk_rope_head_dim``, kv_cache/spec.py)
  instead of K/V per head; q comes straight from ``q_proj`` (V2-Lite) or through a low-rank
  ``q_a_proj -> q_a_layernorm -> q_b_proj`` (V2, V3);
- RoPE touches only the ``qk_rope_head_dim`` part of q and the shared ``k_pe``, laid out in
  interleaved pairs in the checkpoint (V2 always, V3 with ``rope_interleave``): they are
  de-interleaved first, then rotated in the usual rotate-half layout (q and k the same way, so
  scores are unchanged); YaRN's ``mscale_all_dim`` also scales the softmax (``softmax_scale``);
- the first ``first_k_dense_replace`` layers have a dense MLP, the rest routed experts plus
  ``n_shared_experts`` always-on experts;
- V3 checkpoints carry ``num_nextn_predict_layers`` multi-token-prediction layers after the last
  decoder layer (``model.layers.<num_hidden_layers + i>``): not used for decoding, skipped at
  load and named in the log.
"""
from __future__ import annotations

import logging
import re

import torch
from torch import nn

from pagedllm.attention.backend import AttentionBackend
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.mla import MLABackend
from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.layers.fused_moe import FusedMoE
from pagedllm.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from pagedllm.layers.moe_routing import GroupedTopK
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.rotary import rope_parameters
from pagedllm.layers.rotary_variants import make_rotary
from pagedllm.models.decoder import DecoderSpec, GatedMLP
from pagedllm.models.moe import MoeForCausalLM

logger = logging.getLogger(__name__)
_LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")


def softmax_scale(cfg) -> float:
    """``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` under YaRN (DeepSeek's
    reference and transformers' ``yarn_apply_mscale``)."""
    from transformers.modeling_rope_utils import yarn_apply_mscale
    return yarn_apply_mscale(rope_parameters(cfg), (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5)


def rope_interleaved(cfg) -> bool:
    """V2 checkpoints always pair rope dims (x0, x1), (x2, x3), ...; V3 says so in ``rope_interleave``."""
    return bool(getattr(cfg, "rope_interleave", True))


class MLAAttention(nn.Module):
    """DeepSeek's attention: projections here, the latent cache and the attention in MLABackend."""

    def __init__(self, cfg, spec: DecoderSpec, rotary: nn.Module, backend: AttentionBackend,
                 tp: TensorParallelGroup, layer_idx: int = 0, ops: str = "native"):
        super().__init__()
        heads, hidden = cfg.num_attention_heads, cfg.hidden_size
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.rank = cfg.kv_lora_rank
        qk_dim, bias = self.nope + self.rope, bool(getattr(cfg, "attention_bias", False))
        self.q_lora_rank = cfg.q_lora_rank
        if self.q_lora_rank:
            self.q_a_proj = ReplicatedLinear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, cfg.rms_norm_eps, ops)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, heads * qk_dim, tp=tp)
        else:
            self.q_proj = ColumnParallelLinear(hidden, heads * qk_dim, tp=tp)
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, self.rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, cfg.rms_norm_eps, ops)
        self.kv_b_proj = ColumnParallelLinear(self.rank, heads * (self.nope + self.v_dim), tp=tp)
        self.o_proj = RowParallelLinear(heads * self.v_dim, hidden, bias=bias, tp=tp)
        self.num_heads = heads // tp.size
        self.num_kv_heads = 1  # one latent per token, shared by every query head (kv_cache/spec.py)
        self.rotary, self.interleaved = rotary, rope_interleaved(cfg)
        self.scale = softmax_scale(cfg)
        if not isinstance(backend, MLABackend):  # the selector's choice for an MLA spec (attention/selector.py)
            raise ValueError(f"{type(backend).__name__} cannot run multi-head latent attention; build the model "
                             "with the backend get_attention_backend(..., kind='mla') returns")
        self.backend = backend

    def forward(self, positions, x, kv_cache: tuple[torch.Tensor], meta: AttentionMetadata):
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora_rank else self.q_proj(x)
        q = q.view(-1, self.num_heads, self.nope + self.rope)  # [num_tokens, heads, nope + rope]
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv.contiguous())  # [num_tokens, rank]
        q_pe, k_pe = self.rotary(positions, self._pairs(q_pe), self._pairs(k_pe[:, None, :]))
        w_uk, w_uv = self._kv_b_halves()
        out = self.backend.forward(q_nope, q_pe, c_kv, k_pe[:, 0], kv_cache[0], meta, w_uk, w_uv, self.scale)
        return self.o_proj(out.reshape(-1, self.num_heads * self.v_dim))  # [num_tokens, hidden]

    def _kv_b_halves(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``W_UK [heads, nope, rank]`` and ``W_UV [heads, v, rank]``: views of this rank's kv_b_proj."""
        weight = self.kv_b_proj.weight
        if weight.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"kv_b_proj stored as {weight.dtype}: multi-head latent attention reads it as a "
                             "matrix; weight quantization of DeepSeek attention is not supported")
        w_kv = weight.view(self.num_heads, self.nope + self.v_dim, self.rank)
        return tuple(w_kv.split([self.nope, self.v_dim], dim=1))

    def _pairs(self, x: torch.Tensor) -> torch.Tensor:
        """Interleaved rope pairs to the rotate-half layout: ``[x0 x2 x4 ... | x1 x3 x5 ...]`` (a copy)."""
        if not self.interleaved:
            return x.contiguous()
        return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class DeepseekMoE(nn.Module):
    """Routed experts (grouped top-k) plus always-on shared experts."""

    def __init__(self, cfg, spec: DecoderSpec, routing: GroupedTopK, tp: TensorParallelGroup, ops: str):
        super().__init__()
        num_experts = cfg.n_routed_experts
        routing.check(num_experts)
        self.routing = routing
        self.gate = ReplicatedLinear(cfg.hidden_size, num_experts, bias=False)
        if routing.scoring == "sigmoid":  # V3's bias on the choice (not on the weights)
            self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts), requires_grad=False)
        # the routing weights are final (scaled, maybe renormalised): FusedMoE must not renormalise
        self.experts = FusedMoE(num_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size,
                                False, spec.hidden_act, spec.act_field, tp=tp, ops=ops)
        self.shared_experts = None
        if cfg.n_shared_experts:
            self.shared_experts = GatedMLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts,
                                           spec.hidden_act, tp, spec.act_field, ops=ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = getattr(self.gate, "e_score_correction_bias", None)
        logits = torch.nn.functional.linear(x.float(), self.gate.weight.float())  # [tokens, experts], fp32 as HF
        out = self.experts.forward_routed(x, *self.routing(logits, bias))  # [num_tokens, hidden]
        return out if self.shared_experts is None else out + self.shared_experts(x)


class DeepseekV2ForCausalLM(MoeForCausalLM):
    packed_modules = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}  # q_proj stays q_proj
    attention_cls = MLAAttention
    scoring = "softmax"

    @classmethod
    def decoder_spec(cls, cfg) -> DecoderSpec:
        return DecoderSpec(hidden_act=cfg.hidden_act)

    @classmethod
    def check_config(cls, cfg) -> None:
        freq = getattr(cfg, "moe_layer_freq", 1)
        if freq != 1:
            raise ValueError(f"moe_layer_freq={freq!r} is not supported: only 1 (every layer past "
                             "first_k_dense_replace has experts)")
        method = getattr(cfg, "topk_method", None)
        if cls.scoring == "softmax" and method not in (None, "greedy", "group_limited_greedy"):
            raise ValueError(f"topk_method={method!r} must be 'greedy' or 'group_limited_greedy' for DeepSeek V2")

    @classmethod
    def routing(cls, cfg) -> GroupedTopK:
        """``norm_topk_prob`` is honoured for V2 too, as DeepSeek's own code and vLLM do (transformers'
        V2 ignores it; the released V2 / V2-Lite configs have it false, so they agree)."""
        grouped = cls.scoring == "sigmoid" or getattr(cfg, "topk_method", "greedy") == "group_limited_greedy"
        return GroupedTopK(cfg.num_experts_per_tok, int(cfg.n_group or 1) if grouped else 1,
                           int(cfg.topk_group or 1) if grouped else 1, cls.scoring,
                           bool(getattr(cfg, "norm_topk_prob", False)), float(cfg.routed_scaling_factor))

    def make_mlp(self, cfg, spec: DecoderSpec, layer_idx: int) -> nn.Module:
        if not cfg.n_routed_experts or layer_idx < cfg.first_k_dense_replace:
            return super(MoeForCausalLM, self).make_mlp(cfg, spec, layer_idx)  # the dense GatedMLP
        return DeepseekMoE(cfg, spec, self.routing(cfg), self.tp, self.ops)

    def make_rotaries(self, cfg, max_position: int) -> list[nn.Module]:
        rotary = make_rotary(cfg, cfg.qk_rope_head_dim, max_position, self.ops)
        return [rotary] * cfg.num_hidden_layers

    def stage_weight_name(self, name: str) -> str | None:
        """Multi-token-prediction layers (past the last decoder layer) are skipped, and logged."""
        match = _LAYER_INDEX.match(name)
        if match is not None and int(match.group(1)) >= self.config.num_hidden_layers:
            if not getattr(self, "_logged_mtp", False):
                logger.info("skipping the checkpoint's multi-token-prediction layer weights (model.layers.%s.*, "
                            "num_nextn_predict_layers=%s): not used for decoding", match.group(1),
                            getattr(self.config, "num_nextn_predict_layers", "?"))
                self._logged_mtp = True
            return None
        return super().stage_weight_name(name)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    scoring = "sigmoid"

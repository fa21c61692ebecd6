"""Llama 4 (text): the Llama layer with iRoPE attention and interleaved mixture-of-experts.

iRoPE, as transformers' ``modeling_llama4.py`` computes it:

* ``no_rope_layers[i]`` is 1 where layer i *uses* RoPE (by default 3 of every 4 layers). Those
  layers attend in chunks (``layer_types[i] == "chunked_attention"``): the context is cut into
  ``attention_chunk_size`` positions and a token sees only its own chunk. The backend does this
  from ``attention_chunk_size`` (attention/backend.py), so blocks before the chunk are never read.
* RoPE rotates interleaved pairs (channels 2j, 2j+1, transformers' complex multiply). The q/k
  projection rows are permuted at load to the NeoX halves (j, j + head_dim / 2) the rotary
  kernels rotate; q.k is unchanged by a permutation shared by q and k, and v is not permuted.
* RoPE layers with ``use_qk_norm`` L2-normalise q and k per head *after* the rotation (a
  weightless RMSNorm with ``rms_norm_eps``).
* The other layers (NoPE) attend globally, without position encoding, and with
  ``attn_temperature_tuning`` scale q by ``log1p(floor((p + 1) / floor_scale)) * attn_scale + 1``
  at position p.

MoE layers (``moe_layers``, from ``interleave_moe_layer_step``) route each token to its top-k
experts by sigmoid of the router logit, and, as transformers' ``Llama4TextMoe`` does, scale the
expert's *input* by that score (``expert(s * x)``, not ``s * expert(x)``); a shared expert sees
every token unscaled. Dense layers use ``intermediate_size_mlp``.

``Llama4ForConditionalGeneration`` checkpoints run text-only: the language model's weights (under
``language_model.*``) load, the vision tower's and projector's are skipped (named in the log), and
the engine refuses image inputs, since this class is not a vision-language model here.
"""
from __future__ import annotations

import logging
import re
from collections.abc import Iterator

import torch
from torch import nn

from pagedllm.attention.backend import AttentionBackend
from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.distributed.pipeline import PipelineStage
from pagedllm.layers.fused_moe import FusedMoE
from pagedllm.layers.linear import ReplicatedLinear
from pagedllm.models.decoder import Attention, DecoderForCausalLM, DecoderSpec, GatedMLP, head_dim_of

logger = logging.getLogger(__name__)
_QK_PROJ = re.compile(r"\.self_attn\.(q_proj|k_proj)\.(weight|bias)$")
_EXPERTS = re.compile(r"\.mlp\.experts\.(gate_up_proj|down_proj)$")  # (after feed_forward -> mlp)
# Llama4ForConditionalGeneration: the language model's prefixes (hub checkpoints, transformers 5 names)
_TEXT_PREFIXES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                  ("model.language_model.", "model."))
_VISION_PREFIXES = ("vision_model.", "multi_modal_projector.", "model.vision_model.", "model.multi_modal_projector.")


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama4TextL2Norm: a weightless RMSNorm over the last dim, in float32."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def interleaved_to_neox(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows of a q/k projection (``[heads * head_dim, ...]``) reordered per head from interleaved
    RoPE pairs (2j, 2j + 1) to NeoX halves (j, j + head_dim / 2)."""
    rows = w.shape[0]
    # [heads, head_dim / 2, 2, ...] -> [heads, 2, head_dim / 2, ...]
    per_head = w.reshape(rows // head_dim, head_dim // 2, 2, *w.shape[1:])
    return per_head.transpose(1, 2).reshape(w.shape)


class Llama4Attention(Attention):
    def __init__(self, cfg, spec: DecoderSpec, rotary: nn.Module, backend: AttentionBackend,
                 tp: TensorParallelGroup, layer_idx: int = 0, ops: str = "native"):
        super().__init__(cfg, spec, rotary, backend, tp, layer_idx, ops)
        self.use_rope = bool(cfg.no_rope_layers[layer_idx])
        if cfg.layer_types[layer_idx] == "chunked_attention":
            self.attention_chunk_size = int(cfg.attention_chunk_size)
        self.l2_qk_norm = bool(cfg.use_qk_norm) and self.use_rope
        self.eps = cfg.rms_norm_eps
        self.temperature_tuning = bool(cfg.attn_temperature_tuning) and not self.use_rope
        self.floor_scale, self.temperature_scale = float(cfg.floor_scale), float(cfg.attn_scale)

    def position_qk(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """RoPE then the L2 q/k norm on RoPE layers; the temperature on NoPE layers."""
        if self.use_rope:
            q, k = self.rotary(positions, q, k)
            if self.l2_qk_norm:
                q, k = l2_norm(q, self.eps), l2_norm(k, self.eps)
        elif self.temperature_tuning:
            p = positions.float()  # [num_tokens]
            scales = torch.log1p(torch.floor((p + 1.0) / self.floor_scale)) * self.temperature_scale + 1.0
            q = (q * scales[:, None, None]).to(q.dtype)
        return q, k


class Llama4MoE(nn.Module):
    """Router, routed experts (each fed ``score * x``) and a shared expert."""

    def __init__(self, cfg, spec: DecoderSpec, tp: TensorParallelGroup, ops: str = "native"):
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        if not 0 < self.top_k <= cfg.num_local_experts:
            raise ValueError(f"num_experts_per_tok={self.top_k} must be in [1, num_local_experts="
                             f"{cfg.num_local_experts}]")
        self.router = ReplicatedLinear(cfg.hidden_size, cfg.num_local_experts, bias=False)
        # one expert per routed row: each of a token's k choices is its own row, scaled before the expert
        self.experts = FusedMoE(cfg.num_local_experts, 1, cfg.hidden_size, cfg.intermediate_size, False,
                                spec.hidden_act, tp=tp, ops=ops)
        self.shared_expert = GatedMLP(cfg.hidden_size, cfg.intermediate_size, spec.hidden_act, tp, ops=ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        num_tokens, hidden = x.shape
        top_logits, ids = torch.topk(self.router(x), self.top_k, dim=-1)  # [num_tokens, k]
        scores = torch.sigmoid(top_logits.float()).to(x.dtype)
        # [k, num_tokens, hidden] -> [k * num_tokens, hidden]: row c * num_tokens + t is choice c of token t
        routed_in = (scores.t()[:, :, None] * x[None]).reshape(-1, hidden)
        ones = torch.ones(routed_in.shape[0], 1, dtype=torch.float32, device=x.device)
        routed = self.experts.forward_routed(routed_in, ones, ids.t().reshape(-1, 1))
        return self.shared_expert(x) + routed.view(self.top_k, num_tokens, hidden).sum(0)  # [num_tokens, hidden]


class Llama4ForCausalLM(DecoderForCausalLM):
    attention_cls = Llama4Attention

    @classmethod
    def check_config(cls, cfg) -> None:
        act = getattr(cfg, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"hidden_act={act!r} is not supported: Llama 4's MLPs and experts are SwiGLU (silu)")
        chunk = getattr(cfg, "attention_chunk_size", None)
        if "chunked_attention" in cfg.layer_types and not (isinstance(chunk, int) and chunk > 0):
            raise ValueError(f"attention_chunk_size={chunk!r} must be an int > 0 for chunked_attention layers")
        unknown = sorted(set(cfg.layer_types) - {"chunked_attention", "full_attention"})
        if unknown:
            raise ValueError(f"layer_types {unknown} are not supported: Llama 4 layers are 'chunked_attention' or "
                             "'full_attention'")

    @classmethod
    def decoder_spec(cls, cfg) -> DecoderSpec:
        bias = bool(getattr(cfg, "attention_bias", False))
        return DecoderSpec(qkv_bias=bias, o_bias=bias, hidden_act=cfg.hidden_act)

    def make_mlp(self, cfg, spec: DecoderSpec, layer_idx: int) -> nn.Module:
        if layer_idx in cfg.moe_layers:
            return Llama4MoE(cfg, spec, self.tp, self.ops)
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size_mlp, spec.hidden_act, self.tp, spec.act_field,
                        ops=self.ops)

    def checkpoint_weights(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor, object]]:
        name = name.replace(".feed_forward.", ".mlp.")
        experts = _EXPERTS.search(name)
        if experts is not None:
            yield from self._expert_weights(name[:experts.start()] + ".mlp.", experts.group(1), tensor)
            return
        if _QK_PROJ.search(name):
            tensor = interleaved_to_neox(tensor, head_dim_of(self.config))
        yield from super().checkpoint_weights(name, tensor)

    @staticmethod
    def _expert_weights(prefix: str, kind: str, tensor: torch.Tensor):
        """transformers' stacked experts, ``gate_up_proj [experts, hidden, 2 * inter]`` (gate first)
        and ``down_proj [experts, inter, hidden]``, as FusedMoE's per-expert ``[out, in]`` shards."""
        target = f"{prefix}experts.w13" if kind == "gate_up_proj" else f"{prefix}experts.w2"
        for expert, w in enumerate(tensor):
            if kind == "down_proj":
                yield target, w.t(), (expert, "down")  # [hidden, inter]
                continue
            gate, up = w.chunk(2, dim=-1)  # [hidden, inter] each
            yield target, gate.t(), (expert, "gate")
            yield target, up.t(), (expert, "up")


def _text_config(cfg):
    """The language model's config of a Llama4ForConditionalGeneration config (or the config itself)."""
    return getattr(cfg, "text_config", None) or cfg


class Llama4ForConditionalGeneration(Llama4ForCausalLM):
    """A Llama 4 vision-language checkpoint, text only (the vision tower is not supported yet)."""

    def __init__(self, cfg, backend: AttentionBackend, max_position: int, tp: TensorParallelGroup,
                 ops: str = "native", stage: PipelineStage | None = None):
        if getattr(cfg, "quantization_config", None):
            raise ValueError("a quantized Llama4ForConditionalGeneration checkpoint is not supported "
                             f"(quantization_config={cfg.quantization_config!r})")
        super().__init__(_text_config(cfg), backend, max_position, tp, ops, stage)
        self._skipped_vision = False

    @classmethod
    def check_config(cls, cfg) -> None:
        super().check_config(_text_config(cfg))

    @classmethod
    def decoder_spec(cls, cfg) -> DecoderSpec:
        return super().decoder_spec(_text_config(cfg))

    def checkpoint_weights(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor, object]]:
        if name.startswith(_VISION_PREFIXES):
            if not self._skipped_vision:
                self._skipped_vision = True
                logger.info("Llama4ForConditionalGeneration runs text-only: skipping the vision tower and projector "
                            "weights (vision_model.*, multi_modal_projector.*)")
            return
        for old, new in _TEXT_PREFIXES:
            if name.startswith(old):
                name = new + name[len(old):]
                break
        yield from super().checkpoint_weights(name, tensor)

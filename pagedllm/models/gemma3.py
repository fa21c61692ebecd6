"""Gemma 3 (text): four RMSNorms per layer scaling by ``1 + weight``, per-head q/k norms, GeGLU
(tanh GELU), embeddings scaled by sqrt(hidden), attention scaled by ``query_pre_attn_scalar``,
and local (sliding-window) layers with their own rope base (``rope_local_base_freq``) between
global ones."""
from __future__ import annotations

from torch import nn

from pagedllm.layers.rotary_variants import make_rotary
from pagedllm.models.decoder import DecoderForCausalLM, DecoderSpec, head_dim_of


class Gemma3ForCausalLM(DecoderForCausalLM):
    @classmethod
    def check_config(cls, cfg) -> None:
        if getattr(cfg, "attn_logit_softcapping", None) is not None:  # Gemma 2's field, left in Gemma 3's config
            raise ValueError(f"attn_logit_softcapping={cfg.attn_logit_softcapping!r} is not supported for Gemma 3: "
                             "transformers' Gemma 3 attention never applies it, so a checkpoint setting it has no "
                             "reference meaning; it must be null")
        if getattr(cfg, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention=True is not supported: attention here is causal")

    @classmethod
    def decoder_spec(cls, cfg) -> DecoderSpec:
        bias = bool(getattr(cfg, "attention_bias", False))
        return DecoderSpec(
            qkv_bias=bias, o_bias=bias, qk_norm="head", norm_layout="sandwich", gemma_norm=True,
            hidden_act=cfg.hidden_activation, act_field="hidden_activation", embed_scale=cfg.hidden_size**0.5,
            attn_scale=cfg.query_pre_attn_scalar**-0.5, final_logit_softcap=cfg.final_logit_softcapping,
        )

    def make_rotaries(self, cfg, max_position: int) -> list[nn.Module]:
        """Local and global layers rotate with different bases: one table per layer type."""
        tables = {t: make_rotary(cfg, head_dim_of(cfg), max_position, self.ops, t) for t in set(cfg.layer_types)}
        return [tables[t] for t in cfg.layer_types]

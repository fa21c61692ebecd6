"""Granite (3.x dense): the Llama layer with four scalars from the config: the embedding,
residual-branch and attention multipliers and a logits divisor."""
from __future__ import annotations

from pagedllm.models.decoder import DecoderForCausalLM, DecoderSpec


class GraniteForCausalLM(DecoderForCausalLM):
    @classmethod
    def decoder_spec(cls, cfg) -> DecoderSpec:
        bias = bool(getattr(cfg, "attention_bias", False))
        return DecoderSpec(
            qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(cfg, "mlp_bias", False)), hidden_act=cfg.hidden_act,
            embed_scale=float(cfg.embedding_multiplier), residual_scale=float(cfg.residual_multiplier),
            attn_scale=float(cfg.attention_multiplier), logit_scale=1.0 / float(cfg.logits_scaling),
        )

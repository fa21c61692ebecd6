"""Gemma 2: four RMSNorms per layer scaling by ``1 + weight`` (pre- and post-attention,
pre- and post-feed-forward), GeGLU (tanh GELU), embeddings scaled by sqrt(hidden), attention
scaled by ``query_pre_attn_scalar`` and its logits soft-capped (``attn_logit_softcapping``, applied
by the attention backend), sliding-window attention on the ``sliding_attention`` layers
(alternate ones), and final logits soft-capped (``final_logit_softcapping``)."""
from __future__ import annotations

from pagedllm.models.decoder import DecoderForCausalLM, DecoderSpec


class Gemma2ForCausalLM(DecoderForCausalLM):
    @classmethod
    def check_config(cls, cfg) -> None:
        if getattr(cfg, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention=True is not supported: attention here is causal")
        for field in ("attn_logit_softcapping", "final_logit_softcapping"):
            cap = getattr(cfg, field, None)
            if cap is not None and not cap > 0:
                raise ValueError(f"{field}={cap!r} must be null or > 0")

    @classmethod
    def decoder_spec(cls, cfg) -> DecoderSpec:
        bias = bool(getattr(cfg, "attention_bias", False))
        return DecoderSpec(
            qkv_bias=bias, o_bias=bias, norm_layout="sandwich", gemma_norm=True, hidden_act=cfg.hidden_activation,
            act_field="hidden_activation", embed_scale=cfg.hidden_size**0.5,
            attn_scale=cfg.query_pre_attn_scalar**-0.5, attn_logit_softcap=cfg.attn_logit_softcapping,
            final_logit_softcap=cfg.final_logit_softcapping,
        )

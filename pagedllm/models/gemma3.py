"""Gemma 3 (text): Gemma 2's layer (gemma2.py) without the attention-logit soft cap, plus per-head
q/k norms and local (sliding-window) layers with their own rope base (``rope_local_base_freq``)
between global ones."""
from __future__ import annotations

from dataclasses import replace

from torch import nn

from pagedllm.layers.rotary_variants import make_rotary
from pagedllm.models.decoder import DecoderSpec, head_dim_of
from pagedllm.models.gemma2 import Gemma2ForCausalLM


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    @classmethod
    def check_config(cls, cfg) -> None:
        if getattr(cfg, "attn_logit_softcapping", None) is not None:  # Gemma 2's field, left in Gemma 3's config
            raise ValueError(f"attn_logit_softcapping={cfg.attn_logit_softcapping!r} is not supported for Gemma 3: "
                             "transformers' Gemma 3 attention never applies it, so a checkpoint setting it has no "
                             "reference meaning; it must be null")
        super().check_config(cfg)  # causal attention only; a final soft cap must be > 0

    @classmethod
    def decoder_spec(cls, cfg) -> DecoderSpec:
        return replace(super().decoder_spec(cfg), qk_norm="head", attn_logit_softcap=None)

    def make_rotaries(self, cfg, max_position: int) -> list[nn.Module]:
        """Local and global layers rotate with different bases: one table per layer type."""
        tables = {t: make_rotary(cfg, head_dim_of(cfg), max_position, self.ops, t) for t in set(cfg.layer_types)}
        return [tables[t] for t in cfg.layer_types]

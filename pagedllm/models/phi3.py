"""Phi-3 / Phi-4: the Llama layer, with q/k/v and gate/up already fused in the checkpoint,
LongRoPE (``longrope`` / ``su``) and partial rotary where configured.

LongRoPE is per request (layers/rotary_variants.py): short factors while a request fits
``original_max_position_embeddings``, long ones past it, the switch made by recomputing the
request's K/V (engine/scheduler.py), so the model only reads the positions it is given: the
runner offsets a long-factor request's positions into the long half of the rotary table."""
from __future__ import annotations

from collections.abc import Iterator

import torch

from pagedllm.models.decoder import DecoderForCausalLM, DecoderSpec, head_dim_of


class Phi3ForCausalLM(DecoderForCausalLM):
    @classmethod
    def decoder_spec(cls, cfg) -> DecoderSpec:
        return DecoderSpec(hidden_act=cfg.hidden_act)

    def checkpoint_weights(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor, object]]:
        """Splits the checkpoint's fused ``qkv_proj`` / ``gate_up_proj`` back into the shards each
        tensor-parallel rank takes its slice of."""
        if ".qkv_proj." in name:
            cfg, head_dim = self.config, head_dim_of(self.config)
            sizes = [cfg.num_attention_heads * head_dim] + [cfg.num_key_value_heads * head_dim] * 2
            for shard, part in zip("qkv", tensor.split(sizes, dim=0)):
                yield name, part, shard
        elif ".gate_up_proj." in name:
            for shard, part in enumerate(tensor.chunk(2, dim=0)):  # [gate; up]
                yield name, part, shard
        else:
            yield from super().checkpoint_weights(name, tensor)

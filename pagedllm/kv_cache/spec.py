"""What one token stores in one layer's KV cache (docs/design.md, core idea 12).

Everything that sizes, allocates, moves or describes KV blocks reads a :class:`KVCacheSpec`
instead of assuming K and V per head, so a new attention kind is a new spec:

    full attention   2 tensors (K, V) x num_kv_heads x head_size      Llama: 2 x 8 x 128 = 2048 / token
    MLA (DeepSeek)   1 tensor (the latent) x 1 x (kv_lora_rank + qk_rope_head_dim)  V2: 512 + 64 = 576 / token

The pool (worker/cache_engine.py) is ``[num_layers, num_tensors, num_blocks, num_kv_heads,
block_size, head_size]``: a block id indexes dim 2 of every layer whatever the spec, so copy,
swap and the KV tiers move ``kv[:, :, b]`` without knowing what it holds.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

KV_KINDS = ("full", "mla")


@dataclass(frozen=True)
class KVCacheSpec:
    """One layer's per-token storage on one rank."""

    kind: str  # one of KV_KINDS
    num_kv_heads: int  # heads stored per token (MLA: 1, the latent every query head shares)
    head_size: int  # elements per head and tensor (MLA: kv_lora_rank + qk_rope_head_dim)

    def __post_init__(self):
        if self.kind not in KV_KINDS:
            raise ValueError(f"KV cache kind={self.kind!r} must be one of {KV_KINDS}")
        for name in ("num_kv_heads", "head_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r} must be >= 1")

    @classmethod
    def full(cls, num_kv_heads: int, head_dim: int) -> KVCacheSpec:
        return cls("full", num_kv_heads, head_dim)

    @classmethod
    def mla(cls, kv_lora_rank: int, qk_rope_head_dim: int) -> KVCacheSpec:
        """The compressed kv (``c_kv``, after kv_a_layernorm) then the rope'd shared key ``k_pe``."""
        return cls("mla", 1, kv_lora_rank + qk_rope_head_dim)

    @property
    def num_tensors(self) -> int:
        """Tensors per layer in the pool: K and V, or the one latent."""
        return 1 if self.kind == "mla" else 2

    def elements_per_token(self) -> int:
        return self.num_tensors * self.num_kv_heads * self.head_size

    def bytes(self, num_layers: int, dtype: torch.dtype, num_tokens: int = 1) -> int:
        """Bytes ``num_tokens`` tokens take across ``num_layers`` layers of this spec."""
        return num_layers * self.elements_per_token() * num_tokens * dtype.itemsize

    def pool_shape(self, num_layers: int, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """``[num_layers, num_tensors, num_blocks, num_kv_heads, block_size, head_size]``."""
        return (num_layers, self.num_tensors, num_blocks, self.num_kv_heads, block_size, self.head_size)

    def check_cache(self, dtype: torch.dtype, calculate_kv_scales: bool) -> None:
        """Refuses a KV setting this kind cannot honour: an MLA latent in fp8 is stored unscaled
        (scale 1.0, saturating, as vLLM does without calibration; attention/mla.py), so scales
        calibrated from the first batch (``calculate_kv_scales``) have nowhere to go."""
        if self.kind == "mla" and calculate_kv_scales:
            raise ValueError("calculate_kv_scales=True is not supported with multi-head latent attention "
                             f"(DeepSeek V2/V3): its fp8 latent cache ({str(dtype).removeprefix('torch.')}) is "
                             "stored unscaled")

    def describe(self) -> str:
        if self.kind == "mla":
            return f"MLA latent of {self.head_size}"
        return f"K/V x {self.num_kv_heads} heads x {self.head_size}"


def kv_spec_for(hf_config, num_kv_heads: int, head_dim: int) -> KVCacheSpec:
    """The spec of a model's layers from its config: an MLA latent when the config has
    ``kv_lora_rank`` (DeepSeek V2/V3), else K/V for ``num_kv_heads`` heads of ``head_dim`` (the
    heads one rank holds). MLA's latent is not split by tensor parallelism: every rank holds it."""
    kv_lora_rank = _field(hf_config, "kv_lora_rank")
    if kv_lora_rank:
        return KVCacheSpec.mla(int(kv_lora_rank), int(_field(hf_config, "qk_rope_head_dim")))
    return KVCacheSpec.full(num_kv_heads, head_dim)


def _field(cfg, name: str):
    """A config field from a transformers config object or a parsed config.json dict."""
    return cfg.get(name) if isinstance(cfg, dict) else getattr(cfg, name, None)

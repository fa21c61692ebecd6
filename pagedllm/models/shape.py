"""A model's shape from its ``config.json``: the one reader of the dimensions that size memory.

The engine (``engine/arg_utils.py``, from the transformers config it loaded) and ``pagedllm plan``
(from the raw JSON, for any family, weights never loaded) both read layers, heads, KV heads, head
size, vocabulary and context length through :func:`model_shape`, so they cannot disagree.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedllm.kv_cache.spec import KVCacheSpec
from pagedllm.models.moe import is_sparse_layer

# Families whose MLP is up/down only (no gate projection); everything else is assumed
# to be a gated (SwiGLU/GeGLU-style, 3-matrix) MLP, as in Llama.
_NON_GATED_MLP = {
    "gpt2", "gpt_bigcode", "gpt_neox", "gptj", "opt", "bloom", "falcon", "phi", "starcoder2", "mpt",
}
# Families whose config class ties lm_head to the embeddings when config.json is silent.
_TIED_BY_DEFAULT = {"gpt2", "gpt_bigcode", "opt", "bloom", "falcon", "gemma", "gemma2", "gemma3_text"}
_MISSING = object()


class ConfigError(ValueError):
    """config.json could not be found, read, or understood."""


# --------------------------------------------------------------------------- config


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a decoder-only transformer that matter for memory."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    gated_mlp: bool
    num_experts: int = 0  # 0 = dense MLP
    shared_expert_intermediate_size: int = 0
    experts_per_token: int = 0  # top-k: the experts (and so the parameters) one token uses
    num_moe_layers: int = 0  # layers with experts; the others have a dense MLP of dense_intermediate_size
    dense_intermediate_size: int = 0
    sliding_window: int = 0  # tokens a sliding-window layer attends to (0: none)
    num_sliding_layers: int = 0
    max_position_embeddings: int | None = None
    config_dtype: str | None = None
    mla: MLAShape | None = None  # multi-head latent attention (DeepSeek V2/V3): its projections and latent

    @property
    def kv_spec(self) -> KVCacheSpec:
        """What one token stores per layer: the engine's spec (kv_cache/spec.py), on one rank."""
        if self.mla is not None:
            return KVCacheSpec.mla(self.mla.kv_lora_rank, self.mla.qk_rope_head_dim)
        return KVCacheSpec.full(self.num_kv_heads, self.head_dim)


@dataclass(frozen=True)
class MLAShape:
    """DeepSeek's attention: q (direct, or through a ``q_lora_rank`` bottleneck), the latent
    ``kv_lora_rank + qk_rope_head_dim`` and its decompression to per-head K (nope part) and V."""

    q_lora_rank: int  # 0: a direct q_proj (V2-Lite)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @classmethod
    def from_config(cls, cfg: dict) -> MLAShape | None:
        if cfg.get("kv_lora_rank") is None:
            return None
        return cls(int(cfg.get("q_lora_rank") or 0), int(cfg["kv_lora_rank"]), int(_get(cfg, "qk_nope_head_dim")),
                   int(_get(cfg, "qk_rope_head_dim")), int(_get(cfg, "v_head_dim")))

    def attention_params(self, hidden: int, heads: int) -> int:
        return sum(out * in_ for out, in_ in self.linear_shapes(hidden, heads))

    def linear_shapes(self, hidden: int, heads: int) -> list[tuple[int, int]]:
        """``(out, in)`` of the q, kv_a (latent + k_pe), kv_b (latent -> per-head K nope and V) and
        o projections."""
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        q = [(self.q_lora_rank, hidden), (heads * qk, self.q_lora_rank)] if self.q_lora_rank else [(heads * qk, hidden)]
        return q + [(self.kv_lora_rank + self.qk_rope_head_dim, hidden),
                    (heads * (self.qk_nope_head_dim + self.v_head_dim), self.kv_lora_rank),
                    (hidden, heads * self.v_head_dim)]


def _get(cfg: dict, *keys: str, default: Any = _MISSING) -> Any:
    """First non-null value among ``keys`` in ``cfg``; ConfigError if none and no default."""
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    if default is _MISSING:
        raise ConfigError(f"config.json has none of the fields {', '.join(keys)}")
    return default


def _text_config(config: dict) -> dict:
    """Flatten multimodal configs: the language model's ``text_config`` wins over the top level."""
    text = config.get("text_config")
    if isinstance(text, dict) and "num_hidden_layers" not in config:
        return {**config, **text}
    return dict(config)


def _kv_heads(cfg: dict, num_heads: int) -> int:
    """Number of key/value heads: explicit field, Falcon's multi_query, else MHA."""
    explicit = _get(cfg, "num_key_value_heads", "num_kv_heads", "n_head_kv",
                    "multi_query_group_num", "n_kv_heads", default=None)
    if explicit is not None:
        return int(explicit)
    if cfg.get("multi_query") and not cfg.get("new_decoder_architecture"):
        return 1
    return num_heads


def _experts(cfg: dict, hidden_inter: int) -> tuple[int, int, int]:
    """(num_experts, per-expert intermediate size, shared-expert intermediate size)."""
    num = int(_get(cfg, "num_local_experts", "num_experts", "n_routed_experts", default=0))
    if num <= 0:
        return 0, hidden_inter, 0
    inter = int(_get(cfg, "moe_intermediate_size", default=hidden_inter))
    shared = cfg.get("shared_expert_intermediate_size")
    if shared is None:
        shared = int(cfg.get("n_shared_experts") or 0) * inter
    return num, inter, int(shared)


def _moe_layers(cfg: dict, num_layers: int) -> int:
    """Layers with experts: all, except Qwen-MoE's ``mlp_only_layers`` and off-``decoder_sparse_step``
    ones, and DeepSeek's ``first_k_dense_replace`` dense first layers."""
    step, dense = int(cfg.get("decoder_sparse_step") or 1), cfg.get("mlp_only_layers")
    first_dense = int(cfg.get("first_k_dense_replace") or 0)
    return sum(is_sparse_layer(i, step, dense) for i in range(first_dense, num_layers))


def _sliding_layers(cfg: dict, num_layers: int) -> tuple[int, int]:
    """(window, number of layers that slide): ``layer_types``, Gemma's ``sliding_window_pattern``
    (every n-th layer global), or every layer (Mistral); none when ``use_sliding_window`` is false."""
    window = int(cfg.get("sliding_window") or 0)
    if not window or cfg.get("use_sliding_window") is False:
        return 0, 0
    layer_types = cfg.get("layer_types")
    if isinstance(layer_types, list):
        return window, sum(t == "sliding_attention" for t in layer_types)
    pattern = cfg.get("sliding_window_pattern")
    if pattern:
        return window, sum(1 for i in range(num_layers) if (i + 1) % int(pattern))
    return window, num_layers


def model_shape(config: dict) -> ModelShape:
    """Extract a :class:`ModelShape` from a parsed ``config.json`` (Llama/GPT-2/Falcon-style names)."""
    cfg = _text_config(config)
    model_type = str(cfg.get("model_type", "unknown"))
    hidden = int(_get(cfg, "hidden_size", "n_embd", "d_model", "dim"))
    heads = int(_get(cfg, "num_attention_heads", "n_head", "num_heads", "n_heads"))
    head_dim = int(_get(cfg, "head_dim", "kv_channels", default=0)) or hidden // heads
    inter = int(_get(cfg, "intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size", default=4 * hidden))
    dense_inter = inter
    num_experts, inter, shared = _experts(cfg, inter)
    num_layers = int(_get(cfg, "num_hidden_layers", "n_layer", "num_layers", "n_layers"))
    window, sliding = _sliding_layers(cfg, num_layers)
    return ModelShape(
        model_type=model_type,
        num_layers=num_layers,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=_kv_heads(cfg, heads),
        head_dim=head_dim,
        intermediate_size=inter,
        vocab_size=int(_get(cfg, "vocab_size", "padded_vocab_size")),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", model_type in _TIED_BY_DEFAULT)),
        gated_mlp=model_type not in _NON_GATED_MLP,
        num_experts=num_experts,
        shared_expert_intermediate_size=shared,
        experts_per_token=int(_get(cfg, "num_experts_per_tok", "moe_topk", default=0)) if num_experts else 0,
        num_moe_layers=_moe_layers(cfg, num_layers) if num_experts else 0,
        dense_intermediate_size=dense_inter,
        sliding_window=window,
        num_sliding_layers=sliding,
        max_position_embeddings=_get(cfg, "max_position_embeddings", "n_positions", "max_sequence_length",
                                     "seq_length", "max_seq_len", default=None),
        config_dtype=_get(cfg, "torch_dtype", "dtype", default=None),
        mla=MLAShape.from_config(cfg),
    )

"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3), read top to bottom.

Parameter names follow the Hugging Face checkpoints so weights load by name; the fused
projections are declared in ``packed_modules``: checkpoint name -> (fused parameter, shard).
``tp`` is the engine's tensor-parallel group, handed down to every parallel layer.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.attention.backend import AttentionBackend
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.rotary import RotaryEmbedding, compute_inv_freq

KVCache = tuple[torch.Tensor, torch.Tensor]  # per layer: key, value [num_blocks, kv_heads, block, dim]


@dataclass(frozen=True)
class ArchVariant:
    """What distinguishes the family members."""

    qkv_bias: bool | None = None  # None: read config.attention_bias
    qk_norm: bool = False


def layer_sliding_window(cfg, layer_idx: int) -> int | None:
    """The layer's attention window: ``layer_types`` says which layers slide (Qwen2 with
    use_sliding_window, Gemma-style mixes); without it ``sliding_window`` applies to all (Mistral)."""
    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None)
    if not window or (layer_types is not None and layer_types[layer_idx] != "sliding_attention"):
        return None
    return int(window)


class LlamaAttention(nn.Module):
    def __init__(self, cfg, variant: ArchVariant, rotary: RotaryEmbedding, backend: AttentionBackend,
                 tp: TensorParallelGroup, layer_idx: int = 0, ops: str = "native"):
        super().__init__()
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        bias = variant.qkv_bias if variant.qkv_bias is not None else getattr(cfg, "attention_bias", False)
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, self.head_dim, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, bias=bias, tp=tp)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * self.head_dim, cfg.hidden_size,
                                        bias=getattr(cfg, "attention_bias", False) and variant.qkv_bias is None, tp=tp)
        if variant.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, ops)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, ops)
        self.qk_norm = variant.qk_norm
        self.rotary = rotary
        self.backend = backend
        self.scale = self.head_dim**-0.5
        self.sliding_window = layer_sliding_window(cfg, layer_idx)

    def forward(self, positions, x, kv_cache: KVCache, meta: AttentionMetadata):
        qkv = self.qkv_proj(x)  # [num_tokens, (heads + 2 * kv_heads) * head_dim]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # [num_tokens, heads, head_dim]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [num_tokens, kv_heads, head_dim]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        out = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, self.sliding_window)
        return self.o_proj(out.reshape(-1, q_size))  # [num_tokens, hidden]


class LlamaMLP(nn.Module):
    def __init__(self, cfg, tp: TensorParallelGroup, ops: str = "native"):
        super().__init__()
        act = getattr(cfg, "hidden_act", "silu")
        if act not in ("silu", "swish"):  # SwiGLU is all this MLP (and the C decoder) computes
            raise ValueError(f"hidden_act={act!r} is not supported: this Llama-family MLP is SwiGLU (silu)")
        bias = getattr(cfg, "mlp_bias", False)
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, bias=bias, tp=tp)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=bias, tp=tp)
        self.act_fn = SiluAndMul(ops)

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg, variant, rotary, backend, tp: TensorParallelGroup, layer_idx: int = 0,
                 ops: str = "native"):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, variant, rotary, backend, tp, layer_idx, ops)
        self.mlp = LlamaMLP(cfg, tp, ops)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)

    def forward(self, positions, hidden, residual, kv_cache, meta):
        if residual is None:
            residual = hidden.clone()
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg, variant, backend, max_position: int, tp: TensorParallelGroup, ops: str = "native"):
        super().__init__()
        self.tp = tp
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        inv_freq, scaling = compute_inv_freq(cfg, head_dim)
        rotary = RotaryEmbedding(head_dim, max_position, inv_freq, scaling, ops)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp=tp)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, variant, rotary, backend, tp, i, ops) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.fused_decoder = None  # models/cpu_decode.py, set by LlamaForCausalLM.enable_fused_decode

    def forward(self, input_ids, positions, kv_caches: list[KVCache], meta):
        fused = self.fused_decoder
        if fused is not None and fused.applies(input_ids.shape[0], kv_caches):
            return fused(input_ids, positions, meta)  # small CPU batch: the whole stack in one C call
        hidden, residual = self.embed_tokens(input_ids), None  # [num_tokens, hidden]
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    variant = ArchVariant()
    packed_modules = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg, backend: AttentionBackend, max_position: int, tp: TensorParallelGroup,
                 ops: str = "native"):
        """``ops``: "native" or "triton", the layers' fused-op implementation (layers/ops.py)."""
        super().__init__()
        self.config = cfg
        self.ops = ops
        self.model = LlamaModel(cfg, self.variant, backend, max_position, tp, ops)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp=tp)
        if getattr(cfg, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, meta)  # [num_tokens, hidden]

    def enable_fused_decode(self, backend: AttentionBackend) -> str | None:
        """Routes small float32 CPU batches through the one-call C decoder once the weights are
        loaded; returns why not, or None when enabled."""
        from pagedllm.models.cpu_decode import FusedCpuDecoder, unsupported_reason
        reason = unsupported_reason(self.model, backend)
        if self.ops == "triton":
            reason = "the model is built for the Triton ops (fused_ops='triton')"
        self.model.fused_decoder = None if reason else FusedCpuDecoder(self.model, backend)
        return reason

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)  # [num_rows, vocab]


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    variant = ArchVariant(qkv_bias=True)


class Qwen3ForCausalLM(LlamaForCausalLM):
    variant = ArchVariant(qk_norm=True)

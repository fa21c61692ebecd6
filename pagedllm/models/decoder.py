"""The decoder skeleton every model family shares, read top to bottom.

A family declares what differs in a :class:`DecoderSpec` (biases, q/k norms, where the norms
sit, scalars on embeddings / residuals / attention / logits) and, where its MLP or rotary
embedding is not the plain one, overrides :meth:`DecoderForCausalLM.make_mlp` or
:meth:`DecoderForCausalLM.make_rotaries`. Parameter names follow the Hugging Face checkpoints
so weights load by name; :meth:`DecoderForCausalLM.checkpoint_weights` maps checkpoint tensors
that are split or fused differently (``packed_modules``: checkpoint name -> (fused parameter, shard)).
``tp`` is the engine's tensor-parallel group, handed down to every parallel layer; ``ops``
("native" | "triton", layers/ops.py) to every norm, rotary and activation the model builds.

Every layer keeps the residual stream as ``(hidden, residual)``: the stream is ``residual +
hidden`` and the next norm adds them (in one fused op where it can).

Under pipeline parallelism a model is one stage (``PipelineStage``): it builds only its layers
(the others are ``MissingLayer`` placeholders, so parameter names keep their global layer index
and load by name), the embedding only on the first stage, the final norm and the LM head only
on the last; a stage past the first takes the previous stage's ``(hidden, residual)`` pair and
one before the last returns its own.
"""
from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.attention import kv_quant
from pagedllm.attention.backend import AttentionBackend
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.distributed.pipeline import PipelineStage
from pagedllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.layers.gated_activation import gated_activation
from pagedllm.layers.gemma_norm import GemmaRMSNorm
from pagedllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.rotary_variants import long_rope_offset, make_rotary

_LAYER_NAME = re.compile(r"model\.layers\.(\d+)\.")
KVCache = tuple[torch.Tensor, torch.Tensor]  # per layer: key, value [num_blocks, kv_heads, block, dim]
NORM_LAYOUTS = ("pre", "post", "sandwich")
QK_NORMS = (None, "head")


@dataclass(frozen=True)
class DecoderSpec:
    """What distinguishes a family's decoder; built from the HF config by ``decoder_spec``."""

    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    # None or "head": one RMSNorm per head (Qwen3, Gemma 3); OLMo 2 norms the whole projection (olmo2.py)
    qk_norm: str | None = None
    # "pre": norm before attention and MLP (Llama); "post": norm their outputs (OLMo 2);
    # "sandwich": both, four norms per layer (Gemma)
    norm_layout: str = "pre"
    gemma_norm: bool = False  # RMSNorm scaling by 1 + weight
    hidden_act: str = "silu"
    act_field: str = "hidden_act"  # the config field hidden_act came from (for error messages)
    embed_scale: float = 1.0
    residual_scale: float = 1.0  # attention and MLP outputs scaled before the residual add (Granite)
    attn_scale: float | None = None  # None: head_dim ** -0.5
    attn_logit_softcap: float | None = None  # scaled scores -> cap * tanh(scores / cap), in the backend (Gemma 2)
    logit_scale: float = 1.0  # logits multiplied by this (Granite: 1 / logits_scaling)
    final_logit_softcap: float | None = None  # logits -> cap * tanh(logits / cap)

    def __post_init__(self):
        if self.norm_layout not in NORM_LAYOUTS:
            raise ValueError(f"norm_layout={self.norm_layout!r} must be one of {NORM_LAYOUTS}")
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm={self.qk_norm!r} must be one of {QK_NORMS}")

    def norm(self, size: int, eps: float, ops: str) -> nn.Module:
        return GemmaRMSNorm(size, eps, ops) if self.gemma_norm else RMSNorm(size, eps, ops)


def head_dim_of(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def layer_sliding_window(cfg, layer_idx: int) -> int | None:
    """The layer's attention window: ``layer_types`` says which layers slide (Qwen2 with
    use_sliding_window, Gemma-style mixes); without it ``sliding_window`` applies to all (Mistral)."""
    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None)
    if not window or (layer_types is not None and layer_types[layer_idx] != "sliding_attention"):
        return None
    return int(window)


class Attention(nn.Module):
    def __init__(self, cfg, spec: DecoderSpec, rotary: nn.Module, backend: AttentionBackend,
                 tp: TensorParallelGroup, layer_idx: int = 0, ops: str = "native"):
        super().__init__()
        self.head_dim = head_dim_of(cfg)
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, self.head_dim, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, bias=spec.qkv_bias, tp=tp)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * self.head_dim, cfg.hidden_size,
                                        bias=spec.o_bias, tp=tp)
        self.qk_norm = spec.qk_norm == "head"  # (read by the C decoder)
        if self.qk_norm:
            self.q_norm = spec.norm(self.head_dim, cfg.rms_norm_eps, ops)
            self.k_norm = spec.norm(self.head_dim, cfg.rms_norm_eps, ops)
        self.rotary = rotary
        self.backend = backend
        self.scale = spec.attn_scale if spec.attn_scale is not None else self.head_dim**-0.5
        self.sliding_window = layer_sliding_window(cfg, layer_idx)
        self.attention_chunk_size: int | None = None  # chunked local attention (Llama 4, llama4.py)
        self.logits_soft_cap = spec.attn_logit_softcap
        self.sinks: torch.Tensor | None = None  # [num_heads] attention-sink logits (GPT-OSS sets them)
        # k_scale / v_scale of an fp8 KV cache (per tensor, or per this rank's KV heads)
        kv_quant.add_scales(self, self.qkv_proj.kv_heads_of_rank(), self.qkv_proj.total_kv_heads)

    def forward(self, positions, x, kv_cache: KVCache, meta: AttentionMetadata):
        qkv = self.qkv_proj(x)  # [num_tokens, (heads + 2 * kv_heads) * head_dim]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.split_qkv(qkv, q_size, kv_size)
        q = q.view(-1, self.num_heads, self.head_dim)  # [num_tokens, heads, head_dim]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [num_tokens, kv_heads, head_dim]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.position_qk(positions, q, k)
        fp8_cache = kv_quant.is_fp8(kv_cache[0].dtype)
        if fp8_cache:  # the K/V scales folded into q, k, v and the output
            q, k, v = kv_quant.scale_inputs(self, q, k, v)
        extra = {} if self.sinks is None else {"sinks": self.sinks}  # (backends without sinks never see the name)
        out = self.backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale, self.sliding_window,
                                   logits_soft_cap=self.logits_soft_cap,
                                   attention_chunk_size=self.attention_chunk_size, **extra)
        if fp8_cache:
            out = kv_quant.scale_output(self, out)
        return self.o_proj(out.reshape(-1, q_size))  # [num_tokens, hidden]

    def position_qk(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q/k norms then RoPE, on ``[num_tokens, heads, head_dim]``; Llama 4 overrides the order."""
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return self.rotary(positions, q, k)

    def split_qkv(self, qkv: torch.Tensor, q_size: int, kv_size: int):
        """q, k, v ``[num_tokens, size]`` each; families with a norm over the whole projection override it."""
        return qkv.split([q_size, kv_size, kv_size], dim=-1)


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with gate and up fused into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, act: str, tp: TensorParallelGroup,
                 act_field: str = "hidden_act", bias: bool = False, ops: str = "native"):
        super().__init__()
        self.act_fn = gated_activation(act, act_field, ops)
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias, tp=tp)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, tp=tp)

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))  # [num_tokens, hidden]


class DecoderLayer(nn.Module):
    def __init__(self, cfg, spec: DecoderSpec, attn: Attention, mlp: nn.Module, ops: str = "native"):
        super().__init__()
        self.self_attn, self.mlp = attn, mlp
        eps, size = cfg.rms_norm_eps, cfg.hidden_size
        if spec.norm_layout != "post":
            self.input_layernorm = spec.norm(size, eps, ops)
        self.post_attention_layernorm = spec.norm(size, eps, ops)
        if spec.norm_layout == "sandwich":
            self.pre_feedforward_layernorm = spec.norm(size, eps, ops)
        if spec.norm_layout != "pre":
            self.post_feedforward_layernorm = spec.norm(size, eps, ops)
        self.residual_scale = spec.residual_scale
        self.layout = spec.norm_layout

    def forward(self, positions, hidden, residual, kv_cache, meta):
        """``residual + hidden`` in, the same after this layer out (as a new pair)."""
        if self.layout == "post":
            return self._forward_post(positions, hidden, residual, kv_cache, meta)
        if residual is None:
            residual = hidden.clone()  # the norms below add into it in place
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta)
        if self.layout == "sandwich":
            hidden, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(hidden), residual)
            return self.post_feedforward_layernorm(self.mlp(hidden)), residual
        hidden, residual = self.post_attention_layernorm(self._scaled(hidden), residual)
        return self._scaled(self.mlp(hidden)), residual

    def _forward_post(self, positions, hidden, residual, kv_cache, meta):
        """OLMo 2: ``x + norm(attn(x))`` then ``x + norm(mlp(x))``; nothing normalises the input."""
        residual = hidden if residual is None else residual + hidden
        residual = residual + self.post_attention_layernorm(self.self_attn(positions, residual, kv_cache, meta))
        return self.post_feedforward_layernorm(self.mlp(residual)), residual

    def _scaled(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.residual_scale == 1.0 else x * self.residual_scale


class MissingLayer(nn.Module):
    """The place of a layer another pipeline stage holds: no parameters, never run."""

    def forward(self, *args):
        raise RuntimeError("this decoder layer belongs to another pipeline stage")


class DecoderModel(nn.Module):
    def __init__(self, cfg, spec: DecoderSpec, layers: list[nn.Module], tp: TensorParallelGroup,
                 ops: str = "native", stage: PipelineStage | None = None):
        super().__init__()
        self.tp = tp  # (read by the C decoder: one rank only)
        self.stage = stage or PipelineStage.whole(len(layers))
        if self.stage.is_first:
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp=tp)
        self.layers = nn.ModuleList(layers)
        if self.stage.is_last:
            self.norm = spec.norm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.embed_scale = spec.embed_scale
        self.fused_decoder = None  # models/cpu_decode.py (Llama family), set by enable_fused_decode

    def forward(self, input_ids, positions, kv_caches: list[KVCache], meta, intermediate=None, inputs_embeds=None):
        """Final-normed hidden ``[num_tokens, hidden]``; a stage before the last returns its
        ``(hidden, residual)`` pair, and one past the first starts from ``intermediate``.
        ``inputs_embeds`` ``[num_tokens, hidden]`` replaces the token embedding (image rows scattered in)."""
        fused = self.fused_decoder
        if (inputs_embeds is None and fused is not None and getattr(meta, "attend_ends", None) is None
                and fused.applies(input_ids.shape[0], kv_caches)):
            return fused(input_ids, positions, meta)  # small CPU batch: the whole stack in one C call
        if inputs_embeds is not None:
            hidden, residual = inputs_embeds, None
        elif self.stage.is_first:
            hidden, residual = self.embed(input_ids), None  # [num_tokens, hidden]
        else:
            hidden, residual = intermediate
        for layer, kv_cache in zip(self.layers[self.stage.start:self.stage.end], kv_caches):
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta)
        if not self.stage.is_last:
            return hidden, residual
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [num_tokens, hidden]
        if self.embed_scale == 1.0:
            return hidden
        return hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)  # rounded to the dtype, as in HF


class DecoderForCausalLM(nn.Module):
    """Base of every family: embedding, decoder layers, final norm, LM head.

    Subclasses implement ``decoder_spec``; they set ``attention_cls`` / ``packed_modules`` and override
    ``make_mlp`` / ``make_rotaries`` / ``checkpoint_weights`` where their checkpoint differs.
    """

    attention_cls: type[Attention] = Attention
    packed_modules = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg, backend: AttentionBackend, max_position: int, tp: TensorParallelGroup,
                 ops: str = "native", stage: PipelineStage | None = None):
        """``ops``: "native" or "triton", the layers' fused-op implementation (layers/ops.py);
        ``stage``: the pipeline stage this rank holds (default: the whole model)."""
        super().__init__()
        self.config, self.tp, self.ops = cfg, tp, ops
        self.stage = stage = stage or PipelineStage.whole(cfg.num_hidden_layers)
        self.check_config(cfg)
        spec = self.spec = self.decoder_spec(cfg)
        # LongRoPE: a long-factor request's positions are offset by this (layers/rotary_variants.py)
        self.long_rope_offset = long_rope_offset(cfg, max_position)
        rotaries = self.make_rotaries(cfg, max_position)
        layers = [DecoderLayer(cfg, spec, self.attention_cls(cfg, spec, rotaries[i], backend, tp, i, ops),
                               self.make_mlp(cfg, spec, i), ops) if stage.owns_layer(i) else MissingLayer()
                  for i in range(cfg.num_hidden_layers)]
        self.model = DecoderModel(cfg, spec, layers, tp, ops, stage)
        if stage.is_last:
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp=tp)
        if stage.is_first and stage.is_last and self.tied_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def tied_embeddings(self) -> bool:
        return bool(getattr(self.config, "tie_word_embeddings", False))

    def stage_layers(self) -> list[nn.Module]:
        """The decoder layers this rank holds (all of them without pipeline parallelism)."""
        return list(self.model.layers[self.stage.start:self.stage.end])

    def stage_weight_name(self, name: str) -> str | None:
        """The name a checkpoint tensor loads under on this stage, or None when another stage
        holds it. A last stage without the embedding loads a tied LM head from the embedding."""
        stage = self.stage
        match = _LAYER_NAME.match(name)
        if match is not None:
            return name if stage.owns_layer(int(match.group(1))) else None
        if name.startswith("model.embed_tokens."):
            if stage.is_first:
                return name
            tied_head = stage.is_last and self.tied_embeddings
            return "lm_head." + name.removeprefix("model.embed_tokens.") if tied_head else None
        if name.startswith(("model.norm.", "lm_head.")):
            return name if stage.is_last else None
        return name

    @classmethod
    def decoder_spec(cls, cfg) -> DecoderSpec:
        raise NotImplementedError(f"{cls.__name__} must declare its decoder_spec")

    @classmethod
    def check_config(cls, cfg) -> None:
        """Refuses config fields that change the math and that this family does not implement."""

    @classmethod
    def attention_soft_cap(cls, cfg) -> float | None:
        """The attention-logit soft cap the backend must apply (None: none), read before the
        model is built so the engine picks a backend that implements it."""
        return cls.decoder_spec(cfg).attn_logit_softcap

    def make_mlp(self, cfg, spec: DecoderSpec, layer_idx: int) -> nn.Module:
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size, spec.hidden_act, self.tp, spec.act_field,
                        spec.mlp_bias, self.ops)

    def make_rotaries(self, cfg, max_position: int) -> list[nn.Module]:
        """One rotary module per layer (shared here: one set of cos/sin tables for all)."""
        rotary = make_rotary(cfg, head_dim_of(cfg), max_position, self.ops)
        return [rotary] * cfg.num_hidden_layers

    def checkpoint_weights(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor, object]]:
        """(parameter name, tensor, shard id or None) for one checkpoint tensor."""
        for ckpt, (fused, shard) in self.packed_modules.items():
            if f".{ckpt}." in name:
                yield name.replace(f".{ckpt}.", f".{fused}."), tensor, shard
                return
        yield name, tensor, None

    def forward(self, input_ids, positions, kv_caches, meta, intermediate=None):
        """``[num_tokens, hidden]``, or the ``(hidden, residual)`` pair a stage before the last hands on."""
        return self.model(input_ids, positions, kv_caches, meta, intermediate)

    def enable_fused_decode(self, backend: AttentionBackend) -> str | None:
        """The one-call C decoder covers the Llama family only; returns why not."""
        return f"{type(self).__name__} is not a Llama-family model"

    def disable_fused_decode(self) -> None:
        """Drops the one-call C decoder and its pointers into the weights and the KV pool
        (sleep mode frees them); ``enable_fused_decode`` builds it again."""
        self.model.fused_decoder = None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)  # [num_rows, vocab]
        if self.spec.logit_scale != 1.0:
            logits = logits * self.spec.logit_scale
        cap = self.spec.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

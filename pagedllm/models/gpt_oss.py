"""GPT-OSS (OpenAI's open-weight MoE): the Llama-style decoder with

* attention sinks: one learned logit per query head (``self_attn.sinks``) that joins every
  row's softmax denominator, applied by the attention backend (``AttentionBackend.forward``);
* biases on q/k/v/o, and sliding-window attention (128) on the ``sliding_attention`` layers
  (alternate ones), full attention on the others (``layer_types``);
* a MoE MLP on every layer: a router with a bias whose top-k logits are soft-maxed (the same
  weights as softmax over all experts then top-k renormalised, ``fused_moe.route``), and experts
  with biases and a clamped SwiGLU, ``(clamp(up, -l, l) + 1) * g * sigmoid(alpha * g)`` with
  ``g = clamp(gate, max=l)`` (transformers' ``GptOssExperts``: alpha 1.702, limit 7.0);
* YaRN RoPE (``rope_parameters``, computed by transformers, ``rotary_variants``).

Checkpoint layout: the experts are stacked per layer, ``mlp.experts.gate_up_proj [E, hidden, 2I]``
with gate and up interleaved along the last dim (gate at even columns), ``gate_up_proj_bias [E, 2I]``
likewise, ``down_proj [E, I, hidden]`` and ``down_proj_bias [E, hidden]``; OpenAI's checkpoints
ship the expert matrices as MXFP4 (``*_blocks`` / ``*_scales``, ``quantization_config.quant_method:
mxfp4``), loaded as shipped into ``layers/quantization/mxfp4.py``'s experts.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from pagedllm.layers.fused_moe import FusedMoE
from pagedllm.layers.linear import ReplicatedLinear
from pagedllm.layers.quantization import mxfp4
from pagedllm.models.decoder import Attention, DecoderSpec
from pagedllm.models.moe import MoeForCausalLM

_EXPERT_TENSORS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


class SwigluClamp:
    """GPT-OSS's gated activation over ``[rows, 2 * inter]`` (gate half, then up half)."""

    def __init__(self, alpha: float, limit: float):
        self.alpha, self.limit = alpha, limit

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))  # [rows, inter]


class GptOssAttention(Attention):
    """Decoder attention plus this rank's heads' sink logits."""

    def __init__(self, cfg, spec, rotary, backend, tp, layer_idx: int = 0, ops: str = "native"):
        super().__init__(cfg, spec, rotary, backend, tp, layer_idx, ops)
        self.tp_rank = tp.rank
        self.sinks = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32), requires_grad=False)
        self.sinks.weight_loader = self._load_sinks

    def _load_sinks(self, param: nn.Parameter, loaded: torch.Tensor, shard=None) -> None:
        param.data.copy_(loaded.narrow(0, self.tp_rank * self.num_heads, self.num_heads))


class GptOssMoE(nn.Module):
    def __init__(self, cfg, tp, ops: str, quantized: bool):
        super().__init__()
        self.router = ReplicatedLinear(cfg.hidden_size, cfg.num_local_experts, bias=True)
        experts_cls = mxfp4.Mxfp4FusedMoE if quantized else FusedMoE
        # renormalize=True: softmax over the k chosen logits (transformers' router) equals the
        # softmax over all experts renormalised over the k (fused_moe.route)
        self.experts = experts_cls(cfg.num_local_experts, cfg.num_experts_per_tok, cfg.hidden_size,
                                   cfg.intermediate_size, True, "swiglu_clamp", tp=tp, ops=ops, bias=True,
                                   act_and_mul=SwigluClamp(cfg.swiglu_alpha, cfg.swiglu_limit))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.router(x))  # [num_tokens, hidden]


class GptOssForCausalLM(MoeForCausalLM):
    attention_cls = GptOssAttention

    @classmethod
    def check_config(cls, cfg) -> None:
        mxfp4.check_config(cfg)
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={cfg.hidden_act!r} is not supported for GPT-OSS: its experts use "
                             "the clamped SwiGLU (silu)")

    @classmethod
    def decoder_spec(cls, cfg) -> DecoderSpec:
        bias = bool(getattr(cfg, "attention_bias", True))
        return DecoderSpec(qkv_bias=bias, o_bias=bias)

    def make_mlp(self, cfg, spec: DecoderSpec, layer_idx: int) -> nn.Module:
        return GptOssMoE(cfg, self.tp, self.ops, mxfp4.is_mxfp4(cfg))

    def checkpoint_weights(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor, object]]:
        """Stacked expert tensors -> per-expert shards of the FusedMoE parameters (MXFP4 ones go
        to the quantized experts' loaders as stacked tensors); the rest by name."""
        prefix, _, leaf = name.rpartition(".experts.")
        if not prefix:
            yield from super().checkpoint_weights(name, tensor)
        elif leaf in _EXPERT_TENSORS:
            yield from _split_experts(f"{prefix}.experts", leaf, tensor)
        else:  # MXFP4: gate_up_proj_blocks / _scales, down_proj_blocks / _scales
            yield from mxfp4.checkpoint_shards(f"{prefix}.experts", leaf, tensor)


def _split_experts(prefix: str, leaf: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor, object]]:
    """One checkpoint tensor stacked over experts -> (parameter, expert slice, (expert, part)) for
    ``FusedMoE.weight_loader``: gate = even columns of gate_up, up = odd ones; matrices as
    ``[out, in]``."""
    param = ("w13" if leaf.startswith("gate_up") else "w2") + ("_bias" if leaf.endswith("_bias") else "")
    for expert, t in enumerate(tensor):
        if leaf == "down_proj":
            yield f"{prefix}.{param}", t.t(), (expert, "down")  # [I, hidden] -> [hidden, I]
        elif leaf == "down_proj_bias":
            yield f"{prefix}.{param}", t, (expert, "down")
        else:  # [hidden, 2I] (or [2I]): gate / up interleaved in the last dim
            gate, up = t[..., 0::2], t[..., 1::2]
            yield f"{prefix}.{param}", gate.t() if gate.dim() == 2 else gate, (expert, "gate")
            yield f"{prefix}.{param}", up.t() if up.dim() == 2 else up, (expert, "up")

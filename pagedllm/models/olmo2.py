"""OLMo 2: norms on the attention and MLP outputs (not their inputs), and q / k RMSNorms over
the whole projection rather than per head."""
from __future__ import annotations

import torch
from torch import nn

from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.models.decoder import Attention, DecoderForCausalLM, DecoderSpec


class ShardedRMSNorm(nn.Module):
    """RMSNorm over a projection whose heads are split across tensor-parallel ranks: the sum of
    squares is all-reduced, so every rank normalises by the full projection's mean square.

    Replicated KV heads (fewer KV heads than ranks) are counted once per replica on every
    rank alike, so the mean over ``local_size * tp_size`` values is still the full one.
    """

    def __init__(self, local_size: int, eps: float, shard_index: int, tp: TensorParallelGroup):
        super().__init__()
        self.local_size, self.eps, self.shard_index = local_size, eps, shard_index
        self.tp = tp
        self.weight = nn.Parameter(torch.ones(local_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        param.data.copy_(loaded.narrow(0, self.shard_index * self.local_size, self.local_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()  # [num_tokens, local_size]
        square_sum = self.tp.all_reduce(xf.pow(2).sum(-1, keepdim=True))  # [num_tokens, 1], over all ranks
        xf = xf * torch.rsqrt(square_sum / (self.local_size * self.tp.size) + self.eps)
        return (self.weight * xf).to(x.dtype)


class Olmo2Attention(Attention):
    def __init__(self, cfg, spec, rotary, backend, tp: TensorParallelGroup, layer_idx: int = 0,
                 ops: str = "native"):
        super().__init__(cfg, spec, rotary, backend, tp, layer_idx, ops)
        rank, replicas = tp.rank, self.qkv_proj.kv_replicas
        # torch ops under either ``ops``: the norm spans ranks (an all-reduce inside), no Triton kernel does
        self.q_norm = ShardedRMSNorm(self.num_heads * self.head_dim, cfg.rms_norm_eps, rank, tp)
        self.k_norm = ShardedRMSNorm(self.num_kv_heads * self.head_dim, cfg.rms_norm_eps, rank // replicas, tp)

    def split_qkv(self, qkv: torch.Tensor, q_size: int, kv_size: int):
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)  # [num_tokens, size] each
        return self.q_norm(q), self.k_norm(k), v


class Olmo2ForCausalLM(DecoderForCausalLM):
    attention_cls = Olmo2Attention

    @classmethod
    def decoder_spec(cls, cfg) -> DecoderSpec:
        bias = bool(getattr(cfg, "attention_bias", False))
        return DecoderSpec(qkv_bias=bias, o_bias=bias, norm_layout="post", hidden_act=cfg.hidden_act)

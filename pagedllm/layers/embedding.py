"""Vocabulary embedding and LM head, sharded over the vocabulary for tensor parallelism."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.layers import cpu_ops


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, *, tp: TensorParallelGroup):
        super().__init__()
        self.tp = tp
        self.tp_rank, self.tp_size = tp.rank, tp.size
        self.vocab_size = vocab_size
        self.shard = -(-vocab_size // self.tp_size)
        self.start = self.tp_rank * self.shard
        self.weight = nn.Parameter(torch.zeros(self.shard, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        part = loaded[self.start:self.start + self.shard]
        param.data[: part.shape[0]].copy_(part)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        mask = (local < 0) | (local >= self.shard)
        out = F.embedding(local.masked_fill(mask, 0), self.weight)
        out.masked_fill_(mask.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    packed_weight = None  # set by cpu_ops.pack_model once the weights are loaded

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = cpu_ops.linear(hidden, self.weight, None, self.packed_weight)  # [n, vocab_shard]
        return self.tp.all_gather_last_dim(logits)[..., : self.vocab_size]

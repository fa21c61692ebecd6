"""Linear layers that shard themselves for tensor parallelism at load time.

Each layer's parameters carry a ``weight_loader(param, loaded, shard_id=None)`` that copies the
rank's slice of a checkpoint tensor into place, so the loader never needs to know the layout.
Parallel layers take their engine's ``TensorParallelGroup`` (``tp``): its rank picks the shard,
and the row-parallel all-reduce runs on it.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.layers import cpu_ops
from pagedllm.layers.lora import LoRASlots

# The forward of a projection whose weight a quantization format replaced, by the weight's dtype:
# int8 codes (layers/quantization/int8.py), uint8 group-wise 4/8-bit codes (grouped.py), FP8
# checkpoints (fp8.py). Each format registers its own when imported, which is before any weight
# has its dtype; the formats import these classes, never the other way.
QUANTIZED_FORWARD: dict[torch.dtype, Callable[[nn.Module, torch.Tensor], torch.Tensor]] = {}


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what}={n} is not divisible by tensor_parallel_size={d}")
    return n // d


class LinearBase(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features  # this rank's shard
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        self.packed_weight = None  # set by cpu_ops.pack_model once the weights are loaded
        self.lora: LoRASlots | None = None  # adapter slots (layers/lora.py), set by lora/model.py

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._base_forward(x)
        # row-parallel: before the all-reduce, which then sums the rank's shards of x @ A.T
        return y if self.lora is None else self.lora.apply(x, y)

    def _base_forward(self, x: torch.Tensor) -> torch.Tensor:
        quantized = QUANTIZED_FORWARD.get(self.weight.dtype)
        if quantized is not None:
            return quantized(self, x)
        return cpu_ops.linear(x, self.weight, self.bias, self.packed_weight)


class ReplicatedLinear(LinearBase):
    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        param.data.copy_(loaded)


class ColumnParallelLinear(LinearBase):
    """Output dimension split across ranks; no communication in forward."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *, tp: TensorParallelGroup):
        self.tp_rank, self.tp_size = tp.rank, tp.size
        super().__init__(in_features, _divide(out_features, self.tp_size, "out_features"), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        size = param.shape[0]
        param.data.copy_(loaded.narrow(0, self.tp_rank * size, size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections fused into one matmul (e.g. gate_up)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False, *, tp: TensorParallelGroup):
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias, tp=tp)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0) -> None:
        shard = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        param.data.narrow(0, offset, shard).copy_(loaded.narrow(0, self.tp_rank * shard, shard))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused; heads split across ranks (KV heads replicated if fewer)."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False, *,
                 tp: TensorParallelGroup):
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, tp.size, "num_attention_heads")
        self.num_kv_heads = max(1, num_kv_heads // tp.size)
        self.kv_replicas = max(1, tp.size // num_kv_heads)
        self.total_kv_heads = num_kv_heads
        total = (num_heads + 2 * self.num_kv_heads * tp.size) * head_dim
        super().__init__(hidden, total, bias, tp=tp)

    def kv_heads_of_rank(self) -> range:
        """The checkpoint's KV heads this rank holds (ranks that replicate a head share it)."""
        start = (self.tp_rank // self.kv_replicas) * self.num_kv_heads
        return range(start, start + self.num_kv_heads)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str = "q") -> None:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[shard_id]
        rank = self.tp_rank if shard_id == "q" else self.tp_rank // self.kv_replicas
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, rank * size, size))


class RowParallelLinear(LinearBase):
    """Input dimension split across ranks; partial outputs are summed with an all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *, tp: TensorParallelGroup):
        self.tp = tp
        self.tp_rank, self.tp_size = tp.rank, tp.size
        super().__init__(_divide(in_features, self.tp_size, "in_features"), out_features, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if param.dim() == 1:  # bias: added once, on the full sum
            param.data.copy_(loaded if self.tp_rank == 0 else torch.zeros_like(loaded))
            return
        size = param.shape[1]
        param.data.copy_(loaded.narrow(1, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(super().forward(x))


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit parameter "
                         f"{tuple(param.shape)}")
    param.data.copy_(loaded)

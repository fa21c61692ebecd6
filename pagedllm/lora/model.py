"""One rank's adapter slots over its model shard: which linear layers take adapters, how a
PEFT adapter is laid out into a slot, and the host-memory cache of laid-out adapters.

The scheduler decides which adapter sits in which slot (lora/slot_pool.py) and hands the runner
``(slot, LoRARequest)`` loads; this module performs them. A fused projection (qkv, gate_up)
takes its sub-projections' adapters side by side on the rank axis (declared by the model's
``packed_modules``: checkpoint name -> (fused parameter, shard)), and each factor is sharded by
the layer's own weight loader, as vLLM shards them: a column-parallel layer keeps A whole and
takes its rows of B, a row-parallel one takes its columns of A and keeps B whole (its shard of
``x @ A.T`` is summed by the layer's all-reduce).
"""
from __future__ import annotations

import re
from collections import OrderedDict

import numpy as np
import torch
from torch import nn

from pagedllm.config import LoRAConfig
from pagedllm.layers.linear import LinearBase, RowParallelLinear
from pagedllm.layers.lora import LoRABatch, LoRASlots
from pagedllm.lora import checkpoint
from pagedllm.lora.request import LoRARequest

_LAYER_PROJ = re.compile(r"^model\.layers\.\d+\.(?:self_attn|mlp)\.\w+$")  # a decoder layer's own projection
Sub = tuple[str, object]  # (checkpoint projection, the fused layer's shard id or None)
LaidOut = dict[str, tuple[torch.Tensor, torch.Tensor]]  # layer name -> (A [R, in], B [out, R]) of this rank


class LoRAModel:
    """Attaches :class:`LoRASlots` to every targetable linear layer of ``model`` and loads
    adapters into them; keeps up to ``config.num_cpu_loras`` laid-out adapters in host memory (LRU)."""

    def __init__(self, model: nn.Module, packed_modules: dict[str, tuple[str, object]], config: LoRAConfig,
                 dtype: torch.dtype, device: torch.device):
        self.config, self.device = config, device
        self.dtype = config.slot_dtype(dtype)
        self.batch = LoRABatch(config.max_loras)
        self.targets: dict[str, tuple[LinearBase, list[Sub]]] = {}
        fused: dict[str, list[Sub]] = {}
        for ckpt, (name, shard) in packed_modules.items():
            fused.setdefault(name, []).append((ckpt, shard))
        for name, module in model.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if not isinstance(module, LinearBase) or not _LAYER_PROJ.match(name):
                continue
            subs = fused.get(leaf) or ([(leaf, None)] if leaf in checkpoint.TARGET_MODULES else None)
            if subs is None:
                continue
            module.lora = LoRASlots(config.max_loras, len(subs) * config.max_lora_rank, module.in_features,
                                    module.out_features, self.dtype, device, self.batch)
            self.targets[name] = (module, subs)
        self.host: OrderedDict[int, LaidOut] = OrderedDict()  # lora_int_id -> laid out, LRU first
        self.host_hits = 0

    @property
    def nbytes(self) -> int:
        """Device bytes of every slot of every layer."""
        return sum(layer.lora.nbytes for layer, _ in self.targets.values())

    def set_batch(self, token_slots: np.ndarray) -> None:
        """The step's slot per token (-1: base), before the forward."""
        self.batch.set(token_slots, self.device)

    def load(self, slot: int, request: LoRARequest) -> None:
        """Writes ``request``'s adapter into ``slot`` of every layer (zeros where it has no factor)."""
        laid_out = self._laid_out(request)
        for name, (layer, _) in self.targets.items():
            factors = laid_out.get(name)
            if factors is None:
                layer.lora.a[slot].zero_()
                layer.lora.b[slot].zero_()
            else:
                layer.lora.a[slot].copy_(factors[0], non_blocking=True)
                layer.lora.b[slot].copy_(factors[1], non_blocking=True)

    def _laid_out(self, request: LoRARequest) -> LaidOut:
        key = request.lora_int_id
        if key in self.host:
            self.host.move_to_end(key)
            self.host_hits += 1
            return self.host[key]
        laid_out = self.lay_out(checkpoint.load_weights(request.lora_path))
        self.host[key] = laid_out
        while len(self.host) > self.config.num_cpu_loras:
            self.host.popitem(last=False)
        return laid_out

    def lay_out(self, weights: checkpoint.LoRAWeights) -> LaidOut:
        """This rank's ``(A, B)`` per layer, scale folded into B (host memory, the slots' dtype)."""
        out = {}
        for name, (layer, subs) in self.targets.items():
            prefix = name.rsplit(".", 1)[0]
            found = [weights.modules.get(f"{prefix}.{ckpt}") for ckpt, _ in subs]
            if any(f is not None for f in found):
                out[name] = self._shard(layer, subs, found, weights.config.scale)
        return out

    def _shard(self, layer: LinearBase, subs: list[Sub], found: list,
               scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        r_max, n = self.config.max_lora_rank, len(subs)
        fan_in = next(f[0].shape[1] for f in found if f is not None)
        a_full = torch.zeros(n * r_max, fan_in)  # [R, whole in]
        for i, f in enumerate(found):
            if f is not None:
                a_full[i * r_max:i * r_max + f[0].shape[0]] = f[0]
        a = torch.zeros(n * r_max, layer.in_features)
        b = torch.zeros(layer.out_features, n * r_max)
        if isinstance(layer, RowParallelLinear):  # its columns of A; B whole
            layer.weight_loader(a, a_full)
            b[:, :found[0][1].shape[1]] = found[0][1] * scale
            return a.to(self.dtype), b.to(self.dtype)
        a.copy_(a_full)
        for i, ((_, shard), f) in enumerate(zip(subs, found)):
            if f is None:
                continue
            b_sub = torch.zeros(f[1].shape[0], n * r_max)  # [whole sub out, R]: this sub's rank block only
            b_sub[:, i * r_max:i * r_max + f[1].shape[1]] = f[1] * scale
            if shard is None:
                layer.weight_loader(b, b_sub)
            else:
                layer.weight_loader(b, b_sub, shard)
        return a.to(self.dtype), b.to(self.dtype)

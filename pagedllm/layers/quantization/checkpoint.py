"""What the pre-quantized checkpoint formats (gptq.py, awq.py, compressed_tensors.py) share.

A format lists the tensors each linear layer has in the checkpoint (``qweight``, ``scales``...)
and how to unpack each into the logical form of ``grouped.py`` (codes, scale, zero, g_idx), with
the output dimension first. The layer gets one parameter per checkpoint tensor, under the
checkpoint's name (so the model loader finds it by name), holding the unpacked tensor; its
``weight_loader`` unpacks the whole checkpoint tensor and then takes this rank's slice:

* column-parallel layers (qkv, gate_up): through the layer's own ``weight_loader`` (rows, i.e.
  output channels, with the q/k/v or gate/up offsets); ``g_idx`` is not split, and fused
  projections must share it (they read the same input, so GPTQ orders their columns alike);
* row-parallel layers (o, down): the input columns of the codes and ``g_idx`` and, when there
  is more than one group, the groups of the scales and zeros: each rank's slice must be whole
  groups. One group (``group_size=-1``, channel-wise) is replicated on every rank.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from pagedllm.layers.linear import RowParallelLinear
from pagedllm.layers.quantization import grouped
from pagedllm.layers.quantization.base import QuantMethod

# the axis of each logical tensor that runs over input columns (codes, g_idx) or groups
_INPUT_AXIS = {"codes": 1, "scale": 1, "zero": 1, "g_idx": 0}
_DTYPES = {"codes": torch.uint8, "scale": torch.float32, "zero": torch.float32, "g_idx": torch.int32,
           "shape": torch.int64}


@dataclass(frozen=True)
class CheckpointTensor:
    """One tensor a quantized linear layer has in the checkpoint."""

    name: str  # the checkpoint's suffix, e.g. "qweight"
    kind: str  # codes, scale, zero, g_idx, or shape (checked, not kept)
    optional: bool = False  # absent: the default (zero = 2^(bits-1), no act order)


class CheckpointMethod(QuantMethod):
    """A group-wise format read from the checkpoint (subclasses: unpacking and names)."""

    def __init__(self, bits: int, group_size: int, act_order: bool = False):
        self.bits, self.group_size, self.act_order = bits, group_size, act_order

    def checkpoint_tensors(self) -> tuple[CheckpointTensor, ...]:
        raise NotImplementedError

    def convert(self, kind: str, tensor: torch.Tensor) -> torch.Tensor:
        """The checkpoint tensor as its logical form, output dimension first (full, unsharded)."""
        raise NotImplementedError

    def default_zero(self) -> float:
        return float(2 ** (self.bits - 1))

    # --- before loading ------------------------------------------------------------------------

    def create_weights(self, layer: torch.nn.Module) -> None:
        out_features, in_features = layer.weight.shape
        groups = self._local_groups(layer, in_features)
        shapes = {"codes": (out_features, in_features), "scale": (out_features, groups),
                  "zero": (out_features, groups), "g_idx": (in_features,), "shape": (2,)}
        device = layer.weight.device
        del layer.weight  # the codes take its place in process_weights
        for t in self.checkpoint_tensors():
            fill = self.default_zero() if t.kind == "zero" else 0
            param = torch.nn.Parameter(torch.full(shapes[t.kind], fill, dtype=_DTYPES[t.kind], device=device),
                                       requires_grad=False)
            param.weight_loader = functools.partial(self._load, layer, t)
            param.raw_checkpoint_tensor = True  # the loader must not cast the packed int32 words
            param.optional_in_checkpoint = t.optional
            param.loaded = False
            layer.register_parameter(t.name, param)

    def _local_groups(self, layer: torch.nn.Module, in_features: int) -> int:
        """Groups in this rank's slice of the inputs (row-parallel layers hold 1/tp of them)."""
        tp = layer.tp_size if isinstance(layer, RowParallelLinear) else 1
        if self.group_size == -1:
            return 1
        if (in_features * tp) % self.group_size:
            raise ValueError(f"group_size={self.group_size} does not divide a layer's {in_features * tp} inputs")
        if in_features % self.group_size:
            raise ValueError(f"group_size={self.group_size} does not divide the {in_features} inputs of a "
                             f"row-parallel layer's rank slice (tensor_parallel_size={tp})")
        if tp > 1 and self.act_order:
            raise ValueError(f"desc_act/act-order checkpoints with tensor_parallel_size={tp} are not supported "
                             "(a rank's slice of a row-parallel layer would hold partial groups)")
        return in_features // self.group_size

    # --- loading -------------------------------------------------------------------------------

    def _load(self, layer: torch.nn.Module, spec: CheckpointTensor, param: torch.nn.Parameter,
              loaded: torch.Tensor, shard_id=None) -> None:
        full = self.convert(spec.kind, loaded)
        if spec.kind == "shape":
            self._check_shape(layer, full)
        else:
            shard_into(layer, param, full, shard_id, spec)
        param.loaded = True

    def _check_shape(self, layer: torch.nn.Module, shape: torch.Tensor) -> None:
        """The checkpoint's own record of the unpacked shape ``[out, in]`` must match the layer's."""
        codes = next(getattr(layer, t.name) for t in self.checkpoint_tensors() if t.kind == "codes")
        in_features = codes.shape[1] * (layer.tp_size if isinstance(layer, RowParallelLinear) else 1)
        if shape.numel() != 2 or int(shape[1]) != in_features:
            raise ValueError(f"checkpoint weight_shape {shape.tolist()} does not match a layer with {in_features} "
                             "inputs")

    # --- after loading -------------------------------------------------------------------------

    def process_weights(self, layer: torch.nn.Module) -> None:
        logical = {}
        for t in self.checkpoint_tensors():
            param = getattr(layer, t.name)
            # an absent zero point keeps its default; an absent g_idx means no act order
            logical[t.kind] = param.data if param.loaded or t.kind != "g_idx" else None
            delattr(layer, t.name)
        g_idx = logical.get("g_idx")
        if g_idx is not None:
            g_idx = g_idx - self._first_group(layer, logical["scale"].shape[1])
        grouped.install(layer, logical["codes"], logical["scale"], logical["zero"], g_idx, self.bits)

    def _first_group(self, layer: torch.nn.Module, local_groups: int) -> int:
        """g_idx numbers the groups of the whole layer; a row-parallel rank holds groups
        ``[rank * local_groups, (rank + 1) * local_groups)`` (all of them when there is one)."""
        if not isinstance(layer, RowParallelLinear) or self.group_size == -1:
            return 0
        return layer.tp_rank * local_groups


def shard_into(layer: torch.nn.Module, param: torch.nn.Parameter, full: torch.Tensor, shard_id,
                spec: CheckpointTensor) -> None:
    """Copies this rank's slice of the logical tensor ``full`` into ``param`` (module docstring)."""
    axis = _INPUT_AXIS[spec.kind]
    if isinstance(layer, RowParallelLinear):
        size = param.shape[axis]
        replicated = full.shape[axis] == size  # one group: the same scale / zero on every rank
        expect = list(param.shape)
        expect[axis] = size if replicated else size * layer.tp_size
        _check_fits(spec, full, expect)
        param.data.copy_(full.narrow(axis, 0 if replicated else layer.tp_rank * size, size))
    elif spec.kind == "g_idx":
        _check_fits(spec, full, param.shape)
        if param.loaded and not torch.equal(param.data, full.to(param.dtype)):
            raise ValueError(f"checkpoint tensor {spec.name!r}: the projections fused into one layer have different "
                             "act-order permutations (g_idx); not supported")
        param.data.copy_(full)
    else:
        _check_fits(spec, full, (full.shape[0], *param.shape[1:]))
        layer.weight_loader(param, full) if shard_id is None else layer.weight_loader(param, full, shard_id)


def _check_fits(spec: CheckpointTensor, tensor: torch.Tensor, shape) -> None:
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"checkpoint tensor {spec.name!r} unpacks to shape {tuple(tensor.shape)}, expected "
                         f"{tuple(shape)}: the quantization_config (bits, group_size) does not match the tensors")

"""GPTQ checkpoints (``quant_method: gptq``), as gptqmodel and AutoGPTQ write them.

Per linear layer (``bits`` 4 or 8, ``32 / bits`` codes per int32, lowest bits first):

    qweight  int32 [in / (32 / bits), out]   codes packed along the INPUT dimension
    qzeros   int32 [G, out / (32 / bits)]    zero points packed along the OUTPUT dimension
    scales   float [G, out]
    g_idx    int32 [in]                      group of each input column (act order: desc_act)

    W[o, i] = (code[i, o] - zero[g_idx[i], o]) * scale[g_idx[i], o]

with ``G = in / group_size`` (one group for ``group_size: -1``). Checkpoint format ``gptq``
(v1) stores every zero point minus one (AutoGPTQ's historical off-by-one; a symmetric 4-bit
checkpoint stores 7 for 8); ``gptq_v2`` stores it as is. No GPTQ tool installs here (gptqmodel
builds CUDA extensions), so this layout was checked by reading GPTQModel's
``PackableQuantLinear.dequantize_weight`` (nn_modules/qlinear/__init__.py: shifts
``range(0, 32, bits)`` along the packed axis, ``scales[g_idx] * (weight - zeros[g_idx])``, v1
zeros + 1 when converting to v2) and is tested against a packer written from it.
"""
from __future__ import annotations

import torch

from pagedllm.layers.quantization.base import unpack_int32
from pagedllm.layers.quantization.checkpoint import CheckpointMethod, CheckpointTensor
from pagedllm.layers.quantization.config import require, require_choice

FORMATS = ("gptq", "gptq_v2")


class GPTQMethod(CheckpointMethod):
    name = "gptq"

    def __init__(self, bits: int, group_size: int, act_order: bool, v2: bool):
        super().__init__(bits, group_size, act_order)
        self.v2 = v2

    @classmethod
    def from_config(cls, cfg: dict) -> GPTQMethod:
        bits = require_choice(cfg, "bits", (4, 8))
        group = cfg.get("group_size", 128)
        require(isinstance(group, int) and (group == -1 or group > 0), "group_size", group,
                "-1 or a positive multiple of 8")
        fmt = cfg.get("checkpoint_format", cfg.get("format", "gptq"))
        require(fmt in FORMATS, "checkpoint_format", fmt, f"one of {FORMATS}")
        require(not cfg.get("lm_head", False), "lm_head", True, "false (a quantized LM head is not supported)")
        require(not cfg.get("dynamic"), "dynamic", cfg.get("dynamic"), "empty (per-module overrides are not supported)")
        return cls(bits, group, bool(cfg.get("desc_act", False)), v2=fmt == "gptq_v2")

    def checkpoint_tensors(self) -> tuple[CheckpointTensor, ...]:
        return (CheckpointTensor("qweight", "codes"), CheckpointTensor("qzeros", "zero"),
                CheckpointTensor("scales", "scale"), CheckpointTensor("g_idx", "g_idx", optional=True))

    def convert(self, kind: str, tensor: torch.Tensor) -> torch.Tensor:
        if kind == "codes":
            return unpack_int32(tensor, self.bits, dim=0).t()  # [in, out] -> [out, in]
        if kind == "zero":
            return unpack_int32(tensor, self.bits, dim=1).t().float() + (0 if self.v2 else 1)  # [out, G]
        if kind == "scale":
            return tensor.t().float()  # [out, G]
        return tensor.to(torch.int32)

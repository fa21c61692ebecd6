"""AWQ checkpoints (``quant_method: awq``, ``version: gemm``), as AutoAWQ writes them.

Per linear layer (4 bits, 8 codes per int32):

    qweight  int32 [in, out / 8]   codes packed along the OUTPUT dimension, interleaved
    qzeros   int32 [G, out / 8]    zero points, packed the same way
    scales   float [G, out]

    W[o, i] = (code[i, o] - zero[i / group, o]) * scale[i / group, o]

AutoAWQ's interleaving (``AWQ_ORDER`` in awq/utils/packing_utils.py): the word's 4-bit slot k
holds column ``[0, 2, 4, 6, 1, 3, 5, 7][k]`` of its 8, so column j sits in slot
``[0, 4, 1, 5, 2, 6, 3, 7][j]``. Zero points are stored as is (no GPTQ-style offset).
"""
from __future__ import annotations

import torch

from pagedllm.layers.quantization.base import unpack_int32
from pagedllm.layers.quantization.checkpoint import CheckpointMethod, CheckpointTensor
from pagedllm.layers.quantization.config import require, require_choice

SLOT_OF_COLUMN = [0, 4, 1, 5, 2, 6, 3, 7]
VERSIONS = ("gemm",)


class AWQMethod(CheckpointMethod):
    name = "awq"

    @classmethod
    def from_config(cls, cfg: dict) -> AWQMethod:
        bits = require_choice(cfg, "bits" if "bits" in cfg else "w_bit", (4,))
        group = cfg.get("group_size", cfg.get("q_group_size", 128))
        require(isinstance(group, int) and group > 0, "group_size", group, "a positive multiple of 8")
        version = str(cfg.get("version", "gemm")).lower()
        require(version in VERSIONS, "version", cfg.get("version"), f"one of {VERSIONS} (the GEMM layout)")
        require(cfg.get("zero_point", True) is True, "zero_point", cfg.get("zero_point"), "true")
        skipped = cfg.get("modules_to_not_convert")
        require(not skipped, "modules_to_not_convert", skipped, "empty (every projection quantized)")
        return cls(bits, group)

    def checkpoint_tensors(self) -> tuple[CheckpointTensor, ...]:
        return (CheckpointTensor("qweight", "codes"), CheckpointTensor("qzeros", "zero"),
                CheckpointTensor("scales", "scale"))

    def convert(self, kind: str, tensor: torch.Tensor) -> torch.Tensor:
        if kind == "codes":
            return unpack_int32(tensor, 4, dim=1, order=SLOT_OF_COLUMN).t()  # [in, out] -> [out, in]
        if kind == "zero":
            return unpack_int32(tensor, 4, dim=1, order=SLOT_OF_COLUMN).t().float()  # [out, G]
        return tensor.t().float()  # scales [G, out] -> [out, G]

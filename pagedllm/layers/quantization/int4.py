"""Weight-only int4 made at load time (``quantization="int4"``): group-wise, group 128, symmetric.

Each projection weight ``W [out, in]`` (after tensor-parallel sharding: each rank quantizes its
own slice) gets one float32 scale per row and group of 128 input columns,
``s = max|W[row, group]| / 7``, and codes ``round(W / s)`` in ``[-7, 7]``, stored offset by 8
(unsigned nibbles, zero point 8) in the group-wise runtime layout of ``grouped.py``. Why: a
CPU decodes small batches at memory bandwidth, and 4-bit codes are an eighth of float32's
bytes (plus 8 bytes of scale and zero per 128 weights). Activations, norms, embeddings and the
LM head stay in the model dtype.
"""
from __future__ import annotations

import torch

from pagedllm.layers.quantization import grouped
from pagedllm.layers.quantization.base import QuantMethod

GROUP_SIZE = 128
ZERO = 8  # codes are round(W / s) + 8, so the signed range [-7, 7] is stored as [1, 15]


def quantize_int4(weight: torch.Tensor, group: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes [out, in] uint8 in [1, 15], scale [out, in / group] float32)`` with
    ``weight ~= (codes - 8) * scale`` per group."""
    out_features, in_features = weight.shape
    grouped.check_group(group, in_features, "int4 group size")
    w = weight.detach().float().reshape(out_features, in_features // group, group)  # [out, G, group]
    scale = w.abs().amax(dim=2) / 7.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero group stays zero
    q = torch.round(w / scale[..., None]).clamp_(-7, 7) + ZERO
    return q.reshape(out_features, in_features).to(torch.uint8), scale.contiguous()


class Int4Method(QuantMethod):
    name = "int4"
    group_size = GROUP_SIZE

    def process_weights(self, layer: torch.nn.Module) -> None:
        codes, scale = quantize_int4(layer.weight)
        zero = torch.full_like(scale, float(ZERO))
        grouped.install(layer, codes.to(layer.weight.device), scale.to(layer.weight.device),
                        zero.to(layer.weight.device), None, bits=4, what="int4 group size")

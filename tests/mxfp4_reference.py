"""The MXFP4 packer the tests write checkpoints with (the OCP MX rules gpt-oss's weights follow;
the loader's layout is ``pagedllm/layers/quantization/mxfp4.py``, its dequantization checked
against transformers' ``convert_moe_packed_tensors``)."""
from __future__ import annotations

import torch

from pagedllm.layers.quantization import mxfp4


def pack_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The format's packer for ``w [..., out, in]``: per 32-element group the shared exponent is
    floor(log2(amax)) - 2 (e2m1's largest exponent), values rounded to the nearest e2m1 code
    (saturating at +-6), two codes per byte, the even element in the low nibble."""
    groups = w.reshape(*w.shape[:-1], -1, mxfp4.GROUP).float()  # [..., out, in / 32, 32]
    amax = groups.abs().amax(-1, keepdim=True).clamp_min(2.0**-126)
    exp = torch.floor(torch.log2(amax)) - 2
    values = torch.tensor(mxfp4.E2M1_VALUES)
    scaled = (groups / torch.exp2(exp)).clamp(-6, 6)
    codes = (scaled[..., None] - values).abs().argmin(-1).to(torch.uint8)  # [..., 32]
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)  # [..., in / 32, 16]
    return blocks, (exp[..., 0] + 127).to(torch.uint8)

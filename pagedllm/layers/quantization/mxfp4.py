"""MXFP4 expert weights as OpenAI's gpt-oss checkpoints ship them (``quantization_config:
{quant_method: mxfp4}``), loaded as shipped and never widened in memory.

A weight ``W [out, in]`` is stored per 32-element group of a row (the OCP MX format, e2m1 values
with an e8m0 scale), in the layout of transformers' ``integrations/mxfp4.py``::

    *_blocks  uint8 [..., out, in / 32, 16]   byte j of a group: element 2j in the low nibble,
                                               element 2j + 1 in the high nibble (e2m1 codes)
    *_scales  uint8 [..., out, in / 32]       the group's scale 2^(s - 127)

    e2m1 code -> value: 0 0.5 1 1.5 2 3 4 6, and the same negated for codes 8..15

gpt-oss quantizes only the experts (``gate_up_proj`` with gate / up rows interleaved, and
``down_proj``); attention, router, embeddings and the LM head stay bfloat16
(``modules_to_not_convert``), so :class:`Mxfp4Method` leaves the linear projections alone and
:class:`Mxfp4FusedMoE` holds the experts. Kernels: on the CPU ``native/csrc/mxfp4.c`` (decodes a
group into registers inside the dot product), on CUDA (or Triton's interpreter)
``layers/triton_ops/mxfp4.py``, whose in-register decode the fused MoE GEMMs also use under
``ops="triton"`` (no host sync: CUDA-graph capturable); :func:`dequantize` is the torch reference
they are tested against.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from pagedllm.layers.fused_moe import FusedMoE
from pagedllm.layers.ops import _interpreting, triton_available
from pagedllm.layers.quantization.base import QuantMethod
from pagedllm.native import bindings

GROUP = 32  # elements per e8m0 scale
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# checkpoint leaf (under ``.experts.``) -> the Mxfp4FusedMoE parameter
_PARAMS = {"gate_up_proj_blocks": "w13_blocks", "gate_up_proj_scales": "w13_scales",
           "down_proj_blocks": "w2_blocks", "down_proj_scales": "w2_scales"}


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 ``[..., out, in]`` from ``blocks [..., out, in / 32, 16]`` and ``scales [..., out, in / 32]``."""
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()  # [..., groups, 16, 2]: low nibble first
    values = lut[codes].flatten(-2)  # [..., groups, 32]
    values = torch.ldexp(values, scales.to(torch.int32)[..., None] - 127)
    return values.flatten(-2)  # [..., out, in]


def mxfp4_linear(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [rows, in] @ W^T + bias`` with W in MXFP4 (``blocks [out, in / 32, 16]``, ``scales
    [out, in / 32]``), in ``x``'s dtype: the C kernel on the CPU, the Triton kernel on CUDA and
    under Triton's interpreter, else the weight dequantized in torch."""
    if x.device.type == "cpu" and bindings.is_available() and not torch.compiler.is_compiling():
        out = torch.empty(x.shape[0], blocks.shape[0], dtype=torch.float32)
        b = None if bias is None else bias.float().contiguous()
        bindings.library().mx_linear(x.float().contiguous(), blocks, scales, b, out, torch.get_num_threads())
        return out.to(x.dtype)
    if _triton_runs_on(x.device):
        from pagedllm.layers.triton_ops.mxfp4 import mxfp4_matmul
        return mxfp4_matmul(x, blocks, scales, bias)
    return torch.nn.functional.linear(x, dequantize(blocks, scales).to(x.dtype), bias)


def _triton_runs_on(device: torch.device) -> bool:
    return triton_available() and (device.type == "cuda" or _interpreting())


def is_mxfp4(hf_config) -> bool:
    cfg = getattr(hf_config, "quantization_config", None)
    if cfg is not None and not isinstance(cfg, dict):
        cfg = cfg.to_dict()
    return bool(cfg) and str(cfg.get("quant_method", "")).lower() == "mxfp4"


def check_config(hf_config) -> None:
    """The experts' sizes must be whole MX groups (what the checkpoint layout implies)."""
    if not is_mxfp4(hf_config):
        return
    for field in ("hidden_size", "intermediate_size"):
        value = getattr(hf_config, field)
        if value % GROUP:
            raise ValueError(f"{field}={value} must be a multiple of {GROUP} for MXFP4 experts")


class Mxfp4Method(QuantMethod):
    """``quant_method: mxfp4``: only the experts are quantized (``Mxfp4FusedMoE``), so the linear
    projections keep their float weights."""

    name = "mxfp4"

    @classmethod
    def from_config(cls, cfg: dict) -> Mxfp4Method:
        return cls()

    def create_weights(self, layer: nn.Module) -> None:
        """Nothing: the projections are stored in float."""

    def process_weights(self, layer: nn.Module) -> None:
        """Nothing: the projections run their float kernels."""


def checkpoint_shards(prefix: str, leaf: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor, object]]:
    """The MXFP4 expert tensors of one layer, stacked over experts, to their parameters (sliced
    per rank by ``Mxfp4FusedMoE.load_stacked``)."""
    if leaf not in _PARAMS:
        raise ValueError(f"checkpoint tensor {prefix}.{leaf!r} is not a GPT-OSS expert tensor; expected one of "
                         f"{sorted(_PARAMS)} or the float gate_up_proj / down_proj (and biases)")
    yield f"{prefix}.{_PARAMS[leaf]}", tensor, None


class Mxfp4FusedMoE(FusedMoE):
    """FusedMoE whose expert matrices stay MXFP4 (``w13_blocks`` / ``w13_scales``: this rank's gate
    rows then up rows, ``w2_blocks`` / ``w2_scales``: down with this rank's slice of the inputs);
    each expert's GEMMs run :func:`mxfp4_linear`. Biases and routing as in FusedMoE."""

    def create_expert_weights(self, hidden_size: int) -> None:
        if self.inter % GROUP or hidden_size % GROUP:
            raise ValueError(f"MXFP4 experts need the per-rank intermediate size ({self.inter}) and hidden size "
                             f"({hidden_size}) to be multiples of {GROUP} (lower tensor_parallel_size)")
        e, inter = self.num_experts, self.inter

        def param(*shape):
            p = nn.Parameter(torch.empty(*shape, dtype=torch.uint8), requires_grad=False)
            p.weight_loader, p.raw_checkpoint_tensor = self.load_stacked, True
            return p

        self.w13_blocks = param(e, 2 * inter, hidden_size // GROUP, GROUP // 2)
        self.w13_scales = param(e, 2 * inter, hidden_size // GROUP)
        self.w2_blocks = param(e, hidden_size, inter // GROUP, GROUP // 2)
        self.w2_scales = param(e, hidden_size, inter // GROUP)

    def load_stacked(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """A checkpoint tensor over all experts -> this rank's slice. gate_up rows interleave
        gate (even) and up (odd); down's groups split along the input (intermediate) dimension."""
        start, inter = self.tp_rank * self.inter, self.inter
        if param is self.w13_blocks or param is self.w13_scales:
            gate, up = loaded[:, 0::2], loaded[:, 1::2]  # [E, I, ...] each
            param.data.copy_(torch.cat([gate[:, start:start + inter], up[:, start:start + inter]], dim=1))
        else:
            param.data.copy_(loaded[:, :, start // GROUP:(start + inter) // GROUP])

    def forward_routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Triton ops: the device-side grouped GEMMs decoding the blocks in registers (no host
        sync); otherwise per expert on :func:`mxfp4_linear`."""
        if self.ops != "triton":
            return self.forward_grouped(x, weights, ids)
        from pagedllm.layers.triton_ops.fused_moe import fused_experts
        b2 = self.w2_bias if self.tp_rank == 0 else None  # ranks are summed
        return self.tp.all_reduce(fused_experts(x, self.w13_blocks, self.w2_blocks, weights, ids, self.act_and_mul,
                                                self.w13_bias, b2, self.w13_scales, self.w2_scales))

    def pack_weights(self, kernel: bool = True) -> int:
        return 0  # the MXFP4 kernels read the checkpoint layout

    def expert_linear(self, x: torch.Tensor, expert: int, which: str) -> torch.Tensor:
        blocks, scales = (self.w13_blocks, self.w13_scales) if which == "w13" else (self.w2_blocks, self.w2_scales)
        return mxfp4_linear(x, blocks[expert], scales[expert], self.expert_bias(expert, which))

    def cuda_graph_blocker(self) -> str | None:
        if self.ops == "triton":
            return None
        return "the MXFP4 experts built with fused_ops='native' read their token counts on the host"

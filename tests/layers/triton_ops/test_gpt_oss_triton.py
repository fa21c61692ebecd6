"""GPT-OSS's device-side pieces (interpreted on CPU tensors, compiled on a GPU): the MXFP4 GEMM
(pagedllm/layers/triton_ops/mxfp4.py) against the dequantized weight, and the fused MoE with the
experts' biases and the clamped SwiGLU against the float64 per-token reference and the layer's
torch path."""
from __future__ import annotations

import pytest
import torch
from mxfp4_reference import pack_mxfp4
from triton_devices import DEVICES

from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.layers.fused_moe import FusedMoE, route
from pagedllm.layers.quantization import mxfp4
from pagedllm.layers.triton_ops import fused_moe
from pagedllm.layers.triton_ops.mxfp4 import mxfp4_matmul
from pagedllm.models.gpt_oss import SwigluClamp

HIDDEN, INTER = 64, 32  # whole MX groups; partial N tiles at the prefill tile
ACT = SwigluClamp(alpha=1.702, limit=0.5)  # a low limit, so the clamps bind at these scales


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows, bias", [(1, True), (20, False)], ids=["decode-bias", "prefill"])
def test_mxfp4_gemm_equals_the_dequantized_weight(device, rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(48, 96, generator=g) * torch.logspace(-2, 1, 96)  # [out, in], groups of different ranges
    blocks, scales = pack_mxfp4(w)
    x, b = torch.randn(rows, 96, generator=g), torch.randn(48, generator=g) if bias else None
    out = mxfp4_matmul(x.to(device), blocks.to(device), scales.to(device), None if b is None else b.to(device))
    ref = x.double() @ mxfp4.dequantize(blocks, scales).double().T + (0 if b is None else b.double())
    torch.testing.assert_close(out.cpu().double(), ref, atol=1e-4, rtol=1e-5)


def _biased_inputs(tokens: int, experts: int, device):
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN, generator=g)
    w13 = torch.randn(experts, 2 * INTER, HIDDEN, generator=g) * 0.2
    w2 = torch.randn(experts, HIDDEN, INTER, generator=g) * 0.2
    b13 = torch.randn(experts, 2 * INTER, generator=g) * 0.3
    b2 = torch.randn(experts, HIDDEN, generator=g) * 0.3
    weights, ids = route(torch.randn(tokens, experts, generator=g), 2, renormalize=True)
    return [t.to(device) for t in (x, w13, w2, weights, ids, b13, b2)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tokens", [3, 40], ids=["decode", "prefill-tile"])
def test_fused_experts_with_biases_and_clamped_swiglu(device, tokens):
    x, w13, w2, weights, ids, b13, b2 = _biased_inputs(tokens, 4, device)
    out = fused_moe.fused_experts(x, w13, w2, weights, ids, ACT, b13, b2)
    ref = fused_moe.fused_experts_ref(x, w13, w2, weights, ids, ACT, b13, b2)
    torch.testing.assert_close(out.double(), ref.double(), atol=1e-5, rtol=1e-5)
    unbiased = fused_moe.fused_experts_ref(x, w13, w2, weights, ids, ACT)
    assert not torch.allclose(ref, unbiased, atol=1e-3)  # the biases matter to the answer


def _gpt_oss_layer(ops: str, quantized: bool) -> FusedMoE:
    """A GPT-OSS-shaped expert layer (biases, clamped SwiGLU), float or MXFP4, same values."""
    torch.manual_seed(0)
    cls = mxfp4.Mxfp4FusedMoE if quantized else FusedMoE
    layer = cls(4, 2, HIDDEN, INTER, True, "swiglu_clamp", tp=TensorParallelGroup(), ops=ops, bias=True,
                act_and_mul=ACT)
    w13, w2 = torch.randn(4, 2 * INTER, HIDDEN) * 0.2, torch.randn(4, HIDDEN, INTER) * 0.2
    layer.w13_bias.data.normal_(std=0.3), layer.w2_bias.data.normal_(std=0.3)
    if quantized:
        (layer.w13_blocks.data, layer.w13_scales.data), (layer.w2_blocks.data, layer.w2_scales.data) = \
            pack_mxfp4(w13), pack_mxfp4(w2)
    else:
        layer.w13.data.copy_(w13), layer.w2.data.copy_(w2)
    return layer


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("quantized, tokens", [(False, 6), (True, 6), (True, 40)],
                         ids=["float", "mxfp4-decode", "mxfp4-prefill-tile"])
def test_gpt_oss_expert_layer_on_the_triton_ops_equals_its_torch_path(device, quantized, tokens):
    triton_layer, native = _gpt_oss_layer("triton", quantized).to(device), _gpt_oss_layer("native", quantized)
    assert triton_layer.cuda_graph_blocker() is None and native.cuda_graph_blocker() is not None
    g = torch.Generator().manual_seed(5)
    x, logits = torch.randn(tokens, HIDDEN, generator=g), torch.randn(tokens, 4, generator=g)
    out = triton_layer(x.to(device), logits.to(device))
    torch.testing.assert_close(out.cpu(), native(x, logits), atol=1e-5, rtol=1e-5)

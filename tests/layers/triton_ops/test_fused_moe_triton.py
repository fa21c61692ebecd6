"""The device-side fused MoE (pagedllm/layers/triton_ops/fused_moe.py): the sort by expert and its
static bounds, the grouped GEMM pair against a float64 per-token reference (interpreted on CPU
tensors, float32 and float16), and FusedMoE built for the Triton ops against its torch path."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_devices import DEVICES

from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.layers.activation import silu_and_mul
from pagedllm.layers.fused_moe import FusedMoE, route
from pagedllm.layers.gated_activation import gelu_tanh_and_mul
from pagedllm.layers.triton_ops import fused_moe

HIDDEN, INTER = 40, 24  # partial K and N tiles under every tile shape


@pytest.mark.parametrize("tokens, top_k, experts, block_m", [(1, 2, 8, 16), (5, 2, 8, 4), (30, 3, 4, 16),
                                                             (7, 2, 3, 64)])
def test_align_sorts_every_slot_once_into_single_expert_blocks(tokens, top_k, experts, block_m):
    g = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])  # [tokens, top_k]
    blocks = fused_moe.align_by_expert(ids, experts, block_m)
    slots = tokens * top_k
    assert blocks.max_blocks == fused_moe.max_blocks(slots, experts, block_m)  # fixed by the shapes
    counts = torch.bincount(ids.flatten(), minlength=experts)
    used = int(sum(-(-c // block_m) for c in counts.tolist()))  # blocks the data needs
    assert used <= blocks.max_blocks and blocks.num_padded.tolist() == [used * block_m]
    rows = blocks.sorted_slots.view(-1, block_m)  # [max_blocks, block_m]
    real = rows[:used][rows[:used] < slots]
    assert sorted(real.tolist()) == list(range(slots))  # each slot exactly once, inside the used blocks
    assert (rows[used:] == slots).all()  # the tail is padding only
    flat = ids.flatten()
    for b in range(used):
        members = rows[b][rows[b] < slots].long()
        assert len(members) > 0 and (flat[members] == blocks.block_expert[b]).all()


def _inputs(tokens, top_k, experts, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=g)
    w13 = torch.randn(experts, 2 * INTER, HIDDEN, generator=g) * 0.2
    w2 = torch.randn(experts, HIDDEN, INTER, generator=g) * 0.2
    weights, ids = route(torch.randn(tokens, experts, generator=g), top_k, renormalize=False)
    return *(t.to(dtype).to(device) for t in (x, w13, w2)), weights.to(device), ids.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16))
@pytest.mark.parametrize("tokens, top_k, experts", [(1, 2, 8), (6, 2, 8), (40, 2, 4)],
                         ids=["decode-1", "decode-6", "prefill-tile"])
def test_fused_experts_equal_the_per_token_reference(device, dtype, tokens, top_k, experts):
    x, w13, w2, weights, ids = _inputs(tokens, top_k, experts, dtype, device, seed=tokens)
    assert (fused_moe.tiles(tokens * top_k, experts)[0] == 64) == (tokens == 40)
    out = fused_moe.fused_experts(x, w13, w2, weights, ids, silu_and_mul)
    ref = fused_moe.fused_experts_ref(x, w13, w2, weights, ids, silu_and_mul)
    assert out.dtype == dtype and out.shape == (tokens, HIDDEN)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-3, rtol=3e-3)
    torch.testing.assert_close(out.double(), ref.double(), **tol)


@pytest.mark.parametrize("device", DEVICES)
def test_every_token_on_one_expert_and_a_gelu_activation(device):
    """All slots of one expert (one run spanning several blocks, every other expert idle) and the
    GeGLU activation that runs as torch ops between the GEMMs."""
    x, w13, w2, _, _ = _inputs(9, 2, 4, torch.float32, device, seed=3)
    ids = torch.tensor([[2, 1]] * 9, device=device)
    weights = torch.rand(9, 2, generator=torch.Generator().manual_seed(4)).to(device)
    out = fused_moe.fused_experts(x, w13, w2, weights, ids, gelu_tanh_and_mul)
    ref = fused_moe.fused_experts_ref(x, w13, w2, weights, ids, gelu_tanh_and_mul)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def _layer(ops: str, renormalize: bool) -> FusedMoE:
    torch.manual_seed(0)
    moe = FusedMoE(8, 2, HIDDEN, INTER, renormalize, tp=TensorParallelGroup(), ops=ops)
    moe.w13.normal_(std=0.2), moe.w2.normal_(std=0.2)
    return moe


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("renormalize", [True, False])
def test_layer_on_the_triton_ops_equals_its_torch_path(device, renormalize):
    triton_layer, native = _layer("triton", renormalize).to(device), _layer("native", renormalize).to(device)
    assert triton_layer.pack_weights() == 0 and triton_layer.kernel_weights is None  # no CPU copies to keep
    x, logits = torch.randn(5, HIDDEN).to(device), torch.randn(5, 8).to(device)
    torch.testing.assert_close(triton_layer(x, logits), native(x, logits), atol=1e-5, rtol=1e-5)


def test_only_the_triton_layer_declares_itself_capturable():
    assert _layer("triton", True).cuda_graph_blocker() is None
    assert "fused_ops='native'" in _layer("native", True).cuda_graph_blocker()


def test_reference_is_the_routing_definition():
    """The float64 reference against a loop written from the SwiGLU definition (guards the oracle)."""
    x, w13, w2, weights, ids = _inputs(3, 2, 4, torch.float32, "cpu")
    want = torch.zeros(3, HIDDEN, dtype=torch.float64)
    for t in range(3):
        for j in range(2):
            gate, up = (w13[ids[t, j]].double() @ x[t].double()).chunk(2)
            want[t] += weights[t, j].double() * (w2[ids[t, j]].double() @ (F.silu(gate) * up))
    torch.testing.assert_close(fused_moe.fused_experts_ref(x, w13, w2, weights, ids, silu_and_mul).double(), want,
                               atol=1e-6, rtol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("tokens", [1, 80])  # the decode and the prefill tile
def test_layer_captured_in_a_cuda_graph_replays_what_eager_computes(tokens):
    """The capture the model runner makes, on the layer alone: no sync while capturing (the sync
    debug mode raises on one), and a replay on new inputs equals the eager forward on them."""
    layer = _layer("triton", True).to("cuda", torch.bfloat16)
    g = torch.Generator().manual_seed(tokens)
    new_inputs = lambda: (torch.randn(tokens, HIDDEN, generator=g).to("cuda", torch.bfloat16),  # noqa: E731
                          torch.randn(tokens, 8, generator=g).to("cuda"))
    x, logits = new_inputs()
    side = torch.cuda.Stream()  # warm-up (the kernels' first compile) off the capture stream
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        layer(x, logits)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            out = layer(x, logits)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    fresh_x, fresh_logits = new_inputs()
    x.copy_(fresh_x), logits.copy_(fresh_logits)
    graph.replay()
    torch.testing.assert_close(out, layer(fresh_x, fresh_logits), atol=0, rtol=0)

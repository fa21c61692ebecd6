"""FusedMoE (layers/fused_moe.py) against a per-token loop written from the routing definition."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.layers import cpu_ops
from pagedllm.layers.fused_moe import FusedMoE, route

HIDDEN, INTER, EXPERTS = 16, 12, 8


def _reference(x, logits, w13, w2, top_k, renormalize):
    probs = torch.softmax(logits, -1)
    weights, ids = torch.topk(probs, top_k, -1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    y = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(top_k):
            e = int(ids[t, j])
            gate, up = (w13[e] @ x[t]).chunk(2)
            y[t] += weights[t, j] * (w2[e] @ (F.silu(gate) * up))
    return y


def _layer(renormalize: bool, top_k: int = 2) -> FusedMoE:
    torch.manual_seed(0)
    moe = FusedMoE(EXPERTS, top_k, HIDDEN, INTER, renormalize, tp=TensorParallelGroup())
    for e in range(EXPERTS):  # loaded the way checkpoints come: one matrix per expert and part
        for part in ("gate", "up"):
            moe.weight_loader(moe.w13, torch.randn(INTER, HIDDEN), (e, part))
        moe.weight_loader(moe.w2, torch.randn(HIDDEN, INTER), (e, "down"))
    return moe


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("num_tokens", [1, 3, 64])
def test_matches_per_token_reference(renormalize, num_tokens):
    moe = _layer(renormalize)
    x, logits = torch.randn(num_tokens, HIDDEN), torch.randn(num_tokens, EXPERTS)
    _, ids = route(logits, 2, renormalize)
    if num_tokens == 3:  # at most 6 of 8 experts active: the idle ones must simply be skipped
        assert len(ids.unique()) < EXPERTS
    expected = _reference(x, logits, moe.w13, moe.w2, 2, renormalize)
    assert torch.allclose(moe(x, logits), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("num_tokens", [1, 64])
def test_packed_experts_match_the_reference(num_tokens):
    moe = _layer(renormalize=True)
    assert cpu_ops.pack_model(moe) == 2 * EXPERTS  # what the model runner does on CPU once loaded
    x, logits = torch.randn(num_tokens, HIDDEN), torch.randn(num_tokens, EXPERTS)
    expected = _reference(x, logits, moe.w13, moe.w2, 2, True)
    torch.testing.assert_close(moe(x, logits), expected, atol=1e-4, rtol=1e-4)


def test_loaded_parts_land_in_the_stacked_tensors():
    moe = FusedMoE(2, 1, 4, 3, renormalize=True, tp=TensorParallelGroup())
    gate, up, down = torch.randn(3, 4), torch.randn(3, 4), torch.randn(4, 3)
    moe.weight_loader(moe.w13, gate, (1, "gate"))
    moe.weight_loader(moe.w13, up, (1, "up"))
    moe.weight_loader(moe.w2, down, (1, "down"))
    assert torch.equal(moe.w13[1], torch.cat([gate, up])) and torch.equal(moe.w2[1], down)


def test_bad_top_k_is_refused():
    with pytest.raises(ValueError, match="num_experts_per_tok=9"):
        FusedMoE(8, 9, HIDDEN, INTER, renormalize=True, tp=TensorParallelGroup())

"""The batched LoRA op's C kernel (native/csrc/lora_sgmv.c) against its torch reference, on mixed
batches: several adapters, base-model tokens (left untouched) and a batch of one adapter whole;
metadata out of range is refused by the kernel, not read."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedllm.layers.lora import LoRABatch, lora_shrink_expand, lora_shrink_expand_ref
from pagedllm.native import bindings

pytestmark = pytest.mark.skipif(not bindings.is_available(), reason="the C library did not build")


def _case(token_slots: list[int], slots: int = 4, rank: int = 24, n_in: int = 72, n_out: int = 200, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(len(token_slots), n_in, generator=g)
    y = torch.randn(len(token_slots), n_out, generator=g)
    a = torch.randn(slots, rank, n_in, generator=g) * 0.1
    b = torch.randn(slots, n_out, rank, generator=g) * 0.1
    batch = LoRABatch()
    batch.set(np.array(token_slots, dtype=np.int64), torch.device("cpu"))
    return x, y, a, b, batch


@pytest.mark.parametrize("token_slots", [
    [2, -1, 0, 2, 3, -1, 0, 0, 1, 2, -1],  # mixed, with base tokens
    [1] * 9,  # one adapter over the whole batch (no row indirection)
    [-1, -1, 3],  # one LoRA token
    list(np.random.default_rng(1).integers(-1, 4, 150)),  # more rows than one rank / column block
])
def test_c_kernel_equals_the_reference(token_slots):
    x, y, a, b, batch = _case(token_slots)
    expected = lora_shrink_expand_ref(x, y.clone(), a, b, batch)
    got = lora_shrink_expand(x, y.clone(), a, b, batch)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    base = torch.tensor([s < 0 for s in token_slots])
    assert torch.equal(got[base], y[base])  # base-model rows are never written


@pytest.mark.parametrize("rank,n_in,n_out", [(5, 13, 11), (12, 20, 29), (8, 8, 8)])
def test_c_kernel_sizes_off_its_8_wide_tiles(rank, n_in, n_out):
    """Ranks, inputs and outputs that are not multiples of the kernel's 8-row dots (their tails)."""
    token_slots = [0, 1, -1, 1, 0, 0, 2]
    x, y, a, b, batch = _case(token_slots, rank=rank, n_in=n_in, n_out=n_out, seed=rank)
    expected = lora_shrink_expand_ref(x, y.clone(), a, b, batch)
    torch.testing.assert_close(lora_shrink_expand(x, y.clone(), a, b, batch), expected, atol=1e-5, rtol=1e-5)


def test_reference_is_the_per_token_formula():
    x, y, a, b, batch = _case([0, -1, 1, 0], rank=8, n_in=16, n_out=12)
    want = y.clone()
    for row, slot in enumerate([0, -1, 1, 0]):
        if slot >= 0:
            want[row] += (x[row] @ a[slot].T) @ b[slot].T
    torch.testing.assert_close(lora_shrink_expand_ref(x, y.clone(), a, b, batch), want)


def test_no_lora_tokens_is_a_no_op():
    x, y, a, b, batch = _case([-1, -1])
    assert not batch.active and torch.equal(lora_shrink_expand(x, y.clone(), a, b, batch), y)


def test_metadata_out_of_range_is_refused():
    x, y, a, b, batch = _case([0, 1, 1])
    lib = bindings.library()
    with pytest.raises(ValueError, match="lora_sgmv: metadata out of range"):
        lib.lora_sgmv(x, y, a, b, batch.perm, torch.tensor([0, 7]), batch.seg_start, 1)  # slot 7 of 4
    with pytest.raises(ValueError, match="lora_sgmv: metadata out of range"):
        lib.lora_sgmv(x, y, a, b, torch.tensor([0, 1, 9]), batch.seg_slot, batch.seg_start, 1)  # row 9 of 3


@pytest.mark.parametrize("whole", [True, False])
def test_c_kernel_block_diagonal_b(whole):
    """A fused projection's B is block-diagonal over its sub-projections' ranks (lora/model.py): with
    enough tokens in a segment the kernel dots each column block over its non-zero ranks only,
    including a block straddling two sub-projections and one with no non-zero rank at all."""
    rank, subs = 8, (150, 60, 50)  # column blocks of 128: 0-127 in sub 0, 128-255 straddles all three
    token_slots = [1] * 40 if whole else [1, 0, -1] * 20  # segments of 40, 20 and 20 tokens
    x, y, a, b, batch = _case(token_slots, slots=2, rank=rank * len(subs), n_in=40, n_out=sum(subs) + 130)
    mask = torch.zeros_like(b)
    start = 0
    for i, n in enumerate(subs):
        mask[:, start:start + n, i * rank:(i + 1) * rank] = 1
        start += n  # the last 130 columns (a whole block among them) stay zero
    b = b * mask
    expected = lora_shrink_expand_ref(x, y.clone(), a, b, batch)
    torch.testing.assert_close(lora_shrink_expand(x, y.clone(), a, b, batch), expected, atol=1e-5, rtol=1e-5)

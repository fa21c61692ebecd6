"""The batched LoRA Triton kernels (layers/triton_ops/lora.py) against the torch reference
(layers/lora.py), on a mixed batch with base-model tokens, segments longer than one token block,
and a rank that is not a power of two; and in the graph-safe layout CUDA graphs capture."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from lora_graph_cases import ROWS, check_against_eager
from triton_devices import DEVICES

from pagedllm.layers.lora import LoRABatch, lora_shrink_expand_ref

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=2e-2, rtol=2e-2)}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_lora_sgmv_equals_the_reference(device, dtype):
    from pagedllm.layers.triton_ops.lora import lora_sgmv
    token_slots = np.array([2, -1, 0] + [1] * 19 + [-1, 2, 0], dtype=np.int64)  # slot 1: 19 tokens, 2 blocks
    g = torch.Generator().manual_seed(0)
    x = torch.randn(len(token_slots), 40, generator=g).to(dtype)
    y = torch.randn(len(token_slots), 72, generator=g).to(dtype)
    a = (torch.randn(3, 24, 40, generator=g) * 0.1).to(dtype)
    b = (torch.randn(3, 72, 24, generator=g) * 0.1).to(dtype)
    batch = LoRABatch()
    batch.set(token_slots, torch.device(device))
    on_cpu = LoRABatch()
    on_cpu.set(token_slots, torch.device("cpu"))
    expected = lora_shrink_expand_ref(*(t.float() for t in (x, y.clone(), a, b)), on_cpu)
    got = lora_sgmv(x.to(device), y.clone().to(device), a.to(device), b.to(device), batch.perm, batch.seg_slot,
                    batch.seg_start, batch.max_segment)
    torch.testing.assert_close(got.cpu().float(), expected, **TOL[dtype])
    base = torch.from_numpy(token_slots < 0)
    assert torch.equal(got.cpu()[base], y[base])  # base-model rows are never written



@pytest.mark.parametrize("device", DEVICES)
def test_graph_safe_mode_equals_eager_across_refills(device):
    """The layout a CUDA graph captures (one segment per slot, the grid over every row): each
    mapping refilled into the same buffers gives the eager reference's result."""
    from pagedllm.layers.triton_ops.lora import lora_sgmv

    def run(x, y, a, b, batch):
        assert batch.max_segment == ROWS  # fixed by the buffers, not by the mapping
        return lora_sgmv(x, y, a, b, batch.perm, batch.seg_slot, batch.seg_start, batch.max_segment)
    check_against_eager(run, device, TOL[torch.float32])

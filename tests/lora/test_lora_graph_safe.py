"""The batched LoRA op in ``LoRABatch``'s graph-safe mode (what a CUDA graph captures: fixed-size
buffers refilled in place, one segment per slot, grids fixed by the row count) equals the eager op,
for the torch reference and the C kernel, on mixed mappings with base-model and padding rows and
one set of buffers reused across mappings (tests/lora_graph_cases.py); the Triton kernels' case is
in tests/layers/triton_ops/test_lora_triton.py."""
from __future__ import annotations

import numpy as np
import pytest
from host_syncs import no_host_syncs
from lora_graph_cases import MAPPINGS, ROWS, check_against_eager, graph_batch, refill

from pagedllm.layers import lora
from pagedllm.layers.lora import lora_shrink_expand, row_slots, slot_groups
from pagedllm.native import bindings


def test_slot_groups_lists_every_row_grouped_by_slot_base_rows_last():
    perm, seg_start = slot_groups(np.array([2, -1, 0, 2, -1, 0]), 4)
    assert perm.tolist() == [2, 5, 0, 3, 1, 4] and seg_start.tolist() == [0, 2, 2, 4, 4]
    batch = graph_batch()
    refill(batch, MAPPINGS[0])
    assert row_slots(batch, ROWS).tolist() == MAPPINGS[0]


def test_reference_graph_safe_equals_eager_and_reads_nothing_on_the_host(monkeypatch):
    """The reference's graph-safe form is capturable: no host read inside it (``no_host_syncs``)."""
    with no_host_syncs(monkeypatch, armed=False) as syncs:
        syncs.arm_within(monkeypatch, lora, "lora_shrink_expand_ref")
        check_against_eager(lambda *args: lora.lora_shrink_expand_ref(*args), "cpu", dict(atol=1e-5, rtol=1e-5))
    assert syncs.armed_calls == len(MAPPINGS)


@pytest.mark.skipif(not bindings.is_available(), reason="the C library did not build")
def test_c_kernel_graph_safe_equals_eager():
    """What the CPU harness of the runner's graph path (test_lora_cuda_graphs.py) runs."""
    check_against_eager(lora_shrink_expand, "cpu", dict(atol=1e-5, rtol=1e-5))

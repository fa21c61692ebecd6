"""Cases for the batched LoRA op in ``LoRABatch``'s graph-safe mode (tests/lora/test_lora_graph_safe.py
and, for the Triton kernels, tests/layers/triton_ops/test_lora_triton.py): mappings replayed one
after another over one set of buffers, each checked against the eager op."""
from __future__ import annotations

import numpy as np
import torch

from pagedllm.layers.lora import LoRABatch, lora_shrink_expand_ref, slot_groups

SLOTS, RANK, N_IN, N_OUT, ROWS = 4, 12, 24, 40, 20
# one after another over the same buffers (a graph's replays): -1 is a base-model or padding row
MAPPINGS = [
    [2, -1, 0, 2, 3, -1, 0, 0, 1, 2, -1, 3, 1, 0, 2, -1, -1, -1, -1, -1],  # every slot, padding last
    [1] * 18 + [-1] * 2,  # one slot, more tokens than one 16-token block of the Triton grid
    [-1] * ROWS,  # base rows only: nothing added
    [3, -1, 3, -1, 0] + [-1] * 15,  # two slots; slots 1 and 2 now empty
]


def graph_batch(device: str = "cpu") -> LoRABatch:
    """A graph-safe batch over buffers that start as the capture's (every row a base row)."""
    batch = LoRABatch(SLOTS)
    batch.use_graph(torch.arange(ROWS, device=device), torch.arange(SLOTS, device=device),
                    torch.zeros(SLOTS + 1, dtype=torch.int64, device=device))
    return batch


def refill(batch: LoRABatch, mapping: list[int]) -> None:
    """What DecodeGraphs.prepare does before a replay: the new mapping into the same tensors."""
    perm, seg_start = slot_groups(np.array(mapping, dtype=np.int64), SLOTS)
    batch.perm.copy_(torch.from_numpy(perm))
    batch.seg_start.copy_(torch.from_numpy(seg_start))


def _eager(x, y, a, b, mapping: list[int]) -> torch.Tensor:
    batch = LoRABatch(SLOTS)
    batch.set(np.array(mapping, dtype=np.int64), torch.device("cpu"))
    return lora_shrink_expand_ref(x, y.clone(), a, b, batch) if batch.active else y.clone()


def check_against_eager(run, device: str, tol: dict) -> None:
    """``run(x, y, a, b, batch)`` (adds into ``y``) over each mapping in turn, on one set of
    buffers on ``device``, against the eager reference; base and padding rows stay untouched."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(ROWS, N_IN, generator=g), torch.randn(ROWS, N_OUT, generator=g)
    a, b = torch.randn(SLOTS, RANK, N_IN, generator=g) * 0.2, torch.randn(SLOTS, N_OUT, RANK, generator=g) * 0.2
    batch = graph_batch(device)
    buffers = (batch.perm.data_ptr(), batch.seg_start.data_ptr())
    dev = [t.to(device) for t in (x, y, a, b)]
    for mapping in MAPPINGS:
        refill(batch, mapping)
        got = run(dev[0], dev[1].clone(), dev[2], dev[3], batch).cpu()
        torch.testing.assert_close(got, _eager(x, y, a, b, mapping), **tol)
        base = torch.tensor(mapping) < 0
        assert torch.equal(got[base], y[base]), mapping
    assert (batch.perm.data_ptr(), batch.seg_start.data_ptr()) == buffers

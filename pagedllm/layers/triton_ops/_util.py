"""Launch-size helpers shared by the kernels."""
from __future__ import annotations

import triton


def row_block(dim: int) -> int:
    """A power-of-two block that holds one whole row of ``dim`` elements."""
    return triton.next_power_of_2(max(1, dim))


def num_warps_for(block: int) -> int:
    """Warps for a one-row-per-program kernel: enough lanes for the block, at most 16."""
    return max(1, min(16, block // 256))

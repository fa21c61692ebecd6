"""The runner's persistent block tables (worker/block_table.py)."""
from __future__ import annotations

import numpy as np
import pytest

from pagedllm.contracts.scheduler_output import ScheduledChunk
from pagedllm.worker.block_table import PersistentBlockTable


def _chunk(rid: str, start: int, ids: list[int]) -> ScheduledChunk:
    return ScheduledChunk(rid, [1], 0, start, ids, 1)


def test_rows_are_updated_in_place_reused_and_grown():
    bt = PersistentBlockTable(max_blocks_per_seq=2, num_rows=2)
    assert bt.apply(_chunk("a", 0, [7, 3])) == 0 and bt.apply(_chunk("b", 0, [5])) == 1
    assert bt.apply(_chunk("a", 2, [9])) == 0  # appended: grows to 3 columns
    assert bt.table.shape == (2, 3) and bt.table[0].tolist() == [7, 3, 9] and bt.lens.tolist() == [3, 1]
    assert bt.apply(_chunk("a", 1, [4, 9])) == 0  # copy-on-write replaced entry 1
    assert bt.apply(_chunk("c", 0, [6])) == 2  # no free row: doubled to 4 rows
    assert bt.table.shape[0] == 4
    np.testing.assert_array_equal(bt.gather(np.array([2, 0]), 3)[:, :1], [[6], [7]])
    assert bt.gather(np.array([0]), 3).tolist() == [[7, 4, 9]]
    bt.release(["a", "unknown"])
    assert bt.apply(_chunk("d", 0, [8])) == 0  # a's row is reused
    assert bt.lens[0] == 1 and "a" not in bt.rows


def test_an_update_that_would_leave_a_gap_is_a_bug():
    bt = PersistentBlockTable(max_blocks_per_seq=4)
    with pytest.raises(RuntimeError, match="unknown request"):
        bt.apply(_chunk("x", 1, [3]))
    bt.apply(_chunk("x", 0, [3]))
    with pytest.raises(RuntimeError, match="skips entries"):
        bt.apply(_chunk("x", 2, [4]))

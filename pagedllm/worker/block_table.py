"""The runner's persistent block tables: one row per running request, updated in place.

The scheduler sends each request's table as an update (``new_block_start``, ``new_block_ids``)
rather than the whole list, so a decode step touches only the rows that gained a block (one in
``block_size`` steps per request) and the step's ``[num_reqs, max_blocks]`` table is a single
numpy gather of the batch's rows.
"""
from __future__ import annotations

import numpy as np

from pagedllm.contracts.scheduler_output import ScheduledChunk


class PersistentBlockTable:
    """Rows of block ids keyed by request id; rows of released requests are reused.

    Grows (doubling) in rows and columns when needed, so no limit has to be known up front.
    """

    def __init__(self, max_blocks_per_seq: int, num_rows: int = 64):
        self.table = np.zeros((num_rows, max(1, max_blocks_per_seq)), dtype=np.int32)
        self.lens = np.zeros(num_rows, dtype=np.int64)  # valid entries per row
        self.rows: dict[str, int] = {}
        self._free_rows = list(range(num_rows - 1, -1, -1))

    def release(self, request_ids) -> None:
        for rid in request_ids:
            row = self.rows.pop(rid, None)
            if row is not None:
                self.lens[row] = 0
                self._free_rows.append(row)

    def apply(self, chunk: ScheduledChunk) -> int:
        """Applies the chunk's table update; returns the request's row."""
        row = self.rows.get(chunk.request_id)
        if row is None:
            if chunk.new_block_start != 0:
                raise RuntimeError(f"block-table update for unknown request {chunk.request_id!r} "
                                   f"starts at {chunk.new_block_start}, not 0")
            row = self.rows[chunk.request_id] = self._take_row()
        end = chunk.num_blocks
        if chunk.new_block_start > self.lens[row]:
            raise RuntimeError(f"block-table update for {chunk.request_id!r} skips entries "
                               f"{self.lens[row]}..{chunk.new_block_start}")
        if end > self.table.shape[1]:
            self._grow(cols=end)
        self.table[row, chunk.new_block_start:end] = chunk.new_block_ids
        self.lens[row] = end
        return row

    def gather(self, rows: np.ndarray, max_blocks: int) -> np.ndarray:
        """The batch's block tables ``[len(rows), max_blocks]`` (entries past a row's length are stale)."""
        return self.table[rows, :max_blocks]

    def reset(self) -> None:
        self.release(list(self.rows))

    def _take_row(self) -> int:
        if not self._free_rows:
            self._grow(rows=2 * self.table.shape[0])
        return self._free_rows.pop()

    def _grow(self, rows: int = 0, cols: int = 0) -> None:
        old_rows, old_cols = self.table.shape
        new_rows, new_cols = max(rows, old_rows), max(cols, old_cols)
        table = np.zeros((new_rows, new_cols), dtype=np.int32)
        table[:old_rows, :old_cols] = self.table
        self.table = table
        self.lens = np.concatenate([self.lens, np.zeros(new_rows - old_rows, dtype=np.int64)])
        self._free_rows = list(range(new_rows - 1, old_rows - 1, -1)) + self._free_rows

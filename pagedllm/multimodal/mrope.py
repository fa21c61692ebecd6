"""M-RoPE position ids (Qwen2-VL, Qwen2.5-VL): three components (temporal, height, width) per token.

A text token has the same position in all three; an image's placeholder run gets its grid's
coordinates offset by the position where the image starts, and the text after it continues from
that start + ``max(h, w)`` (transformers' ``get_rope_index``). So a prompt's positions fall
behind its token indices, and decode continues at ``index + delta`` where ``delta = max
position + 1 - prompt length`` (negative or 0) in all three components::

    prompt   t  t  [i  i  i  i]  t  t | o  o      (t text, i a 2x2-token image, o output)
    index    0  1   2  3  4  5   6  7 | 8  9
    t-row    0  1   2  2  2  2   4  5 | 6  7      delta = 5 + 1 - 8 = -2
    h-row    0  1   2  2  3  3   4  5 | 6  7
    w-row    0  1   2  3  2  3   4  5 | 6  7

The positions are a function of the token ids and the images' grids, which their content hashes
cover (size and processor options), so the prefix cache's block hashes already key on them.
The scheduler hands each chunk its ``[3, n]`` rows (``MRopePositions.rows``); the runner sends
``[num_tokens]`` positions when every row of the step agrees (text and decode: the plain rotary,
the C decoder and the CUDA graphs apply) and ``[3, num_tokens]`` otherwise.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pagedllm.multimodal.inputs import MultiModalItem


@dataclass(frozen=True)
class MRopePositions:
    """A prompt's three-component positions ``[3, prompt_len]`` and the decode offset ``delta``."""

    prompt: np.ndarray
    delta: int

    @classmethod
    def of(cls, prompt_len: int, items: Sequence[MultiModalItem]) -> MRopePositions | None:
        """None unless an item has an M-RoPE grid (LLaVA's images, text-only prompts: plain positions)."""
        if not any(item.grid is not None for item in items):
            return None
        rows = np.empty((3, prompt_len), dtype=np.int64)
        pos = cursor = 0  # next text position, next prompt index
        for item in items:
            rows[:, cursor:item.offset] = np.arange(pos, pos + item.offset - cursor)
            pos += item.offset - cursor
            rows[:, item.offset:item.end] = grid_positions(item.grid, item.time_interval) + pos
            pos += max(item.grid[1], item.grid[2])
            cursor = item.end
        rows[:, cursor:] = np.arange(pos, pos + prompt_len - cursor)
        return cls(rows, int(rows.max()) + 1 - prompt_len)

    def rows(self, start: int, end: int) -> np.ndarray:
        """Positions ``[3, end - start]`` of token indices ``[start, end)`` (past the prompt: index + delta)."""
        prompt_len = self.prompt.shape[1]
        head = self.prompt[:, start:min(end, prompt_len)]
        if end <= prompt_len:
            return head
        tail = np.arange(max(start, prompt_len), end, dtype=np.int64) + self.delta
        return np.concatenate([head, np.broadcast_to(tail, (3, len(tail)))], axis=1)


def grid_positions(grid: tuple[int, int, int], time_interval: float = 1.0) -> np.ndarray:
    """``[3, t * h * w]`` coordinates of a (merged) grid, row-major like the tower's output rows;
    the temporal coordinate is spaced by ``time_interval`` (Qwen2.5-VL videos: ``tokens_per_second *
    second_per_grid_ts``)."""
    t, h, w = grid
    # float32 like transformers' get_rope_index: the product is truncated, so its rounding matters
    times = (np.arange(t, dtype=np.float32) * np.float32(time_interval)).astype(np.int64)
    tt, hh, ww = np.meshgrid(times, np.arange(h), np.arange(w),
                             indexing="ij")
    return np.stack([tt, hh, ww]).reshape(3, -1)


def batch_positions(chunk_rows: Sequence[np.ndarray | None], query_lens: Sequence[int],
                    positions: np.ndarray) -> np.ndarray:
    """The step's rotary positions: ``positions`` ``[num_tokens]`` with each chunk's M-RoPE rows
    (None: a plain chunk) put in; ``[num_tokens]`` again when all three rows agree, else
    ``[3, num_tokens]``."""
    if all(rows is None for rows in chunk_rows):
        return positions
    out = np.broadcast_to(positions, (3, len(positions))).copy()  # [3, num_tokens]
    base = 0
    for rows, n in zip(chunk_rows, query_lens):
        if rows is not None:
            out[:, base:base + n] = rows
        base += n
    return out[0].copy() if (out == out[0]).all() else out

"""N-gram (prompt-lookup) proposals: find the sequence's last n tokens earlier in it and propose
what followed them there. No model, no state."""
from __future__ import annotations

import numpy as np


class NgramProposer:
    """Proposes up to ``k`` tokens for a sequence from its own history (prompt and output).

    The longest suffix of length ``max_n`` down to ``min_n`` that occurs earlier wins; of its
    earlier occurrences, the latest one followed by ``k`` tokens (the most recent context), else
    the latest, its continuation running on into the proposal itself (a loop of period
    ``num - i - n`` repeats)::

        tokens:  ... a b c x y z ... a b c | ?     suffix "a b c" (n = 3) matched at i
        propose:           x y z ...               tokens[i + n : i + n + k]
    """

    def __init__(self, min_n: int, max_n: int):
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to ``k`` draft tokens; empty when no suffix of ``min_n``.. tokens occurs earlier."""
        tokens = np.asarray(token_ids, dtype=np.int64)
        num = len(tokens)
        ends = np.flatnonzero(tokens[:num - 1] == tokens[-1])  # earlier occurrences of the last token
        lengths = _match_lengths(tokens, ends, min(self.max_n, num - 1))
        best = int(lengths.max()) if lengths.size else 0
        if best < self.min_n:
            return []
        starts = ends[lengths == best] + 1  # where the continuation of each longest match begins
        full = starts[starts + k <= num]
        return _continue(token_ids, int(full[-1] if full.size else starts[-1]), k)


def _match_lengths(tokens: np.ndarray, ends: np.ndarray, max_n: int) -> np.ndarray:
    """For each earlier occurrence ending at ``ends[i]``, how many of the sequence's last
    ``max_n`` tokens it matches (walking backwards from the last token)."""
    lengths = np.ones(len(ends), dtype=np.int64)
    alive = np.ones(len(ends), dtype=bool)
    for m in range(1, max_n):
        back = ends - m
        alive &= back >= 0
        alive[alive] = tokens[back[alive]] == tokens[-1 - m]
        lengths += alive
    return np.minimum(lengths, max_n)


def _continue(token_ids: list[int], start: int, k: int) -> list[int]:
    """``k`` tokens copied from ``start`` on; past the end the copy reads its own output."""
    seq = list(token_ids[start:start + k])
    while len(seq) < k:
        seq.append(seq[len(seq) - (len(token_ids) - start)])
    return seq

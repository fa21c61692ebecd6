"""N-gram (prompt-lookup) proposals: find the sequence's last n tokens earlier in it and propose
what followed them there. No model, no state."""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


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
        for n in range(min(self.max_n, num - 1), self.min_n - 1, -1):
            # windows starting at 0 .. num-1-n: every occurrence but the suffix itself
            windows = sliding_window_view(tokens[:num - 1], n)  # [num - n, n]
            hits = np.flatnonzero((windows == tokens[num - n:]).all(axis=1))
            if hits.size:
                full = hits[hits + n + k <= num]
                return _continue(token_ids, int((full[-1] if full.size else hits[-1]) + n), k)
        return []


def _continue(token_ids: list[int], start: int, k: int) -> list[int]:
    """``k`` tokens copied from ``start`` on; past the end the copy reads its own output."""
    seq = list(token_ids[start:start + k])
    while len(seq) < k:
        seq.append(seq[len(seq) - (len(token_ids) - start)])
    return seq

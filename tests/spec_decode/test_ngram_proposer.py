"""N-gram proposals: longest suffix first, the latest full-length match, loops continued."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm.spec_decode.ngram import NgramProposer


def test_proposes_what_followed_the_suffix():
    assert NgramProposer(2, 3).propose([1, 2, 3, 4, 5, 6, 1, 2, 3], 3) == [4, 5, 6]


def test_the_longest_suffix_wins_over_a_later_shorter_match():
    # "2 3" last occurs before 9, but "1 2 3" (n = 3) occurs only before 4
    tokens = [1, 2, 3, 4, 7, 2, 3, 9, 1, 2, 3]
    assert NgramProposer(2, 3).propose(tokens, 2) == [4, 7]
    assert NgramProposer(2, 2).propose(tokens, 2) == [9, 1]


def test_the_latest_match_with_k_tokens_after_it_wins():
    tokens = [5, 6, 1, 5, 6, 2, 2, 2, 5, 6]
    assert NgramProposer(2, 2).propose(tokens, 3) == [2, 2, 2]


def test_a_loop_continues_into_its_own_proposal():
    assert NgramProposer(2, 3).propose([9, 1, 2, 1, 2, 1, 2], 5) == [1, 2, 1, 2, 1]


def test_nothing_when_no_suffix_repeats():
    assert NgramProposer(2, 4).propose([5, 6, 7, 8], 3) == []
    assert NgramProposer(1, 1).propose([4], 3) == []
    assert NgramProposer(3, 3).propose([1, 2, 1, 2], 3) == []  # "1 2" repeats, but n >= 3 is asked


def _reference(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Brute force: longest n, then the latest occurrence with k tokens after it, else the latest."""
    num = len(tokens)
    for n in range(min(max_n, num - 1), min_n - 1, -1):
        starts = [i + n for i in range(num - n) if tokens[i:i + n] == tokens[num - n:]]
        if starts:
            full = [s for s in starts if s + k <= num]
            start = full[-1] if full else starts[-1]
            out = tokens[start:start + k]
            while len(out) < k:  # a loop: the copy continues into itself
                out.append(out[len(out) - (num - start)])
            return out
    return []


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=40), st.integers(1, 6), st.integers(1, 3), st.integers(0, 3))
def test_matches_a_brute_force_search(tokens, k, min_n, extra):
    assert NgramProposer(min_n, min_n + extra).propose(tokens, k) == _reference(tokens, k, min_n, min_n + extra)

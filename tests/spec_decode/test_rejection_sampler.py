"""The rejection sampler keeps the target's distribution: chi-squared goodness of fit on a small
vocabulary with fixed target (p) and draft (q) distributions, and a check that the same test
catches a wrong acceptance rule."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from pagedllm.spec_decode.rejection_sampler import draw, rejection_sample

VOCAB = 6
P = torch.tensor([[0.40, 0.25, 0.15, 0.10, 0.06, 0.04],   # predicts draft 0
                  [0.05, 0.10, 0.45, 0.05, 0.05, 0.30],   # predicts draft 1
                  [0.20, 0.20, 0.20, 0.20, 0.10, 0.10]])  # bonus position
Q = torch.tensor([[0.10, 0.50, 0.10, 0.10, 0.10, 0.10],
                  [0.30, 0.10, 0.10, 0.40, 0.05, 0.05]])
DRAWS = 20000


def _run(sampler, q: torch.Tensor | None, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Token counts at output positions 0, 1 and 2 (each position only where the run reached it)."""
    gen = torch.Generator().manual_seed(seed)
    counts = np.zeros((3, VOCAB))
    for _ in range(DRAWS):
        if q is None:  # a point-mass proposer (n-gram): fixed drafts
            drafts = [0, 2]
        else:
            drafts = [draw(q[j], gen) for j in range(2)]
        for pos, tok in enumerate(sampler(P, drafts, q, gen)):
            counts[pos, tok] += 1
    return counts[0], counts[1], counts[2]


def _p_value(counts: np.ndarray, probs: torch.Tensor) -> float:
    expected = probs.double().numpy() * counts.sum()
    return chisquare(counts, expected).pvalue


@pytest.mark.parametrize("q", [Q, None], ids=["draft-model", "point-mass"])
def test_each_output_position_follows_the_target(q):
    first, second, third = _run(rejection_sample, q)
    assert first.sum() == DRAWS and second.sum() > 1000 and third.sum() > 300
    for counts, probs in zip((first, second, third), P):
        assert _p_value(counts, probs) > 1e-3


def _accept_always(p, drafts, q, gen):
    """A wrong rule: every draft accepted (outputs follow q)."""
    return drafts + [draw(p[len(drafts)], gen)]


def _accept_by_ratio_without_residual(p, drafts, q, gen):
    """A wrong rule: the right acceptance test, but the replacement drawn from p instead of the residual."""
    for j, d in enumerate(drafts):
        if torch.rand(1, generator=gen).item() >= min(1.0, (p[j, d] / q[j, d]).item()):
            return drafts[:j] + [draw(p[j], gen)]
    return drafts + [draw(p[len(drafts)], gen)]


@pytest.mark.parametrize("wrong", [_accept_always, _accept_by_ratio_without_residual])
def test_the_chi_squared_check_catches_a_wrong_rule(wrong):
    first, _, _ = _run(wrong, Q)
    assert _p_value(first, P[0]) < 1e-6


def test_greedy_point_masses_accept_exactly_the_argmax():
    p = torch.nn.functional.one_hot(torch.tensor([2, 4, 1]), VOCAB).float()
    assert rejection_sample(p, [2, 4], None, None) == [2, 4, 1]
    assert rejection_sample(p, [2, 5], None, None) == [2, 4]
    assert rejection_sample(p, [0, 4], p[:2], None) == [2]


def test_a_draft_the_target_cannot_produce_is_rejected():
    p = torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.5, 0.0]])
    q = torch.tensor([[1.0, 0.0, 0.0]])
    gen = torch.Generator().manual_seed(1)
    assert all(rejection_sample(p, [0], q, gen) == [1] for _ in range(50))

"""The standard speculative-sampling rule (Leviathan et al. 2023, Chen et al. 2023): the tokens it
returns are distributed exactly as if drawn one by one from the target's distributions ``p``.

For draft token ``d_j`` drawn from ``q_j``: accept with probability ``min(1, p_j(d_j) / q_j(d_j))``;
at the first rejection draw the replacement from ``norm(max(0, p_j - q_j))`` and stop; when all
``s`` drafts are accepted draw a bonus token from ``p_s``. A proposer without a distribution (the
n-gram lookup) is a point mass ``q_j = one-hot(d_j)``: accept with probability ``p_j(d_j)``, on
rejection draw from ``p_j`` with ``d_j`` removed. Greedy rows (``p`` one-hot at the argmax) reduce
to "accept while the draft equals the target's argmax". A position whose target row allows no token
(all-zero ``p``: the sampler's empty row) rejects its draft and yields ``NO_TOKEN``.
"""
from __future__ import annotations

import torch

from pagedllm.layers.sampler import NO_TOKEN


def rejection_sample(p: torch.Tensor, drafts: list[int], q: torch.Tensor | None,
                     generator: torch.Generator | None) -> list[int]:
    """The accepted drafts followed by one target token (replacement or bonus).

    ``p``: ``[s + 1, vocab]`` target probabilities at the positions that predict each draft and
    the token after them; ``q``: ``[s, vocab]`` the draft's probabilities (None: point masses).
    Random numbers come from ``generator`` (a seeded request's own) or torch's global one.
    """
    s = len(drafts)
    p = p.float()
    d = torch.tensor(drafts, dtype=torch.long, device=p.device)
    p_d = p[:s].gather(1, d[:, None]).squeeze(1)  # [s] target probability of each draft
    q_d = torch.ones_like(p_d) if q is None else q.float().gather(1, d[:, None]).squeeze(1)
    u = torch.rand(s, generator=generator).to(p.device)
    # p_d > 0 also guards q_d = 0 (a draft its own distribution could not produce)
    accepted = (p_d > 0) & (u * q_d < p_d)  # u < p/q without dividing
    rejected = (~accepted).nonzero()
    num_accepted = int(rejected[0]) if rejected.numel() else s
    if num_accepted == s:
        return drafts + [draw(p[s], generator)]
    return drafts[:num_accepted] + [draw(_residual(p, q, d, num_accepted), generator)]


def _residual(p: torch.Tensor, q: torch.Tensor | None, d: torch.Tensor, j: int) -> torch.Tensor:
    """``norm(max(0, p_j - q_j))`` (unnormalised: ``draw`` does not need it)."""
    if q is None:
        residual = p[j].clone()
        residual[d[j]] = 0.0
    else:
        residual = (p[j] - q[j].float()).clamp_min(0.0)
    # all zero only when p_j <= q_j everywhere, i.e. p_j == q_j up to rounding: then p_j itself
    return residual if bool(residual.sum() > 0) else p[j]


def draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """One index drawn with probability proportional to ``weights`` (``[vocab]``, >= 0), by the
    exponential race ``argmax(w / e), e ~ Exp(1)`` the sampler uses; ``NO_TOKEN`` when every
    weight is 0 (a row that allows no token)."""
    noise = torch.empty(weights.shape[0]).exponential_(generator=generator).to(weights.device)
    return _positive_index((weights / noise).argmax(), weights)


def best(weights: torch.Tensor) -> int:
    """The index of the largest of ``weights`` (``[vocab]``, >= 0); ``NO_TOKEN`` when all are 0."""
    return _positive_index(weights.argmax(), weights)


def _positive_index(index: torch.Tensor, weights: torch.Tensor) -> int:
    return int(torch.where(weights[index] > 0, index, NO_TOKEN))  # one device->host read, as before

"""DeepSeek's grouped top-k routing: experts sit in ``n_group`` groups, a token first keeps its
``topk_group`` best groups, then its ``top_k`` best experts among those.

    V2 (softmax scoring):  score = softmax(logits); a group's score is its best expert's
    V3 (sigmoid scoring):  score = sigmoid(logits); choice = score + e_score_correction_bias;
                           a group's score is the sum of its two best choices; the chosen
                           experts' weights are the unbiased scores

then optionally renormalised over the k (``norm_topk_prob``) and multiplied by
``routed_scaling_factor``. The result feeds ``FusedMoE.forward_routed``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

SCORING = ("softmax", "sigmoid")


@dataclass(frozen=True)
class GroupedTopK:
    top_k: int
    num_groups: int  # n_group (1: plain top-k)
    topk_groups: int  # topk_group
    scoring: str  # one of SCORING
    renormalize: bool  # norm_topk_prob
    scaling: float  # routed_scaling_factor

    def check(self, num_experts: int) -> None:
        if self.scoring not in SCORING:
            raise ValueError(f"scoring_func={self.scoring!r} must be one of {SCORING}")
        if self.num_groups < 1 or num_experts % self.num_groups:
            raise ValueError(f"n_group={self.num_groups} must be >= 1 and divide n_routed_experts={num_experts}")
        if not 1 <= self.topk_groups <= self.num_groups:
            raise ValueError(f"topk_group={self.topk_groups} must be in [1, n_group={self.num_groups}]")
        if self.top_k > self.topk_groups * (num_experts // self.num_groups):
            raise ValueError(f"num_experts_per_tok={self.top_k} exceeds the experts of topk_group={self.topk_groups} "
                             "groups")

    def __call__(self, router_logits: torch.Tensor, bias: torch.Tensor | None = None):
        """(weights [tokens, k] float32, expert ids [tokens, k])."""
        logits = router_logits.float()  # [tokens, experts]
        scores = torch.sigmoid(logits) if self.scoring == "sigmoid" else torch.softmax(logits, dim=-1)
        choice = scores if bias is None else scores + bias.float()
        masked = self._mask_groups(choice)
        ids = torch.topk(masked, self.top_k, dim=-1)[1]  # [tokens, k]
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids

    def _mask_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """``choice`` with every expert outside the token's ``topk_groups`` best groups at -inf."""
        if self.num_groups == 1:
            return choice
        grouped = choice.view(choice.shape[0], self.num_groups, -1)  # [tokens, groups, experts per group]
        # [tokens, groups]; V3 (sigmoid): the sum of each group's two best choices; V2 (softmax): its best
        group_scores = grouped.topk(2, dim=-1)[0].sum(-1) if self.scoring == "sigmoid" else grouped.amax(-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, torch.topk(group_scores, self.topk_groups, dim=-1)[1], True)
        return grouped.masked_fill(~keep[..., None], float("-inf")).view_as(choice)

"""Speculative-decoding counters, exported with vLLM's metric names under ``pagedllm:``."""
from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.metrics.stats import Metric


@dataclass
class SpecDecodeStats:
    """Counts over every verified run: one draft = one request's proposal checked in one step."""

    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [k]: drafts accepted at position j

    def __post_init__(self):
        self.accepted_per_pos = [0] * self.num_speculative_tokens

    def record(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            self.accepted_per_pos[j] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def metrics(self) -> list[Metric]:
        out = [Metric("pagedllm:spec_decode_num_drafts", self.num_drafts, kind="counter"),
               Metric("pagedllm:spec_decode_num_draft_tokens", self.num_draft_tokens, kind="counter"),
               Metric("pagedllm:spec_decode_num_accepted_tokens", self.num_accepted_tokens, kind="counter")]
        out += [Metric("pagedllm:spec_decode_num_accepted_tokens_per_pos", n, {"position": str(j)}, "counter")
                for j, n in enumerate(self.accepted_per_pos)]
        return out

"""What comes back to the scheduler for one scheduled request: the answer to a ``ScheduledChunk``."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SampledTokens:
    """What the sampler produced for one scheduled request (several tokens on a fork)."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float]  # logprob of each sampled token
    top_logprobs: list[dict[int, float]] | None = None
    # token_ids follow one another in this one sequence (a verified speculative run), not one per fork
    consecutive: bool = False

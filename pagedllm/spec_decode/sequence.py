"""What speculative decoding reads of an engine request, as a protocol.

The engine's ``Request`` (engine/request.py) has these attributes; spec_decode sits below the
engine and names only what it reads, so it never imports the engine (docs/design.md, layer rules).
"""
from __future__ import annotations

from typing import Protocol

import torch

from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output import GrammarState


class DraftedSequence(Protocol):
    request_id: str
    all_token_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int
    params: SamplingParams
    generator: torch.Generator | None
    grammar: GrammarState | None  # structured_outputs: the sequence's matcher
    spec_token_ids: list[int]  # the drafts to verify in the next step

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_output_tokens(self) -> int: ...

"""Per-request options of a pooling (embedding) request, as vLLM's ``PoolingParams``."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PoolingParams:
    """``normalize``: None takes the engine's ``pooler_config.normalize``; ``truncate_prompt_tokens``
    keeps the prompt's last k tokens (-1: as many as max_model_len allows). ``dimensions``
    (matryoshka truncation) is refused: the supported models are not trained for it."""

    normalize: bool | None = None
    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self):
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize={self.normalize!r} is invalid: must be true, false or null")
        if self.dimensions is not None:
            raise ValueError(f"dimensions={self.dimensions!r} is not supported: the embedding keeps the model's "
                             "hidden size (no matryoshka truncation)")
        if self.truncate_prompt_tokens is not None and (
                isinstance(self.truncate_prompt_tokens, bool) or not isinstance(self.truncate_prompt_tokens, int)
                or (self.truncate_prompt_tokens < 1 and self.truncate_prompt_tokens != -1)):
            raise ValueError(f"truncate_prompt_tokens={self.truncate_prompt_tokens!r} is invalid: an integer >= 1 "
                             "or -1")

"""Per-request options of a pooling request (embedding, classification, scoring), as vLLM's ``PoolingParams``."""
from __future__ import annotations

from dataclasses import dataclass

# vLLM's per-token tasks: one row per prompt token (token_embed: hidden states; token_classify:
# a classifier's head at every position, as LLM.reward returns)
TOKEN_POOLING_TASKS = ("token_embed", "token_classify")
# what a pooling request computes (vLLM's names): "embed" a vector per prompt (embedding models),
# "classify" class probabilities and "score" a cross-encoder's relevance (*ForSequenceClassification)
POOLING_TASKS = ("embed", "classify", "score", *TOKEN_POOLING_TASKS)


@dataclass
class PoolingParams:
    """``task``: one of POOLING_TASKS; None takes the model's own (``classify`` for a sequence
    classifier, else ``embed``). ``normalize`` (embed): None takes the engine's
    ``pooler_config.normalize``. ``use_activation``: classify / score apply the head's activation
    (softmax over the labels, sigmoid for one label; vLLM's rule) unless False; for embed it means
    ``normalize``. ``truncate_prompt_tokens`` keeps the prompt's last k tokens (-1: as many as
    max_model_len allows). ``dimensions`` (matryoshka truncation) is refused: the supported models
    are not trained for it."""

    normalize: bool | None = None
    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None
    task: str | None = None
    use_activation: bool | None = None

    def __post_init__(self):
        for name in ("normalize", "use_activation"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name}={value!r} is invalid: must be true, false or null")
        if self.dimensions is not None:
            raise ValueError(f"dimensions={self.dimensions!r} is not supported: the embedding keeps the model's "
                             "hidden size (no matryoshka truncation)")
        if self.truncate_prompt_tokens is not None and (
                isinstance(self.truncate_prompt_tokens, bool) or not isinstance(self.truncate_prompt_tokens, int)
                or (self.truncate_prompt_tokens < 1 and self.truncate_prompt_tokens != -1)):
            raise ValueError(f"truncate_prompt_tokens={self.truncate_prompt_tokens!r} is invalid: an integer >= 1 "
                             "or -1")
        check_task(self.task, "task")
        if self.task not in (None, "embed", "token_embed") and self.normalize is not None:
            raise ValueError(f"normalize={self.normalize!r} applies to tasks 'embed' and 'token_embed' only; task "
                             f"{self.task!r} takes use_activation")
        if self.normalize is not None and self.use_activation is not None and self.normalize != self.use_activation:
            raise ValueError(f"normalize={self.normalize!r} and use_activation={self.use_activation!r} disagree "
                             "(for embed, use_activation means normalize); set one")


def check_task(task: str | None, name: str = "pooling_task") -> None:
    """A pooling task name (the argument ``name``): one of POOLING_TASKS or None."""
    if task is not None and task not in POOLING_TASKS:
        raise ValueError(f"{name}={task!r} is invalid: one of {POOLING_TASKS}")

"""``*ForSequenceClassification`` checkpoints (classifiers, cross-encoder rerankers): the family's
decoder with a ``score`` head (Linear hidden -> num_labels, no bias, as transformers') in place of
the LM head. They run under ``runner="pooling"``: the engine pools the prompt's last token (what
transformers does for a prompt without padding) and ``compute_logits`` gives that row's class
logits, which become the request's result (engine/pooling.py applies the activation)."""
from __future__ import annotations

import torch

from pagedllm.layers.linear import ReplicatedLinear
from pagedllm.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM


class SequenceClassificationHead:
    """Mixin over a ``*ForCausalLM`` family: swaps its LM head for the ``score`` head.

    The head is replicated on every tensor-parallel rank (num_labels rows are tiny) and reads the
    final-normed hidden state, which every rank holds whole."""

    def __init__(self, cfg, *args, **kwargs):
        super().__init__(cfg, *args, **kwargs)
        num_labels = getattr(cfg, "num_labels", None)
        if not isinstance(num_labels, int) or num_labels < 1:
            raise ValueError(f"num_labels={num_labels!r} in config.json must be an integer >= 1")
        if self.stage.is_last:
            del self.lm_head  # a classifier checkpoint has no LM head; the head below replaces it
            self.score = ReplicatedLinear(cfg.hidden_size, num_labels, bias=False)

    @property
    def tied_embeddings(self) -> bool:
        return False  # the embedding is never shared with the score head

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.score(hidden)  # [num_rows, num_labels]


class LlamaForSequenceClassification(SequenceClassificationHead, LlamaForCausalLM):
    pass


class MistralForSequenceClassification(SequenceClassificationHead, MistralForCausalLM):
    pass


class Qwen2ForSequenceClassification(SequenceClassificationHead, Qwen2ForCausalLM):
    pass


class Qwen3ForSequenceClassification(SequenceClassificationHead, Qwen3ForCausalLM):
    pass


SEQUENCE_CLASSIFIERS = {cls.__name__: cls for cls in (LlamaForSequenceClassification, MistralForSequenceClassification,
                                                      Qwen2ForSequenceClassification, Qwen3ForSequenceClassification)}

"""engine/pooling.py: the activation vLLM applies to a classifier's logits, per task and config."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pagedllm.engine.pooling import activation

LOGITS = torch.tensor([0.5, -1.0, 2.0])


@pytest.mark.parametrize("config, task, want", [
    (SimpleNamespace(), "classify", torch.softmax(LOGITS, -1)),
    (SimpleNamespace(problem_type="single_label_classification"), "classify", torch.softmax(LOGITS, -1)),
    (SimpleNamespace(problem_type="multi_label_classification"), "classify", torch.sigmoid(LOGITS)),
    (SimpleNamespace(problem_type="regression"), "classify", LOGITS),
    (SimpleNamespace(), "score", torch.softmax(LOGITS, -1)),
    (SimpleNamespace(sbert_ce_default_activation_function="torch.nn.modules.linear.Identity"), "score", LOGITS),
    (SimpleNamespace(sentence_transformers={"activation_fn": "torch.nn.modules.activation.Tanh"}), "score",
     torch.tanh(LOGITS)),
    (SimpleNamespace(sentence_transformers={"activation_fn": "torch.nn.modules.activation.Sigmoid"}), "score",
     torch.softmax(LOGITS, -1)),  # vLLM's rule: Sigmoid / Softmax mean the classify activation
    (SimpleNamespace(sbert_ce_default_activation_function="torch.nn.modules.linear.Identity"), "classify",
     torch.softmax(LOGITS, -1)),  # the cross-encoder's activation is for score only
])
def test_activation_per_task_and_config(config, task, want):
    torch.testing.assert_close(activation(config, task)(LOGITS), want)


def test_one_label_is_a_sigmoid_and_foreign_activations_are_refused():
    torch.testing.assert_close(activation(SimpleNamespace(), "classify")(LOGITS[:1]), torch.sigmoid(LOGITS[:1]))
    with pytest.raises(ValueError, match="not a torch.nn.modules class"):
        activation(SimpleNamespace(sbert_ce_default_activation_function="os.system"), "score")

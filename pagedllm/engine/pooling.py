"""What a pooling request's pooled row becomes, per task (vLLM's pooler heads and activations).

An embedding model's row is the final-normed hidden state (LAST / MEAN / CLS, llm_engine._pool),
L2-normalized for ``embed``. A sequence classifier's row is its score head's logits at the last
token; ``classify`` and ``score`` pass them through the activation vLLM picks from the config:

    classify: problem_type "regression" -> identity, "multi_label_classification" -> sigmoid,
              otherwise sigmoid for one label and softmax over several
    score:    the cross-encoder's sentence-transformers activation (``activation_fn`` or
              ``sbert_ce_default_activation_function``, a torch.nn module), otherwise as classify

``use_activation=False`` returns the raw logits. The per-token tasks take every prompt
position's row the same way: ``token_embed`` normalizes each hidden state, ``token_classify``
applies the classify activation to each position's logits (what ``LLM.reward`` returns).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from pagedllm.config import ModelConfig, PoolerConfig
from pagedllm.pooling_params import TOKEN_POOLING_TASKS, PoolingParams

Activation = Callable[[torch.Tensor], torch.Tensor]


def check_pooler(model: ModelConfig, pooler: PoolerConfig | None) -> None:
    """A classifier's logits come from its last token's row alone: only LAST pooling applies."""
    if pooler is not None and model.is_classifier and pooler.pooling_type != "LAST":
        raise ValueError(f"pooler_config.pooling_type={pooler.pooling_type!r} cannot be used with "
                         f"{model.architecture}: a sequence classifier pools the last token (LAST)")


def per_token(params: PoolingParams | None) -> bool:
    """A per-token task: one result row per prompt token (TOKEN_POOLING_TASKS)."""
    return params is not None and params.task in TOKEN_POOLING_TASKS


def default_task(model: ModelConfig) -> str:
    return "classify" if model.is_classifier else "embed"


def resolve_task(params: PoolingParams, model: ModelConfig) -> PoolingParams:
    """``params`` with its task filled in (None: the model's own) and checked against the model."""
    task = params.task or default_task(model)
    if model.is_classifier and task in ("embed", "token_embed"):
        raise ValueError(f"task {task!r} needs an embedding model; {model.architecture} is a sequence classifier "
                         "(use classify, score or token_classify)")
    if not model.is_classifier and task not in ("embed", "token_embed"):
        raise ValueError(f"task {task!r} needs a *ForSequenceClassification model (a score head); "
                         f"{model.architecture} gives embeddings (use embed or token_embed; LLM.score compares "
                         "embeddings)")
    if task == "score" and model.num_labels != 1:
        raise ValueError(f"task 'score' needs a cross-encoder (num_labels == 1); this classifier has "
                         f"num_labels={model.num_labels} (use classify)")
    return params if task == params.task else dataclasses.replace(params, task=task)


def finish(row: torch.Tensor, params: PoolingParams, model: ModelConfig, pooler: PoolerConfig) -> torch.Tensor:
    """The request's result from its pooled row ``[hidden]`` (embed) or ``[num_labels]`` logits,
    or for a per-token task its rows ``[prompt tokens, hidden or num_labels]``, each taken alike."""
    row = row.float()
    if params.task in ("embed", "token_embed"):
        normalize = next(v for v in (params.normalize, params.use_activation, pooler.normalize) if v is not None)
        return torch.nn.functional.normalize(row, dim=-1) if normalize else row
    if params.use_activation is False:
        return row
    return activation(model.hf_config, "classify" if params.task == "token_classify" else params.task)(row)


def activation(hf_config, task: str) -> Activation:
    """The activation vLLM applies to a classifier's logits for ``task`` ("classify" or "score")."""
    if task == "score":
        fn = _cross_encoder_activation(hf_config)
        if fn is not None:
            return fn
    problem = getattr(hf_config, "problem_type", None)
    if problem == "regression":
        return _identity
    if problem == "multi_label_classification":
        return torch.sigmoid
    return _classify


def _classify(logits: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(logits) if logits.shape[-1] < 2 else torch.softmax(logits, dim=-1)


def _identity(logits: torch.Tensor) -> torch.Tensor:
    return logits


def _cross_encoder_activation(hf_config) -> Activation | None:
    """sentence-transformers' CrossEncoder activation named in config.json (a ``torch.nn.modules``
    class; any other name is refused, as vLLM refuses it); None when the config names none."""
    st = getattr(hf_config, "sentence_transformers", None)
    name = st.get("activation_fn") if isinstance(st, dict) else None
    name = name or getattr(hf_config, "sbert_ce_default_activation_function", None)
    if name is None:
        return None
    cls = getattr(torch.nn, name.rsplit(".", 1)[-1], None) if name.startswith("torch.nn.modules.") else None
    if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
        raise ValueError(f"the cross-encoder activation {name!r} in config.json is not a torch.nn.modules class")
    if cls is torch.nn.Identity:
        return _identity
    if cls in (torch.nn.Sigmoid, torch.nn.Softmax):  # vLLM's rule: the classify activation
        return _classify
    return cls()

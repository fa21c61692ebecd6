"""Sentence-pair scoring shared by ``LLM.score`` and the server's /score and /rerank (vLLM's rules).

Pairs: one text against N (1-to-N), or N against N pairwise; any other shape is refused. A
cross-encoder (a sequence classifier with one label) reads each pair as the tokenizer's text pair
(``tokenizer(text, text_pair)``: its own separators and special tokens) and scores it with its
head; an embedding model embeds both sides and scores the pair by cosine similarity.
"""
from __future__ import annotations

import torch


def as_texts(data: object, name: str) -> list[str]:
    """One side of the pairs: a string or a non-empty list of strings (ValueError naming ``name``)."""
    texts = [data] if isinstance(data, str) else data
    if not isinstance(texts, (list, tuple)) or not all(isinstance(t, str) for t in texts):
        raise ValueError(f"{name} must be a string or a list of strings, got {type(data).__name__}")
    if not texts:
        raise ValueError(f"{name} must not be empty: give at least one text")
    return list(texts)


def check_pair_counts(n_1: int, n_2: int, names: tuple[str, str] = ("data_1", "data_2")) -> None:
    """1-to-N or N-to-N: ``n_1`` is 1 or equals ``n_2``."""
    if n_1 != 1 and n_1 != n_2:
        raise ValueError(f"{names[0]} has {n_1} texts and {names[1]} {n_2}: give one {names[0]} text (scored "
                         f"against every {names[1]} text) or as many as {names[1]} (scored pairwise)")


def broadcast(firsts: list, n: int) -> list:
    """The first side, one item per pair: a single item repeated ``n`` times (1-to-N), else as given."""
    return firsts * n if len(firsts) == 1 else firsts


def pair_up(data_1: object, data_2: object, names: tuple[str, str] = ("data_1", "data_2")) -> list[tuple[str, str]]:
    """The (text_1, text_2) pairs to score, in ``data_2``'s order."""
    texts_1, texts_2 = as_texts(data_1, names[0]), as_texts(data_2, names[1])
    check_pair_counts(len(texts_1), len(texts_2), names)
    return list(zip(broadcast(texts_1, len(texts_2)), texts_2))


def cross_encoder_ids(tokenizer, text_1: str, text_2: str) -> list[int]:
    """The pair as one prompt, as a cross-encoder was trained on it (``tokenizer(text, text_pair)``)."""
    return list(tokenizer(text=text_1, text_pair=text_2)["input_ids"])


def cosine(a: torch.Tensor | list[float], b: torch.Tensor | list[float]) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32)
    return torch.nn.functional.cosine_similarity(a, b, dim=0).item()


def embedding_scores(embeds_1: list, embeds_2: list) -> list[float]:
    """Cosine similarity of each pair: ``embeds_1`` has one vector (against all) or one per ``embeds_2``'s."""
    return [cosine(a, b) for a, b in zip(broadcast(embeds_1, len(embeds_2)), embeds_2)]

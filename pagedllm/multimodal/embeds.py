"""Precomputed image embeddings (vLLM's ``image_embeds`` inputs): the prompt gives each image's
rows ``[rows, hidden]`` (what the vision tower + projector would make) instead of pixels, so the
tower is skipped; each image's placeholder token is expanded to its rows here, where the model's
processor would have expanded it from the image's size.

    multi_modal_data={"image": {"image_embeds": tensor [images, rows, hidden] | [rows, hidden] | list of
                                [rows, hidden], "image_grid_thw": tensor [images, 3]}}  # the grid: M-RoPE models
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from pagedllm.multimodal.inputs import tensors_hash

EMBED_KEYS = ("image_embeds", "image_grid_thw")


def parse_image_embeds(value: Mapping, hidden_size: int | None, needs_grid: bool) -> list[dict[str, torch.Tensor]]:
    """``multi_modal_data["image"]`` in the embeddings form -> one dict per image
    (``image_embeds`` ``[rows, hidden]``, with its ``image_grid_thw`` ``[1, 3]`` where given)."""
    unknown = sorted(set(value) - set(EMBED_KEYS), key=str)
    if unknown or "image_embeds" not in value:
        raise ValueError(f"multi_modal_data['image'] as a dict takes the keys {EMBED_KEYS} (image_embeds required); "
                         f"got {sorted(value, key=str)}")
    rows = _embeds_list(value["image_embeds"], hidden_size)
    grids = value.get("image_grid_thw")
    if grids is not None and not needs_grid:
        raise ValueError("image_grid_thw is for M-RoPE models (Qwen2-VL, Qwen2.5-VL); this model takes image_embeds "
                         "alone")
    if needs_grid and grids is None:
        raise ValueError("image_embeds for this model need image_grid_thw (one [t, h, w] row per image, as its "
                         "processor returned it): its M-RoPE positions come from the grid")
    if grids is None:
        return [{"image_embeds": r} for r in rows]
    grids = torch.as_tensor(grids, dtype=torch.int64).reshape(-1, 3) if _is_grid(grids) else None
    if grids is None or grids.shape[0] != len(rows):
        raise ValueError(f"image_grid_thw must be one [t, h, w] row of positive integers per image ({len(rows)} "
                         "images)")
    return [{"image_embeds": r, "image_grid_thw": grids[i:i + 1]} for i, r in enumerate(rows)]


def _embeds_list(value: object, hidden_size: int | None) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor) and value.ndim == 3:
        value = list(value)
    elif isinstance(value, torch.Tensor):
        value = [value]
    if not isinstance(value, Sequence) or not value:
        raise ValueError("image_embeds must be a tensor [images, rows, hidden] or [rows, hidden], or a non-empty "
                         "list of [rows, hidden] tensors")
    for i, rows in enumerate(value):
        if not isinstance(rows, torch.Tensor) or rows.ndim != 2 or not rows.is_floating_point() or not len(rows):
            raise ValueError(f"image_embeds[{i}] must be a floating-point tensor [rows, hidden] with rows > 0")
        if hidden_size is not None and rows.shape[1] != hidden_size:
            raise ValueError(f"image_embeds[{i}] has {rows.shape[1]} columns: this model's embeddings have "
                             f"hidden_size={hidden_size}")
    return [rows.detach().cpu().contiguous() for rows in value]


def _is_grid(grids: object) -> bool:
    try:
        tensor = torch.as_tensor(grids)
    except (TypeError, ValueError, RuntimeError):
        return False
    return not tensor.is_floating_point() and tensor.numel() % 3 == 0 and bool((tensor > 0).all())


def embeds_hash(data: Mapping[str, torch.Tensor]) -> bytes:
    """SHA-256 of the rows (and the grid): the same embeddings share encoder-cache and KV blocks."""
    return tensors_hash(b"image_embeds", {key: data[key] for key in EMBED_KEYS if key in data})


def expand_placeholders(ids: list[int], token_id: int, lengths: list[int]) -> list[int]:
    """Each of the prompt's image placeholder tokens repeated to its image's rows (in order)."""
    count = ids.count(token_id)
    if count != len(lengths):
        raise ValueError(f"the prompt has {count} image placeholders and {len(lengths)} image_embeds: put one "
                         "placeholder per image")
    out, images = [], iter(lengths)
    for token in ids:
        out.extend([token] * next(images) if token == token_id else [token])
    return out


def chat_embeds(parts: list) -> dict:
    """``LLM.chat``'s ``image_embeds`` parts (each a tensor ``[rows, hidden]``, or a dict with
    ``image_embeds`` and ``image_grid_thw``), in order, as one ``multi_modal_data["image"]``."""
    dicts = [part if isinstance(part, Mapping) else {"image_embeds": part} for part in parts]
    with_grid = sum("image_grid_thw" in d for d in dicts)
    if with_grid not in (0, len(dicts)):
        raise ValueError("image_embeds parts must all give image_grid_thw or none")
    merged = {"image_embeds": [_one_image(d.get("image_embeds")) for d in dicts]}
    if with_grid:
        merged["image_grid_thw"] = [torch.as_tensor(d["image_grid_thw"]).reshape(-1).tolist() for d in dicts]
    return merged


def _one_image(rows: object) -> object:
    """A part's ``[1, rows, hidden]`` as ``[rows, hidden]`` (anything else is checked by parse_image_embeds)."""
    return rows[0] if isinstance(rows, torch.Tensor) and rows.ndim == 3 and rows.shape[0] == 1 else rows

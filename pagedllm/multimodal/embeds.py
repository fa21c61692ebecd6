"""Precomputed image and video embeddings (vLLM's ``image_embeds`` / ``video_embeds`` inputs): the
prompt gives each item's rows ``[rows, hidden]`` (what the vision tower + projector would make)
instead of pixels or frames, so the tower is skipped; each item's placeholder token is expanded to
its rows here, where the model's processor would have expanded it from the item's size.

    multi_modal_data={"image": {"image_embeds": tensor [images, rows, hidden] | [rows, hidden] | list of
                                [rows, hidden], "image_grid_thw": tensor [images, 3]}}  # the grid: M-RoPE models
    multi_modal_data={"video": {"video_embeds": ..., "video_grid_thw": tensor [videos, 3],  # Qwen2-VL family
                                "second_per_grid_ts": [videos]}}  # optional, Qwen2.5-VL (default 1, as transformers)

With a grid, a ``[rows, hidden]`` tensor may hold every item's rows one after another (vLLM's
flat form): it is cut by each grid row's size.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from pagedllm.multimodal.inputs import tensors_hash

VIDEO_SECONDS = "second_per_grid_ts"  # a video's seconds per temporal patch (Qwen2.5-VL's M-RoPE spacing)


def embed_keys(modality: str) -> tuple[str, str]:
    """The embeddings' and the grid's key for ``modality`` ("image": image_embeds, image_grid_thw)."""
    return f"{modality}_embeds", f"{modality}_grid_thw"


def parse_embeds(modality: str, value: Mapping, hidden_size: int | None, needs_grid: bool,
                 rows_of: Callable[[dict[str, torch.Tensor]], int], extra: tuple[str, ...] = ()
                 ) -> list[dict[str, torch.Tensor]]:
    """``multi_modal_data[modality]`` in the embeddings form -> one dict per item (``{modality}_embeds``
    ``[rows, hidden]``, with its ``{modality}_grid_thw`` ``[1, 3]`` where given). ``rows_of``: the
    model's rows for one item's grid; ``extra``: further keys the caller reads from ``value``."""
    embeds_key, grid_key = embed_keys(modality)
    keys = (embeds_key, grid_key, *extra)
    unknown = sorted(set(value) - set(keys), key=str)
    if unknown or embeds_key not in value:
        raise ValueError(f"multi_modal_data[{modality!r}] as a dict takes the keys {keys} ({embeds_key} required); "
                         f"got {sorted(value, key=str)}")
    grids = value.get(grid_key)
    if grids is not None and not needs_grid:
        raise ValueError(f"{grid_key} is for M-RoPE models (Qwen2-VL, Qwen2.5-VL); this model takes {embeds_key} "
                         "alone")
    if needs_grid and grids is None:
        raise ValueError(f"{embeds_key} for this model need {grid_key} (one [t, h, w] row per {modality}, as its "
                         f"processor returned it): its M-RoPE positions come from the grid")
    if grids is None:
        return [{embeds_key: r} for r in _embeds_list(value[embeds_key], embeds_key, hidden_size)]
    grids = torch.as_tensor(grids, dtype=torch.int64).reshape(-1, 3) if _is_grid(grids) else None
    if grids is None:
        raise ValueError(f"{grid_key} must be one [t, h, w] row of positive integers per {modality}")
    items = [{grid_key: grids[i:i + 1]} for i in range(grids.shape[0])]
    rows = _embeds_list(_split_flat(value[embeds_key], [rows_of(d) for d in items]), embeds_key, hidden_size)
    if len(rows) != len(items):
        raise ValueError(f"{grid_key} has {len(items)} rows for {len(rows)} {embeds_key}: give one [t, h, w] row "
                         f"per {modality}")
    for i, (r, d) in enumerate(zip(rows, items)):
        if rows_of(d) != r.shape[0]:
            raise ValueError(f"{embeds_key}[{i}] has {r.shape[0]} rows; its {grid_key} {d[grid_key][0].tolist()} "
                             f"makes {rows_of(d)}")
        d[embeds_key] = r
    return items


def _split_flat(value: object, sizes: list[int]) -> object:
    """vLLM's flat form: one ``[sum(sizes), hidden]`` tensor for several items, cut by their grids' rows."""
    if len(sizes) > 1 and isinstance(value, torch.Tensor) and value.ndim == 2 and value.shape[0] == sum(sizes):
        return list(value.split(sizes))
    return value


def _embeds_list(value: object, name: str, hidden_size: int | None) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor) and value.ndim == 3:
        value = list(value)
    elif isinstance(value, torch.Tensor):
        value = [value]
    if not isinstance(value, Sequence) or not value:
        raise ValueError(f"{name} must be a tensor [items, rows, hidden] or [rows, hidden], or a non-empty "
                         "list of [rows, hidden] tensors")
    for i, rows in enumerate(value):
        if not isinstance(rows, torch.Tensor) or rows.ndim != 2 or not rows.is_floating_point() or not len(rows):
            raise ValueError(f"{name}[{i}] must be a floating-point tensor [rows, hidden] with rows > 0")
        if hidden_size is not None and rows.shape[1] != hidden_size:
            raise ValueError(f"{name}[{i}] has {rows.shape[1]} columns: this model's embeddings have "
                             f"hidden_size={hidden_size}")
    return [rows.detach().cpu().contiguous() for rows in value]


def _is_grid(grids: object) -> bool:
    try:
        tensor = torch.as_tensor(grids)
    except (TypeError, ValueError, RuntimeError):
        return False
    return not tensor.is_floating_point() and tensor.numel() % 3 == 0 and bool((tensor > 0).all())


def video_seconds(value: object, count: int) -> list[float]:
    """``second_per_grid_ts``: one number > 0 per video."""
    try:
        seconds = torch.as_tensor(value, dtype=torch.float64).reshape(-1).tolist()
    except (TypeError, ValueError, RuntimeError):
        seconds = None
    if seconds is None or len(seconds) != count or not all(s > 0 for s in seconds):
        raise ValueError(f"{VIDEO_SECONDS}={value!r:.80} must be one number > 0 per video ({count} videos)")
    return seconds


def embeds_hash(data: Mapping[str, torch.Tensor], time_interval: float = 1.0) -> bytes:
    """SHA-256 of the rows and the grid (and a video's temporal spacing, which moves its positions):
    the same embeddings share encoder-cache and KV blocks."""
    keys = [key for key in data if key.endswith(("_embeds", "_grid_thw"))]
    return tensors_hash(repr(("embeds", float(time_interval))).encode(), {key: data[key] for key in keys})


def expand_placeholders(ids: list[int], token_id: int, lengths: list[int], modality: str = "image") -> list[int]:
    """Each of the prompt's ``modality`` placeholder tokens repeated to its item's rows (in order)."""
    count = ids.count(token_id)
    if count != len(lengths):
        raise ValueError(f"the prompt has {count} {modality} placeholders and {len(lengths)} {modality}_embeds: put "
                         f"one placeholder per {modality}")
    out, items = [], iter(lengths)
    for token in ids:
        out.extend([token] * next(items) if token == token_id else [token])
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
    """A part's ``[1, rows, hidden]`` as ``[rows, hidden]`` (anything else is checked by parse_embeds)."""
    return rows[0] if isinstance(rows, torch.Tensor) and rows.ndim == 3 and rows.shape[0] == 1 else rows

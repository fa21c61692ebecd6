"""Prompt text + images -> token ids with expanded image placeholders + per-image items, with the
model's own Hugging Face processor (``AutoProcessor``: resizing, patching, placeholder expansion).

It runs inside the input processor, i.e. on the async engine's tokenizer threads, never on the
engine loop: a large image never stalls the requests that are running.
"""
from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.multimodal.inputs import MultiModalItem, image_hash, to_pil_images

MODALITIES = ("image",)
_TEXT_KEYS = ("input_ids", "attention_mask", "token_type_ids")


@dataclass(frozen=True)
class MultiModalLimits:
    """What a prompt may carry: ``limit_mm_per_prompt`` (modality -> most items, vLLM's option),
    ``mm_processor_kwargs`` (engine-wide defaults for the HF processor, a request's own override
    them) and the most placeholder tokens one image may take (``max_item_tokens``: one item must
    fit in the encoder cache and in one step's encoder budget)."""

    limit_per_prompt: tuple[tuple[str, int], ...] = ()
    processor_kwargs: tuple[tuple[str, object], ...] = ()
    max_item_tokens: int = 2048

    def limit(self, modality: str) -> int | None:
        return dict(self.limit_per_prompt).get(modality)


def check_limit_mm_per_prompt(value: object) -> tuple[tuple[str, int], ...]:
    """vLLM's ``limit_mm_per_prompt`` ({"image": 2}; an {"image": {"count": 2}} entry too) as pairs."""
    if value is None:
        return ()
    if not isinstance(value, Mapping):
        raise ValueError(f"limit_mm_per_prompt={value!r:.80} must be a dict such as {{'image': 4}}")
    pairs = []
    for modality, limit in value.items():
        if isinstance(limit, Mapping) and set(limit) <= {"count"}:
            limit = limit.get("count")
        if modality not in MODALITIES:
            raise ValueError(f"limit_mm_per_prompt has modality {modality!r}: supported modalities are {MODALITIES}")
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
            raise ValueError(f"limit_mm_per_prompt[{modality!r}]={limit!r} must be an integer >= 0")
        pairs.append((modality, limit))
    return tuple(pairs)


class MultiModalProcessor:
    """The model's HF processor plus the engine's limits. Not thread-safe (it holds a tokenizer):
    each tokenizer thread uses its own ``clone()``."""

    def __init__(self, hf_processor, image_token_id: int, limits: MultiModalLimits,
                 image_rows: Callable[[dict[str, torch.Tensor]], int]):
        """``image_rows``: the model's embedding rows for one image's tensors, which must equal
        the placeholder tokens the processor put in the prompt for it."""
        self.hf = hf_processor
        self.image_rows = image_rows
        self.image_token_id = image_token_id
        self.limits = limits
        image_processor = getattr(hf_processor, "image_processor", None)
        self.option_names = frozenset(image_processor.to_dict()) if image_processor is not None else frozenset()

    @classmethod
    def from_pretrained(cls, model_dir: str, image_token_id: int, limits: MultiModalLimits,
                        image_rows: Callable[[dict[str, torch.Tensor]], int],
                        trust_remote_code: bool = False) -> MultiModalProcessor:
        from transformers import AutoProcessor
        return cls(AutoProcessor.from_pretrained(model_dir, trust_remote_code=trust_remote_code), image_token_id,
                   limits, image_rows)

    @property
    def placeholder(self) -> str:
        """The text that stands for one image in a prompt (``<image>``); the processor expands it."""
        return getattr(self.hf, "image_token", None) or self.hf.tokenizer.decode([self.image_token_id])

    def clone(self) -> MultiModalProcessor:
        other = copy.copy(self)
        other.hf = copy.deepcopy(self.hf)
        return other

    def process(self, text: str, mm_data: object, kwargs: object = None,
                add_special_tokens: bool = True) -> tuple[list[int], tuple[MultiModalItem, ...]]:
        """Token ids (each image's placeholder expanded to its embedding length) and one item per
        image, in prompt order. ``add_special_tokens``: the tokenizer's BOS etc. (False for a chat
        template's text, which writes its own). Raises ValueError naming the field for anything
        it cannot take."""
        images = self._images(mm_data)
        options = self._options(kwargs)
        try:
            out = self.hf(text=[text], images=images, return_tensors="pt", add_special_tokens=add_special_tokens,
                          **options)
        except (ValueError, TypeError, OSError) as exc:
            raise ValueError(f"multi_modal_data could not be processed by the model's processor: {exc}") from None
        ids = out["input_ids"][0].tolist()
        data = [self._item_data(out, i, len(images)) for i in range(len(images))]
        runs = self._placeholder_runs(ids, [self.image_rows(d) for d in data])
        items = tuple(MultiModalItem(image_hash(img, options), offset, length, d)
                      for img, (offset, length), d in zip(images, runs, data))
        return ids, items

    def _images(self, mm_data: object) -> list:
        if not isinstance(mm_data, Mapping):
            raise ValueError(f"multi_modal_data={mm_data!r:.80} must be a dict such as {{'image': image}}")
        unknown = sorted(set(mm_data) - set(MODALITIES), key=str)
        if unknown:
            raise ValueError(f"multi_modal_data has {unknown}: this engine takes the modalities {MODALITIES}")
        images = to_pil_images(mm_data["image"]) if "image" in mm_data else []
        limit = self.limits.limit("image")
        if limit is not None and len(images) > limit:
            raise ValueError(f"the prompt has {len(images)} images, over limit_mm_per_prompt={{'image': {limit}}}; "
                             "send fewer images (or start the engine with a higher limit_mm_per_prompt)")
        if not images:
            raise ValueError("multi_modal_data has no image; leave multi_modal_data out for a text-only prompt")
        return images

    def _options(self, kwargs: object) -> dict:
        """The engine's ``mm_processor_kwargs`` updated by the request's; every key must be an
        option of the model's image processor (one it would not read is refused, never dropped)."""
        if kwargs is not None and not isinstance(kwargs, Mapping):
            raise ValueError(f"mm_processor_kwargs={kwargs!r:.80} must be a dict")
        options = {**dict(self.limits.processor_kwargs), **dict(kwargs or {})}
        unknown = sorted(set(options) - self.option_names)
        if unknown:
            raise ValueError(f"mm_processor_kwargs has {unknown}: this model's image processor takes "
                             f"{sorted(self.option_names)}")
        return options

    def _placeholder_runs(self, ids: list[int], lengths: list[int]) -> list[tuple[int, int]]:
        """``(offset, length)`` of each image's placeholder run: the placeholder tokens in prompt
        order, the first ``lengths[0]`` for the first image and so on (adjacent images make one
        run). ``lengths``: the rows the model embeds each image as; the processor must have put
        exactly that many placeholders, each image's contiguous."""
        positions = np.flatnonzero(np.asarray(ids) == self.image_token_id)
        if len(positions) != sum(lengths):
            raise ValueError(f"the model's processor put {len(positions)} image placeholder tokens in the prompt for "
                             f"{len(lengths)} images that the model embeds as {sum(lengths)} rows: its processor "
                             "config does not match the model (e.g. num_additional_image_tokens, patch_size)")
        runs, start = [], 0
        for length in lengths:
            run = positions[start:start + length]
            if length == 0 or run[-1] - run[0] != length - 1:
                raise ValueError("the prompt's image placeholders are not one contiguous run per image: put exactly "
                                 "one image placeholder in the prompt per image")
            if length > self.limits.max_item_tokens:
                raise ValueError(f"an image takes {length} tokens, over the {self.limits.max_item_tokens} that fit in "
                                 "one step's encoder budget (max_num_batched_tokens); use smaller images or raise "
                                 "max_num_batched_tokens")
            runs.append((int(run[0]), length))
            start += length
        return runs

    @staticmethod
    def _item_data(out: Mapping, index: int, num_images: int) -> dict[str, torch.Tensor]:
        """Image ``index``'s rows of every per-image tensor the processor returned."""
        data = {}
        for key, value in out.items():
            if key in _TEXT_KEYS or not isinstance(value, torch.Tensor):
                continue
            if value.shape[0] != num_images:
                raise ValueError(f"the processor's {key!r} has {value.shape[0]} rows for {num_images} images: "
                                 "this model's processor output is not one row per image")
            data[key] = value[index:index + 1].clone()
        return data

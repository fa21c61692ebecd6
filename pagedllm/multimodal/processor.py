"""Prompt text + images (and videos) -> token ids with expanded placeholders + one item per
placeholder run, with the model's own Hugging Face processor (``AutoProcessor``: resizing,
patching, placeholder expansion). A run is an image, a video (Qwen2-VL: its frames, multimodal/video.py)
or one crop of an image (Gemma 3's pan-and-scan: the whole image, then each crop, each its own run).

It runs inside the input processor, i.e. on the async engine's tokenizer threads, never on the
engine loop: a large image never stalls the requests that are running.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.multimodal.embeds import (
    VIDEO_SECONDS,
    embed_keys,
    embeds_hash,
    expand_placeholders,
    parse_embeds,
    video_seconds,
)
from pagedllm.multimodal.inputs import MultiModalItem, image_hash, tensors_hash, to_pil_images
from pagedllm.multimodal.processor_cache import ProcessorCache
from pagedllm.multimodal.video import FramesVideoProcessor, parse_videos, video_hash

MODALITIES = ("image", "video")
# transformers' video processor options that pick frames (and vLLM's num_frames): the frames given are
# all kept (FramesVideoProcessor, and transformers' own with do_sample_frames off), so these are refused
FRAME_SAMPLING_OPTIONS = frozenset({"fps", "num_frames", "do_sample_frames", "min_frames", "max_frames"})
_TEXT_KEYS = ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids")


@dataclass(frozen=True)
class ImageLayout:
    """What a model says about its images beyond their embedding rows (``None``: LLaVA's defaults).

    ``split``: the processor's output -> one dict of tensors per image (default: row ``i`` of each
    tensor; Qwen2-VL concatenates every image's patches, split by their grids); ``grid``: an
    image's M-RoPE token grid ``(t, h, w)`` (multimodal/mrope.py); ``placeholder``: the text that
    stands for one image in a chat prompt (default: the processor's image token).
    """

    split: Callable[[Mapping, int], list[dict[str, torch.Tensor]]] | None = None
    grid: Callable[[dict[str, torch.Tensor]], tuple[int, int, int]] | None = None
    placeholder: str | None = None
    hidden_size: int | None = None  # the language model's (``image_embeds`` inputs must match it)
    # Gemma 3: an image's tokens attend to each other both ways (MultiModalItem.bidirectional)
    bidirectional: bool = False
    # videos (Qwen2-VL): the processor's output -> one dict of tensors per video, and each video's
    # M-RoPE temporal spacing; None: the model takes no video
    split_videos: Callable[[Mapping, int], list[dict[str, torch.Tensor]]] | None = None
    video_intervals: Callable[[Mapping, int], list[float]] | None = None
    video_placeholder: str | None = None


def image_layout(model_cls: type, hf_config) -> ImageLayout:
    """The model class's ``split_images`` / ``image_grid`` / ``image_placeholder``, where it has them."""
    split, grid = getattr(model_cls, "split_images", None), getattr(model_cls, "image_grid", None)
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    return ImageLayout(functools.partial(split, hf_config) if split else None,
                       functools.partial(grid, hf_config) if grid else None,
                       getattr(model_cls, "image_placeholder", None), text.hidden_size,
                       bool(getattr(model_cls, "bidirectional_images", False)),
                       *(functools.partial(getattr(model_cls, name), hf_config) if hasattr(model_cls, name) else None
                         for name in ("split_videos", "video_intervals")),
                       getattr(model_cls, "video_placeholder", None))


@dataclass(frozen=True)
class MultiModalLimits:
    """What a prompt may carry: ``limit_mm_per_prompt`` (modality -> most items, vLLM's option),
    ``mm_processor_kwargs`` (engine-wide defaults for the HF processor, a request's own override
    them) and the most placeholder tokens one image may take (``max_item_tokens``: one item must
    fit in the encoder cache and in one step's encoder budget)."""

    limit_per_prompt: tuple[tuple[str, int], ...] = ()
    processor_kwargs: tuple[tuple[str, object], ...] = ()
    max_item_tokens: int = 2048
    language_model_only: bool = False  # vLLM's option: no tower loaded, every item refused

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
        if isinstance(limit, Mapping):
            extra = sorted(set(limit) - {"count"}, key=str)
            if extra:  # vLLM's dummy-input sizes (num_frames, width, height) for its profiling run
                raise ValueError(f"limit_mm_per_prompt[{modality!r}] has {extra}: only 'count' is taken (the "
                                 "profiling run's dummy input is sized by max_num_batched_tokens, not by these)")
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
                 image_rows: Callable[[dict[str, torch.Tensor]], int], layout: ImageLayout = ImageLayout(),
                 cache: ProcessorCache | None = None):
        """``image_rows``: the model's embedding rows for one image's tensors, which must equal
        the placeholder tokens the processor put in the prompt for it. ``cache``: the processor
        outputs of recent images and videos (None: every prompt runs the HF processor), shared by clones."""
        self.cache = cache
        self.hf = hf_processor
        self.image_rows = image_rows
        self.layout = layout
        self.image_token_id = image_token_id
        self.limits = limits
        self.video_token_id = getattr(hf_processor, "video_token_id", None)
        image_processor = getattr(hf_processor, "image_processor", None)
        self.option_names = _image_options(image_processor)
        self.check_limits()
        self._options(None)  # the engine's mm_processor_kwargs: refused at start-up, not at the first image

    @classmethod
    def from_pretrained(cls, model_dir: str, image_token_id: int, limits: MultiModalLimits,
                        image_rows: Callable[[dict[str, torch.Tensor]], int],
                        trust_remote_code: bool = False, layout: ImageLayout = ImageLayout(),
                        cache: ProcessorCache | None = None) -> MultiModalProcessor:
        return cls(load_hf_processor(model_dir, trust_remote_code), image_token_id, limits, image_rows, layout, cache)

    @property
    def placeholder(self) -> str:
        """The text that stands for one image in a prompt (``<image>``); the processor expands it."""
        if self.layout.placeholder is not None:
            return self.layout.placeholder
        return getattr(self.hf, "image_token", None) or self.hf.tokenizer.decode([self.image_token_id])

    @property
    def video_placeholder(self) -> str | None:
        """The text that stands for one video in a prompt; None for a model that takes no video."""
        return self.layout.video_placeholder if "video" in self.modalities else None

    def clone(self) -> MultiModalProcessor:
        other = copy.copy(self)
        other.hf = copy.deepcopy(self.hf)
        return other

    def process(self, text: str, mm_data: object, kwargs: object = None,
                add_special_tokens: bool = True) -> tuple[list[int], tuple[MultiModalItem, ...]]:
        """Token ids (each image's / video's placeholder expanded to its embedding length) and one
        item per placeholder run (an image, a video, a pan-and-scan crop), in prompt order.
        ``mm_data``: ``{"image": ..., "video": ...}`` (multimodal/inputs.py, video.py).
        ``add_special_tokens``: the tokenizer's BOS etc. (False for a chat template's text, which
        writes its own). Raises ValueError naming the field for anything it cannot take."""
        if self.limits.language_model_only:
            raise ValueError("multi_modal_data is refused: the engine runs with language_model_only=True (the "
                             "vision tower is not loaded); send text-only prompts or start it without that option")
        if isinstance(mm_data, Mapping) and any(isinstance(value, Mapping) for value in mm_data.values()):
            return self._process_embeds(text, mm_data, kwargs, add_special_tokens)
        images, (videos, metadata) = self._inputs(mm_data)
        options = self._options(kwargs)
        keys = self._cache_keys(images, videos, metadata, options) if self.cache is not None else None
        cached = keys and self._from_cache(text, keys, add_special_tokens)
        if cached:
            return cached
        try:
            out = self.hf(text=[text], images=images or None, videos=videos or None, return_tensors="pt",
                          add_special_tokens=add_special_tokens, images_kwargs=options,
                          **({"videos_kwargs": {**options, "video_metadata": metadata}} if videos else {}))
        except (ValueError, TypeError, OSError) as exc:
            raise ValueError(f"multi_modal_data could not be processed by the model's processor: {exc}") from None
        ids = out["input_ids"][0].tolist()
        image_items = self._image_items(ids, out, images, options, keys[0] if keys else None)
        video_items = self._video_items(ids, out, videos, options)
        if keys and len(image_items) == len(images):  # (pan-and-scan crops are not one item per image)
            self._remember(text, ids, keys, (image_items, video_items), add_special_tokens)
        return ids, tuple(sorted(image_items + video_items, key=lambda item: item.offset))

    def _cache_keys(self, images: list, videos: list, metadata: list,
                    options: dict) -> tuple[list[bytes], list[bytes]]:
        """Each image's and each video's processor-cache key: its content and every option that
        shapes its tensors (a video's metadata too: its frame rate spaces its temporal positions)."""
        video_keys = [hashlib.sha256(video_hash(frames, options, 0.0) + repr(sorted(meta.items())).encode()).digest()
                      for frames, meta in zip(videos, metadata)]
        return [image_hash(image, options) for image in images], video_keys

    def _from_cache(self, text: str, keys: tuple[list[bytes], list[bytes]],
                    add_special_tokens: bool) -> tuple[list[int], tuple[MultiModalItem, ...]] | None:
        """The prompt's ids and items without the HF processor, when every item is cached and this
        model's placeholder expansion is a plain repeat (ProcessorCache.expansion_ok); else None."""
        modalities = {m for m, k in zip(("image", "video"), keys) if k}
        if not self.cache.fast_path(modalities):
            return None
        cached = self.cache.get_all(keys[0] + keys[1])
        if cached is None:
            return None
        groups = (cached[:len(keys[0])], cached[len(keys[0]):])
        ids = self._expanded(text, groups, add_special_tokens)
        if ids is None:  # a placeholder count that is not one per item: the HF processor says what is wrong
            return None
        items = []
        for group, token_id, kind in zip(groups, (self.image_token_id, self.video_token_id), ("image", "video")):
            runs = self._placeholder_runs(ids, [item.length for item in group], token_id, kind) if group else []
            items += [dataclasses.replace(item, offset=offset) for item, (offset, _) in zip(group, runs)]
        return ids, tuple(sorted(items, key=lambda item: item.offset))

    def _expanded(self, text: str, groups: tuple, add_special_tokens: bool) -> list[int] | None:
        """The text's ids with each image's (video's) placeholder token repeated to its item's rows;
        None if the text does not have one placeholder per item."""
        ids = self.hf.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        for group, token_id in zip(groups, (self.image_token_id, self.video_token_id)):
            if ids.count(token_id) != len(group):
                return None
            ids = expand_placeholders(ids, token_id, [item.length for item in group]) if group else ids
        return ids

    def _remember(self, text: str, ids: list[int], keys: tuple[list[bytes], list[bytes]], groups: tuple,
                  add_special_tokens: bool) -> None:
        """Caches a processed prompt's items, and checks that the cache's fast path would have
        made the processor's ids for it."""
        modalities = {m for m, group in zip(("image", "video"), groups) if group}
        if all(self.cache.expansion_ok.get(m, True) for m in modalities):  # (once wrong, never checked again)
            self.cache.record_expansion(modalities, self._expanded(text, groups, add_special_tokens) == ids)
        for key, item in zip(keys[0] + keys[1], groups[0] + groups[1]):
            self.cache.put(key, item)

    def _image_items(self, ids: list[int], out: Mapping, images: list, options: dict,
                     hashes: list[bytes] | None = None) -> tuple[MultiModalItem, ...]:
        """One item per image placeholder run: an image's, or (more runs than images: Gemma 3's
        pan-and-scan) each crop's, named by its own pixels since the output does not say which
        image a crop came from. ``hashes``: the images' ``image_hash``es where already computed."""
        if not images:
            return ()
        data = (self.layout.split or self._split_rows)(out, len(images))
        runs = self._placeholder_runs(ids, [self.image_rows(d) for d in data], self.image_token_id, "image")
        hashes = ((hashes or [image_hash(image, options) for image in images]) if len(data) == len(images)
                  else [tensors_hash(b"image crop" + repr(sorted(options.items(), key=str)).encode(), d) for d in data])
        grid = self.layout.grid or (lambda d: None)
        return tuple(MultiModalItem(h, offset, length, d, grid(d), bidirectional=self.layout.bidirectional)
                     for h, (offset, length), d in zip(hashes, runs, data))

    def _video_items(self, ids: list[int], out: Mapping, videos: list, options: dict) -> tuple[MultiModalItem, ...]:
        """One item per video: its patches, its M-RoPE grid and temporal spacing."""
        if not videos:
            return ()
        data = self.layout.split_videos(out, len(videos))
        intervals = self.layout.video_intervals(out, len(videos))
        runs = self._placeholder_runs(ids, [self.image_rows(d) for d in data], self.video_token_id, "video")
        return tuple(MultiModalItem(video_hash(frames, options, interval), offset, length, d, self.layout.grid(d),
                                    interval, modality="video", frames=len(frames))
                     for frames, interval, (offset, length), d in zip(videos, intervals, runs, data))

    def _process_embeds(self, text: str, mm_data: Mapping, kwargs: object,
                        add_special_tokens: bool) -> tuple[list[int], tuple[MultiModalItem, ...]]:
        """Precomputed embeddings (multimodal/embeds.py): the text is tokenized alone and each
        placeholder token repeated to its item's rows; the vision tower never runs for them."""
        self._check_modalities(mm_data)
        raw = [m for m, value in mm_data.items() if not isinstance(value, Mapping)]
        if raw:
            given = [embed_keys(m)[0] for m in mm_data if m not in raw]
            raise ValueError(f"multi_modal_data cannot mix {' and '.join(given)} with a raw {raw[0]}: give every "
                             f"item as embeddings, or send the {raw[0]} in another prompt")
        if kwargs:
            names = " and ".join(embed_keys(m)[0] for m in mm_data)
            raise ValueError(f"mm_processor_kwargs={kwargs!r:.80} cannot apply to {names} (no image or video is "
                             "processed); leave it out")
        ids = self.hf.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        parsed = {modality: self._embeds(modality, value) for modality, value in mm_data.items()}
        lengths = {m: [d[embed_keys(m)[0]].shape[0] for d in data] for m, (data, _) in parsed.items()}
        for modality, rows in lengths.items():
            ids = expand_placeholders(ids, self._token_id(modality), rows, modality)
        items, grid = [], self.layout.grid or (lambda d: None)
        for modality, (data, intervals) in parsed.items():
            runs = self._placeholder_runs(ids, lengths[modality], self._token_id(modality), modality)
            items += [MultiModalItem(embeds_hash(d, interval), offset, length, d, grid(d), interval,
                                     bidirectional=self.layout.bidirectional and modality == "image",
                                     modality=modality)
                      for (offset, length), d, interval in zip(runs, data, intervals)]
        return ids, tuple(sorted(items, key=lambda item: item.offset))

    def _embeds(self, modality: str, value: Mapping) -> tuple[list[dict[str, torch.Tensor]], list[float]]:
        """One modality's embeddings checked (multimodal/embeds.py), and each item's M-RoPE temporal
        spacing (a video's, from ``second_per_grid_ts`` where the model reads it)."""
        spaced = modality == "video" and VIDEO_SECONDS in getattr(self.hf, "model_input_names", ())
        data = parse_embeds(modality, value, self.layout.hidden_size, self.layout.grid is not None,
                            self.image_rows, (VIDEO_SECONDS,) if spaced else ())
        self._check_count(modality, len(data))
        if modality == "image":
            return data, [1.0] * len(data)
        seconds = video_seconds(value[VIDEO_SECONDS], len(data)) if VIDEO_SECONDS in value else [1.0] * len(data)
        return data, self.layout.video_intervals({VIDEO_SECONDS: seconds}, len(data))

    def _token_id(self, modality: str) -> int:
        return self.image_token_id if modality == "image" else self.video_token_id

    @property
    def modalities(self) -> tuple[str, ...]:
        """What this model's prompts may carry: images, and videos where the model and its processor take them."""
        return MODALITIES if self.layout.split_videos is not None and self.video_token_id is not None else ("image",)

    def check_limits(self) -> None:
        """``limit_mm_per_prompt`` names only modalities this model takes (ValueError otherwise)."""
        for modality, _ in self.limits.limit_per_prompt:
            if modality not in self.modalities:
                raise ValueError(f"limit_mm_per_prompt has {modality!r}: this model takes {self.modalities}")

    def _inputs(self, mm_data: object) -> tuple[list, tuple[list, list]]:
        """The prompt's images, and its videos (each a list of frames) with their metadata, the
        counts checked."""
        self._check_modalities(mm_data)
        images = to_pil_images(mm_data["image"]) if "image" in mm_data else []
        videos, metadata = parse_videos(mm_data["video"]) if "video" in mm_data else ([], [])
        self._check_count("image", len(images))
        self._check_count("video", len(videos))
        if not images and not videos:
            raise ValueError("multi_modal_data has no image or video; leave multi_modal_data out for a text-only "
                             "prompt")
        return images, (videos, metadata)

    def _check_modalities(self, mm_data: object) -> None:
        if not isinstance(mm_data, Mapping):
            raise ValueError(f"multi_modal_data={mm_data!r:.80} must be a dict such as {{'image': image}}")
        unknown = sorted(set(mm_data) - set(self.modalities), key=str)
        if unknown:
            raise ValueError(f"multi_modal_data has {unknown}: this model takes the modalities {self.modalities}")

    def _check_count(self, modality: str, count: int) -> None:
        limit = self.limits.limit(modality)
        if limit is not None and count > limit:
            raise ValueError(f"the prompt has {count} {modality}s, over limit_mm_per_prompt={{{modality!r}: {limit}}}; "
                             f"send fewer {modality}s (or start the engine with a higher limit_mm_per_prompt)")

    def _options(self, kwargs: object) -> dict:
        """The engine's ``mm_processor_kwargs`` updated by the request's; every key must be an
        option of the model's image processor (one it would not read is refused, never dropped)."""
        if kwargs is not None and not isinstance(kwargs, Mapping):
            raise ValueError(f"mm_processor_kwargs={kwargs!r:.80} must be a dict")
        options = {**dict(self.limits.processor_kwargs), **dict(kwargs or {})}
        unknown = sorted(set(options) - self.option_names)
        sampling = [name for name in unknown if name in FRAME_SAMPLING_OPTIONS]
        if sampling:
            raise ValueError(f"mm_processor_kwargs has {sampling}: videos are not resampled here (every frame given is "
                             "kept); sample the frames before sending them and give their rate as the video's "
                             "metadata fps (multi_modal_data={'video': (frames, {'fps': ...})})")
        if unknown:
            raise ValueError(f"mm_processor_kwargs has {unknown}: this model's image processor takes "
                             f"{sorted(self.option_names)} (applied to images and to every video frame)")
        return options

    def _placeholder_runs(self, ids: list[int], lengths: list[int], token_id: int,
                          kind: str) -> list[tuple[int, int]]:
        """``(offset, length)`` of each item's placeholder run (``token_id`` tokens): the placeholder
        tokens in prompt order, the first ``lengths[0]`` for the first item and so on (adjacent
        items make one run). ``lengths``: the rows the model embeds each item as; the processor must
        have put exactly that many placeholders, each item's contiguous."""
        positions = np.flatnonzero(np.asarray(ids) == token_id)
        if len(positions) != sum(lengths):
            raise ValueError(f"the model's processor put {len(positions)} {kind} placeholder tokens in the prompt for "
                             f"{len(lengths)} {kind} runs that the model embeds as {sum(lengths)} rows: its processor "
                             "config does not match the model (e.g. num_additional_image_tokens, patch_size)")
        runs, start = [], 0
        for length in lengths:
            run = positions[start:start + length]
            if length == 0 or run[-1] - run[0] != length - 1:
                raise ValueError(f"the prompt's {kind} placeholders are not one contiguous run per {kind}: put exactly "
                                 f"one {kind} placeholder in the prompt per {kind}")
            if length > self.limits.max_item_tokens:
                raise ValueError(f"one {kind} takes {length} tokens, over the {self.limits.max_item_tokens} that "
                                 f"fit in one step's encoder budget (max_num_batched_tokens); use smaller {kind}s "
                                 "(fewer frames) or raise max_num_batched_tokens")
            runs.append((int(run[0]), length))
            start += length
        return runs

    @staticmethod
    def _split_rows(out: Mapping, num_images: int) -> list[dict[str, torch.Tensor]]:
        """Each image's row of every per-image tensor the processor returned."""
        tensors = image_tensors(out)
        for key, value in tensors.items():
            if value.shape[0] != num_images:
                raise ValueError(f"the processor's {key!r} has {value.shape[0]} rows for {num_images} images: "
                                 "this model's processor output is not one row per image")
        return [{key: value[i:i + 1].clone() for key, value in tensors.items()} for i in range(num_images)]


# image-processor call options that change the output's container or device, not the pixels
_NOT_OPTIONS = frozenset({"return_tensors", "data_format", "input_data_format", "device"})


def _image_options(image_processor) -> frozenset[str]:
    """The options the image processor takes: its config's fields and the call's typed kwargs
    (transformers 5: ``valid_kwargs``, e.g. Qwen2-VL's ``min_pixels`` / ``max_pixels``)."""
    if image_processor is None:
        return frozenset()
    typed = getattr(getattr(image_processor, "valid_kwargs", None), "__annotations__", {})
    return frozenset(image_processor.to_dict()) | (frozenset(typed) - _NOT_OPTIONS)


def image_tensors(out: Mapping) -> dict[str, torch.Tensor]:
    """The processor output's image tensors (its text fields left out)."""
    return {key: value for key, value in out.items() if key not in _TEXT_KEYS and isinstance(value, torch.Tensor)}


def load_hf_processor(model_dir: str, trust_remote_code: bool = False):
    """The checkpoint's ``AutoProcessor``. Without torchvision (or without a video processor
    config), transformers cannot build a video processor, so a processor that has one (Qwen2-VL) is
    loaded without it and given ``FramesVideoProcessor`` (multimodal/video.py), made of its image
    processor."""
    from transformers import AutoConfig, AutoProcessor
    try:
        return AutoProcessor.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    except (ImportError, OSError) as exc:
        if "torchvision" not in str(exc).lower() and "video processor" not in str(exc).lower():
            raise
        import transformers
        arch = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code).model_type
        cls = _PROCESSOR_CLASSES.get(arch)
        if cls is None:
            raise
        processor = image_only_processor(getattr(transformers, cls)).from_pretrained(model_dir)
        processor.video_processor = FramesVideoProcessor(processor.image_processor)
        return processor


_PROCESSOR_CLASSES = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor"}


def image_only_processor(cls: type) -> type:
    """``cls`` without its video processor (its ``__call__`` reads one only for videos; one set on
    the instance, FramesVideoProcessor, is left out of the saved / printed config)."""
    attributes = [name for name in cls.get_attributes() if name != "video_processor"]

    def to_dict(self) -> dict:
        return {key: value for key, value in cls.to_dict(self).items() if key != "video_processor"}
    return type(cls.__name__, (cls,), {"get_attributes": classmethod(lambda _: list(attributes)), "to_dict": to_dict})

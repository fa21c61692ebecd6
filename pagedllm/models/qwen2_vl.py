"""Qwen2-VL and Qwen2.5-VL (``Qwen2VLForConditionalGeneration``, ``Qwen2_5_VLForConditionalGeneration``):
a ViT over 14x14 patches of two frames (``temporal_patch_size``; an image is its frame twice),
with 2D rotary positions in the tower, Qwen2.5-VL's windowed attention in all blocks but
``fullatt_block_indexes``, and a patch merger that turns each 2x2 group of patches into one
language-model token; the language model is Qwen2 with M-RoPE (layers/rotary_mrope.py), whose
three-component positions the scheduler computes per request (multimodal/mrope.py).

The processor resizes an image to a multiple of ``patch_size * merge_size`` within
``min_pixels`` / ``max_pixels`` (``mm_processor_kwargs``) and returns every image's patches in one
``pixel_values`` ``[sum of patches, 3 * temporal_patch_size * patch_size ** 2]`` with
``image_grid_thw`` ``[images, 3]``; ``split_images`` cuts that per image. The tower is
transformers' own module (weights load by their checkpoint names) run by our forward
(models/qwen2_vl_tower.py; Qwen2.5-VL's by transformers'): it runs once per image, off the
paged-KV path, which only the language model uses.

A video is the same tower over ``pixel_values_videos`` (two consecutive frames per temporal
patch) with ``video_grid_thw``; its M-RoPE temporal positions are spaced by ``video_intervals``
(1 on Qwen2-VL; ``tokens_per_second * second_per_grid_ts`` on Qwen2.5-VL, as get_rope_index).
"""
from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

import torch
from torch import nn

from pagedllm.attention.backend import AttentionBackend
from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.distributed.pipeline import PipelineStage
from pagedllm.layers import cpu_ops
from pagedllm.layers.rotary_mrope import make_mrotary
from pagedllm.models.decoder import head_dim_of
from pagedllm.models.llama import Qwen2ForCausalLM
from pagedllm.models.qwen2_vl_tower import VisionRotary, make_packable, tower_forward
from pagedllm.models.vision_language import VisionLanguageModel
from pagedllm.multimodal.processor import image_tensors

IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO_PLACEHOLDER = "<|vision_start|><|video_pad|><|vision_end|>"
# checkpoint prefixes -> the names used here: transformers 5 ("model.language_model.*", "model.visual.*")
# and the released checkpoints ("model.layers.*", "visual.*"); the first match wins
_RENAMES = (("model.language_model.", "language_model.model."), ("model.visual.", "visual."),
            ("visual.", "visual."), ("lm_head.", "language_model.lm_head."), ("model.", "language_model.model."))


class LinearPatchEmbed(nn.Module):
    """The tower's patch embedding as one GEMM. Its ``Conv3d`` has kernel == stride (one output
    per patch) and the processor hands each patch already flattened in the kernel's (channel,
    frame, row, column) order, so the convolution is ``pixels @ weight.view(embed_dim, -1).T``.
    transformers runs it as a 3-D convolution over ``[patches, 3, 2, 14, 14]``, which oneDNN
    computes ~3.7x slower on one core here (11.0 against 3.0 ms for a 336x336 image's 576
    patches at embed_dim 192; a sixth of the benchmark tower's time). The conv module stays as
    ``proj``, so the checkpoint's ``patch_embed.proj.weight`` loads as before."""

    def __init__(self, conv_embed: nn.Module):
        super().__init__()
        self.proj = conv_embed.proj  # nn.Conv3d [embed_dim, channels, frames, patch, patch]
        self.embed_dim = conv_embed.embed_dim

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight.view(self.embed_dim, -1)  # [embed_dim, channels * frames * patch ** 2]
        # pixels [patches, channels * frames * patch ** 2] -> [patches, embed_dim]
        return cpu_ops.unpacked_linear(pixels.to(weight.dtype), weight, self.proj.bias)


class Qwen2VLTextForCausalLM(Qwen2ForCausalLM):
    """Qwen2 with M-RoPE rotaries (positions ``[num_tokens]`` or ``[3, num_tokens]``)."""

    def make_rotaries(self, cfg, max_position: int) -> list:
        rotary = make_mrotary(cfg, head_dim_of(cfg), max_position, self.ops)
        return [rotary] * cfg.num_hidden_layers


class Qwen2VLForConditionalGeneration(VisionLanguageModel):
    """Vision tower (with its merger) + Qwen2 M-RoPE language model; ``config`` is the whole config."""

    image_placeholder = IMAGE_PLACEHOLDER
    video_placeholder = VIDEO_PLACEHOLDER

    def __init__(self, cfg, backend: AttentionBackend, max_position: int, tp: TensorParallelGroup,
                 ops: str = "native", stage: PipelineStage | None = None):
        super().__init__()
        self.config, self.tp, self.ops = cfg, tp, ops
        # the checkpoint's config.json says it on the top config (transformers 5 ties by that one)
        cfg.text_config.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        self.language_model = Qwen2VLTextForCausalLM(cfg.text_config, backend, max_position, tp, ops, stage)
        self.stage = self.language_model.stage
        cfg.vision_config._attn_implementation = "sdpa"
        self.visual = self.tower_class()._from_config(cfg.vision_config)
        self.visual.patch_embed = LinearPatchEmbed(self.visual.patch_embed)  # its Conv3d as the GEMM it is
        self.init_tower_forward()

    def init_tower_forward(self) -> None:
        """Qwen2-VL's tower runs our forward (models/qwen2_vl_tower.py) on packed linears and
        per-grid rotary tables."""
        make_packable(self.visual)
        self.vision_rotary = VisionRotary(self.visual.rotary_pos_emb, self.merge_size(self.config))

    def run_tower(self, pixels: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """The merged rows of one image's (or video's) patches ``[patches, patch dim]``."""
        return tower_forward(self.visual, self.vision_rotary, pixels, grid_thw)

    @staticmethod
    def tower_class() -> type:
        from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel
        return Qwen2VisionTransformerPretrainedModel

    @classmethod
    def check_config(cls, cfg) -> None:
        Qwen2VLTextForCausalLM.check_config(cfg.text_config)
        make_mrotary(cfg.text_config, head_dim_of(cfg.text_config), 1)  # refuses an unsupported rope_parameters

    @classmethod
    def attention_soft_cap(cls, cfg) -> float | None:
        return None

    # ------------------------------------------------------------------ images (multimodal/processor.py)
    @staticmethod
    def merge_size(cfg) -> int:
        return cfg.vision_config.spatial_merge_size

    @staticmethod
    def _grid_thw(data: dict[str, torch.Tensor]) -> torch.Tensor:
        """An image's ``image_grid_thw`` or a video's ``video_grid_thw`` ``[1, 3]`` (patches)."""
        return data["image_grid_thw"] if "image_grid_thw" in data else data["video_grid_thw"]

    @classmethod
    def image_rows(cls, cfg, data: dict[str, torch.Tensor]) -> int:
        """One token per ``merge_size ** 2`` patches of the image's (or video's) grid."""
        return int(cls._grid_thw(data)[0].prod()) // cls.merge_size(cfg) ** 2

    @classmethod
    def image_grid(cls, cfg, data: dict[str, torch.Tensor]) -> tuple[int, int, int]:
        """The image's (or video's) M-RoPE token grid (t, h, w): its patch grid with h and w merged."""
        t, h, w = cls._grid_thw(data)[0].tolist()
        merge = cls.merge_size(cfg)
        return t, h // merge, w // merge

    @staticmethod
    def split_images(cfg, out: Mapping, num_images: int, kind: str = "image") -> list[dict[str, torch.Tensor]]:
        """The processor's concatenated patches, cut per image by ``image_grid_thw`` (``kind``
        "video": ``pixel_values_videos`` by ``video_grid_thw``)."""
        pixels_key, grid_key = ("pixel_values", "image_grid_thw") if kind == "image" else \
            ("pixel_values_videos", "video_grid_thw")
        tensors = image_tensors(out)
        grids = tensors.get(grid_key)
        if grids is None or grids.shape[0] != num_images or pixels_key not in tensors:
            raise ValueError(f"the processor returned {sorted(tensors)} for {num_images} {kind}s: this model needs "
                             f"{pixels_key} and one {grid_key} row per {kind}")
        patches = grids.prod(-1).tolist()
        if num_images == 1:  # the whole output is the one image's: no copy (2.7 MB for a 336x336 image)
            return [{pixels_key: tensors[pixels_key], grid_key: grids}]
        pixels = tensors[pixels_key].split(patches)  # each [patches, patch dim]
        # copies: a view would hold the other images' patches alive in the caches
        return [{pixels_key: pixels[i].clone(), grid_key: grids[i:i + 1].clone()} for i in range(num_images)]

    @classmethod
    def split_videos(cls, cfg, out: Mapping, num_videos: int) -> list[dict[str, torch.Tensor]]:
        return cls.split_images(cfg, out, num_videos, "video")

    @staticmethod
    def video_intervals(cfg, out: Mapping, num_videos: int) -> list[float]:
        """Each video's M-RoPE temporal spacing: 1 (Qwen2-VL's get_rope_index)."""
        return [1.0] * num_videos

    def dummy_image(self, max_rows: int) -> dict[str, torch.Tensor]:
        """The largest square image one step's encoder budget (``max_rows`` tokens) takes."""
        vc, merge = self.config.vision_config, self.merge_size(self.config)
        side = max(1, math.isqrt(max_rows)) * merge  # patches per side
        patch_dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
        return {"pixel_values": torch.zeros(side * side, patch_dim), "image_grid_thw": torch.tensor([[1, side, side]])}

    @torch.inference_mode()
    def encode_pixels(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        """One image's (or video's) embeddings ``[placeholder tokens, hidden]``: the tower's merged output."""
        pixels = data["pixel_values"] if "pixel_values" in data else data["pixel_values_videos"]
        pixels = pixels.to(self.visual.dtype)  # [patches, patch dim]: a video's like an image's
        return self.run_tower(pixels, self._grid_thw(data))  # [patches / merge ** 2, hidden]

    # ------------------------------------------------------------------ weights
    def checkpoint_weights(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor, object]]:
        name = self.renamed(name, _RENAMES)
        if name.startswith("language_model."):
            yield from self.language_weights(name, tensor)
            return
        yield name, tensor, None


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):  # noqa: N801 - the HF name
    """Qwen2.5-VL: the tower has RMSNorm, a gated MLP and windowed attention (``window_size``
    pixels) in every block but ``fullatt_block_indexes``; the rest is Qwen2-VL's."""

    @staticmethod
    def tower_class() -> type:
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
        return Qwen2_5_VisionTransformerPretrainedModel

    def init_tower_forward(self) -> None:
        """Qwen2.5-VL's tower (windowed attention) keeps transformers' forward."""

    def run_tower(self, pixels: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        return self.visual(pixels, grid_thw=grid_thw).pooler_output

    @staticmethod
    def video_intervals(cfg, out: Mapping, num_videos: int) -> list[float]:
        """``tokens_per_second * second_per_grid_ts`` (the processor's, from the frame rate), as
        transformers' get_rope_index spaces a video's temporal positions."""
        seconds = out.get("second_per_grid_ts")
        if seconds is None or len(seconds) != num_videos:
            raise ValueError(f"the processor returned second_per_grid_ts={seconds!r} for {num_videos} videos: "
                             "Qwen2.5-VL needs one per video")
        per_second = getattr(cfg.vision_config, "tokens_per_second", None) or cfg.tokens_per_second
        # in float32, as transformers multiplies the processor's tensor (the positions truncate the product)
        return [float(per_second * s) for s in torch.as_tensor(seconds, dtype=torch.float32)]

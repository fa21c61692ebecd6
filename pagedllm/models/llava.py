"""LLaVA (``LlavaForConditionalGeneration``): a CLIP/SigLIP vision tower, a two-layer projector
and a Llama-family language model whose prompt carries one run of image placeholder tokens per
image (the processor expands them). The runner encodes each image once (``encode_image``) and
scatters its rows over the placeholders' token embeddings (``forward(inputs_embeds=...)``).

The vision tower and the projector are transformers' own modules (weights load by their
checkpoint names): they run once per image on SDPA, off the paged-KV path, which only the
language model uses.
"""
from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from pagedllm.attention.backend import AttentionBackend
from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.distributed.pipeline import PipelineStage
from pagedllm.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM

# text_config.model_type -> the language model's family
LANGUAGE_MODELS = {"llama": LlamaForCausalLM, "mistral": MistralForCausalLM, "qwen2": Qwen2ForCausalLM}
_SELECT_STRATEGIES = ("default", "full")
# newer transformers checkpoints ("model.language_model.*", top-level "lm_head") -> the legacy names used here
_RENAMES = (("model.language_model.", "language_model.model."), ("model.vision_tower.", "vision_tower."),
            ("model.multi_modal_projector.", "multi_modal_projector."), ("model.image_newline", "image_newline"),
            ("lm_head.", "language_model.lm_head."))


def _language_model_class(cfg) -> type[LlamaForCausalLM]:
    model_type = cfg.text_config.model_type
    if model_type not in LANGUAGE_MODELS:
        raise ValueError(f"LLaVA with a {model_type!r} language model is not supported; supported: "
                         f"{sorted(LANGUAGE_MODELS)}")
    return LANGUAGE_MODELS[model_type]


class LlavaForConditionalGeneration(nn.Module):
    """Vision tower + projector + language model; ``config`` is the whole LLaVA config."""

    is_multimodal = True

    def __init__(self, cfg, backend: AttentionBackend, max_position: int, tp: TensorParallelGroup,
                 ops: str = "native", stage: PipelineStage | None = None):
        super().__init__()
        from transformers import AutoModel
        self.check_config(cfg)
        self.config, self.tp, self.ops = cfg, tp, ops
        self.language_model = _language_model_class(cfg)(cfg.text_config, backend, max_position, tp, ops, stage)
        self.stage = self.language_model.stage
        cfg.vision_config._attn_implementation = "sdpa"
        self.vision_tower = AutoModel.from_config(cfg.vision_config)
        self.multi_modal_projector = self.make_projector(cfg)
        self.feature_layers = cfg.vision_feature_layer
        self.select_strategy = cfg.vision_feature_select_strategy
        # checkpoints name the tower "vision_tower.vision_model.*" (transformers 4) or "vision_tower.*"
        names = {n for n, _ in self.vision_tower.named_parameters()}
        self._tower_has_vision_model = any(n.startswith("vision_model.") for n in names)

    @staticmethod
    def make_projector(cfg) -> nn.Module:
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector
        return LlavaMultiModalProjector(cfg)

    @classmethod
    def check_config(cls, cfg) -> None:
        if cfg.vision_feature_select_strategy not in _SELECT_STRATEGIES:
            raise ValueError(f"vision_feature_select_strategy={cfg.vision_feature_select_strategy!r} is not "
                             f"supported: one of {_SELECT_STRATEGIES}")
        _language_model_class(cfg).check_config(cfg.text_config)

    @classmethod
    def attention_soft_cap(cls, cfg) -> float | None:
        return _language_model_class(cfg).attention_soft_cap(cfg.text_config)

    @staticmethod
    def image_rows(cfg, data: dict[str, torch.Tensor]) -> int:
        """Embedding rows ``encode_image`` gives for one image's processor tensors: one per patch
        (plus the CLS row under the "full" strategy)."""
        vc = cfg.vision_config
        height, width = data["pixel_values"].shape[-2:]
        return (height // vc.patch_size) * (width // vc.patch_size) + (cfg.vision_feature_select_strategy == "full")

    def dummy_image(self) -> dict[str, torch.Tensor]:
        """The largest image's processor tensors (for the runner's memory profile)."""
        size = self.config.vision_config.image_size
        return {"pixel_values": torch.zeros(1, 3, size, size)}

    @property
    def spec(self):
        return self.language_model.spec

    @property
    def model(self) -> nn.Module:
        """The decoder stack (what the runner compiles and the C decoder walks)."""
        return self.language_model.model

    def stage_layers(self) -> list[nn.Module]:
        return self.language_model.stage_layers()

    # ------------------------------------------------------------------ weights
    def checkpoint_weights(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor, object]]:
        for new, old in _RENAMES:
            if name.startswith(new):
                name = old + name.removeprefix(new)
                break
        if name.startswith("language_model."):
            for target, part, shard in self.language_model.checkpoint_weights(name.removeprefix("language_model."),
                                                                             tensor):
                yield "language_model." + target, part, shard
            return
        if name.startswith("vision_tower."):
            name = self._tower_name(name)
        yield name, tensor, None

    def _tower_name(self, name: str) -> str:
        rest = name.removeprefix("vision_tower.")
        has = rest.startswith("vision_model.")
        if has and not self._tower_has_vision_model:
            rest = rest.removeprefix("vision_model.")
        elif not has and self._tower_has_vision_model:
            rest = "vision_model." + rest
        return "vision_tower." + rest

    def stage_weight_name(self, name: str) -> str | None:
        if name.startswith("language_model."):
            inner = self.language_model.stage_weight_name(name.removeprefix("language_model."))
            return None if inner is None else "language_model." + inner
        return name

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def encode_image(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        """One image's embeddings ``[placeholder tokens, hidden]`` from its processor tensors."""
        return self.project(data["pixel_values"])[0]  # [patches, hidden]

    def project(self, pixels: torch.Tensor) -> torch.Tensor:
        """Tower tiles ``[tiles, 3, H, W]`` -> projected features ``[tiles, patches, hidden]``."""
        pixels = pixels.to(self.multi_modal_projector.linear_1.weight.dtype)
        out = self.vision_tower(pixels, output_hidden_states=True, return_dict=True)
        layers = [self.feature_layers] if isinstance(self.feature_layers, int) else list(self.feature_layers)
        feats = [out.hidden_states[i] for i in layers]  # each [tiles, 1 + patches, vision hidden]
        if self.select_strategy == "default":
            feats = [f[:, 1:] for f in feats]  # the CLS row has no placeholder
        return self.multi_modal_projector(torch.cat(feats, dim=-1))  # [tiles, patches, hidden]

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.model.embed(input_ids)  # [num_tokens, hidden]

    def forward(self, input_ids, positions, kv_caches, meta, intermediate=None, inputs_embeds=None):
        return self.language_model.model(input_ids, positions, kv_caches, meta, intermediate, inputs_embeds)

    def enable_fused_decode(self, backend: AttentionBackend) -> str | None:
        return self.language_model.enable_fused_decode(backend)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)


class LlavaNextForConditionalGeneration(LlavaForConditionalGeneration):
    """LLaVA-NeXT ("anyres"): the processor cuts an image into a base view plus a grid of tiles
    chosen from ``image_grid_pinpoints`` by the image's aspect ratio; the tiles' features are
    unpadded back to the image's aspect and each row of them ends with ``image_newline``. The
    packing is transformers' own (``LlavaNextModel.pack_image_features``), so the rows and their
    order are exactly the checkpoint's."""

    def __init__(self, cfg, backend: AttentionBackend, max_position: int, tp: TensorParallelGroup,
                 ops: str = "native", stage: PipelineStage | None = None):
        super().__init__(cfg, backend, max_position, tp, ops, stage)
        self.image_newline = nn.Parameter(torch.empty(cfg.text_config.hidden_size))

    @staticmethod
    def make_projector(cfg) -> nn.Module:
        from transformers.models.llava_next.modeling_llava_next import LlavaNextMultiModalProjector
        return LlavaNextMultiModalProjector(cfg)

    @classmethod
    def image_rows(cls, cfg, data: dict[str, torch.Tensor]) -> int:
        """The packed rows of one image: its tiles' features packed with a 1-wide stand-in."""
        vc = cfg.vision_config
        patches = (vc.image_size // vc.patch_size) ** 2 + (cfg.vision_feature_select_strategy == "full")
        tiles = _num_tiles(cfg, data)
        stand_in = torch.zeros(tiles, patches, 1)  # [tiles, patches, 1]: only the shapes matter
        return _pack(cfg, stand_in, data["image_sizes"], torch.zeros(1)).shape[0]

    def dummy_image(self) -> dict[str, torch.Tensor]:
        """The most tiles: the largest grid's, plus the base view."""
        size = self.config.vision_config.image_size
        height, width = max(self.config.image_grid_pinpoints, key=lambda hw: hw[0] * hw[1])
        tiles = (height // size) * (width // size) + 1
        return {"pixel_values": torch.zeros(1, tiles, 3, size, size), "image_sizes": torch.tensor([[height, width]])}

    @torch.inference_mode()
    def encode_image(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        tiles = _num_tiles(self.config, data)
        feats = self.project(data["pixel_values"][0, :tiles])  # [tiles, patches, hidden]: padding tiles dropped
        return _pack(self.config, feats, data["image_sizes"], self.image_newline)  # [rows, hidden]


def _num_tiles(cfg, data: dict[str, torch.Tensor]) -> int:
    """The image's real tiles (the processor pads a batch's images to the most tiles)."""
    from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches
    return image_size_to_num_patches(data["image_sizes"][0], cfg.image_grid_pinpoints, cfg.vision_config.image_size)


def _pack(cfg, feats: torch.Tensor, image_sizes: torch.Tensor, newline: torch.Tensor) -> torch.Tensor:
    from types import SimpleNamespace

    from transformers.models.llava_next.modeling_llava_next import LlavaNextModel
    owner = SimpleNamespace(config=cfg)  # pack_image_features reads only the config
    packed, _ = LlavaNextModel.pack_image_features(owner, [feats], image_sizes, cfg.vision_feature_select_strategy,
                                                   image_newline=newline)
    return packed[0] if isinstance(packed, (list, tuple)) else packed  # [rows, hidden]

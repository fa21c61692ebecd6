"""Gemma 3 with images (``Gemma3ForConditionalGeneration``): a SigLIP vision tower, a projector
that average-pools the tower's patch grid to ``mm_tokens_per_image`` rows, RMS-normalises them
(``mm_soft_emb_norm``) and projects them to the language model's width, and the Gemma 3 text
model (gemma3.py). The processor (``Gemma3Processor``) writes each image as
``\\n\\n<start_of_image>`` + ``mm_tokens_per_image`` image tokens + ``<end_of_image>\\n\\n``.

The tokens of one image attend to each other in both directions (transformers'
``token_type_ids`` block mask, OR'ed with the causal mask; on sliding-window layers the window
still applies): each image item is marked ``bidirectional``, so the scheduler never splits its
run across chunks and hands the attention per-token visible ends (attention/metadata.py).

Pan-and-scan (``mm_processor_kwargs={"do_pan_and_scan": True}``, off by default) crops a wide or
tall image: the processor writes the whole image's run, then one run per crop, and returns one
``pixel_values`` row per run in that order; ``split_images`` makes each row its own item, so each
crop is encoded, cached and attended to both ways on its own, as transformers does.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from pagedllm.attention.backend import AttentionBackend
from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.distributed.pipeline import PipelineStage
from pagedllm.models.gemma3 import Gemma3ForCausalLM
from pagedllm.models.vision_language import VisionLanguageModel
from pagedllm.multimodal.processor import image_tensors

# transformers 5 checkpoints ("model.language_model.*", top-level "lm_head") and the released ones
# ("language_model.model.*", "vision_tower.vision_model.*") -> the names used here; the first match wins
_RENAMES = (("model.language_model.", "language_model.model."), ("model.vision_tower.", "vision_tower."),
            ("model.multi_modal_projector.", "multi_modal_projector."), ("lm_head.", "language_model.lm_head."))


class Gemma3ForConditionalGeneration(VisionLanguageModel):
    """SigLIP tower + pooling projector + Gemma 3 text model; ``config`` is the whole Gemma 3 config."""

    bidirectional_images = True  # multimodal/processor.py marks the items (attention/metadata.py)

    def __init__(self, cfg, backend: AttentionBackend, max_position: int, tp: TensorParallelGroup,
                 ops: str = "native", stage: PipelineStage | None = None):
        super().__init__()
        from transformers import AutoModel
        from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector
        self.check_config(cfg)
        self.config, self.tp, self.ops = cfg, tp, ops
        cfg.text_config.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", True))
        self.language_model = Gemma3ForCausalLM(cfg.text_config, backend, max_position, tp, ops, stage)
        self.stage = self.language_model.stage
        cfg.vision_config._attn_implementation = "sdpa"
        self.vision_tower = AutoModel.from_config(cfg.vision_config)
        self.multi_modal_projector = Gemma3MultiModalProjector(cfg)
        # checkpoints name the tower "vision_tower.vision_model.*" (transformers 4) or "vision_tower.*" (5)
        names = [n for n, _ in self.vision_tower.named_parameters()]
        self._tower_prefix = "vision_model." if any(n.startswith("vision_model.") for n in names) else ""

    @classmethod
    def check_config(cls, cfg) -> None:
        Gemma3ForCausalLM.check_config(cfg.text_config)
        cap = getattr(cfg.text_config, "final_logit_softcapping", None)
        if cap is not None:  # released Gemma 3 checkpoints have null
            raise ValueError(f"text_config.final_logit_softcapping={cap!r} is not supported for Gemma 3 with images: "
                             "transformers' Gemma3ForConditionalGeneration never applies it; it must be null")
        vc = cfg.vision_config
        side, per_side = vc.image_size // vc.patch_size, int(cfg.mm_tokens_per_image ** 0.5)
        if per_side * per_side != cfg.mm_tokens_per_image or side % per_side:
            raise ValueError(f"mm_tokens_per_image={cfg.mm_tokens_per_image} must be a square whose side divides "
                             f"the tower's {side}x{side} patch grid")

    @classmethod
    def attention_soft_cap(cls, cfg) -> float | None:
        return None

    # ------------------------------------------------------------------ images (multimodal/processor.py)
    @staticmethod
    def image_rows(cfg, data: dict[str, torch.Tensor]) -> int:
        """Every image is pooled to ``mm_tokens_per_image`` rows."""
        return cfg.mm_tokens_per_image

    def dummy_image(self, max_rows: int) -> dict[str, torch.Tensor]:
        size = self.config.vision_config.image_size
        return {"pixel_values": torch.zeros(1, 3, size, size)}

    @staticmethod
    def split_images(cfg, out: Mapping, num_images: int) -> list[dict[str, torch.Tensor]]:
        """One ``pixel_values`` row per placeholder run: an image's, then (pan-and-scan) each of its crops'."""
        pixels = image_tensors(out).get("pixel_values")
        if pixels is None or pixels.shape[0] < num_images:
            raise ValueError(f"the processor returned no pixel_values row per image ({num_images} images)")
        return [{"pixel_values": pixels[i:i + 1].clone()} for i in range(pixels.shape[0])]

    @torch.inference_mode()
    def encode_pixels(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        """One image's embeddings ``[mm_tokens_per_image, hidden]`` (transformers' get_image_features)."""
        pixels = data["pixel_values"].to(self.multi_modal_projector.mm_input_projection_weight.dtype)
        hidden = self.vision_tower(pixel_values=pixels).last_hidden_state  # [1, patches, vision hidden]
        return self.multi_modal_projector(hidden)[0]  # [mm_tokens_per_image, hidden]

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """An image token id past the text vocabulary (transformers allows one) is looked up as
        token 0, as transformers does: its rows are replaced by image embeddings anyway."""
        if self.config.image_token_id >= self.language_model.model.embed_tokens.vocab_size:
            input_ids = input_ids.masked_fill(input_ids == self.config.image_token_id, 0)
        return super().embed_input_ids(input_ids)

    # ------------------------------------------------------------------ weights
    def checkpoint_weights(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor, object]]:
        name = self.renamed(name, _RENAMES)
        if name.startswith("language_model."):
            yield from self.language_weights(name, tensor)
            return
        if name.startswith("vision_tower."):
            rest = name.removeprefix("vision_tower.").removeprefix("vision_model.")
            name = "vision_tower." + self._tower_prefix + rest
        yield name, tensor, None

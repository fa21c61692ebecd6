"""What every vision-language model shares: a language model (``self.language_model``, one of
the decoder families) that the runner drives like a text model, plus a vision encoder the runner
calls once per image (``encode_image``) and whose rows replace the image placeholders' token
embeddings (``forward(inputs_embeds=...)``). Subclasses build the tower and say how an image's
processor tensors become rows (``image_rows``, ``encode_image``, ``dummy_image``)."""
from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from pagedllm.attention.backend import AttentionBackend


class VisionLanguageModel(nn.Module):
    is_multimodal = True
    language_model: nn.Module
    language_model_only = False  # vLLM's option: the tower and projector were dropped (drop_vision)

    def drop_vision(self) -> None:
        """vLLM's ``language_model_only``: every module and parameter but the language model goes
        (tower, projector, LLaVA-NeXT's newline row) right after the model is built and before the
        weights load (the constructors build them; dropping here needs no case per model), so the
        checkpoint's tower tensors are skipped (``stage_weight_name``) and never read; the engine
        refuses multimodal inputs (multimodal/processor.py)."""
        for name, _ in list(self.named_children()):
            if name != "language_model":
                delattr(self, name)
        for name, _ in list(self.named_parameters(recurse=False)):
            delattr(self, name)
        self.language_model_only = True

    @property
    def spec(self):
        return self.language_model.spec

    @property
    def model(self) -> nn.Module:
        """The decoder stack (what the runner compiles and the C decoder walks)."""
        return self.language_model.model

    def stage_layers(self) -> list[nn.Module]:
        return self.language_model.stage_layers()

    @staticmethod
    def renamed(name: str, renames: tuple[tuple[str, str], ...]) -> str:
        """``name`` with the first matching checkpoint prefix of ``renames`` replaced by ours (the
        transformers 5 layout ``model.language_model.`` etc. onto the module tree)."""
        for prefix, ours in renames:
            if name.startswith(prefix):
                return ours + name.removeprefix(prefix)
        return name

    def language_weights(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor, object]]:
        """A ``language_model.*`` checkpoint tensor through the language model's own mapping."""
        inner = name.removeprefix("language_model.")
        for target, part, shard in self.language_model.checkpoint_weights(inner, tensor):
            yield "language_model." + target, part, shard

    def stage_weight_name(self, name: str) -> str | None:
        if name.startswith("language_model."):
            inner = self.language_model.stage_weight_name(name.removeprefix("language_model."))
            return None if inner is None else "language_model." + inner
        return None if self.language_model_only else name  # the tower's and projector's: dropped

    @torch.inference_mode()
    def encode_image(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        """One image's (video's) embeddings ``[placeholder tokens, hidden]``: precomputed
        ``image_embeds`` / ``video_embeds`` as given (the tower is skipped; multimodal/embeds.py),
        else the tower's on its pixels."""
        if self.language_model_only:
            raise ValueError("language_model_only=True: this engine has no vision tower and takes no images or videos")
        embeds = data.get("image_embeds", data.get("video_embeds"))
        if embeds is not None:
            return embeds.to(self.language_model.model.embed_tokens.weight.dtype)
        return self.encode_pixels(data)

    def encode_pixels(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must encode its images")

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.model.embed(input_ids)  # [num_tokens, hidden]

    def forward(self, input_ids, positions, kv_caches, meta, intermediate=None, inputs_embeds=None):
        return self.language_model.model(input_ids, positions, kv_caches, meta, intermediate, inputs_embeds)

    def enable_fused_decode(self, backend: AttentionBackend) -> str | None:
        return self.language_model.enable_fused_decode(backend)

    def disable_fused_decode(self) -> None:
        self.language_model.disable_fused_decode()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)

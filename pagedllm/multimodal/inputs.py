"""One image of a prompt, as the engine carries it: its content hash, where its placeholder
tokens sit in the prompt, and the processor's tensors the vision tower reads."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np
import torch
from PIL import Image


@dataclass(frozen=True)
class MultiModalItem:
    """An image's placeholder run ``[offset, offset + length)`` in the prompt and its inputs.

    ``hash`` names the image's content (and the processor options that shaped its tensors): the
    encoder cache and the prefix cache key on it, so the same image is encoded once and shares KV.
    """

    hash: bytes
    offset: int
    length: int
    # the processor's per-image tensors, batch dim 1 (``pixel_values`` [1, 3, H, W], ...)
    data: dict[str, torch.Tensor] = field(compare=False, repr=False)

    @property
    def end(self) -> int:
        return self.offset + self.length

    def overlaps(self, start: int, end: int) -> bool:
        return self.offset < end and start < self.end


def to_pil_images(value: object) -> list[Image.Image]:
    """``multi_modal_data["image"]``: one image or a list of them, each a PIL image, an HWC uint8
    array or a CHW/HWC tensor (vLLM's accepted shapes), as RGB PIL images."""
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    if not items:
        raise ValueError("multi_modal_data['image'] is an empty list; give at least one image or leave it out")
    return [_to_pil(item, i) for i, item in enumerate(items)]


def _to_pil(item: object, index: int) -> Image.Image:
    if isinstance(item, Image.Image):
        return item.convert("RGB")
    if isinstance(item, torch.Tensor):
        item = item.detach().cpu()
        if item.ndim == 3 and item.shape[0] in (1, 3, 4) and item.shape[-1] not in (1, 3, 4):
            item = item.permute(1, 2, 0)  # CHW -> HWC
        item = item.numpy()
    if isinstance(item, np.ndarray):
        return _array_to_pil(item, index)
    raise ValueError(f"multi_modal_data['image'][{index}] is a {type(item).__name__}: an image must be a "
                     "PIL.Image, a numpy array (HWC) or a torch tensor (CHW or HWC)")


def _array_to_pil(array: np.ndarray, index: int) -> Image.Image:
    if array.ndim == 3 and array.shape[-1] == 1:
        array = array[..., 0]
    if array.ndim not in (2, 3) or (array.ndim == 3 and array.shape[-1] not in (3, 4)):
        raise ValueError(f"multi_modal_data['image'][{index}] has shape {list(array.shape)}: an array image must "
                         "be HxW, HxWx1, HxWx3 or HxWx4")
    if array.dtype != np.uint8:
        if np.issubdtype(array.dtype, np.floating) and array.size and array.min() >= 0 and array.max() <= 1:
            array = array * 255  # floats in [0, 1], as torchvision's ToTensor makes them
        array = np.clip(np.rint(array), 0, 255).astype(np.uint8)
    return Image.fromarray(array).convert("RGB")


def image_hash(image: Image.Image, options: dict) -> bytes:
    """SHA-256 of the RGB pixels, the size and the processor options (which change the embeddings)."""
    digest = hashlib.sha256()
    digest.update(repr((image.size, sorted(options.items(), key=str))).encode())
    digest.update(image.tobytes())
    return digest.digest()

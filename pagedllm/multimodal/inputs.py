"""One image (or video, or image crop) of a prompt, as the engine carries it: its content hash,
where its placeholder tokens sit in the prompt, and the processor's tensors the vision tower reads."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np
import torch
from PIL import Image


@dataclass(frozen=True)
class MultiModalItem:
    """An image's (a video's, a crop's) placeholder run ``[offset, offset + length)`` in the
    prompt and its inputs.

    ``hash`` names the image's content (and the processor options that shaped its tensors; a
    video's temporal spacing): the encoder cache and the prefix cache key on it, so the same image
    is encoded once and shares KV.
    """

    hash: bytes
    offset: int
    length: int
    # the processor's per-image tensors (``pixel_values`` [1, 3, H, W], ...; Qwen2-VL: [patches, dim])
    data: dict[str, torch.Tensor] = field(compare=False, repr=False)
    # M-RoPE models: the run's (t, h, w) token grid (multimodal/mrope.py), and the temporal spacing
    grid: tuple[int, int, int] | None = None
    time_interval: float = 1.0
    # Gemma 3: the run's tokens attend to each other in both directions (attention/metadata.py's
    # attend_ends), so the scheduler never splits the run across chunks
    bidirectional: bool = False
    # "image" (an image or a crop of one) or "video"; a video's frames (0 for precomputed video_embeds),
    # which the encoder cache's metrics count
    modality: str = "image"
    frames: int = 0

    @property
    def end(self) -> int:
        return self.offset + self.length

    def overlaps(self, start: int, end: int) -> bool:
        return self.offset < end and start < self.end


def cut_before_split_runs(items, start: int, num_new: int, every_item: bool = False) -> int:
    """``num_new`` cut so that the chunk ``[start, start + num_new)`` does not end inside a
    bidirectional run (with ``every_item``, vLLM's disable_chunked_mm_input: inside any item's
    run): it stops before the run (0 when the chunk starts inside it and cannot reach its end
    this step; the request then waits for a step with the budget left, which comes: the input
    processor refuses a run longer than a whole step's budget, max_item_tokens)."""
    end = start + num_new
    for item in items:
        if (every_item or item.bidirectional) and item.offset < end < item.end:
            return max(0, item.offset - start)
    return num_new


def attend_ends(items, start: int, num_new: int):
    """The chunk's per-token visible ends (attention/metadata.py), or None without a
    bidirectional run in it: ``position + 1``, an image token's run end."""
    runs = [m for m in items if m.bidirectional and m.overlaps(start, start + num_new)]
    if not runs:
        return None
    ends = np.arange(start + 1, start + num_new + 1, dtype=np.int32)
    for m in runs:
        ends[max(m.offset, start) - start:min(m.end, start + num_new) - start] = m.end
    return ends


def to_pil_images(value: object) -> list[Image.Image]:
    """``multi_modal_data["image"]``: one image or a list of them, each a PIL image, an HWC uint8
    array or a CHW/HWC tensor (vLLM's accepted shapes), as RGB PIL images."""
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    if not items:
        raise ValueError("multi_modal_data['image'] is an empty list; give at least one image or leave it out")
    return [to_pil(item, f"multi_modal_data['image'][{i}]") for i, item in enumerate(items)]


def to_pil(item: object, name: str) -> Image.Image:
    """One image (or video frame) as RGB; ``name`` says where it was, for the error."""
    if isinstance(item, Image.Image):
        return item.convert("RGB")
    if isinstance(item, torch.Tensor):
        item = item.detach().cpu()
        if item.ndim == 3 and item.shape[0] in (1, 3, 4) and item.shape[-1] not in (1, 3, 4):
            item = item.permute(1, 2, 0)  # CHW -> HWC
        item = item.numpy()
    if isinstance(item, np.ndarray):
        return _array_to_pil(item, name)
    raise ValueError(f"{name} is a {type(item).__name__}: an image must be a "
                     "PIL.Image, a numpy array (HWC) or a torch tensor (CHW or HWC)")


def _array_to_pil(array: np.ndarray, name: str) -> Image.Image:
    if array.ndim == 3 and array.shape[-1] == 1:
        array = array[..., 0]
    if array.ndim not in (2, 3) or (array.ndim == 3 and array.shape[-1] not in (3, 4)):
        raise ValueError(f"{name} has shape {list(array.shape)}: an array image must "
                         "be HxW, HxWx1, HxWx3 or HxWx4")
    if array.dtype != np.uint8:
        if np.issubdtype(array.dtype, np.floating) and array.size and array.min() >= 0 and array.max() <= 1:
            array = array * 255  # floats in [0, 1], as torchvision's ToTensor makes them
        array = np.clip(np.rint(array), 0, 255).astype(np.uint8)
    return Image.fromarray(array).convert("RGB")


def tensors_hash(tag: bytes, data: dict[str, torch.Tensor]) -> bytes:
    """SHA-256 of ``tag`` and every tensor of ``data`` (name, dtype, shape, bytes), in name order."""
    digest = hashlib.sha256(tag)
    for key in sorted(data):
        tensor = data[key].detach().cpu().contiguous()
        digest.update(repr((key, str(tensor.dtype), tuple(tensor.shape))).encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.dtype == torch.bfloat16
                      else tensor.numpy().tobytes())
    return digest.digest()


def image_hash(image: Image.Image, options: dict) -> bytes:
    """SHA-256 of the RGB pixels, the size and the processor options (which change the embeddings)."""
    digest = hashlib.sha256()
    digest.update(repr((image.size, sorted(options.items(), key=str))).encode())
    digest.update(image.tobytes())
    return digest.digest()

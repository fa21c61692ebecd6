"""Videos as frames (Qwen2-VL, Qwen2.5-VL): vLLM's ``multi_modal_data={"video": ...}`` shapes parsed
into frames, a video's content hash, and a video processor for a checkpoint whose processor has
none here.

transformers' own video processor (``Qwen2VLVideoProcessor``) needs torchvision; where torchvision
cannot be imported (PyPI's torchvision wheels need CUDA torch: they do not load on CPU-only torch),
``FramesVideoProcessor`` stands in: every frame goes through the checkpoint's image processor
(transformers' resize, rescale and normalise, with the same options as the prompt's images), and
consecutive frames are paired into the tower's temporal patches exactly as the video processor's
``patchify`` lays them out (the last frame repeated to a multiple of ``temporal_patch_size``). The
HF processor's own ``__call__`` still expands each ``<|video_pad|>`` and computes
``second_per_grid_ts``, so only the pixel path differs: frames are resized with PIL's bicubic
filter instead of torchvision's, which may change a pixel value by a rounding step.
"""
from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import numpy as np
import torch
from PIL import Image

from pagedllm.multimodal.inputs import image_hash, to_pil

# transformers' VideoMetadata fields (vLLM passes a video's metadata in the same shape)
METADATA_KEYS = frozenset({"total_num_frames", "fps", "width", "height", "duration", "video_backend", "frames_indices"})


def parse_videos(value: object) -> tuple[list[list[Image.Image]], list[dict]]:
    """``multi_modal_data["video"]`` -> each video's frames and metadata. A video is given as in
    ``to_videos``, or as vLLM's ``(video, metadata)`` pair whose dict holds transformers'
    ``VideoMetadata`` fields (``fps``: the sampled frames' rate, which spaces Qwen2.5-VL's temporal
    positions); a video without metadata gets what transformers infers (no frame rate)."""
    pairs = [value] if _is_pair(value) else list(value) if isinstance(value, (list, tuple)) else None
    if pairs is None or not any(_is_pair(p) for p in pairs):
        videos = to_videos(value)
        return videos, [default_metadata(frames) for frames in videos]
    videos, metadata = [], []
    for i, item in enumerate(pairs):
        video, meta = item if _is_pair(item) else (item, None)
        frames = to_videos([video] if isinstance(video, (list, tuple)) else video)
        if len(frames) != 1:
            raise ValueError(f"multi_modal_data['video'][{i}] must be one video (frames) with its metadata")
        videos.append(frames[0])
        metadata.append({**default_metadata(frames[0]), **_checked_metadata(meta, i)})
    return videos, metadata


def _is_pair(value: object) -> bool:
    return isinstance(value, tuple) and len(value) == 2 and (value[1] is None or isinstance(value[1], Mapping))


def _checked_metadata(meta: Mapping | None, index: int) -> dict:
    unknown = sorted(set(meta or {}) - METADATA_KEYS, key=str)
    if unknown:
        raise ValueError(f"multi_modal_data['video'][{index}] metadata has {unknown}: the keys are "
                         f"{sorted(METADATA_KEYS)}")
    fps = (meta or {}).get("fps")
    if fps is not None and (isinstance(fps, bool) or not isinstance(fps, (int, float)) or not fps > 0):
        raise ValueError(f"multi_modal_data['video'][{index}] metadata fps={fps!r} must be a number > 0")
    return dict(meta or {})


def default_metadata(frames: Sequence[Image.Image]) -> dict:
    """What transformers infers for frames given without metadata (every frame kept, no frame rate)."""
    return {"total_num_frames": len(frames), "fps": None, "frames_indices": list(range(len(frames))),
            "height": frames[0].height, "width": frames[0].width}


def to_videos(value: object) -> list[list[Image.Image]]:
    """``multi_modal_data["video"]``: one video or a list of them, as lists of RGB PIL frames. A
    video is a ``[T, H, W, C]`` array / tensor (``[T, C, H, W]`` too), or a list of frames (PIL
    images, ``HWC`` arrays, ``CHW`` / ``HWC`` tensors); a list of such videos is several."""
    if _is_clip(value):
        return [_frames(value, 0)]
    if isinstance(value, (list, tuple)) and value and all(_is_clip(v) or isinstance(v, (list, tuple)) for v in value):
        return [_frames(v, i) for i, v in enumerate(value)]
    if isinstance(value, (list, tuple)) and value:
        return [_frames(value, 0)]  # one video, as a list of frames
    raise ValueError(f"multi_modal_data['video']={value!r:.80} must be a video ([T, H, W, 3] array or tensor, or a "
                     "non-empty list of frames) or a non-empty list of videos")


def _is_clip(value: object) -> bool:
    return isinstance(value, (np.ndarray, torch.Tensor)) and value.ndim == 4


def _frames(video: object, index: int) -> list[Image.Image]:
    frames = list(video)
    if not frames:
        raise ValueError(f"multi_modal_data['video'][{index}] has no frames")
    pil = [to_pil(frame, f"multi_modal_data['video'][{index}][{t}]") for t, frame in enumerate(frames)]
    sizes = {frame.size for frame in pil}
    if len(sizes) > 1:
        raise ValueError(f"multi_modal_data['video'][{index}] has frames of sizes {sorted(sizes)}: all frames of a "
                         "video must have one size")
    return pil


def video_hash(frames: Sequence[Image.Image], options: dict, time_interval: float) -> bytes:
    """SHA-256 over every frame (pixels, size, processor options) and the temporal spacing of the
    video's M-RoPE positions (it changes the keys, so two videos that differ only in it never share KV)."""
    digest = hashlib.sha256(repr(("video", len(frames), float(time_interval))).encode())
    for frame in frames:
        digest.update(image_hash(frame, options))
    return digest.digest()


class FramesVideoProcessor:
    """A Qwen2-VL video processor made of the checkpoint's image processor (see the module doc);
    called by the HF processor as its ``video_processor``."""

    def __init__(self, image_processor):
        self.image_processor = image_processor
        self.merge_size = image_processor.merge_size
        self.temporal_patch_size = image_processor.temporal_patch_size

    def __call__(self, videos: list[list[Image.Image]], return_metadata: bool = False, return_tensors=None,
                 video_metadata=None, **options):
        """``options``: the image processor's (MultiModalProcessor checked them), applied to every frame."""
        from transformers import BatchFeature
        from transformers.video_utils import make_batched_metadata
        videos = to_videos(videos)  # as the HF processor batched them (frames: PIL images or arrays)
        patches, grids = zip(*(self._video(frames, options) for frames in videos))
        out = BatchFeature({"pixel_values_videos": np.concatenate(patches), "video_grid_thw": np.array(grids)},
                           tensor_type=return_tensors)
        if return_metadata:  # Qwen2.5-VL's processor derives second_per_grid_ts from the frame rate
            metadata = video_metadata or [default_metadata(frames) for frames in videos]
            out["video_metadata"] = make_batched_metadata(videos, video_metadata=metadata)
        return out

    def _video(self, frames: list[Image.Image], options: Mapping) -> tuple[np.ndarray, list[int]]:
        """One video's patches ``[grid_t * grid_h * grid_w, C * tp * p * p]`` and its grid."""
        tp, patch = self.temporal_patch_size, self.image_processor.patch_size
        frames = frames + frames[-1:] * (-len(frames) % tp)  # the last frame repeated, as the video processor does
        out = self.image_processor(images=frames, return_tensors="np", **options)
        _, grid_h, grid_w = (int(v) for v in out["image_grid_thw"][0])
        pixels = out["pixel_values"]  # [frames * grid_h * grid_w, C * tp * p * p]: each frame repeated tp times
        pixels = pixels.reshape(len(frames), grid_h * grid_w, -1, tp, patch, patch)[:, :, :, 0]  # [T, N, C, p, p]
        grid_t = len(frames) // tp
        pixels = pixels.reshape(grid_t, tp, grid_h * grid_w, -1, patch, patch)  # [t, tp, N, C, p, p]
        pixels = pixels.transpose(0, 2, 3, 1, 4, 5)  # [t, N, C, tp, p, p]: the video processor's patch layout
        return pixels.reshape(grid_t * grid_h * grid_w, -1), [grid_t, grid_h, grid_w]

"""Video inputs without a model: FramesVideoProcessor's patches are laid out as transformers' video
processor lays them out ([C, temporal_patch_size, p, p] per patch, frames paired in order), the
shapes vLLM takes parse to frames and metadata, and a video file keeps at most MAX_VIDEO_FRAMES
evenly spaced frames with its frame rate."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from pagedllm.multimodal.video import FramesVideoProcessor, parse_videos
from tests.multimodal.qwen2_vl_fixtures import MAX_PIXELS, MERGE, MIN_PIXELS, PATCH, make_video


@pytest.fixture(scope="module")
def image_processor():
    import transformers as tf
    return tf.Qwen2VLImageProcessorPil(patch_size=PATCH, merge_size=MERGE, temporal_patch_size=2,
                                       min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)


def _image_patches(image_processor, frame) -> np.ndarray:
    """One frame as an image: ``[N, C, tp, p, p]``, the frame repeated along tp."""
    out = image_processor(images=[frame], return_tensors="np")
    return out["pixel_values"].reshape(out["pixel_values"].shape[0], 3, 2, PATCH, PATCH)


def test_frames_pair_into_temporal_patches(image_processor):
    """Frames (a, b, c): t=0 holds a then b along tp, t=1 holds c twice (the last frame repeated);
    the patch order within a frame is the image processor's (merge groups first)."""
    clip = make_video(1, frames=3)
    out = FramesVideoProcessor(image_processor)([list(clip)], return_tensors="pt")
    grid_t, grid_h, grid_w = out["video_grid_thw"][0].tolist()
    assert (grid_t, grid_h, grid_w) == (2, 10, 8)  # patches: 5 x 4 tokens after the 2x2 merge
    assert out["pixel_values_videos"].shape == (2 * 80, 3 * 2 * PATCH ** 2)
    patches = out["pixel_values_videos"].numpy().reshape(grid_t, grid_h * grid_w, 3, 2, PATCH, PATCH)
    a, b, c = (_image_patches(image_processor, frame)[:, :, 0] for frame in clip)
    np.testing.assert_array_equal(patches[0, :, :, 0], a)
    np.testing.assert_array_equal(patches[0, :, :, 1], b)
    np.testing.assert_array_equal(patches[1, :, :, 0], c)
    np.testing.assert_array_equal(patches[1, :, :, 1], c)


def test_video_shapes_parse_to_frames_and_metadata():
    clip = make_video(2, frames=4, size=(8, 12))
    as_tensor = torch.from_numpy(clip).permute(0, 3, 1, 2)  # [T, C, H, W]
    for value in (clip, list(clip), as_tensor, [clip]):
        videos, metadata = parse_videos(value)
        assert len(videos) == 1 and len(videos[0]) == 4 and videos[0][0].size == (12, 8)
        assert metadata == [{"total_num_frames": 4, "fps": None, "frames_indices": [0, 1, 2, 3], "height": 8,
                             "width": 12}]
    videos, metadata = parse_videos([clip, (clip[:2], {"fps": 2.0})])
    assert [len(v) for v in videos] == [4, 2] and [m["fps"] for m in metadata] == [None, 2.0]
    assert np.array_equal(np.asarray(videos[0][1]), clip[1])


def test_video_file_keeps_evenly_spaced_frames():
    av = pytest.importorskip("av")
    from pagedllm.entrypoints.openai.media import MAX_VIDEO_FRAMES, decode_video
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=10)
        stream.width, stream.height, stream.pix_fmt = 16, 8, "yuv420p"
        for frame in make_video(3, frames=40, size=(8, 16)):
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    frames, metadata = decode_video(buf.getvalue(), "data:video/mp4;base64,...")
    assert frames.shape == (MAX_VIDEO_FRAMES, 8, 16, 3)
    assert metadata["total_num_frames"] == 40 and metadata["fps"] == 10.0
    indices = metadata["frames_indices"]
    assert len(indices) == MAX_VIDEO_FRAMES and indices[0] == 0 and indices[-1] == 39
    assert 1 <= min(np.diff(indices)) and max(np.diff(indices)) <= 2

"""The server with a Qwen2.5-VL model and the real openai client: video_url parts (vLLM's
data:video/jpeg frames, an mp4 file under --allowed-local-media-path, decoded with PyAV) become the
model's video tokens and the reply equals transformers' generate on the same frames (and, for a
file, its frame rate); too many videos and corrupt ones are 400s."""
from __future__ import annotations

import base64
import io

import numpy as np
import openai
import pytest

from tests.multimodal import qwen2_vl_fixtures
from tests.multimodal.llava_fixtures import make_image
from tests.multimodal.qwen2_vl_fixtures import PLACEHOLDER, VIDEO, hf_generate, jpeg_frames_url, load_hf, make_video
from tests.multimodal.test_llava_server import MAX_NEW, _data_url
from tests.server.live_server import CHAT_TEMPLATE, start_server

qwen2_5_vl_dir = qwen2_vl_fixtures.qwen2_5_vl_dir  # fixture
av = pytest.importorskip("av")  # the video extra (and the test extra): decoding video files


def _mp4(clip: np.ndarray, rate: int) -> bytes:
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=rate)
        stream.width, stream.height, stream.pix_fmt = clip.shape[2], clip.shape[1], "yuv420p"
        for frame in clip:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return buf.getvalue()


def _decoded(data: bytes) -> np.ndarray:
    """The file's frames as PyAV decodes them (the lossy codec changed the pixels)."""
    with av.open(io.BytesIO(data)) as container:
        return np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("videos")
    (path / "clip.mp4").write_bytes(_mp4(make_video(7, frames=6), rate=2))
    return path


@pytest.fixture(scope="module")
def client(qwen2_5_vl_dir, media_dir):
    srv = start_server(qwen2_5_vl_dir, chat_template=CHAT_TEMPLATE, max_model_len=256, max_num_batched_tokens=64,
                       limit_mm_per_prompt={"image": 1, "video": 1}, allowed_local_media_path=str(media_dir))
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    srv.stop()


@pytest.fixture(scope="module")
def hf(qwen2_5_vl_dir):
    return load_hf(qwen2_5_vl_dir)


def _chat(client, parts: list[dict]):
    parts = parts + [{"type": "text", "text": "what is this?"}]
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": parts}],
                                          max_tokens=MAX_NEW, temperature=0, extra_body={"return_token_ids": True})


def _video(url: str) -> dict:
    return {"type": "video_url", "video_url": {"url": url}}


def test_jpeg_frames_and_an_image_match_transformers(client, hf):
    url, frames = jpeg_frames_url(make_video(3))
    image = make_image(4)
    out = _chat(client, [_video(url), {"type": "image_url", "image_url": {"url": _data_url(image)}}])
    text = f"<s>user: {VIDEO}\n{PLACEHOLDER}\nwhat is this?\nassistant:"
    assert out.choices[0].token_ids == hf_generate(hf, text, [image], MAX_NEW, [frames])
    assert out.usage.prompt_tokens > 40  # the video's 2 x 5 x 4 tokens are counted


def test_mp4_file_with_its_frame_rate(client, hf, media_dir):
    """A file's frames (PyAV) and its rate (2 fps: second_per_grid_ts 1) give transformers' tokens."""
    frames = _decoded((media_dir / "clip.mp4").read_bytes())
    out = _chat(client, [_video(f"file://{media_dir}/clip.mp4")])
    metadata = [{"total_num_frames": len(frames), "fps": 2.0, "frames_indices": list(range(len(frames)))}]
    text = f"<s>user: {VIDEO}\nwhat is this?\nassistant:"
    assert out.choices[0].token_ids == hf_generate(hf, text, [], MAX_NEW, [frames],
                                                   videos_kwargs={"video_metadata": metadata})


def test_too_many_videos_is_a_400_naming_the_limit(client):
    url, _ = jpeg_frames_url(make_video(1, frames=2))
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, [_video(url), _video(url)])
    assert info.value.body["param"] == "limit_mm_per_prompt" and "{'video': 1}" in info.value.body["message"]


@pytest.mark.parametrize("url, match", [
    ("data:video/mp4;base64," + base64.b64encode(b"not a video at all").decode(), "not a readable video"),
    ("data:video/jpeg;base64,aGVsbG8=,aGVsbG8=", "not a readable image"),
    ("http://example.com/clip.mp4", "allowed-media-domains"),
])
def test_bad_videos_are_400s(client, url, match):
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, [_video(url)])
    assert info.value.body["param"] == "messages" and match in info.value.body["message"]


def test_tokenize_refuses_video_parts(client):
    import httpx
    url, _ = jpeg_frames_url(make_video(1, frames=2))
    messages = [{"role": "user", "content": [_video(url)]}]
    base = str(client.base_url).removesuffix("/v1/")
    r = httpx.post(f"{base}/tokenize", json={"model": "tiny", "messages": messages})
    assert r.status_code == 400 and "does not process images or videos" in r.json()["error"]["message"]


def _encoded(client) -> tuple[float, ...]:
    """/metrics' images, videos and video frames encoded (prometheus_client parses the scrape)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(str(client.base_url).removesuffix("/v1/") + "/metrics").text
    values = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}
    return tuple(values[f"pagedllm:mm_{name}_encoded_total"] for name in ("images", "videos", "video_frames"))


def test_metrics_count_videos_and_images_apart(client):
    """A video request moves the video counters (one video, its 3 frames), an image request the image one."""
    before = _encoded(client)
    url, _ = jpeg_frames_url(make_video(81, frames=3))
    _chat(client, [_video(url)])
    after_video = _encoded(client)
    _chat(client, [{"type": "image_url", "image_url": {"url": _data_url(make_image(82))}}])
    after_image = _encoded(client)
    assert [a - b for a, b in zip(after_video, before)] == [0, 1, 3]
    assert [a - b for a, b in zip(after_image, after_video)] == [1, 0, 0]


def test_frame_sampling_kwargs_are_400s(client):
    """vLLM's num_frames / fps in mm_processor_kwargs are refused by name (every frame sent is kept)."""
    url, _ = jpeg_frames_url(make_video(1, frames=2))
    messages = [{"role": "user", "content": [_video(url)]}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", max_tokens=2, messages=messages,
                                       extra_body={"mm_processor_kwargs": {"num_frames": 1}})
    assert "mm_processor_kwargs has ['num_frames']: videos are not resampled here" in info.value.body["message"]

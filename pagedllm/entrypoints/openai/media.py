"""Images and videos of chat content parts (``image_url``, ``video_url``): where they may come
from, and their bytes.

- ``data:`` URLs (base64) always;
- ``file://`` URLs only under the engine's ``allowed_local_media_path`` (its real path, so a
  symlink or ``..`` cannot leave it);
- ``http(s)://`` URLs only from a host in ``allowed_media_domains``, with redirects refused (a
  redirect could lead to any host), a download timeout (PAGEDLLM_MEDIA_FETCH_TIMEOUT) and a size
  limit (PAGEDLLM_MAX_MEDIA_BYTES, which bounds the other sources too).

The server never fetches from a host it was not told to trust. Fetching and decoding run on
worker threads, so a large image never stalls the event loop (or the streams it serves).

A video is either frames, as vLLM sends them (``data:video/jpeg;base64,<frame>,<frame>,...``: each
frame a base64 image), or a video file (mp4, webm, ...) decoded with PyAV (the ``video`` extra),
of which at most ``MAX_VIDEO_FRAMES`` frames are kept, evenly spaced (vLLM's default ``num_frames``),
with the file's frame rate as the video's metadata.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import io
import os
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass

import numpy as np
from PIL import Image

from pagedllm import envs

from .request_fields import RequestFieldError

PARAM = "messages"
MAX_VIDEO_FRAMES = 32


@dataclass(frozen=True)
class MediaPolicy:
    local_path: str | None = None  # a real directory path, or None: no file:// URLs
    domains: tuple[str, ...] = ()  # hosts for http(s) URLs
    max_bytes: int = 20 * 2**20
    timeout: float = 5.0

    @classmethod
    def of(cls, model_config) -> MediaPolicy:
        return cls(model_config.allowed_local_media_path, tuple(model_config.allowed_media_domains),
                   envs.PAGEDLLM_MAX_MEDIA_BYTES, envs.PAGEDLLM_MEDIA_FETCH_TIMEOUT)


async def load_images(urls: list[str], policy: MediaPolicy) -> list[Image.Image]:
    """Every URL's image (RGB), fetched and decoded on worker threads; RequestFieldError (a 400)
    for a refused source, a failed download or bytes that are not an image."""
    return list(await asyncio.gather(*(asyncio.to_thread(load_image, url, policy) for url in urls)))


def load_image(url: str, policy: MediaPolicy) -> Image.Image:
    return decode_image(image_bytes(url, policy), url)


async def load_videos(urls: list[str], policy: MediaPolicy) -> list[tuple[np.ndarray, dict]]:
    """Every URL's video as vLLM's ``(frames [T, H, W, 3], metadata)`` pair, on worker threads;
    RequestFieldError (a 400) as for images, and for a file that is not a readable video."""
    return list(await asyncio.gather(*(asyncio.to_thread(load_video, url, policy) for url in urls)))


def load_video(url: str, policy: MediaPolicy) -> tuple[np.ndarray, dict]:
    header = url.partition(",")[0].lower()
    if header.startswith("data:video/jpeg") or header.startswith("data:video/png"):  # vLLM's frames URL
        frames = [decode_image(base64_bytes(payload, url, policy, "video_url"), url, "video_url")
                  for payload in _data_payload(url, policy, "video_url").split(",")]
        if len({frame.size for frame in frames}) > 1:
            raise RequestFieldError(f"video_url {_short(url)}: its frames differ in size", PARAM)
        return np.stack([np.asarray(frame) for frame in frames]), {}
    return decode_video(image_bytes(url, policy, "video_url"), url)


def image_bytes(url: str, policy: MediaPolicy, part: str = "image_url") -> bytes:
    scheme = urllib.parse.urlsplit(url).scheme.lower()
    if scheme == "data":
        return base64_bytes(_data_payload(url, policy, part), url, policy, part)
    if scheme == "file":
        return _file_bytes(url, policy, part)
    if scheme in ("http", "https"):
        return _fetch(url, policy, part)
    raise RequestFieldError(f"{part} {_short(url)} has scheme {scheme!r}: use a data: URL (base64), a file:// URL "
                            "under --allowed-local-media-path or an http(s) URL of an --allowed-media-domains host",
                            PARAM)


def decode_image(data: bytes, url: str, part: str = "image_url") -> Image.Image:
    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.convert("RGB")  # decodes every pixel: a truncated file fails here
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise RequestFieldError(f"{part} {_short(url)} is not a readable image: {exc}", PARAM) from None


def decode_video(data: bytes, url: str) -> tuple[np.ndarray, dict]:
    """A video file's frames ``[T, H, W, 3]`` (at most MAX_VIDEO_FRAMES, evenly spaced: only those are
    kept while decoding) and its metadata (frame count, rate, the kept frames' indices)."""
    try:
        import av
    except ImportError:
        raise RequestFieldError(f"video_url {_short(url)} is a video file: decoding it needs PyAV (pip install "
                                "'pagedllm[video]'); or send its frames as data:video/jpeg;base64,<frame>,<frame>,...",
                                PARAM) from None
    try:
        total = _count_frames(av, data)
        keep = set(np.linspace(0, total - 1, min(total, MAX_VIDEO_FRAMES)).round().astype(int).tolist())
        with av.open(io.BytesIO(data)) as container:
            stream = container.streams.video[0]
            rate = float(stream.average_rate) if stream.average_rate else None
            frames = [frame.to_ndarray(format="rgb24") for i, frame in enumerate(container.decode(stream))
                      if i in keep]
    except (av.FFmpegError, IndexError, ValueError) as exc:
        raise RequestFieldError(f"video_url {_short(url)} is not a readable video: {exc}", PARAM) from None
    if not frames:
        raise RequestFieldError(f"video_url {_short(url)} has no video frames", PARAM)
    return np.stack(frames), {"total_num_frames": total, "fps": rate, "frames_indices": sorted(keep)[:len(frames)]}


def _count_frames(av, data: bytes) -> int:
    """The video stream's frames, from its packets (no decoding); the container's count can be missing."""
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        return sum(1 for packet in container.demux(stream) if packet.size)


def _data_payload(url: str, policy: MediaPolicy, part: str) -> str:
    header, sep, payload = url.partition(",")
    if not sep or not header.endswith(";base64"):
        raise RequestFieldError(f"{part} {_short(url)}: a data: URL must be base64 (data:image/...;base64,...)",
                                PARAM)
    if len(payload) * 3 // 4 > policy.max_bytes:
        raise RequestFieldError(f"{part} data is over {policy.max_bytes} bytes (PAGEDLLM_MAX_MEDIA_BYTES)", PARAM)
    return payload


def base64_bytes(payload: str, url: str, policy: MediaPolicy, part: str) -> bytes:
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise RequestFieldError(f"{part} {_short(url)}: its data is not valid base64", PARAM) from None


def _file_bytes(url: str, policy: MediaPolicy, part: str) -> bytes:
    if policy.local_path is None:
        raise RequestFieldError(f"file:// {part} URLs are refused: the server was not started with "
                                "--allowed-local-media-path", PARAM)
    path = os.path.realpath(urllib.parse.unquote(urllib.parse.urlsplit(url).path))
    if os.path.commonpath([path, policy.local_path]) != policy.local_path:
        raise RequestFieldError(f"{part} {_short(url)} is outside --allowed-local-media-path", PARAM)
    try:
        if os.path.getsize(path) > policy.max_bytes:
            raise RequestFieldError(f"{part} {_short(url)} is over {policy.max_bytes} bytes "
                                    "(PAGEDLLM_MAX_MEDIA_BYTES)", PARAM)
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise RequestFieldError(f"{part} {_short(url)} cannot be read: {exc.strerror}", PARAM) from None


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        raise urllib.error.HTTPError(req.full_url, code, f"redirect to {newurl!r} refused", headers, fp)


_OPENER = urllib.request.build_opener(_NoRedirects)


def _fetch(url: str, policy: MediaPolicy, part: str) -> bytes:
    host = (urllib.parse.urlsplit(url).hostname or "").lower()
    if host not in {d.lower() for d in policy.domains}:
        raise RequestFieldError(f"{part} host {host!r} is not allowed: the server fetches media only from "
                                "--allowed-media-domains hosts (send it as a base64 data: URL instead)", PARAM)
    try:
        with _OPENER.open(url, timeout=policy.timeout) as response:
            data = response.read(policy.max_bytes + 1)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise RequestFieldError(f"{part} {_short(url)} could not be fetched: {exc}", PARAM) from None
    if len(data) > policy.max_bytes:
        raise RequestFieldError(f"{part} {_short(url)} is over {policy.max_bytes} bytes (PAGEDLLM_MAX_MEDIA_BYTES)",
                                PARAM)
    return data


def _short(url: str) -> str:
    return repr(url if len(url) <= 80 else url[:77] + "...")

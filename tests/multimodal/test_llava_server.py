"""The server with a LLaVA model and the real openai client: base64 / local-file / allowed-host
image_url parts give transformers' output; other sources, too many images and corrupt images
are 400s naming what to change."""
from __future__ import annotations

import base64
import functools
import http.server
import io
import threading

import openai
import pytest

from tests.multimodal.llava_fixtures import hf_generate, llava_dir, llava_hf, make_image  # noqa: F401 - fixtures
from tests.server.live_server import CHAT_TEMPLATE, live_server, server_model_dir, start_server  # noqa: F401 - fixtures

MAX_NEW = 8


def _png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _data_url(image) -> str:
    return "data:image/png;base64," + base64.b64encode(_png(image)).decode()


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("media")
    (path / "a.png").write_bytes(_png(make_image(61)))
    return path


@pytest.fixture(scope="module")
def image_host(media_dir):
    """A local HTTP server (127.0.0.1 only) serving media_dir."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(media_dir))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def server(llava_dir, media_dir):
    srv = start_server(llava_dir, chat_template=CHAT_TEMPLATE, max_model_len=256, max_num_batched_tokens=64,
                       limit_mm_per_prompt={"image": 2}, allowed_local_media_path=str(media_dir),
                       allowed_media_domains=["127.0.0.1"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _chat(client, urls: list[str], text: str = "what is this?"):
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls] + [{"type": "text", "text": text}]
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": parts}],
                                          max_tokens=MAX_NEW, temperature=0, extra_body={"return_token_ids": True})


def _rendered(num_images: int, text: str = "what is this?") -> str:
    """CHAT_TEMPLATE over one user message whose image parts became placeholders."""
    return "<s>user: " + "<image>\n" * num_images + text + "\nassistant:"


def _bad_request(client, urls: list[str]) -> dict:
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, urls)
    return info.value.body


def test_base64_image_matches_transformers(client, llava_hf):
    image = make_image(62)
    out = _chat(client, [_data_url(image)])
    assert out.choices[0].token_ids == hf_generate(llava_hf, _rendered(1), [image], MAX_NEW)


def test_two_images_and_other_sources(client, llava_hf, image_host, media_dir):
    """A local file (under --allowed-local-media-path) and an allowed host's URL give the same
    tokens as the same image sent inline."""
    expected = hf_generate(llava_hf, _rendered(2), [make_image(61), make_image(63)], MAX_NEW)
    for first in (_data_url(make_image(61)), f"file://{media_dir}/a.png", f"{image_host}/a.png"):
        assert _chat(client, [first, _data_url(make_image(63))]).choices[0].token_ids == expected


def test_sources_not_allowed_are_refused(client, media_dir, tmp_path):
    outside = tmp_path / "b.png"
    outside.write_bytes(_png(make_image(1)))
    assert "allowed-media-domains" in _bad_request(client, ["http://example.com/a.png"])["message"]
    assert "outside --allowed-local-media-path" in _bad_request(client, [f"file://{outside}"])["message"]
    assert "outside" in _bad_request(client, [f"file://{media_dir}/../{outside.parent.name}/b.png"])["message"]
    assert "scheme 'ftp'" in _bad_request(client, ["ftp://127.0.0.1/a.png"])["message"]


def test_too_many_images_is_a_400_naming_the_limit(client):
    body = _bad_request(client, [_data_url(make_image(i)) for i in range(3)])
    assert body["param"] == "limit_mm_per_prompt" and "limit_mm_per_prompt" in body["message"]


@pytest.mark.parametrize("url", ["data:image/png;base64,aGVsbG8gd29ybGQ=", "data:image/png;base64,%%%",
                                 "data:image/png," + "x" * 10])
def test_corrupt_image_is_a_400(client, url):
    body = _bad_request(client, [url])
    assert body["param"] == "messages"


def test_text_only_model_refuses_image_parts(live_server):  # noqa: F811
    client = openai.OpenAI(base_url=live_server.url + "/v1", api_key="unused", max_retries=0)
    body = _bad_request(client, [_data_url(make_image(1))])
    assert "text only" in body["message"]


def test_tokenize_refuses_image_parts(server):
    import httpx
    parts = [{"type": "image_url", "image_url": {"url": _data_url(make_image(1))}}, {"type": "text", "text": "x"}]
    r = httpx.post(f"{server.url}/tokenize", json={"model": "tiny", "messages": [{"role": "user", "content": parts}]})
    assert r.status_code == 400 and "does not process images" in r.json()["error"]["message"]


def test_image_detail_other_than_auto_is_refused(client):
    parts = [{"type": "image_url", "image_url": {"url": _data_url(make_image(1)), "detail": "high"}}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": parts}], max_tokens=2)
    assert "detail" in str(info.value.body)
    out = client.chat.completions.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": _data_url(make_image(1)), "detail": "auto"}}]}])
    assert out.choices[0].finish_reason == "length"


def test_video_url_parts_need_a_video_model(client):
    parts = [{"type": "video_url", "video_url": {"url": "data:video/jpeg;base64,aGVsbG8="}}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": parts}], max_tokens=2)
    assert "does not take videos" in info.value.body["message"] and info.value.body["param"] == "messages"

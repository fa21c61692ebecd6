"""The server with a Gemma 3 image model and the real openai client: base64 image_url parts
become each image's <start_of_image> run, and the reply equals transformers' generate, also with
mm_processor_kwargs={"do_pan_and_scan": True} (a run per crop)."""
from __future__ import annotations

import openai
import pytest

from tests.multimodal.gemma3_vl_fixtures import IMAGE_TOKENS, gemma3_vl_dir, gemma3_vl_hf  # noqa: F401 - fixtures
from tests.multimodal.llava_fixtures import make_image
from tests.multimodal.test_gemma3_vl import IMG, MAX_NEW, hf_generate
from tests.multimodal.test_llava_server import _data_url
from tests.server.live_server import CHAT_TEMPLATE, start_server


@pytest.fixture(scope="module")
def client(gemma3_vl_dir):
    srv = start_server(gemma3_vl_dir, chat_template=CHAT_TEMPLATE, max_model_len=256, max_num_batched_tokens=16,
                       limit_mm_per_prompt={"image": 2})
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    srv.stop()


def _chat(client, images: list, **extra):
    parts = [{"type": "image_url", "image_url": {"url": _data_url(i)}} for i in images]
    parts.append({"type": "text", "text": "what is this?"})
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": parts}],
                                          max_tokens=MAX_NEW, temperature=0,
                                          extra_body={"return_token_ids": True, **extra})


def test_base64_images_match_transformers(client, gemma3_vl_hf):
    images = [make_image(62), make_image(63, (30, 60))]
    out = _chat(client, images)
    text = "<s>user: " + f"{IMG}\n" * 2 + "what is this?\nassistant:"
    assert out.choices[0].token_ids == hf_generate(gemma3_vl_hf, text, images)
    assert out.usage.prompt_tokens > 2 * IMAGE_TOKENS  # the image tokens are counted


def test_pan_and_scan_per_request(client, gemma3_vl_hf):
    image = make_image(64, (40, 120))
    kwargs = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 16}
    out = _chat(client, [image], mm_processor_kwargs=kwargs)
    text = f"<s>user: {IMG}\nwhat is this?\nassistant:"
    assert out.choices[0].token_ids == hf_generate(gemma3_vl_hf, text, [image], **kwargs)
    assert out.usage.prompt_tokens > 4 * IMAGE_TOKENS  # the whole image and its 3 crops


def test_bad_mm_processor_kwargs_are_400s(client):
    with pytest.raises(openai.BadRequestError, match="no_such_option"):
        _chat(client, [make_image(65)], mm_processor_kwargs={"no_such_option": 1})
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, [], mm_processor_kwargs={"do_pan_and_scan": True})
    assert info.value.body["param"] == "mm_processor_kwargs"

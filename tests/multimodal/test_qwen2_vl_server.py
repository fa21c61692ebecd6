"""The server with a Qwen2-VL model and the real openai client: a base64 image_url part becomes
the model's vision tokens and the reply equals transformers' generate."""
from __future__ import annotations

import openai
import pytest

from tests.multimodal import qwen2_vl_fixtures
from tests.multimodal.llava_fixtures import make_image
from tests.multimodal.qwen2_vl_fixtures import PLACEHOLDER, hf_generate, load_hf
from tests.multimodal.test_llava_server import MAX_NEW, _chat, _data_url
from tests.server.live_server import CHAT_TEMPLATE, start_server

qwen2_vl_dir = qwen2_vl_fixtures.qwen2_vl_dir  # fixture


@pytest.fixture(scope="module")
def client(qwen2_vl_dir):
    srv = start_server(qwen2_vl_dir, chat_template=CHAT_TEMPLATE, max_model_len=256, max_num_batched_tokens=64,
                       limit_mm_per_prompt={"image": 2})
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    srv.stop()


def test_base64_images_match_transformers(client, qwen2_vl_dir):
    images = [make_image(62), make_image(63, (30, 60))]
    out = _chat(client, [_data_url(image) for image in images])
    text = "<s>user: " + f"{PLACEHOLDER}\n" * 2 + "what is this?\nassistant:"
    assert out.choices[0].token_ids == hf_generate(load_hf(qwen2_vl_dir), text, images, MAX_NEW)
    assert out.usage.prompt_tokens > 2 * 4  # the image tokens are counted

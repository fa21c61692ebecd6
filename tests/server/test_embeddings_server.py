"""``POST /v1/embeddings`` on a server run with ``--runner pooling``, with the real openai client:
the vectors are the offline LLM.embed's, float or base64; bad input is a 400 naming the field;
a generation server refuses embeddings and a pooling server refuses completions."""
from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest
from live_server import live_server, server_model_dir, start_server  # noqa: F401 - fixtures

from pagedllm import LLM

INPUTS = ["the quick brown fox", "jumps over the lazy dog again"]


@pytest.fixture(scope="module")
def pooling_server(server_model_dir):  # noqa: F811
    server = start_server(server_model_dir, runner="pooling")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def offline(server_model_dir):  # noqa: F811
    return LLM(server_model_dir, runner="pooling", block_size=8, num_gpu_blocks_override=64, max_model_len=128)


def test_embeddings_equal_the_offline_engines(pooling_server, offline):
    client = openai.OpenAI(base_url=f"{pooling_server.url}/v1", api_key="none")
    reply = client.embeddings.create(model="tiny", input=INPUTS)
    want = [o.outputs.embedding for o in offline.embed(INPUTS, use_tqdm=False)]
    assert [d.index for d in reply.data] == [0, 1]
    for d, w in zip(reply.data, want):
        np.testing.assert_allclose(d.embedding, w, atol=1e-6)
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == sum(
        len(o.prompt_token_ids) for o in offline.embed(INPUTS, use_tqdm=False))
    packed = httpx.post(f"{pooling_server.url}/v1/embeddings",
                        json={"input": INPUTS[0], "encoding_format": "base64"}).json()["data"][0]["embedding"]
    np.testing.assert_allclose(np.frombuffer(base64.b64decode(packed), dtype="<f4"), want[0], atol=1e-6)
    ids = offline.get_tokenizer().encode(INPUTS[1])
    by_ids = client.embeddings.create(model="tiny", input=[ids]).data[0].embedding
    np.testing.assert_allclose(by_ids, want[1], atol=1e-6)
    raw = httpx.post(f"{pooling_server.url}/v1/embeddings", json={"input": INPUTS[0], "normalize": False}).json()
    assert abs(np.linalg.norm(raw["data"][0]["embedding"]) - 1) > 0.01
    assert pooling_server.wait_idle().num_used_blocks == 0


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "dimensions": 8}, "dimensions"), ({"input": []}, "input"), ({"input": "x", "bogus": 1}, "bogus"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"), ({"input": [[5, 999999]]}, "input"),
])
def test_bad_embedding_requests_are_400s_naming_the_field(pooling_server, body, param):
    r = httpx.post(f"{pooling_server.url}/v1/embeddings", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert httpx.post(f"{pooling_server.url}/v1/embeddings", json={"input": "ok"}).status_code == 200


def test_each_runner_refuses_the_others_endpoints(pooling_server, live_server):  # noqa: F811
    r = httpx.post(f"{pooling_server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 400 and "runner='pooling'" in r.json()["error"]["message"]
    r = httpx.post(f"{live_server.url}/v1/embeddings", json={"input": "hi"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    assert "--runner pooling" in r.json()["error"]["message"]

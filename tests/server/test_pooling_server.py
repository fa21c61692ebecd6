"""vLLM's pooling routes on servers run with --runner pooling: /score, /v1/score, /rerank,
/v1/rerank, /v2/rerank against transformers on a tiny cross-encoder (its tokenizer's text pairs
through its score head) and an embedding model (cosine similarity); /classify and /pooling on a
three-label classifier; bad bodies are 400s naming the field, a text-generation server refuses
every route by naming the model, and the routes sit behind the API key."""
from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
import torch
from conftest import make_classifier_dir
from live_server import live_server, server_model_dir, start_server  # noqa: F401 - fixtures

QUERY = "the quick brown fox"
DOCS = ["jumps over the lazy dog", "keeps a block table", "hello world", "héllo wörld"]
LABELS = {0: "negative", 1: "neutral", 2: "positive"}
ROUTES = ["/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank", "/pooling", "/classify"]
BODIES = {"/score": {"text_1": QUERY, "text_2": DOCS[0]}, "/rerank": {"query": QUERY, "documents": DOCS},
          "/pooling": {"input": QUERY}, "/classify": {"input": QUERY}}


def body_for(route: str) -> dict:
    return BODIES[route.removeprefix("/v1").removeprefix("/v2")]


def hf_model(path: str, kind: str = "AutoModelForSequenceClassification"):
    import transformers as tf
    return getattr(tf, kind).from_pretrained(path, torch_dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def cross(tmp_path_factory):
    """A one-label Qwen2 cross-encoder server, its transformers twin and tokenizer."""
    from transformers import AutoTokenizer
    path = make_classifier_dir(tmp_path_factory.mktemp("cross"), "qwen2", num_labels=1)
    server = start_server(path, runner="pooling")
    yield server, hf_model(path), AutoTokenizer.from_pretrained(path)
    server.stop()


@pytest.fixture(scope="module")
def embedder(server_model_dir):  # noqa: F811
    server = start_server(server_model_dir, runner="pooling")
    yield server, hf_model(server_model_dir, "AutoModelForCausalLM")
    server.stop()


def pair_score(hf, tok, a: str, b: str) -> float:
    with torch.no_grad():
        return torch.sigmoid(hf(torch.tensor([tok(text=a, text_pair=b)["input_ids"]])).logits[0, 0]).item()


@pytest.mark.parametrize("route", ["/score", "/v1/score"])
@pytest.mark.parametrize("names", [("text_1", "text_2"), ("data_1", "data_2"), ("queries", "documents"),
                                   ("queries", "items")])
def test_score_is_the_cross_encoders_sigmoid_of_each_text_pair(cross, route, names):
    server, hf, tok = cross
    r = httpx.post(server.url + route, json={"model": "tiny", names[0]: QUERY, names[1]: DOCS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == "tiny" and body["id"].startswith("score-")
    assert [d["index"] for d in body["data"]] == list(range(len(DOCS)))
    assert {d["object"] for d in body["data"]} == {"score"}
    assert [d["score"] for d in body["data"]] == pytest.approx([pair_score(hf, tok, QUERY, d) for d in DOCS], abs=2e-5)
    assert body["usage"]["prompt_tokens"] == sum(len(tok(text=QUERY, text_pair=d)["input_ids"]) for d in DOCS)
    pairwise = httpx.post(server.url + route, json={names[0]: DOCS[:2], names[1]: DOCS[2:]}).json()["data"]
    assert [d["score"] for d in pairwise] == pytest.approx(
        [pair_score(hf, tok, a, b) for a, b in zip(DOCS[:2], DOCS[2:])], abs=2e-5)


@pytest.mark.parametrize("route", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_sorts_by_relevance_and_keeps_top_n(cross, route):
    server, hf, tok = cross
    want = [pair_score(hf, tok, QUERY, d) for d in DOCS]
    order = sorted(range(len(DOCS)), key=lambda i: -want[i])
    body = httpx.post(server.url + route, json={"query": QUERY, "documents": DOCS, "top_n": 2}).json()
    assert body["id"].startswith("rerank-") and [r["index"] for r in body["results"]] == order[:2]
    assert [r["relevance_score"] for r in body["results"]] == pytest.approx([want[i] for i in order[:2]], abs=2e-5)
    assert [r["document"]["text"] for r in body["results"]] == [DOCS[i] for i in order[:2]]
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] > 0
    every = httpx.post(server.url + route, json={"query": QUERY, "documents": DOCS, "return_documents": False}).json()
    assert [r["index"] for r in every["results"]] == order and all(r["document"] is None for r in every["results"])
    assert server.wait_idle().num_used_blocks == 0


def test_embedding_model_scores_and_reranks_by_cosine_similarity(embedder):
    server, hf = embedder
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(hf.name_or_path)

    def hidden(text: str) -> torch.Tensor:
        with torch.no_grad():
            return hf.base_model(torch.tensor([tok.encode(text)])).last_hidden_state[0, -1]  # [hidden]
    want = [torch.nn.functional.cosine_similarity(hidden(QUERY), hidden(d), dim=0).item() for d in DOCS]
    scores = httpx.post(server.url + "/v1/score", json={"data_1": [QUERY], "data_2": DOCS}).json()["data"]
    assert [d["score"] for d in scores] == pytest.approx(want, abs=1e-5)
    ranked = httpx.post(server.url + "/rerank", json={"query": QUERY, "documents": DOCS}).json()["results"]
    assert [r["relevance_score"] for r in ranked] == pytest.approx(sorted(want, reverse=True), abs=1e-5)
    pooled = httpx.post(server.url + "/pooling", json={"input": [QUERY], "encoding_format": "base64"}).json()
    vector = np.frombuffer(base64.b64decode(pooled["data"][0]["data"]), dtype="<f4")
    np.testing.assert_allclose(vector, torch.nn.functional.normalize(hidden(QUERY), dim=0).numpy(), atol=2e-5)
    r = httpx.post(server.url + "/classify", json={"input": QUERY})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    assert "ForSequenceClassification" in r.json()["error"]["message"]


def test_classify_and_pooling_on_a_three_label_classifier(tmp_path):
    path = make_classifier_dir(tmp_path, "llama", num_labels=3, id2label=LABELS)
    hf = hf_model(path)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    server = start_server(path, runner="pooling")
    try:
        inputs = [QUERY, DOCS[1]]
        body = httpx.post(server.url + "/classify", json={"input": inputs}).json()
        raw = httpx.post(server.url + "/pooling", json={"input": inputs, "softmax": False}).json()
        tokens = httpx.post(server.url + "/pooling", json={"input": inputs[0], "task": "token_classify"}).json()
    finally:
        server.stop()
    assert body["id"].startswith("classify-") and raw["id"].startswith("pool-")
    for text, data, pooled in zip(inputs, body["data"], raw["data"]):
        with torch.no_grad():
            logits = hf(torch.tensor([tok.encode(text)])).logits[0]
        assert data["num_classes"] == 3 and data["label"] == LABELS[int(logits.argmax())]
        torch.testing.assert_close(torch.tensor(data["probs"]), torch.softmax(logits, -1), atol=2e-5, rtol=1e-4)
        assert pooled["object"] == "pooling"
        torch.testing.assert_close(torch.tensor(pooled["data"]), logits, atol=2e-5, rtol=1e-4)
    with torch.no_grad():
        per_token = hf.score(hf.model(torch.tensor([tok.encode(inputs[0])])).last_hidden_state[0])
    torch.testing.assert_close(torch.tensor(tokens["data"][0]["data"]), torch.softmax(per_token, -1), atol=2e-5,
                               rtol=1e-4)


@pytest.mark.parametrize("route, body, param", [
    ("/score", {"text_1": "a"}, "text_2"),
    ("/score", {"text_1": ["a", "b", "c"], "text_2": ["a", "b"]}, "text_1"),
    ("/score", {"data_1": "a", "data_2": "b", "text_1": "c"}, "text_1"),
    ("/v1/score", {"data_1": "a", "data_2": []}, "data_2"),
    ("/rerank", {"query": "a", "documents": ["x"], "top_n": -1}, "top_n"),
    ("/rerank", {"query": 5, "documents": ["x"]}, "query"),
    ("/v2/rerank", {"query": "a", "documents": ["x"], "max_tokens_per_doc": 4}, "max_tokens_per_doc"),
    ("/pooling", {"input": "x", "task": "embed"}, "task"),
    ("/pooling", {"input": "x", "task": "token_embed"}, "task"),
    ("/pooling", {"input": "x", "task": "plugin"}, "task"),
    ("/pooling", {"input": "x", "dimensions": 8}, "dimensions"),
    ("/classify", {"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("/classify", {"input": [[5, 999999]]}, "input"),
])
def test_bad_pooling_requests_are_400s_naming_the_field(cross, route, body, param):
    server = cross[0]
    r = httpx.post(server.url + route, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert httpx.post(server.url + route, json=body_for(route)).status_code == 200


def test_a_generation_server_refuses_every_pooling_route(live_server):  # noqa: F811
    for route in ROUTES:
        r = httpx.post(live_server.url + route, json=body_for(route))
        assert r.status_code == 400 and r.json()["error"]["param"] == "model", (route, r.text)
        assert "--runner pooling" in r.json()["error"]["message"]


def test_the_pooling_routes_need_the_api_key(tmp_path):
    path = make_classifier_dir(tmp_path, "qwen2", num_labels=1)
    server = start_server(path, runner="pooling", api_key="sesame")
    try:
        for route in ROUTES:
            assert httpx.post(server.url + route, json=body_for(route)).status_code == 401, route
            ok = httpx.post(server.url + route, json=body_for(route), headers={"Authorization": "Bearer sesame"})
            assert ok.status_code == 200, (route, ok.text)
    finally:
        server.stop()

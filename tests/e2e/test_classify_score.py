"""runner="pooling" with *ForSequenceClassification checkpoints and scoring: LLM.classify's
probabilities are transformers' logits through vLLM's activation (sigmoid for one label, softmax
for several), LLM.score scores a cross-encoder's tokenizer text pairs with its head and an
embedding model's pairs by cosine similarity, LLM.encode returns the raw pooled tensor, per
token too (LLM.reward: the head at every position); mismatched tasks and pair shapes are refused
by name."""
from __future__ import annotations

import pytest
import torch
from conftest import make_classifier_dir

from pagedllm import LLM, PoolingParams

TEXTS = ["the quick brown fox", "hello world, this is a tiny tokenizer for tests and a rather long prompt that "
         "spans several chunks of sixteen tokens", "paged attention"]
DOCS = ["jumps over the lazy dog", "keeps a block table", "héllo wörld"]
CLASSIFIERS = [("qwen2", 1), ("llama", 3), ("qwen3", 2), ("mistral", 2)]


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]  # [num_labels]; no padding: the last token is pooled


def pooling_llm(path: str, **kwargs) -> LLM:
    return LLM(path, runner="pooling", block_size=8, num_gpu_blocks_override=64, max_num_batched_tokens=16, **kwargs)


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    """A tiny Qwen2ForSequenceClassification with one label, ours and transformers'."""
    import transformers as tf
    path = make_classifier_dir(tmp_path_factory.mktemp("cross-encoder"), "qwen2", num_labels=1)
    hf = tf.AutoModelForSequenceClassification.from_pretrained(path, torch_dtype=torch.float32).eval()
    llm = pooling_llm(path)
    yield llm, hf
    llm.shutdown()


@pytest.mark.parametrize("arch, num_labels", CLASSIFIERS)
def test_classify_matches_transformers(tmp_path, arch, num_labels):
    """A batch whose long prompt is prefilled in chunks of 16 tokens beside the others."""
    import transformers as tf
    path = make_classifier_dir(tmp_path, arch, num_labels=num_labels)
    hf = tf.AutoModelForSequenceClassification.from_pretrained(path, torch_dtype=torch.float32).eval()
    with pooling_llm(path) as llm:
        tok = llm.get_tokenizer()
        outs = llm.classify(TEXTS, use_tqdm=False)
        raw = llm.classify(TEXTS, pooling_params=PoolingParams(use_activation=False), use_tqdm=False)
        encoded = llm.encode(TEXTS, pooling_task="classify", use_tqdm=False)
        rewards = llm.reward(TEXTS, use_tqdm=False)  # every position's head, the long prompt over 3 chunks
        assert llm.get_kv_cache_stats().num_used_blocks == 0
    act = torch.sigmoid if num_labels == 1 else (lambda x: torch.softmax(x, -1))
    for text, out, logits_out, enc, reward in zip(TEXTS, outs, raw, encoded, rewards):
        ids = tok.encode(text)
        logits = hf_logits(hf, ids)
        assert out.outputs.num_classes == num_labels and out.prompt_token_ids == ids
        torch.testing.assert_close(torch.tensor(out.outputs.probs), act(logits), atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(torch.tensor(logits_out.outputs.probs), logits, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(enc.outputs.data, torch.tensor(out.outputs.probs))
        with torch.no_grad():
            per_token = hf.score(hf.model(torch.tensor([ids])).last_hidden_state[0])  # [tokens, num_labels]
        torch.testing.assert_close(reward.outputs.data, act(per_token), atol=2e-5, rtol=1e-4)


def test_cross_encoder_scores_text_pairs(cross_encoder):
    llm, hf = cross_encoder
    tok = llm.get_tokenizer()

    def want(a: str, b: str) -> float:
        return torch.sigmoid(hf_logits(hf, tok(text=a, text_pair=b)["input_ids"])).item()

    one_to_n = llm.score(TEXTS[0], DOCS, use_tqdm=False)
    assert [o.prompt_token_ids for o in one_to_n] == [tok(text=TEXTS[0], text_pair=d)["input_ids"] for d in DOCS]
    assert [o.outputs.score for o in one_to_n] == pytest.approx([want(TEXTS[0], d) for d in DOCS], abs=2e-5)
    pairwise = llm.score(TEXTS, DOCS, use_tqdm=False)
    assert [o.outputs.score for o in pairwise] == pytest.approx([want(a, b) for a, b in zip(TEXTS, DOCS)], abs=2e-5)
    old_names = llm.score(text_1=[TEXTS[0]], text_2=DOCS[:2], use_tqdm=False)  # vLLM's older argument names
    assert [o.outputs.score for o in old_names] == pytest.approx([o.outputs.score for o in one_to_n[:2]], abs=1e-6)
    logit = llm.score(TEXTS[0], DOCS[0], pooling_params=PoolingParams(use_activation=False), use_tqdm=False)[0]
    assert logit.outputs.score == pytest.approx(hf_logits(hf, one_to_n[0].prompt_token_ids).item(), abs=2e-5)


def test_embedding_model_scores_cosine_similarity(llama_dir, hf_models):
    hf = hf_models["llama"]

    def hidden(text: str, tok) -> torch.Tensor:
        with torch.no_grad():
            return hf.base_model(torch.tensor([tok.encode(text)])).last_hidden_state[0, -1]  # [hidden]

    with pooling_llm(llama_dir) as llm:
        tok = llm.get_tokenizer()
        one_to_n = llm.score(TEXTS[0], DOCS, use_tqdm=False)
        pairwise = llm.score(TEXTS, DOCS, use_tqdm=False)
        encoded = llm.encode(TEXTS[:1], use_tqdm=False)[0]  # the model's own task: embed
        embedded = llm.embed(TEXTS[:1], use_tqdm=False)[0]
        tokens = llm.encode(TEXTS[1:2], pooling_task="token_embed", use_tqdm=False)[0]  # over 3 chunks
    cos = torch.nn.functional.cosine_similarity
    assert [o.outputs.score for o in one_to_n] == pytest.approx(
        [cos(hidden(TEXTS[0], tok), hidden(d, tok), dim=0).item() for d in DOCS], abs=1e-5)
    assert [o.outputs.score for o in pairwise] == pytest.approx(
        [cos(hidden(a, tok), hidden(b, tok), dim=0).item() for a, b in zip(TEXTS, DOCS)], abs=1e-5)
    assert pairwise[1].prompt_token_ids == tok.encode(TEXTS[1]) + tok.encode(DOCS[1])
    torch.testing.assert_close(encoded.outputs.data, torch.tensor(embedded.outputs.embedding))
    with torch.no_grad():
        states = hf.base_model(torch.tensor([tok.encode(TEXTS[1])])).last_hidden_state[0]  # [tokens, hidden]
    torch.testing.assert_close(tokens.outputs.data, torch.nn.functional.normalize(states, dim=-1), atol=2e-5,
                               rtol=1e-4)


def test_what_cannot_run_is_refused_by_name(cross_encoder, llama_dir, tmp_path):
    llm, _ = cross_encoder
    with pytest.raises(ValueError, match="task 'token_embed' needs an embedding model"):
        llm.encode(TEXTS, pooling_task="token_embed")
    with pytest.raises(ValueError, match="pooling_task='bogus'"):
        llm.encode(TEXTS, pooling_task="bogus")
    with pytest.raises(ValueError, match="data_1 has 3 texts and data_2 2"):
        llm.score(TEXTS, DOCS[:2])
    with pytest.raises(ValueError, match="data_2 must not be empty"):
        llm.score(TEXTS[0], [])
    with pytest.raises(ValueError, match="data_1 and text_1"):
        llm.score(TEXTS[0], DOCS, text_1=TEXTS[0])
    with pytest.raises(ValueError, match="task 'embed' needs an embedding model"):
        llm.embed(TEXTS)
    with pytest.raises(ValueError, match="normalize=True applies to tasks 'embed' and 'token_embed' only"):
        PoolingParams(task="classify", normalize=True)
    assert not llm.llm_engine.has_unfinished_requests()
    with pooling_llm(llama_dir) as embedder:
        for method in (embedder.classify, embedder.reward):
            with pytest.raises(ValueError, match="ForSequenceClassification"):
                method(TEXTS)
    three = make_classifier_dir(tmp_path / "three", "llama", num_labels=3)
    with pooling_llm(three) as classifier, pytest.raises(ValueError, match="num_labels=3"):
        classifier.score(TEXTS[0], DOCS)
    with pytest.raises(ValueError, match="runner='pooling'"):
        LLM(three, block_size=8, num_gpu_blocks_override=64)
    with pytest.raises(ValueError, match="pooling_type='MEAN'"):
        pooling_llm(three, pooler_config={"pooling_type": "MEAN"})


def test_tensor_parallel_classifier_matches_one_rank(cross_encoder):
    """The score head is replicated on every rank and reads the whole final hidden state."""
    llm, _ = cross_encoder
    path = llm.llm_engine.model_config.model
    want = [o.outputs.score for o in llm.score(TEXTS[0], DOCS, use_tqdm=False)]
    with LLM(path, runner="pooling", num_gpu_blocks_override=200, tensor_parallel_size=2, num_threads=1) as tp:
        got = [o.outputs.score for o in tp.score(TEXTS[0], DOCS, use_tqdm=False)]
    assert got == pytest.approx(want, abs=1e-5)

"""tokenizer_mode and trust_remote_code reach the tokenizer; served_model_name reaches the server."""
from __future__ import annotations

import os

import pytest
from conftest import make_model_dir

from pagedllm import LLM, SamplingParams

ENGINE = dict(block_size=16, num_gpu_blocks_override=16, max_model_len=64)


@pytest.fixture(scope="module")
def byt5_dir(tmp_path_factory):
    """A tiny Llama whose tokenizer is ByT5's, a Python ("slow") tokenizer with no fast version."""
    from transformers import ByT5Tokenizer
    path = make_model_dir(tmp_path_factory.mktemp("byt5"), vocab_size=384)  # ByT5: 3 special + 256 bytes + 125
    for name in os.listdir(path):
        if name.startswith(("tokenizer", "special_tokens")):
            os.remove(os.path.join(path, name))
    ByT5Tokenizer().save_pretrained(path)
    return path


def test_auto_loads_the_fast_tokenizer(llama_dir):
    assert LLM(llama_dir, **ENGINE).get_tokenizer().is_fast


def test_slow_loads_the_python_tokenizer_and_generates(byt5_dir):
    llm = LLM(byt5_dir, tokenizer_mode="slow", **ENGINE)
    tok = llm.get_tokenizer()
    assert type(tok).__name__ == "ByT5Tokenizer" and not tok.is_fast
    out = llm.generate("hello", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4 and out.prompt_token_ids == tok.encode("hello")


def test_slow_without_a_python_tokenizer_is_refused(llama_dir):
    """transformers 5 only has a fast tokenizer for this model: "slow" must not quietly load it."""
    with pytest.raises(ValueError, match="tokenizer_mode='slow'"):
        LLM(llama_dir, tokenizer_mode="slow", **ENGINE)


def test_trust_remote_code_reaches_the_tokenizer(llama_dir, monkeypatch):
    from transformers import AutoTokenizer
    seen, load = [], AutoTokenizer.from_pretrained
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda *a, **kw: seen.append(kw) or load(*a, **kw))
    LLM(llama_dir, trust_remote_code=True, **ENGINE)
    assert seen and seen[-1]["trust_remote_code"] is True


def test_served_model_name_names_an_engine_built_server(llama_dir):
    from fastapi.testclient import TestClient

    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.entrypoints.openai.api_server import build_app
    engine = LLMEngine.from_engine_args(EngineArgs(llama_dir, served_model_name=["tiny", "alias"], **ENGINE))
    models = TestClient(build_app(engine)).get("/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["tiny", "alias"]

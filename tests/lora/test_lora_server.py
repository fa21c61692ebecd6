"""LoRA adapters over HTTP with the openai client: --lora-modules (both forms), model= picks the
adapter, /v1/models lists them with their parent, runtime load/unload behind the env switch, and
each adapter's completion equals the offline engine's."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest
from adapters import make_adapter

from pagedllm import LLM, LoRARequest, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
from live_server import server_model_dir, start_server  # noqa: E402

openai = pytest.importorskip("openai")
pytest.importorskip("peft")
PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def served(server_model_dir, tmp_path_factory):
    from pagedllm.entrypoints.openai.lora_serving import LoRAModulePath
    paths = [make_adapter(server_model_dir, tmp_path_factory.mktemp(f"srv{i}"), 8, 16, targets, seed=20 + i)
             for i, targets in enumerate((["q_proj", "v_proj", "down_proj"], ["k_proj", "o_proj", "up_proj"]))]
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")  # vLLM's spelling is honoured too
    modules = [LoRAModulePath("adapter-a", paths[0]), LoRAModulePath("adapter-b", paths[1], "tiny")]
    srv = start_server(server_model_dir, lora_modules=modules, enable_lora=True, max_loras=2)
    mp.undo()
    with LLM(server_model_dir, enable_lora=True, max_loras=2) as llm:
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        offline = {name: llm.generate(PROMPT, params, lora_request=lora, use_tqdm=False)[0].outputs[0].text
                   for name, lora in (("tiny", None), ("adapter-a", LoRARequest("a", 1, paths[0])),
                                      ("adapter-b", LoRARequest("b", 2, paths[1])))}
    yield srv, paths, offline
    srv.stop()


def _complete(client, model: str) -> str:
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text


def test_model_picks_the_adapter_and_equals_offline(served):
    srv, _, offline = served
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x")
    got = {name: _complete(client, name) for name in offline}
    assert got == offline and len(set(got.values())) == 3  # each adapter changes the output
    chat = client.chat.completions.create(model="adapter-b", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=4, temperature=0)
    assert chat.model == "adapter-b"


def test_models_lists_adapters_with_their_parent(served):
    srv, paths, _ = served
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x")
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) >= {"tiny", "adapter-a", "adapter-b"}
    assert cards["adapter-a"].parent == "tiny" and cards["adapter-b"].parent == "tiny"
    assert cards["adapter-a"].root == paths[0]


def test_runtime_load_and_unload(served, tmp_path):
    srv, paths, offline = served
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x")
    r = httpx.post(f"{srv.url}/v1/load_lora_adapter", json={"lora_name": "adapter-c", "lora_path": paths[0]})
    assert r.status_code == 200, r.text
    assert _complete(client, "adapter-c") == offline["adapter-a"]  # same weights under a new name and id
    again = httpx.post(f"{srv.url}/v1/load_lora_adapter", json={"lora_name": "adapter-c", "lora_path": paths[0]})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    bad = httpx.post(f"{srv.url}/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(tmp_path)})
    assert bad.status_code == 400 and str(tmp_path) in bad.json()["error"]["message"]
    assert bad.json()["error"]["param"] == "lora_path"
    assert httpx.post(f"{srv.url}/v1/unload_lora_adapter", json={"lora_name": "adapter-c"}).status_code == 200
    with pytest.raises(openai.BadRequestError, match="adapter-c"):
        _complete(client, "adapter-c")
    gone = httpx.post(f"{srv.url}/v1/unload_lora_adapter", json={"lora_name": "adapter-c"})
    assert gone.status_code == 404


def test_lora_modules_flag_forms():
    import argparse

    from pagedllm.entrypoints.openai.lora_serving import LoRAModulePath, parse_lora_module
    assert parse_lora_module("a=/x/y") == LoRAModulePath("a", "/x/y")
    entry = json.dumps({"name": "b", "path": "/p", "base_model_name": "base"})
    assert parse_lora_module(entry) == LoRAModulePath("b", "/p", "base")
    for bad in ("no-equals", '{"name": "x"}', '{"name": "x", "path": "/p", "other": 1}'):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_lora_module(bad)


def test_lora_modules_are_checked_at_start(server_model_dir, tmp_path):
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.entrypoints.openai.api_server import build_app
    from pagedllm.entrypoints.openai.lora_serving import LoRAModulePath
    modules = [LoRAModulePath("a", str(tmp_path))]
    with pytest.raises(ValueError, match="--lora-modules a=.* needs --enable-lora"):
        build_app(EngineArgs(model=server_model_dir), lora_modules=modules)
    with pytest.raises(ValueError, match=f"lora_path='{tmp_path}' is not a PEFT adapter"):
        build_app(EngineArgs(model=server_model_dir, enable_lora=True), lora_modules=modules)


def test_lora_modules_without_enable_lora_is_refused_before_loading(capsys):
    from pagedllm.entrypoints.cli import main
    assert main(["serve", "m", "--lora-modules", "sql=/adapters/sql"]) == 2  # no model named "m" is loaded
    assert "--lora-modules sql=/adapters/sql needs --enable-lora" in capsys.readouterr().err


def test_runtime_routes_answer_404_when_off(server_model_dir):
    from fastapi.testclient import TestClient

    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.entrypoints.openai.api_server import build_app
    app = build_app(EngineArgs(model=server_model_dir, enable_lora=True, num_gpu_blocks_override=64,
                               max_model_len=64))
    with TestClient(app) as client:
        r = client.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"})
    assert r.status_code == 404 and "PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING" in r.json()["error"]["message"]

"""vLLM's lifecycle methods RL loops call (issue 31): sleep/wake_up (the KV pool's memory really
goes: RSS measured), collective_rpc weight updates through the model's own loaders, profiling.
Outputs are checked against transformers on the same tiny random checkpoints."""
from __future__ import annotations

import gc
import glob
import json

import psutil
import pytest
import torch
from conftest import hf_greedy, make_model_dir, random_prompts

from pagedllm import LLM, SamplingParams
from pagedllm.engine.llm_engine import EngineSleepingError

MAX_NEW = 6
POOL_MIB = 256
# 256 MiB of 8 KiB blocks is 32768 blocks: max_num_seqs x max_model_len must not cap it lower
ENGINE = dict(kv_cache_memory=f"{POOL_MIB}MiB", max_model_len=512, max_num_seqs=1024, num_threads=1)


@pytest.fixture(scope="module")
def llm(llama_dir):
    with LLM(llama_dir, enable_sleep_mode=True, **ENGINE) as engine:
        yield engine


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(3, seed=31, hi=20)


@pytest.fixture(scope="module")
def expected(hf_models, prompts) -> list[list[int]]:
    return [hf_greedy(hf_models["llama"], p, MAX_NEW) for p in prompts]


@pytest.fixture(scope="module")
def second_model(tmp_path_factory):
    """Another checkpoint of the same shape (other random weights), with its HF model."""
    import transformers as tf
    path = make_model_dir(tmp_path_factory.mktemp("second"), "llama", seed=7)
    return path, tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def resident_rss_mib(llm: LLM) -> float:
    """RSS once the whole KV pool is in memory (past its first blocks it is faulted in by a
    background thread: cache_engine.PoolPrefault)."""
    assert llm.llm_engine.executor.runner.cache.wait_prefaulted(60)
    return rss_mib()


def rss_mib() -> float:
    gc.collect()
    return psutil.Process().memory_info().rss / 2**20


def test_level_1_frees_the_pool_and_wakes_to_the_same_outputs(llm, prompts, expected):
    assert greedy(llm, prompts) == expected
    before = resident_rss_mib(llm)
    llm.sleep(level=1)
    try:
        assert llm.is_sleeping()
        assert before - rss_mib() > 0.8 * POOL_MIB  # the pool's pages went back to the system
        with pytest.raises(EngineSleepingError, match="wake_up"):
            greedy(llm, prompts)
    finally:
        llm.wake_up()
    assert not llm.is_sleeping()
    assert greedy(llm, prompts) == expected


def test_level_2_then_a_weight_reload_gives_the_same_outputs(llm, prompts, expected, hf_models):
    before = resident_rss_mib(llm)
    llm.sleep(level=2)
    assert before - rss_mib() > 0.8 * POOL_MIB
    llm.wake_up(tags=["weights"])
    assert llm.is_sleeping()  # the KV cache still sleeps: no request yet
    with pytest.raises(EngineSleepingError, match="kv_cache"):
        greedy(llm, prompts)
    state = hf_models["llama"].state_dict()
    assert llm.collective_rpc("load_weights", args=(list(state.items()),))  # one rank: one list of names
    llm.wake_up(tags=["kv_cache"])
    assert greedy(llm, prompts) == expected
    llm.sleep(level=2)
    llm.wake_up()
    llm.collective_rpc("reload_weights")  # from the engine's own checkpoint
    assert greedy(llm, prompts) == expected


def test_weight_update_from_another_checkpoint_gives_its_outputs(llm, prompts, expected, second_model, hf_models):
    path, other = second_model
    want = [hf_greedy(other, p, MAX_NEW) for p in prompts]
    assert want != expected  # the update must be visible
    greedy(llm, prompts)  # fills the prefix cache with the old weights' K/V
    names = llm.collective_rpc("update_weights", args=(other.state_dict(),))[0]
    assert "model.layers.0.self_attn.qkv_proj.weight" in names  # q, k, v went through the fused loader
    assert greedy(llm, prompts) == want  # no stale cached prefix either
    llm.collective_rpc("update_weights", kwargs={"named_tensors": hf_models["llama"].state_dict()})
    assert greedy(llm, prompts) == expected


def test_collective_rpc_runs_callables_and_names_bad_methods(llm):
    assert llm.collective_rpc(lambda worker, k: (type(worker.model_runner.model).__name__, k), args=(3,)) == [
        ("LlamaForCausalLM", 3)]
    with pytest.raises(ValueError, match="not a ModelRunner method"):
        llm.collective_rpc("no_such_method")
    with pytest.raises(ZeroDivisionError):
        llm.collective_rpc(lambda worker: 1 / 0)
    with pytest.raises(ValueError, match="has no matching parameter"):
        llm.collective_rpc("load_weights", args=([("not.a.weight", torch.zeros(1))],))


def test_sleep_is_refused_while_requests_run_and_without_sleep_mode(llm, llama_dir, prompts):
    engine = llm.llm_engine
    engine.add_request("busy", {"prompt_token_ids": prompts[0]}, SamplingParams(max_tokens=2))
    try:
        with pytest.raises(RuntimeError, match="idle engine"):
            llm.sleep()
    finally:
        engine.abort_request("busy")
    with pytest.raises(ValueError, match="level=3"):
        llm.sleep(level=3)
    with pytest.raises(ValueError, match="tags="):
        llm.wake_up(tags=["everything"])
    with LLM(llama_dir, num_gpu_blocks_override=32, max_model_len=128, num_threads=1) as plain:
        with pytest.raises(ValueError, match="enable_sleep_mode=True"):
            plain.sleep()


def test_profile_writes_a_chrome_trace(llm, prompts, tmp_path, monkeypatch):
    monkeypatch.delenv("PAGEDLLM_TORCH_PROFILER_DIR", raising=False)
    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR", raising=False)
    with pytest.raises(RuntimeError, match="PAGEDLLM_TORCH_PROFILER_DIR"):
        llm.start_profile()
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path))  # vLLM's name works too
    llm.start_profile()
    with pytest.raises(RuntimeError, match="already running"):
        llm.start_profile()
    greedy(llm, prompts[:1])
    llm.stop_profile()
    traces = glob.glob(str(tmp_path / "*.pt.trace.json"))
    assert len(traces) == 1 and "pagedllm-tp0-pp0" in traces[0]
    with open(traces[0]) as f:
        events = json.load(f)["traceEvents"]
    assert any(str(e.get("name", "")).startswith("aten::") for e in events)  # the step's torch ops are in it
    with pytest.raises(RuntimeError, match="not running"):
        llm.stop_profile()

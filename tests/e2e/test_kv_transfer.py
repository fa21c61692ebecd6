"""Prefill/decode roles on the remote tier (kv_cache/offload/kv_transfer.py), engine level, on a real
Redis: a producer's finished request has its blocks in the pool when ``generate`` returns (no flush),
also blocks another request still holds; a consumer decodes from them with transformers' output and
never writes; vLLM's ``kv_transfer_config`` form is read or refused by name."""
from __future__ import annotations

import pytest
from conftest import hf_greedy
from redis_server import RedisServer
from test_kv_tiers import DOC, GREEDY, PROMPTS, _assert_all_blocks_free, _llm, _tier

from pagedllm import LLM, SamplingParams
from pagedllm.engine.arg_utils import EngineArgs

BLOCK = 8
NUM_PROMPT_BLOCKS = (len(PROMPTS[0]) - 1) // BLOCK  # what a consumer can take: never the last token's block
PREFILL = SamplingParams(temperature=0, max_tokens=1)


@pytest.fixture(scope="module")
def server():
    with RedisServer() as srv:
        yield srv


@pytest.fixture(scope="module")
def expected(hf_models):
    return hf_greedy(hf_models["llama"], PROMPTS[0], GREEDY.max_tokens)


def _role(llm_dir: str, url: str, role: str | None, **kw) -> LLM:
    return _llm(llm_dir, BLOCK, kv_offload_remote=url, kv_role=role, **kw)


def test_producer_publishes_before_returning_and_consumer_decodes(llama_dir, server, expected):
    server.client().flushdb()
    producer = _role(llama_dir, server.url, "producer")
    producer.generate([{"prompt_token_ids": PROMPTS[0]}], PREFILL, use_tqdm=False)
    published = set(server.keys())  # no flush_kv_tiers(): the engine awaited the writes
    assert len(published) >= NUM_PROMPT_BLOCKS
    consumer = _role(llama_dir, server.url, "consumer")
    out = consumer.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert out == expected
    remote = _tier(consumer, "remote")
    assert remote["hits"] == NUM_PROMPT_BLOCKS and remote["misses"] == 0 and remote["unreachable"] == 0
    assert remote["bytes_loaded"] == NUM_PROMPT_BLOCKS * 2 * 2 * 2 * 16 * BLOCK * 4  # float32 blocks
    trips = {m.labels["op"]: m for m in consumer.llm_engine.get_metrics()
             if m.name == "pagedllm:kv_offload_round_trip_seconds"}
    assert trips["read"].buckets[-1][1] == 1 and trips["read"].value > 0  # the whole prefix in one MGET
    assert trips["stat"].buckets[-1][1] >= 1  # the presence checks of the prefix walk
    consumer.generate([{"prompt_token_ids": PROMPTS[3]}], GREEDY, use_tqdm=False)  # new blocks of its own
    consumer.llm_engine.flush_kv_tiers()
    assert set(server.keys()) == published and _tier(consumer, "remote")["stored_blocks"] == 0  # never writes
    _assert_all_blocks_free(consumer)
    producer.llm_engine.shutdown()
    consumer.llm_engine.shutdown()


def test_producer_publishes_blocks_another_request_still_holds(llama_dir, server):
    server.client().flushdb()
    producer = _role(llama_dir, server.url, "both")
    engine = producer.llm_engine
    engine.add_request("prefill", {"prompt_token_ids": PROMPTS[0]}, PREFILL)
    engine.add_request("long", {"prompt_token_ids": PROMPTS[1]}, SamplingParams(temperature=0, max_tokens=30))
    while not any(o.finished and o.request_id == "prefill" for o in engine.step()):
        pass
    assert engine.has_unfinished_requests()  # "long" still holds the document's blocks
    assert len(server.keys()) >= len(DOC) // BLOCK  # ... and they are in the pool already
    while engine.has_unfinished_requests():
        engine.step()
    engine.shutdown()


def test_consumer_misses_recompute(llama_dir, server, expected):
    server.client().flushdb()  # nothing published: every block is a miss, the output the same
    consumer = _role(llama_dir, server.url, "consumer")
    out = consumer.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert out == expected
    remote = _tier(consumer, "remote")
    assert remote["hits"] == 0 and remote["misses"] == 1  # the walk stops at its first miss
    consumer.llm_engine.shutdown()


@pytest.mark.parametrize("kwargs, match", [
    ({"kv_role": "producer"}, "kv_role='producer' needs kv_offload_remote"),
    ({"kv_role": "decode", "kv_offload_remote": "redis://127.0.0.1:1/0"}, "kv_role='decode' is invalid"),
    ({"kv_transfer_config": '{"kv_connector": "NixlConnector", "kv_role": "kv_both"}'},
     "kv_connector='NixlConnector' is not supported"),
    ({"kv_transfer_config": {"kv_role": "kv_consumer", "kv_port": 1}}, "kv_port=1 is not supported"),
    ({"kv_transfer_config": {"kv_role": "kv_consumer", "kv_load_failure_policy": "fail"}},
     "kv_load_failure_policy='fail' is not supported"),
    ({"kv_transfer_config": {"kv_role": "kv_consumer", "bogus": 1}}, "key 'bogus' is not supported"),
    ({"kv_transfer_config": {"kv_connector": "PagedLLMRemoteTier"}}, "needs a kv_role"),
    ({"kv_transfer_config": "kv_both"}, "is not JSON"),
    ({"kv_role": "consumer", "kv_transfer_config": {"kv_role": "kv_producer"}}, "contradicts"),
])
def test_bad_roles_are_refused(llama_dir, kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs(model=llama_dir, **kwargs).create_engine_config()


@pytest.mark.parametrize("kwargs, role", [
    ({"kv_transfer_config": '{"kv_role": "kv_producer"}'}, "producer"),
    ({"kv_transfer_config": {"kv_connector": "PagedLLMRemoteTier", "kv_role": "kv_consumer", "kv_rank": None}},
     "consumer"),
    ({"kv_role": "kv_both"}, "both"),
])
def test_vllm_kv_transfer_config_sets_the_role(llama_dir, kwargs, role):
    config = EngineArgs(model=llama_dir, kv_offload_remote="redis://127.0.0.1:1/0", **kwargs).create_engine_config()
    assert config.cache.kv_role == role

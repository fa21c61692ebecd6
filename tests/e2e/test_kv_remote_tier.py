"""The remote KV tier on a real Redis server: a prefix one engine computed is a tier hit for a
second engine with empty device, CPU and disk tiers, with the outputs of transformers and of a
cold run; bad values, a flushed or killed server and another model's engine are all misses with
correct outputs, and a server that stays down turns the tier off while the engine keeps serving."""
from __future__ import annotations

import pytest
from conftest import hf_greedy, make_model_dir, random_prompts
from redis_server import RedisServer
from test_kv_tiers import DOC, GREEDY, PROMPTS, _assert_all_blocks_free, _llm, _tier

from pagedllm import LLM
from pagedllm.kv_cache.offload.tier_fs import MAX_CONSECUTIVE_ERRORS

BLOCK = 8
NUM_DOC_BLOCKS = len(DOC) // BLOCK  # full blocks of the shared document


@pytest.fixture
def server():
    with RedisServer() as srv:
        yield srv


@pytest.fixture(scope="module")
def expected(llama_dir, hf_models):
    """PROMPTS[0] and PROMPTS[1] (the document + two questions), greedy, as transformers computes them."""
    return [hf_greedy(hf_models["llama"], PROMPTS[i], GREEDY.max_tokens) for i in range(2)]


def _remote(llm_dir: str, url: str, **kw) -> LLM:
    return _llm(llm_dir, BLOCK, kv_offload_remote=url, **kw)


def _greedy(llm: LLM, i: int) -> list[int]:
    return llm.generate([{"prompt_token_ids": PROMPTS[i]}], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def _keys(server: RedisServer) -> list[bytes]:
    return server.keys()


def test_second_engine_hits_what_the_first_computed(llama_dir, server, expected):
    a = _remote(llama_dir, server.url)
    assert _greedy(a, 0) == expected[0]
    a.llm_engine.flush_kv_tiers()  # the finished request's blocks are published between steps
    assert len(_keys(server)) >= NUM_DOC_BLOCKS
    b = _remote(llama_dir, server.url)  # its own empty device pool, no CPU or disk tier
    assert _greedy(b, 1) == expected[1]  # the document + another question
    remote = _tier(b, "remote")
    assert remote["hits"] >= NUM_DOC_BLOCKS and remote["errors"] == dict.fromkeys(remote["errors"], 0)
    assert b.get_kv_cache_stats().prefix_cache_hits >= NUM_DOC_BLOCKS * BLOCK
    _assert_all_blocks_free(b)
    a.llm_engine.shutdown()
    b.llm_engine.shutdown()


def test_bad_and_flushed_values_are_misses(llama_dir, server, expected):
    a = _remote(llama_dir, server.url)
    _greedy(a, 0)
    a.llm_engine.flush_kv_tiers()
    client = server.client()
    corrupt = {}
    for key in _keys(server):  # flip one payload byte of every value: the CRC fails
        value = bytearray(client.get(key))
        value[-1] ^= 0xFF
        corrupt[key] = bytes(value)
        client.set(key, corrupt[key])
    b = _remote(llama_dir, server.url)
    assert _greedy(b, 1) == expected[1]
    assert _tier(b, "remote")["hits"] == 0
    b.llm_engine.flush_kv_tiers()
    # the document's blocks were deleted as they were found bad and published again by b (the
    # blocks of a's question stay: nothing looked them up)
    assert len([k for k, v in corrupt.items() if client.get(k) == v]) == len(corrupt) - NUM_DOC_BLOCKS
    client.flushdb()
    c = _remote(llama_dir, server.url)
    assert _greedy(c, 1) == expected[1]
    assert _tier(c, "remote")["hits"] == 0
    _assert_all_blocks_free(c)


def test_another_model_never_hits(llama_dir, server, expected, tmp_path):
    a = _remote(llama_dir, server.url)
    _greedy(a, 0)
    a.llm_engine.flush_kv_tiers()
    other_dir = make_model_dir(tmp_path / "other", "llama", seed=7)  # same shapes, other weights
    other = _remote(other_dir, server.url)
    plain = _llm(other_dir, BLOCK, enable_prefix_caching=False)
    assert _greedy(other, 1) == _greedy(plain, 1)
    assert _tier(other, "remote")["hits"] == 0


def test_killed_server_is_misses_then_the_tier_turns_off(llama_dir, server, expected):
    a = _remote(llama_dir, server.url)
    assert _greedy(a, 0) == expected[0]
    server.kill()  # mid-run: the engine's next writes and lookups fail
    b = _remote(llama_dir, server.url)
    for _ in range(3):
        assert _greedy(b, 1) == expected[1]
        assert _greedy(a, 1) == expected[1]
        a.llm_engine.flush_kv_tiers()
    for llm in (a, b):
        remote = _tier(llm, "remote")
        assert remote["hits"] == 0 and sum(remote["errors"].values()) > 0
        assert remote["unreachable"] > 0  # the server is gone (not an error reply)
        _assert_all_blocks_free(llm)
    metrics = "\n".join(f"{m.name}{m.labels}={m.value}" for m in b.llm_engine.get_metrics()
                        if "kv_offload_errors" in m.name and m.labels.get("tier") == "remote")
    assert "op" in metrics
    unreachable = [m.value for m in b.llm_engine.get_metrics()
                   if m.name == "pagedllm:kv_offload_unreachable" and m.labels == {"tier": "remote"}]
    assert unreachable and unreachable[0] > 0  # the Redis-down counter
    plain = _llm(llama_dir, BLOCK, enable_prefix_caching=False)
    fresh = [{"prompt_token_ids": p} for p in random_prompts(MAX_CONSECUTIVE_ERRORS + 1, seed=43, lo=20, hi=40)]
    for prompt in fresh:  # new prefixes: each is looked up (and written) remotely, and fails
        assert b.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == \
            plain.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    remote = _tier(b, "remote")
    assert remote["disabled"] == 1 and remote["errors"]["stat"] >= MAX_CONSECUTIVE_ERRORS
    calls = sum(remote["errors"].values())
    assert b.generate(fresh[:2], GREEDY, use_tqdm=False)  # off: no more calls to the server
    b.llm_engine.flush_kv_tiers()
    assert sum(_tier(b, "remote")["errors"].values()) == calls
    _assert_all_blocks_free(b)


def test_bad_remote_url_is_refused(llama_dir):
    with pytest.raises(ValueError, match="kv_offload_remote='http://x'"):
        _remote(llama_dir, "http://x")
    with pytest.raises(ValueError, match="kv_offload_remote_ttl_s=0"):
        _remote(llama_dir, "redis://127.0.0.1:1/0", kv_offload_remote_ttl=0)


def test_tensor_parallel_ranks_share_through_their_own_key_spaces(llama_dir, server, expected):
    a = _remote(llama_dir, server.url, tensor_parallel_size=2, num_threads=1)
    assert _greedy(a, 0) == expected[0]
    a.llm_engine.flush_kv_tiers()
    spaces = {key.split(b":")[2] for key in _keys(server)}
    assert len(spaces) == 2  # one fingerprint per rank: each holds its own share of the KV heads
    a.llm_engine.shutdown()
    b = _remote(llama_dir, server.url, tensor_parallel_size=2, num_threads=1)
    assert _greedy(b, 1) == expected[1]
    assert _tier(b, "remote")["hits"] >= NUM_DOC_BLOCKS
    _assert_all_blocks_free(b)
    b.llm_engine.shutdown()

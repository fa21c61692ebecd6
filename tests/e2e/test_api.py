"""The offline API surface: chat, engine methods, metrics, logging, Hub errors."""
from __future__ import annotations

import logging

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.metrics.prometheus import PrometheusMetrics

TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}" \
           "{% if add_generation_prompt %}<s>assistant:{% endif %}"


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, block_size=8, num_gpu_blocks_override=200)


def test_chat_applies_the_template(llm):
    tok = llm.get_tokenizer()
    messages = [{"role": "user", "content": "hello world"}]
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False, chat_template=TEMPLATE)[0]
    expected = tok.apply_chat_template(messages, chat_template=TEMPLATE, add_generation_prompt=True, tokenize=True)
    expected = list(expected["input_ids"]) if hasattr(expected, "keys") else list(expected)
    assert out.prompt_token_ids == expected
    assert len(out.outputs[0].token_ids) == 4


def test_chat_without_template_is_a_clear_error(llm):
    with pytest.raises(ValueError, match="chat template"):
        llm.chat([{"role": "user", "content": "hi"}])


def test_engine_step_abort_and_metrics(llm):
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    engine.add_request("keep", "hello world", params)
    engine.add_request("drop", "the lazy dog", params)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("keep", "again", params)
    engine.step()
    metrics = {m.name: m.value for m in llm.get_metrics() if not m.labels}
    assert metrics["pagedllm:num_requests_running"] == 2
    assert llm.get_kv_cache_stats().num_used_blocks > 0
    engine.abort_request("drop")
    assert len(engine.scheduler.running) == 1
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["keep"] and finished[0].outputs[0].finish_reason == "length"
    metrics = {(m.name, tuple(m.labels.items())): m.value for m in llm.get_metrics()}
    assert metrics[("pagedllm:request_success", (("finished_reason", "abort"),))] >= 1
    assert metrics[("pagedllm:generation_tokens", ())] >= 50
    assert llm.get_kv_cache_stats().num_used_blocks == 0


def test_iteration_tokens_histogram_counts_every_step(llama_dir):
    """vLLM's iteration_tokens_total: one observation per step of the tokens it computed."""
    llm = LLM(llama_dir, num_gpu_blocks_override=100, enable_prefix_caching=False, max_num_batched_tokens=8)
    llm.generate([{"prompt_token_ids": list(range(5, 25))}], SamplingParams(max_tokens=5, ignore_eos=True),
                 use_tqdm=False)
    (hist,) = [m for m in llm.get_metrics() if m.name == "pagedllm:iteration_tokens_total"]
    # 20 prompt tokens in chunks of 8, 8, 4 (the last samples the first token), then 4 decode steps
    assert hist.kind == "histogram" and hist.value == 20 + 4
    assert dict(hist.buckets) == {1: 4, 8: 7, 16: 7, 32: 7, 64: 7, 128: 7, 256: 7, 512: 7, 1024: 7, 2048: 7,
                                  4096: 7, 8192: 7, 16384: 7, float("inf"): 7}
    text = PrometheusMetrics("m").render(llm.get_metrics()).decode()
    assert 'pagedllm:iteration_tokens_total_bucket{le="8.0",model_name="m"} 7.0' in text
    assert 'pagedllm:iteration_tokens_total_count{model_name="m"} 7.0' in text


def test_periodic_log_line(llama_dir, caplog):
    llm = LLM(llama_dir, num_gpu_blocks_override=100, disable_log_stats=False, log_stats_interval=1e-9)
    with caplog.at_level(logging.INFO, logger="pagedllm.engine.llm_engine"):
        llm.generate(["hello world"], SamplingParams(max_tokens=3), use_tqdm=False)
    line = next(r.getMessage() for r in caplog.records if "generation throughput" in r.getMessage())
    for part in ("Running:", "Swapped:", "Waiting:", "KV cache usage:", "Prefix cache hit rate:"):
        assert part in line


def test_start_up_logs_block_count(llama_dir, caplog):
    with caplog.at_level(logging.INFO, logger="pagedllm.worker.executor"):
        LLM(llama_dir, kv_cache_memory="1MiB", max_model_len=256)
    assert any("KV cache:" in r.getMessage() and "blocks" in r.getMessage() for r in caplog.records)


def test_uncached_hub_id_offline_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(ValueError, match="Hub"):
        LLM("pagedllm-test/definitely-not-cached")


def test_kv_cache_memory_sizes_the_pool(llama_dir):
    llm = LLM(llama_dir, kv_cache_memory="1MiB", block_size=16, max_model_len=256)
    # tiny llama: 2 layers x 2 KV heads x 16 dims x 4 bytes x (K and V) = 512 bytes/token
    assert llm.get_kv_cache_stats().num_blocks == 1024 * 1024 // (512 * 16)


def test_delta_outputs_carry_news_only_and_each_finish_once(llm):
    """n=3 sequences that stop at different steps: a delta output lists a sequence only when it
    has something new, its finish exactly once, and the deltas join to the cumulative result."""
    engine = llm.llm_engine
    params = {kind: SamplingParams(n=3, seed=7, max_tokens=30, stop_token_ids=list(range(3, 120)), output_kind=kind)
              for kind in ("delta", "cumulative")}
    outputs = {}
    for kind, p in params.items():
        engine.add_request(kind, "hello world", p)
        outputs[kind] = []
        while engine.has_unfinished_requests():
            outputs[kind] += engine.step()
    final = {c.index: c for c in outputs["cumulative"][-1].outputs}
    assert len({c.finish_reason and len(c.token_ids) for c in final.values()}) > 1  # they stop apart
    for index, done in final.items():
        pieces = [c for o in outputs["delta"] for c in o.outputs if c.index == index]
        assert [c.finish_reason is not None for c in pieces] == [False] * (len(pieces) - 1) + [True]
        assert all(c.token_ids for c in pieces)
        assert sum((c.token_ids for c in pieces), []) == done.token_ids
        assert "".join(c.text for c in pieces) == done.text

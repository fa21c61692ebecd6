"""Tests for benchmarks/latency.py and benchmarks/attention.py: helpers, the transformers
static-batch server on a fake model, and one tiny end-to-end run of each script."""
from __future__ import annotations

import json
import math
import time

import pytest
import torch
from conftest import load_benchmark

lat = load_benchmark("pagedllm_bench_latency", "latency.py")
attn = load_benchmark("pagedllm_bench_attention", "attention.py")


# --------------------------------------------------------------------------- latency helpers


def test_percentiles_interpolate_and_skip_missing():
    p = lat.percentiles([5, 1, None, 4, 2, 3])
    assert p == pytest.approx({"p50": 3.0, "p90": 4.6, "p99": 4.96, "mean": 3.0})
    assert lat.percentiles([]) is None and lat.percentiles([None]) is None


def test_poisson_offsets_are_fixed_by_the_seed():
    a = lat.poisson_offsets(2000, rate=4.0, seed=7)
    assert a == lat.poisson_offsets(2000, rate=4.0, seed=7) != lat.poisson_offsets(2000, rate=4.0, seed=8)
    assert a[0] == 0.0 and all(x <= y for x, y in zip(a, a[1:]))
    assert abs(a[-1] / 1999 - 0.25) < 0.02  # mean gap 1 / rate
    assert lat.poisson_offsets(3, math.inf, seed=0) == [0.0, 0.0, 0.0]


def test_trace_latencies():
    t = lat.Trace(arrival=1.0, token_times=[1.5, 1.7, 1.9, 2.3], token_ids=[4, 5, 6, 7])
    assert t.ttft == pytest.approx(0.5) and t.e2e == pytest.approx(1.3)
    assert t.tpot == pytest.approx(0.8 / 3) and t.itls == pytest.approx([0.2, 0.2, 0.4])
    assert lat.Trace(0.0, [0.1], [4]).tpot is None  # one token: no decode gap


class _FakeHF:
    """Stands in for a transformers model: each decode step sleeps, then streams a token per row."""

    def __init__(self, step_s: float):
        self.step_s, self.batches = step_s, []

    def generate(self, input_ids, max_new_tokens, streamer, **kwargs):
        self.batches.append(input_ids.shape[0])
        streamer.put(input_ids)
        new = []
        for _ in range(max_new_tokens):
            time.sleep(self.step_s)
            new.append(torch.full((input_ids.shape[0],), 7))
            streamer.put(new[-1])
        return torch.cat([input_ids, torch.stack(new, 1)], 1)


def test_hf_serves_fifo_static_batches_and_counts_the_wait():
    fake, prompts = _FakeHF(0.02), [[3, 4]] * 4
    traces = lat.serve_hf(fake, prompts, 4, [0.0, 0.0, 0.03, 0.035], max_batch=8, device="cpu")
    assert fake.batches == [2, 2]  # the last two arrive while the first batch runs, and wait for it
    assert traces[0].token_times == traces[1].token_times and traces[2].token_ids == [7] * 4
    assert traces[2].ttft >= 0.08 - 0.03 + 0.02  # the rest of batch 1, then its own first step
    assert traces[0].tpot == pytest.approx(0.02, abs=0.015)
    lat.serve_hf(fake, prompts, 2, [0.0] * 4, max_batch=3, device="cpu")
    assert fake.batches[2:] == [3, 1]


# --------------------------------------------------------------------------- attention helpers


def test_min_bytes_by_hand():
    # 1 request, 3 cached + 1 new token, 2 heads, 1 KV head, head_dim 4, float32 cache:
    # K/V read 4 tok x 4 x 4 B x 2 = 128, queries 1 x 2 x 4 x 4 = 32, outputs 32, new K/V 1 x 4 x 4 x 2 = 32
    assert attn.min_bytes([(3, 1)], 2, 1, 4, cache_itemsize=4) == dict(
        kv_read=128, q_read=32, out_write=32, kv_write=32, total=224)
    # + a 2-token prefill, float16 cache: 6 context tokens x 4 x 2 B x 2 = 96; 3 tokens of q / out at 32 B
    assert attn.min_bytes([(3, 1), (0, 2)], 2, 1, 4, cache_itemsize=2) == dict(
        kv_read=96, q_read=96, out_write=96, kv_write=48, total=336)


def test_cases_cover_long_decode_and_prefill():
    full = attn.build_cases(quick=False)
    assert full["decode-bs64-ctx2048"] == [(2047, 1)] * 64 and full["prefill-512"] == [(0, 512)]
    assert len(full) == 7 and all(len(c) in (1, 64) for c in full.values())


# --------------------------------------------------------------------------- end to end


def test_latency_quick_run_end_to_end(llama_dir, tmp_path):
    out = tmp_path / "lat.json"
    lat.main(["--model", llama_dir, "--quick", "--rates", "50,inf", "--num-requests", "4",
              "--num-threads", "1", "--kv-cache-memory", "16MiB", "--output", str(out)])
    res = json.loads(out.read_text())["results"]
    assert list(res) == ["batch1", "rate-50", "rate-inf"]
    assert res["rate-inf"]["workload"]["arrival_offsets_s"] == [0.0] * 4
    for r in res.values():
        n, out_len = r["workload"]["num_requests"], r["workload"]["output_len"]
        for system in ("pagedllm", "transformers"):
            m = r[system]
            assert m["output_tokens"] == n * out_len and [q["tokens"] for q in m["requests"]] == [out_len] * n
            assert all(q["ttft_ms"] > 0 and q["tpot_ms"] > 0 for q in m["requests"]) and m["output_tok_s"] > 0
            assert m["ttft_ms"]["p50"] <= m["ttft_ms"]["p90"] <= m["ttft_ms"]["p99"]
            assert m["e2e_ms"]["p50"] >= m["ttft_ms"]["p50"] + (out_len - 1) * m["tpot_ms"]["p50"] * 0.5
        assert r["pagedllm"]["queue_ms"]["p50"] >= 0
        assert r["ratio"]["greedy_agreement"] == 1.0 and r["ratio"]["ttft"] > 0


def test_attention_quick_run_end_to_end(tmp_path):
    out = tmp_path / "attn.json"
    cases = "decode-bs1-ctx64,decode-bs4-ctx256,prefill-64"
    attn.main(["--quick", "--threads", "1", "--bw-mib", "32", "--repeats", "2", "--cases", cases,
               "--output", str(out)])
    data = json.loads(out.read_text())
    assert data["bandwidth"]["copy_gbs"] > 0 and data["bandwidth"]["read_gbs"] > 0
    assert list(data["cases"]) == cases.split(",")
    for name, c in data["cases"].items():
        reqs = attn.build_cases(quick=True)[name]
        assert c["bytes"] == attn.min_bytes(reqs, attn.NUM_HEADS, attn.NUM_KV_HEADS, attn.HEAD_DIM, 4)
        assert set(c["backends"]) == {"cpu", "torch", "gather+sdpa"}
        for b in c["backends"].values():
            assert b["gbs"] == pytest.approx(c["bytes"]["total"] / b["ms"] / 1e6)
        assert 0 <= c["max_abs_diff"] < 1e-4

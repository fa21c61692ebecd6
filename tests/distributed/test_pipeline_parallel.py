"""Pipeline parallelism and multi-node launch, on one machine ("nodes" are launches that
rendezvous over loopback). Each scenario runs in a subprocess with a time limit
(pp_scenarios.py); the server test kills a pipeline stage under a live server."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from conftest import hf_greedy, random_prompts
from test_tp_lifecycle import scenario
from tp_scenarios import MAX_NEW  # pp_scenarios uses it too

from pagedllm.worker.executor.remote import _SILENCE_S

REPO = Path(__file__).resolve().parents[2]
SCENARIOS = Path(__file__).with_name("pp_scenarios.py")


def _free_ports(n: int) -> int:
    """A port p with p .. p + n - 1 free (probed by binding)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first = s.getsockname()[1]
        if first + n < 65536 and all(_bindable(first + i) for i in range(1, n)):
            return first


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(3, seed=16, hi=20)


@pytest.fixture(scope="module")
def expected(hf_models, prompts) -> list[list[int]]:
    return [hf_greedy(hf_models["llama"], p, MAX_NEW) for p in prompts]


def test_pp2_and_tp2_x_pp2_equal_transformers_with_per_stage_kv(llama_dir, prompts, expected):
    result = scenario("pipeline", llama_dir, prompts, script=SCENARIOS, timeout=300)
    single, pp2, tp2pp2 = result["single"], result["pp2"], result["tp2pp2"]
    assert single["outputs"] == expected
    assert pp2["outputs"] == expected and tp2pp2["outputs"] == expected
    assert pp2["in_flight"] == 2 and tp2pp2["in_flight"] == 2  # 3 requests a step: two micro-batches
    # the prompt-logprob rows come back in the order one forward gives them
    for run in (pp2, tp2pp2):
        for got, want in zip(run["prompt_logprobs"], single["prompt_logprobs"]):
            assert [p and sorted(p) for p in got] == [p and sorted(p) for p in want]
            assert all(abs(g[t] - w[t]) < 1e-4 for g, w in zip(got[1:], want[1:]) for t in w)
    # each stage holds its layer and a KV pool of one layer, the same block count everywhere
    (whole,) = single["shards"]
    assert [(s["first_layer"], s["end_layer"], s["kv_layers"]) for s in pp2["shards"]] == [(0, 1, 1), (1, 2, 1)]
    assert [(s["first_layer"], s["kv_layers"]) for s in tp2pp2["shards"]] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert whole["kv_layers"] == 2 and pp2["num_blocks"] == single["num_blocks"]
    assert all(s["num_params"] < whole["num_params"] for s in pp2["shards"])
    assert sum(s["num_params"] for s in tp2pp2["shards"]) < 2 * whole["num_params"]


def test_tp2_across_two_launches(llama_dir, prompts, expected):
    """Node 0 (the engine) and node 1 (``pagedllm serve --headless``) rendezvous like two hosts;
    killing node 1 turns the idle engine unhealthy within seconds and fails the next call; a node
    with another layout is refused."""
    result = scenario("multinode", llama_dir, prompts, _free_ports(2), script=SCENARIOS, timeout=300)
    assert result["outputs"] == [expected, expected]
    assert result["ranks"] == [0, 1]  # collective_rpc reaches the rank on the other node
    assert "rank 1 (node 1) sent no heartbeat" in result["health"]
    # the watchdog's 10 s of silence plus 10 s of slack: measured 10.6 s quiet and 10.4 s with a CPU hog
    # per core, i.e. 0.6 s past the silence, which the slack covers 16x over
    assert result["seconds"] < _SILENCE_S + 10
    assert result["killed_error"] is not None and "sent no heartbeat" in result["killed_error"]
    assert "does not match the engine on node 0" in result["mismatch"]
    assert "tensor_parallel_size=1 here but 2 on node 0" in result["mismatch"]
    assert result["wrong_exit"] != 0 and "does not match" in result["wrong_stderr"]


def test_a_node_that_never_joins_is_named_with_its_command(llama_dir, monkeypatch):
    """Node 0 of two hosts one rank itself and spawns nothing: no node 1 -> a clear error."""
    from pagedllm import LLM
    monkeypatch.setenv("PAGEDLLM_TP_STARTUP_TIMEOUT", "1")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as err:
        LLM(llama_dir, tensor_parallel_size=2, nnodes=2, master_port=_free_ports(1), num_gpu_blocks_override=64,
            max_model_len=128, num_threads=1)
    assert time.monotonic() - t0 < 30
    assert "node(s) [1] (rank(s) [1]) did not report 'joined' within 1 s" in str(err.value)
    assert "--headless --nnodes 2 --node-rank 1" in str(err.value)

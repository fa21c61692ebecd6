"""The Ray executor (``distributed_executor_backend="ray"``) on a local Ray instance: TP=2 and PP=2 on
CPU (gloo) give transformers' greedy tokens, two engines run one after the other in one process and
leave no actor behind, and an actor killed mid-generation fails the request within seconds,
naming the rank and its node."""
from __future__ import annotations

from pathlib import Path

import pytest
from conftest import hf_greedy, random_prompts
from test_tp_lifecycle import scenario
from tp_scenarios import MAX_NEW

RAY_SCENARIOS = Path(__file__).with_name("ray_scenarios.py")
pytest.importorskip("ray", reason="the Ray executor needs Ray (pip install 'pagedllm[ray]')")


def test_ray_tp2_and_pp2_match_transformers_and_fail_fast(llama_dir, hf_models, isolated_ray):
    prompts = random_prompts(3, seed=38, hi=20)
    expected = [hf_greedy(hf_models["llama"], p, MAX_NEW) for p in prompts]
    result = scenario("lifecycle", llama_dir, prompts, timeout=420, script=RAY_SCENARIOS)
    assert result["outputs"] == [expected, expected]
    assert result["pipeline"] == expected
    assert result["left"] == []  # every actor process of the first two engines is gone
    assert set(result["locations"]) == {"1"} and "node " in result["locations"]["1"]
    assert result["error"] is not None and "worker rank 1" in result["error"] and "node " in result["error"]
    assert result["seconds"] < 10

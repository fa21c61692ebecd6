"""collective_rpc and sleep mode on every rank (issue 31), and which rank failed under pipeline
parallelism (issue 32); each scenario runs in a subprocess (lifecycle_scenarios.py)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import hf_greedy, make_model_dir, random_prompts
from test_tp_lifecycle import scenario
from tp_scenarios import MAX_NEW

SCRIPT = Path(__file__).with_name("lifecycle_scenarios.py")


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(3, seed=31, hi=20)


@pytest.fixture(scope="module")
def second_dir(tmp_path_factory) -> str:
    return make_model_dir(tmp_path_factory.mktemp("second"), "llama", seed=7)


def test_tp2_weight_update_and_sleep_on_every_rank(llama_dir, second_dir, hf_models, prompts):
    import transformers as tf
    second = tf.AutoModelForCausalLM.from_pretrained(second_dir, dtype=torch.float32).eval()
    first_out = [hf_greedy(hf_models["llama"], p, MAX_NEW) for p in prompts]
    second_out = [hf_greedy(second, p, MAX_NEW) for p in prompts]
    assert first_out != second_out
    result = scenario("tp2_rpc", llama_dir, prompts, second_dir, script=SCRIPT, timeout=300)
    assert result["ranks"] == [[0, 2], [1, 2]]  # one result per rank, in rank order
    assert result["before"] == first_out
    assert result["updated"] == second_out  # as an engine loaded from the second checkpoint
    assert result["asleep"] == [True, True]
    assert result["after_level_1"] == second_out  # level 1 keeps the updated weights
    assert result["after_level_2"] == first_out  # level 2, then reloaded from the checkpoint
    assert "rank 1" in result["rank_1_error"] and "KeyError: 'only on rank 1'" in result["rank_1_error"]
    assert result["still_serving"] == first_out


def test_pp2_sleeps_on_every_stage_and_a_stage_failure_names_the_stage(llama_dir, hf_models, prompts):
    result = scenario("pp2_sleep_then_stage_fails", llama_dir, prompts, "-", script=SCRIPT)
    expected = [hf_greedy(hf_models["llama"], p, MAX_NEW) for p in prompts]
    assert result["before"] == result["after"] == expected
    assert result["asleep"] == [True, True]
    assert result["error"].startswith("pipeline-parallel step failed, the engine is dead")
    assert "worker rank 1 [pipeline stage 1, tensor rank 0] raised" in result["error"]

"""Sleep mode, collective_rpc and failure messages across ranks, each run in its own Python
process by ``test_rank_lifecycle.py``.

    python lifecycle_scenarios.py SCENARIO MODEL_DIR PROMPTS_JSON [SECOND_MODEL_DIR]

prints one line ``RESULT <json>`` at the end.
"""
from __future__ import annotations

import json
import sys

from tp_scenarios import ENGINE, greedy  # same directory: the script's own path

from pagedllm import LLM


def tp2_rpc(model: str, prompts: list[list[int]], second: str) -> dict:
    """TP=2: per-rank results, a weight update from ``second``'s state dict, sleep at both levels,
    and a worker-side exception that leaves the engine running."""
    import torch
    from transformers import AutoModelForCausalLM
    llm = LLM(model, tensor_parallel_size=2, enable_sleep_mode=True, **ENGINE)
    result = dict(before=greedy(llm, prompts))
    result["ranks"] = llm.collective_rpc(lambda worker: [worker.tp.rank, worker.tp.size])
    state = AutoModelForCausalLM.from_pretrained(second, dtype=torch.float32).state_dict()
    llm.collective_rpc("update_weights", args=(state,))
    result["updated"] = greedy(llm, prompts)
    llm.sleep(level=1)
    result["asleep"] = llm.collective_rpc("is_sleeping")
    llm.wake_up()
    result["after_level_1"] = greedy(llm, prompts)
    llm.sleep(level=2)
    llm.wake_up(tags=["weights"])
    llm.collective_rpc("reload_weights")  # back to the engine's own checkpoint
    llm.wake_up(tags=["kv_cache"])
    result["after_level_2"] = greedy(llm, prompts)

    def fail_on_rank_1(worker):
        if worker.tp.rank == 1:
            raise KeyError("only on rank 1")
        return worker.tp.rank
    try:
        llm.collective_rpc(fail_on_rank_1)
    except RuntimeError as exc:
        result["rank_1_error"] = str(exc)
    result["still_serving"] = greedy(llm, prompts)
    llm.shutdown()
    return result


def pp2_sleep_then_stage_fails(model: str, prompts: list[list[int]], second: str) -> dict:
    """PP=2: every stage sleeps and wakes; then a call that raises on the second stage is
    reported as that pipeline stage's failure."""
    from pagedllm.worker.executor import RankCall
    from pagedllm.worker.model_runner import ModelRunner
    llm = LLM(model, pipeline_parallel_size=2, enable_sleep_mode=True, **ENGINE)
    before = greedy(llm, prompts)
    llm.sleep(level=1)
    asleep = llm.collective_rpc("is_sleeping")
    llm.wake_up()
    after = greedy(llm, prompts)
    try:
        llm.llm_engine.executor.run_on_all_ranks(RankCall(ModelRunner.init_cache, (-1, 0)))
        error = None
    except RuntimeError as exc:
        error = str(exc)
    return dict(before=before, asleep=asleep, after=after, error=error)


SCENARIOS = {f.__name__: f for f in (tp2_rpc, pp2_sleep_then_stage_fails)}

if __name__ == "__main__":
    name, model_dir, prompts_json, second_dir = sys.argv[1:5]
    result = SCENARIOS[name](model_dir, json.loads(prompts_json), second_dir)
    print("RESULT " + json.dumps(result), flush=True)

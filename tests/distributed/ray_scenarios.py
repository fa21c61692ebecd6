"""Ray executor scenarios, run in their own Python process by ``test_ray_executor.py`` (a local
Ray instance per process, under a time limit)::

    python ray_scenarios.py SCENARIO MODEL_DIR PROMPTS_JSON

prints one line ``RESULT <json>`` at the end.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import ray
from tp_scenarios import ENGINE, greedy, running

from pagedllm import LLM

RAY = dict(tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE)


def pids(llm: LLM) -> list[int]:
    return [int(where.rsplit("pid ", 1)[1]) for where in llm.llm_engine.executor.actor_locations().values()]


def lifecycle(model: str, prompts: list[list[int]]) -> dict:
    """Two TP=2 engines one after the other, a PP=2 engine, then a TP=2 engine whose actor is killed
    mid-generation."""
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    outputs, left = [], []
    for _ in range(2):
        llm = LLM(model, **RAY)
        actors = pids(llm)
        locations = llm.llm_engine.executor.actor_locations()
        outputs.append(greedy(llm, prompts))
        llm.llm_engine.shutdown()
        time.sleep(1.0)  # ray.kill is asynchronous
        left += running(actors)
    llm = LLM(model, **{**RAY, "tensor_parallel_size": 1, "pipeline_parallel_size": 2})
    pp_actors = pids(llm)
    pipeline = greedy(llm, prompts)
    llm.llm_engine.shutdown()
    time.sleep(1.0)
    left += running(pp_actors)
    llm = LLM(model, **RAY)
    pid = pids(llm)[0]
    killed_at = []

    def killer():
        while llm.llm_engine.counters.generation_tokens < 2 * len(prompts):  # some decode steps done
            time.sleep(0.005)
        killed_at.append(time.monotonic())
        os.kill(pid, signal.SIGKILL)

    threading.Thread(target=killer, daemon=True).start()
    try:
        greedy(llm, prompts, max_tokens=100)
        error = None
    except RuntimeError as exc:
        error = str(exc)
    seconds = time.monotonic() - killed_at[0] if killed_at else None
    llm.llm_engine.shutdown()
    return dict(outputs=outputs, pipeline=pipeline, left=left, locations={str(k): v for k, v in locations.items()},
                error=error, seconds=seconds)


SCENARIOS = {"lifecycle": lifecycle}

if __name__ == "__main__":
    name, model_dir, prompts_json = sys.argv[1:4]
    result = SCENARIOS[name](model_dir, json.loads(prompts_json))
    print("RESULT " + json.dumps(result), flush=True)

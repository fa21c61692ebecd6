"""Tensor-parallel lifecycle scenarios, each run in its own Python process by
``test_tp_lifecycle.py`` (under a time limit: before the fix, several of these hung forever).

    python tp_scenarios.py SCENARIO MODEL_DIR PROMPTS_JSON

prints one line ``RESULT <json>`` at the end. Engines are tiny: one thread per rank, a fixed
small KV pool.
"""
from __future__ import annotations

import gc
import json
import os
import signal
import sys
import threading
import time

import psutil

from pagedllm import LLM, SamplingParams

MAX_NEW = 6
ENGINE = dict(num_gpu_blocks_override=64, max_model_len=128, num_threads=1)


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int = MAX_NEW) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def running(pids: list[int]) -> list[int]:
    """The pids still alive (a reaped or zombie process does not count)."""
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def engine_children() -> list[str]:
    """This process's children, less multiprocessing's resource tracker (a per-process
    singleton that spawn starts once and that outlives any one engine)."""
    kids = []
    for child in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(child.cmdline())
            if "resource_tracker" not in cmd and child.status() != psutil.STATUS_ZOMBIE:
                kids.append(f"{child.pid}: {cmd[:120]}")
        except psutil.NoSuchProcess:
            pass
    return kids


def sequence(model: str, prompts: list[list[int]]) -> dict:
    """Issue 18's second hang: TP=2, del, TP=1, then TP=2 again, in one process."""
    llm = LLM(model, tensor_parallel_size=2, **ENGINE)
    first, pids = greedy(llm, prompts), llm.llm_engine.executor.worker_pids()
    del llm  # the finalizer stops the workers; no shutdown() call
    left_after_del = running(pids)
    second = greedy(LLM(model, **ENGINE), prompts)
    with LLM(model, tensor_parallel_size=2, **ENGINE) as llm:
        third = greedy(llm, prompts)
    return dict(outputs=[first, second, third], left_after_del=left_after_del, children=engine_children())


def side_by_side(model: str, prompts: list[list[int]]) -> dict:
    """Two TP=2 engines alive at once, each on its own group and port, used alternately."""
    a = LLM(model, tensor_parallel_size=2, **ENGINE)
    b = LLM(model, tensor_parallel_size=2, **ENGINE)
    out = [greedy(a, prompts[:1]), greedy(b, prompts[:1]), greedy(a, prompts[1:]), greedy(b, prompts[1:])]
    ports = [a.llm_engine.executor.port, b.llm_engine.executor.port]
    a.shutdown()
    b.shutdown()
    return dict(outputs=[out[0] + out[2], out[1] + out[3]], ports=ports, children=engine_children())


def kill_worker(model: str, prompts: list[list[int]], sig: int = signal.SIGKILL) -> dict:
    """Signal the worker while generate() runs (SIGKILL: it dies; SIGSTOP: it hangs, and only the
    collective timeout can tell): generate must raise soon, leaving no process."""
    llm = LLM(model, tensor_parallel_size=2, **ENGINE)
    pid = llm.llm_engine.executor.worker_pids()[0]
    killed_at = []

    def killer():
        while llm.llm_engine.counters.generation_tokens < 2 * len(prompts):  # some decode steps done
            time.sleep(0.005)
        killed_at.append(time.monotonic())
        os.kill(pid, sig)

    threading.Thread(target=killer, daemon=True).start()
    try:
        greedy(llm, prompts, max_tokens=100)
        error = None
    except RuntimeError as exc:
        error = str(exc)
    seconds = time.monotonic() - killed_at[0] if killed_at else None
    try:
        greedy(llm, prompts[:1])
        again = None
    except RuntimeError as exc:
        again = str(exc)
    return dict(error=error, seconds=seconds, again=again, left=running([pid]), children=engine_children())


def hang_worker(model: str, prompts: list[list[int]]) -> dict:
    return kill_worker(model, prompts, signal.SIGSTOP)


def worker_raises(model: str, prompts: list[list[int]]) -> dict:
    """A call that raises on the worker (here on every rank): the worker's traceback comes back."""
    from pagedllm.worker.executor import RankCall
    from pagedllm.worker.model_runner import ModelRunner
    llm = LLM(model, tensor_parallel_size=2, **ENGINE)
    pid = llm.llm_engine.executor.worker_pids()[0]
    try:
        llm.llm_engine.executor.run_on_all_ranks(RankCall(ModelRunner.init_cache, (-1, 0)))
        error = None
    except RuntimeError as exc:
        error = str(exc)
    return dict(error=error, left=running([pid]), children=engine_children())


def shutdown_ports(model: str, prompts: list[list[int]]) -> dict:
    """shutdown() leaves no process, and the next engine binds the same port (PAGEDLLM_PORT)."""
    llm = LLM(model, tensor_parallel_size=2, **ENGINE)
    first, port, pids = greedy(llm, prompts), llm.llm_engine.executor.port, llm.llm_engine.executor.worker_pids()
    llm.shutdown()
    left, children = running(pids), engine_children()
    try:
        greedy(llm, prompts[:1])
        after = None
    except RuntimeError as exc:
        after = str(exc)
    with LLM(model, tensor_parallel_size=2, **ENGINE) as again:
        second, port2 = greedy(again, prompts), again.llm_engine.executor.port
    gc.collect()
    return dict(outputs=[first, second], ports=[port, port2], left=left, children=children,
                after_shutdown=after, children_at_end=engine_children())


SCENARIOS = {f.__name__: f for f in (sequence, side_by_side, kill_worker, hang_worker, worker_raises, shutdown_ports)}

if __name__ == "__main__":
    name, model_dir, prompts_json = sys.argv[1:4]
    result = SCENARIOS[name](model_dir, json.loads(prompts_json))
    print("RESULT " + json.dumps(result), flush=True)

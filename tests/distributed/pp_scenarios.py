"""Pipeline-parallel and multi-node scenarios, each run in its own Python process by
``test_pipeline_parallel.py`` (under a time limit: a broken rendezvous hangs).

    python pp_scenarios.py SCENARIO MODEL_DIR PROMPTS_JSON [PORT]

prints one line ``RESULT <json>`` at the end. Engines are tiny: one thread per rank, a fixed
small KV pool.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

from tp_scenarios import ENGINE, MAX_NEW, greedy  # same directory: the script's own path

from pagedllm import LLM, SamplingParams
from pagedllm.worker.executor import RankCall
from pagedllm.worker.model_runner import ModelRunner


def prompt_logprobs(llm: LLM, prompts: list[list[int]]) -> list[list[dict]]:
    """prompt_logprobs=2 for each prompt: ``[{token: logprob}]`` per position (None first)."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[{str(t): lp.logprob for t, lp in pos.items()} if pos else None for pos in o.prompt_logprobs]
            for o in outs]


def _pipelined(model: str, prompts: list[list[int]], **parallel) -> dict:
    with LLM(model, **parallel, **ENGINE) as llm:
        executor = llm.llm_engine.executor
        out = greedy(llm, prompts)
        return dict(outputs=out, prompt_logprobs=prompt_logprobs(llm, prompts),
                    shards=executor.run_on_all_ranks(RankCall(ModelRunner.shard_summary)),
                    in_flight=executor.runner.pipeline_max_in_flight(), num_blocks=executor.num_blocks)


def pipeline(model: str, prompts: list[list[int]]) -> dict:
    """One rank, PP=2 and TP=2 x PP=2 on the same prompts (3 of them: 2 micro-batches a step)."""
    single = _pipelined(model, prompts)
    return dict(single=single, pp2=_pipelined(model, prompts, pipeline_parallel_size=2),
                tp2pp2=_pipelined(model, prompts, tensor_parallel_size=2, pipeline_parallel_size=2))


def _headless(model: str, port: int, tp: int, pp: int = 1) -> subprocess.Popen:
    """``pagedllm serve MODEL --headless`` as node 1 of 2."""
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", model, "--headless", "--nnodes", "2",
           "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port", str(port), "-tp", str(tp),
           "-pp", str(pp), "--num-threads", "1", "--max-model-len", str(ENGINE["max_model_len"])]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _raises(fn) -> str | None:
    try:
        fn()
    except RuntimeError as exc:
        return str(exc)
    return None


def multinode(model: str, prompts: list[list[int]], port: int) -> dict:
    """TP=2 over two launches (node 0 here, node 1 headless); then node 1 killed while the engine
    is idle (the heartbeat watchdog notices); then a node 1 started with another layout."""
    node1 = _headless(model, port, tp=2)
    llm = LLM(model, tensor_parallel_size=2, nnodes=2, master_port=port, **ENGINE)
    outputs = [greedy(llm, prompts), greedy(llm, prompts)]
    ranks = llm.collective_rpc(lambda worker: worker.tp.rank)  # node 1's answer comes through the store
    node1.send_signal(signal.SIGKILL)
    node1.wait()
    t0 = time.monotonic()
    while llm.llm_engine.executor.health_error() is None and time.monotonic() - t0 < 60:
        time.sleep(0.1)  # an idle engine: only the heartbeat watchdog can tell
    seconds, health = time.monotonic() - t0, llm.llm_engine.executor.health_error()
    killed_error = _raises(lambda: greedy(llm, prompts))
    llm.shutdown()
    wrong = _headless(model, port + 1, tp=1, pp=2)  # world 2 and TP 1 against node 0's TP 2
    # it imports torch before it can be refused: ~3 s of CPU, 30-50 s of wall clock on a loaded 2-core box
    mismatch = _raises(lambda: LLM(model, tensor_parallel_size=2, nnodes=2, master_port=port + 1, **ENGINE))
    return dict(outputs=outputs, ranks=ranks, killed_error=killed_error, health=health, seconds=seconds,
                mismatch=mismatch, wrong_exit=wrong.wait(180), wrong_stderr=wrong.stderr.read()[-2000:])


SCENARIOS = {f.__name__: f for f in (pipeline, multinode)}

if __name__ == "__main__":
    name, model_dir, prompts_json, *rest = sys.argv[1:]
    result = SCENARIOS[name](model_dir, json.loads(prompts_json), *map(int, rest))
    print("RESULT " + json.dumps(result), flush=True)

"""The vLLM side of ``throughput.py --compare-vllm PYTHON``, run by that other interpreter.

    PYTHON benchmarks/vllm_runner.py JOB.json RESULT.json
    PYTHON benchmarks/vllm_runner.py --serve MODEL ENGINE_KWARGS_JSON

``--serve`` (the worker ``throughput.py --compare-vllm`` alternates with pagedllm): loads ``LLM``
once (its caller sets ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the engine is in-process and
nothing busy-polls between runs), prints one JSON line ``{"ready": true, "vllm_version",
"load_s", "engine_kwargs"}``, then answers each JSON line on stdin ``{"prompts": [[ids]],
"output_lens": [n]}`` with ``{"time_s": s, "outputs": [[ids]]}`` (greedy, ``ignore_eos``, the
prefix cache reset before each run), blocking on stdin in between, until stdin closes. A line
may carry ``"loras": [{"name", "id", "path"} or null per prompt]`` (``lora.py --compare-vllm``,
the worker loaded with ``enable_lora``): each prompt then runs its adapter, as a
``vllm.lora.request.LoRARequest(name, id, path)``.

It imports only the standard library and ``vllm`` (it runs in vLLM's own venv, not this one).
It loads the model once, then for every workload of the job runs a small untimed warm-up and
``repeats`` timed ``LLM.generate`` calls on the job's prompt token ids (greedy, ``ignore_eos``,
the prefix cache reset before each run), and writes::

    {"vllm_version": str, "load_s": float, "engine_kwargs": {...},
     "results": {name: {"times_s": [...], "outputs": [[token ids] per request] (of the last run)}}}

The job (written by throughput.py)::

    {"model": dir, "engine_kwargs": {"dtype": "float32", "block_size": 32, ...}, "repeats": 3,
     "workloads": [{"name": str, "prompts": [[ids]], "output_lens": [int],
                    "warm_prompts": [[ids]], "warm_output_lens": [int]}]}

The result is written before the interpreter exits, and the process leaves with ``os._exit``:
vLLM's engine-core processes may outlive it, which is why the caller starts it in its own
process group and kills that group.
"""
from __future__ import annotations

import json
import os
import sys
import time


def generate(llm, vllm, prompts: list[list[int]], output_lens: list[int],
             loras: list[dict | None] | None = None) -> list[list[int]]:
    params = [vllm.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lens]
    inputs = [vllm.TokensPrompt(prompt_token_ids=p) for p in prompts]
    outs = llm.generate(inputs, params, use_tqdm=False, lora_request=lora_requests(loras, len(prompts)))
    got = [list(o.outputs[0].token_ids) for o in outs]
    if [len(g) for g in got] != list(output_lens):
        raise RuntimeError("vLLM returned the wrong number of tokens")
    return got


def lora_requests(loras: list[dict | None] | None, num_prompts: int) -> list | None:
    """One ``LoRARequest`` (or None: the base model) per prompt, from the job's ``loras``."""
    if loras is None:
        return None
    if len(loras) != num_prompts:
        raise ValueError(f"loras: {len(loras)} entries for {num_prompts} prompts; give one per prompt")
    from vllm.lora.request import LoRARequest
    return [None if lo is None else LoRARequest(lo["name"], lo["id"], lo["path"]) for lo in loras]


def reset_prefix_cache(llm) -> None:
    if hasattr(llm, "reset_prefix_cache"):
        llm.reset_prefix_cache()  # runs reuse the prompts: no run may hit an earlier run's blocks


def timed_runs(llm, vllm, wl: dict, repeats: int) -> dict:
    generate(llm, vllm, wl["warm_prompts"], wl["warm_output_lens"])
    times, outputs = [], []
    for _ in range(repeats):
        reset_prefix_cache(llm)
        t0 = time.perf_counter()
        outputs = generate(llm, vllm, wl["prompts"], wl["output_lens"])
        times.append(time.perf_counter() - t0)
        print(f"[vllm] {wl['name']}: {times[-1]:.2f}s", file=sys.stderr, flush=True)
    return dict(times_s=times, outputs=outputs)


def run(job: dict) -> dict:
    import vllm
    t0 = time.perf_counter()
    llm = vllm.LLM(model=job["model"], **job["engine_kwargs"])
    load_s = time.perf_counter() - t0
    print(f"[vllm] loaded in {load_s:.1f}s", file=sys.stderr, flush=True)
    results = {wl["name"]: timed_runs(llm, vllm, wl, job["repeats"]) for wl in job["workloads"]}
    return dict(vllm_version=getattr(vllm, "__version__", "?"), load_s=load_s,
                engine_kwargs=job["engine_kwargs"], results=results)


def protocol_stdout():
    """A private copy of stdout for the JSON lines, with file descriptor 1 pointed at stderr:
    vLLM and its libraries print to stdout (its Triton notice on import), which broke the first
    real run's ready line."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    sys.stdout.flush()
    os.dup2(2, 1)
    return out


def serve(model: str, engine_kwargs: dict) -> None:
    """The JSON-line worker (``--serve``): one load, then one timed run per line on stdin."""
    out = protocol_stdout()  # before vllm is imported
    import vllm
    t0 = time.perf_counter()
    llm = vllm.LLM(model=model, **engine_kwargs)
    print(json.dumps(dict(ready=True, vllm_version=getattr(vllm, "__version__", "?"),
                          load_s=time.perf_counter() - t0, engine_kwargs=engine_kwargs)), file=out, flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        reset_prefix_cache(llm)
        t0 = time.perf_counter()
        outputs = generate(llm, vllm, job["prompts"], job["output_lens"], job.get("loras"))
        print(json.dumps({"time_s": time.perf_counter() - t0, "outputs": outputs}), file=out, flush=True)


def main(argv: list[str], run_job=None) -> None:
    """Reads the job file, runs it (``run_job``: this module's :func:`run` unless a caller such as
    phase_split_vllm.py passes its own) and writes the result file atomically."""
    job_path, result_path = argv
    with open(job_path) as f:
        result = (run_job or run)(json.load(f))
    tmp = result_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, result_path)  # the caller reads only a complete file


if __name__ == "__main__":
    if sys.argv[1] == "--serve":
        serve(sys.argv[2], json.loads(sys.argv[3]))
    else:
        main(sys.argv[1:])
    sys.stderr.flush()
    os._exit(0)  # do not wait on vLLM's shutdown (its background processes are the caller's to kill)

"""The vLLM side of ``phase_split.py``, run by vLLM's own interpreter (standard library and ``vllm`` only).

    PYTHON benchmarks/probes/phase_split_vllm.py JOB.json RESULT.json

The job and result are ``vllm_runner.py``'s (one load, every workload timed ``repeats`` times), with
one addition: a job may carry ``"profile": {"dir": abs path, "prompts": [[ids]], "output_lens": [n]}``.
Then the engine is built with vLLM's torch profiler configured (not running), and after every timed
run one more ``generate`` of those prompts runs between ``start_profile`` and ``stop_profile``; vLLM's
worker writes its op table (``*.profiler_out.txt``, self CPU time per op) and trace into ``dir``.
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/vllm_runner.py

from vllm_runner import generate, main, timed_runs  # noqa: E402


def profiler_config(profile: dict) -> dict:
    """vLLM's ProfilerConfig as a dict: the torch profiler, no Python stacks (they slow every op)."""
    return dict(profiler="torch", torch_profiler_dir=profile["dir"], torch_profiler_with_stack=False,
                torch_profiler_record_shapes=True)


def profiled_run(llm, vllm, profile: dict) -> float:
    llm.start_profile()
    t0 = time.perf_counter()
    generate(llm, vllm, profile["prompts"], profile["output_lens"])
    elapsed = time.perf_counter() - t0
    llm.stop_profile()
    return elapsed


def run(job: dict) -> dict:
    import vllm
    kwargs = dict(job["engine_kwargs"])
    profile = job.get("profile")
    if profile is not None:
        kwargs["profiler_config"] = profiler_config(profile)
    t0 = time.perf_counter()
    llm = vllm.LLM(model=job["model"], **kwargs)
    load_s = time.perf_counter() - t0
    print(f"[vllm] loaded in {load_s:.1f}s", file=sys.stderr, flush=True)
    results = {wl["name"]: timed_runs(llm, vllm, wl, job["repeats"]) for wl in job["workloads"]}
    out = dict(vllm_version=getattr(vllm, "__version__", "?"), load_s=load_s, engine_kwargs=job["engine_kwargs"],
               results=results)
    if profile is not None:
        out["profiled_s"] = profiled_run(llm, vllm, profile)
        time.sleep(2.0)  # the worker writes its table after stop_profile returns
    return out


if __name__ == "__main__":
    main(sys.argv[1:], run)
    sys.stderr.flush()
    os._exit(0)  # vLLM's background processes are the caller's to kill (its process group)

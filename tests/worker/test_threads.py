"""A CPU rank's OpenMP threads (pagedllm/worker/threads.py): pinning to the CPUs of
PAGEDLLM_CPU_OMP_THREADS_BIND, the count that follows the free CPUs, and the options that fix it."""
import argparse
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.worker import threads

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sched_setaffinity")


def _config(num_threads=None, ranks=1, device="cpu"):
    return SimpleNamespace(num_threads=num_threads, parallel=SimpleNamespace(ranks_per_node=ranks),
                           device=torch.device(device))


PIN_PROBE = textwrap.dedent("""
    import os, sys
    from types import SimpleNamespace
    import torch
    from pagedllm.worker.threads import set_up_threads
    set_up_threads(SimpleNamespace(num_threads=None, parallel=SimpleNamespace(ranks_per_node=1),
                                   device=torch.device("cpu")))
    torch.ones(1 << 16).sum()  # a parallel region of torch's own on the pool
    pinned = set()
    for tid in os.listdir("/proc/self/task"):
        cpus = os.sched_getaffinity(int(tid))
        if len(cpus) == 1:
            pinned |= cpus
    print(torch.get_num_threads(), sorted(os.sched_getaffinity(0)), sorted(pinned))
""")


@linux_only
def test_a_cpu_list_pins_one_thread_per_cpu():
    """In a fresh process (pinning is for the life of the threads): with PAGEDLLM_CPU_OMP_THREADS_BIND
    naming every allowed CPU, as many threads as CPUs, the calling thread on the first, and each
    CPU holding one pinned thread of the pool torch shares with the C library."""
    from pagedllm.native import bindings
    if not bindings.is_available():
        pytest.skip("no C compiler")
    cpus = sorted(os.sched_getaffinity(0))[:4]
    env = {**os.environ, "PAGEDLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus)), "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-c", PIN_PROBE], env=env, capture_output=True, text=True, check=True)
    count, main, pinned = out.stdout.strip().split(" ", 2)
    assert int(count) == len(cpus)
    assert main == str(cpus[:1])
    assert pinned == str(cpus)


def test_a_cpu_list_that_does_not_fit_is_refused(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CPU_OMP_THREADS_BIND", "0")
    with pytest.raises(ValueError, match="num_threads=2 contradicts PAGEDLLM_CPU_OMP_THREADS_BIND"):
        threads.set_up_threads(_config(num_threads=2))
    monkeypatch.setenv("PAGEDLLM_CPU_OMP_THREADS_BIND", "0|1")
    with pytest.raises(ValueError, match="2 CPU list"):
        threads.set_up_threads(_config())
    monkeypatch.setenv("PAGEDLLM_CPU_OMP_THREADS_BIND", "100000")
    with pytest.raises(ValueError, match="outside the CPUs this process may run on"):
        threads.set_up_threads(_config())


def test_the_count_adapts_only_when_nothing_fixes_it(monkeypatch):
    monkeypatch.delenv("PAGEDLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    gov = threads.adaptive_threads(_config())
    assert gov is not None and gov.most == torch.get_num_threads()
    assert threads.adaptive_threads(_config(num_threads=2)) is None  # num_threads / --cpu-threads fixes it
    assert threads.adaptive_threads(_config(ranks=2)) is None  # sibling ranks are not neighbours
    assert threads.adaptive_threads(_config(device="meta")) is None
    monkeypatch.setenv("PAGEDLLM_CPU_OMP_THREADS_BIND", "nobind")
    assert threads.adaptive_threads(_config()) is None


def test_following_the_governor_sets_torchs_thread_count():
    saved = torch.get_num_threads()
    gov = SimpleNamespace(check=lambda: 1, ncpus=2)
    try:
        torch.set_num_threads(2)
        threads.follow_free_cores(gov)
        assert torch.get_num_threads() == 1
        threads.follow_free_cores(SimpleNamespace(check=lambda: None, ncpus=2))  # no change asked
        assert torch.get_num_threads() == 1
        threads.follow_free_cores(None)
    finally:
        torch.set_num_threads(saved)


def test_default_count_is_the_cores_this_process_may_use(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(threads.cpu_threads, "allowed_cpus", lambda: {0})  # as under taskset -c 0
    assert threads.num_threads_per_rank(_config()) == 1


def test_cpu_threads_option_and_its_check():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert EngineArgs.from_cli_args(parser.parse_args(["--cpu-threads", "3"])).num_threads == 3
    from pagedllm.config import EngineConfig
    with pytest.raises(ValueError, match="num_threads=0 must be an integer >= 1"):
        EngineConfig(model=None, cache=None, scheduler=None, parallel=None, device=torch.device("cpu"), num_threads=0)


def test_greedy_outputs_hold_while_the_thread_count_changes_every_step(llama_dir, hf_models):
    """The governor changes torch's thread count between steps; the tokens stay transformers'."""
    from conftest import hf_greedy

    from pagedllm import LLM, SamplingParams
    saved, asked = torch.get_num_threads(), []

    def alternate() -> int:
        asked.append(2 if asked and asked[-1] == 1 else 1)
        return asked[-1]

    try:
        with LLM(llama_dir, block_size=8, num_gpu_blocks_override=64) as llm:
            llm.llm_engine.executor.runner.cpu_threads = SimpleNamespace(check=alternate, ncpus=2)
            prompt = [1, 5, 9, 13, 17]
            out = llm.generate([{"prompt_token_ids": prompt}],
                               SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        assert list(out[0].outputs[0].token_ids) == hf_greedy(hf_models["llama"], prompt, 8)
        assert len(asked) >= 8  # one change per step: prefill and every decode step
    finally:
        torch.set_num_threads(saved)

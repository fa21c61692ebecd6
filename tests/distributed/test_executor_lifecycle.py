"""The single-rank executor's lifecycle and the typed call record every executor runs."""
from __future__ import annotations

import gc
import signal
import weakref

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.worker.executor import RankCall
from pagedllm.worker.executor.multiproc import describe_exit
from pagedllm.worker.model_runner import ModelRunner


def test_context_manager_shuts_down_and_frees_the_pool(llama_dir):
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    with LLM(llama_dir, num_gpu_blocks_override=32, max_model_len=128) as llm:
        assert len(llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids) == 3
        runner = llm.llm_engine.executor.runner
        pool = weakref.ref(runner.cache.kv)
    gc.collect()
    assert pool() is None  # the KV tensor is gone although `llm` is still referenced
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate([[5, 6, 7]], params, use_tqdm=False)
    llm.shutdown()  # a second shutdown is harmless


def test_rank_calls_name_runner_methods_not_strings():
    call = RankCall(ModelRunner.init_cache, (4, 0))
    assert call.method is ModelRunner.init_cache
    with pytest.raises(TypeError, match="ModelRunner method"):
        RankCall("execute")
    with pytest.raises(TypeError, match="ModelRunner method"):
        RankCall(print)


class _RaceLostProcess:
    """A worker another thread reaped first: multiprocessing's own join comes back empty (its
    ``waitpid`` got ECHILD) and the status shows only on a later look."""

    pid = 4242

    def __init__(self):
        self.looks = 0

    @property
    def exitcode(self):
        self.looks += 1
        return None if self.looks < 3 else -signal.SIGKILL

    def join(self, timeout=None):
        pass


def test_dead_worker_is_described_even_when_another_thread_reaped_it():
    text = describe_exit(1, _RaceLostProcess(), started=True)
    assert text == "worker rank 1 (pid 4242) was killed by SIGKILL"


def test_failures_name_the_pipeline_stage_and_tensor_rank():
    """Issue 32: under pipeline parallelism a failed rank is named by its stage, not as a tensor rank."""
    from pagedllm.config import ParallelConfig
    from pagedllm.worker.executor.multiproc import parallel_kind, rank_label
    tp2, pp2, both = (ParallelConfig(2, 1), ParallelConfig(1, 2), ParallelConfig(2, 2))
    assert [parallel_kind(p) for p in (tp2, pp2, both)] == [
        "tensor-parallel", "pipeline-parallel", "tensor- and pipeline-parallel"]
    assert rank_label(tp2, 1) == "worker rank 1"
    assert rank_label(both, 3) == "worker rank 3 [pipeline stage 1, tensor rank 1]"
    text = describe_exit(1, _RaceLostProcess(), started=True, label=rank_label(pp2, 1))
    assert text == "worker rank 1 [pipeline stage 1, tensor rank 0] (pid 4242) was killed by SIGKILL"

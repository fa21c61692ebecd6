"""CUDA graphs under tensor parallelism, as far as the CPU proves them: two gloo ranks run as two
threads of this process (test_parallel_state's harness). Each rank's decode steps, padded and
served from the graph buffers exactly as a replay is (``EagerStandIn``: the capture itself needs a
GPU), give the logits of the unpadded eager step, with the row-parallel all-reduces in the padded
forward; every rank computes the same capture schedule and ``agree_on_schedule`` refuses ranks
that do not. The real capture and replay under NCCL is ``test_tp_graph_replay_equals_eager``
(marked ``gpu`` and ``multi_gpu``: skipped without two CUDA devices)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import hf_greedy, random_prompts
from graph_safe_backend import EagerStandIn, GraphSafeDecodeBackend
from test_parallel_state import _two_ranks

from pagedllm import LLM, SamplingParams
from pagedllm.contracts.scheduler_output import ScheduledChunk, SchedulerOutput
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.worker.cuda_graphs import agree_on_schedule
from pagedllm.worker.model_runner import ModelRunner

BS, NUM_BLOCKS, STEPS = 8, 32, 5
CPU = torch.device("cpu")


def test_ranks_that_disagree_on_the_schedule_fail_together():
    def body(group):
        agree_on_schedule(group, [32, 16, 8, 4, 2, 1], CPU)  # the same everywhere: passes
        errors = []
        for schedule in ([32, 16, 8, 4, 2, 1 + group.rank], [32] * (1 + group.rank), [] if group.rank else [1]):
            try:
                agree_on_schedule(group, schedule, CPU)
            except RuntimeError as exc:
                errors.append(str(exc))
        return errors, group.gather_ints([10 * group.rank + 1, 7], CPU)

    for errors, gathered in _two_ranks(body):
        assert len(errors) == 3 and all("disagree on the CUDA-graph capture schedule" in e for e in errors)
        assert gathered == [[1, 7], [11, 7]]


def _runners(group, llama_dir, capture: bool) -> ModelRunner:
    config = EngineArgs(llama_dir, tensor_parallel_size=2, block_size=BS, max_model_len=64, max_num_seqs=12,
                        num_threads=1).create_engine_config()
    runner = ModelRunner(config, group)
    runner._cuda_graphs_apply = lambda: capture  # CPU: config.cuda_graphs is off
    runner.init_cache(NUM_BLOCKS)
    return runner


def _steps(prompts, tokens: list[list[int]], step: int) -> SchedulerOutput:
    """Step 0 prefills every prompt; step s > 0 decodes token s - 1 of each (blocks 4 per request)."""
    chunks = []
    for i, p in enumerate(prompts):
        blocks = list(range(4 * i, 4 * i + 4))
        if step == 0:
            chunks.append(ScheduledChunk(f"r{i}", p, 0, 0, blocks, 1))
        else:
            chunks.append(ScheduledChunk(f"r{i}", [tokens[i][step - 1]], len(p) + step - 1, 0, blocks, 1))
    return SchedulerOutput(chunks=chunks)


def test_tp2_padded_decode_steps_equal_the_unpadded_ones(llama_dir, hf_models, monkeypatch):
    monkeypatch.setattr("pagedllm.worker.model_runner.get_attention_backend",
                        lambda name, device, *kind: GraphSafeDecodeBackend())
    monkeypatch.setattr("pagedllm.worker.model_runner.DecodeGraphs", EagerStandIn)
    prompts = random_prompts(3, seed=31, lo=3, hi=20)  # 3 sequences: a graph of 4, one padding row

    def body(group):
        graphed, eager = _runners(group, llama_dir, True), _runners(group, llama_dir, False)
        assert eager.decode_graphs is None and graphed.cache.kv.shape[2] == NUM_BLOCKS + 1  # + the padding block
        agree_on_schedule(group, graphed.decode_graphs.schedule(), CPU)
        tokens, diffs = [[] for _ in prompts], []
        for step in range(STEPS):  # both runners, the same steps in the same order on both ranks
            out = _steps(prompts, tokens, step)
            g, e = graphed.execute(out).logits, eager.execute(out).logits  # [3, vocab] each
            diffs.append((g - e).abs().max().item())
            for i, t in enumerate(e.argmax(dim=-1).tolist()):
                tokens[i].append(t)
        return tokens, diffs, graphed.decode_graphs.replays, graphed.decode_graphs.schedule()

    (tokens0, diffs0, replays0, sched0), (tokens1, _, replays1, sched1) = _two_ranks(body, timeout=120)
    assert replays0 == replays1 == STEPS - 1  # every decode step went through the graph buffers
    assert sched0 == sched1 == [NUM_BLOCKS, 8, 16, 8, 4, 2, 1]
    assert max(diffs0) < 1e-5 and tokens0 == tokens1
    assert tokens0 == [hf_greedy(hf_models["llama"], p, STEPS) for p in prompts]


def test_tp_graphs_are_opt_in_and_enforce_eager_still_wins(llama_dir, monkeypatch):
    from pagedllm import envs
    cuda = EngineArgs(llama_dir, device="cuda", tensor_parallel_size=2).create_engine_config()
    assert cuda.cuda_graphs is True  # the engine-level switch; the runner adds the TP opt-in
    assert EngineArgs(llama_dir, device="cuda", tensor_parallel_size=2,
                      enforce_eager=True).create_engine_config().cuda_graphs is False
    monkeypatch.delenv("PAGEDLLM_TP_CUDA_GRAPHS", raising=False)
    assert envs.PAGEDLLM_TP_CUDA_GRAPHS is False
    # the runner's own decision, on a stand-in with the fields it reads: no backend blocker, so only
    # the TP opt-in stands between the TP=2 CUDA config and a capture
    runner = SimpleNamespace(config=cuda, cache_dtype=torch.float32, block_size=16, model=torch.nn.Linear(1, 1),
                             backend=SimpleNamespace(cuda_graph_blocker=lambda *args: None))
    assert ModelRunner._cuda_graphs_apply(runner) is False
    monkeypatch.setenv("PAGEDLLM_TP_CUDA_GRAPHS", "1")
    assert envs.PAGEDLLM_TP_CUDA_GRAPHS is True
    assert ModelRunner._cuda_graphs_apply(runner) is True


@pytest.mark.gpu
@pytest.mark.multi_gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_tp_graph_replay_equals_eager(llama_dir, hf_models, monkeypatch):
    """The real thing: TP=2 on NCCL, graphs captured with the all-reduces inside, replay ==
    eager == transformers; the spawned workers inherit the opt-in from the environment."""
    monkeypatch.setenv("PAGEDLLM_TP_CUDA_GRAPHS", "1")
    prompts = random_prompts(5, seed=21, lo=3, hi=40)
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=8, ignore_eos=True)

    def run(**kwargs):
        llm = LLM(llama_dir, device="cuda", dtype="float32", tensor_parallel_size=2, block_size=16,
                  num_gpu_blocks_override=128, max_model_len=512, max_num_seqs=12, **kwargs)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        runner = llm.llm_engine.executor.runner
        replays = runner.decode_graphs.replays if runner.decode_graphs is not None else 0
        llm.shutdown()
        return [o.outputs[0].token_ids for o in outs], replays

    graphed, replays = run()
    eager, eager_replays = run(enforce_eager=True)
    assert replays >= 7 and eager_replays == 0
    assert graphed == eager == [hf_greedy(hf_models["llama"], p, 8) for p in prompts]

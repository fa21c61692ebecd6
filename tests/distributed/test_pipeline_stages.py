"""Pipeline parallelism without processes: the layer split, the micro-batch split, which
checkpoint tensors a stage loads, and the launch options' validation. The multi-process runs
(greedy against transformers, TP x PP, several nodes, a killed worker) are in
tests/distributed/test_pipeline_parallel.py."""
from __future__ import annotations

import pytest
import torch
from conftest import make_model_dir
from hypothesis import given
from hypothesis import strategies as st

from pagedllm.attention.selector import get_attention_backend
from pagedllm.config import ParallelConfig
from pagedllm.contracts.scheduler_output import ScheduledChunk
from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.distributed.pipeline import PipelineStage, RankLayout, stage_of
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.models.loader import build_model, get_model_class, load_weights
from pagedllm.worker.pipeline_execute import split_micro_batches


@pytest.mark.parametrize("num_layers, pp", [(2, 2), (5, 2), (7, 3), (4, 4), (30, 4)])
def test_stages_cover_the_layers_contiguously(num_layers, pp):
    stages = [stage_of(num_layers, pp, s) for s in range(pp)]
    assert [s.start for s in stages] == [0] + [s.end for s in stages[:-1]]
    assert stages[-1].end == num_layers
    assert max(s.num_layers for s in stages) - min(s.num_layers for s in stages) <= 1
    assert [(s.is_first, s.is_last) for s in stages] == [(i == 0, i == pp - 1) for i in range(pp)]


def test_more_stages_than_layers_is_refused():
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=3 exceeds the model's 2 layers"):
        stage_of(2, 3, 0)


def test_rank_layout_is_stage_major():
    layouts = [RankLayout(r, 2, 3) for r in range(6)]
    assert [(x.stage, x.tp_rank) for x in layouts] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert [x.peer(x.stage + 1) for x in layouts[:4]] == [2, 3, 4, 5]
    assert [x.rank for x in layouts if x.sends_logits] == [4]


def _chunks(sizes: list[int]) -> list[ScheduledChunk]:
    return [ScheduledChunk(f"r{i}", [0] * n, 0, 0, [], 1) for i, n in enumerate(sizes)]


@given(st.lists(st.integers(1, 40), min_size=1, max_size=12), st.integers(1, 5))
def test_micro_batches_are_contiguous_non_empty_and_at_most_pp(sizes, pp):
    chunks = _chunks(sizes)
    groups = split_micro_batches(chunks, pp)
    assert len(groups) == min(pp, len(chunks))
    assert all(groups) and [c for g in groups for c in g] == chunks


def test_micro_batches_balance_tokens():
    groups = split_micro_batches(_chunks([10, 10, 10, 10]), 2)
    assert [len(g) for g in groups] == [2, 2]
    groups = split_micro_batches(_chunks([100, 1, 1, 1]), 2)  # one long prefill and three decodes
    assert [len(g) for g in groups] == [1, 3]


@pytest.mark.parametrize("kwargs, word", [
    (dict(tensor_parallel_size=3, nnodes=2, master_port=1), "nnodes=2"),
    (dict(tensor_parallel_size=2, nnodes=2, node_rank=2, master_port=1), "node_rank=2"),
    (dict(tensor_parallel_size=2, nnodes=2), "master_port=0"),
    (dict(pipeline_parallel_size=0), "pipeline_parallel_size=0"),
])
def test_bad_layouts_are_refused_naming_the_parameter(kwargs, word):
    with pytest.raises(ValueError, match=word):
        ParallelConfig(**kwargs)


def test_layout_sizes():
    p = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=3, nnodes=3, node_rank=1, master_port=9)
    assert (p.world_size, p.ranks_per_node) == (6, 2)


def test_pipeline_larger_than_the_model_is_refused(llama_dir):
    with pytest.raises(ValueError, match="pipeline_parallel_size=3 exceeds the model's 2 layers"):
        EngineArgs(model=llama_dir, pipeline_parallel_size=3).create_engine_config()


def test_torchrun_environment_makes_each_process_one_node(llama_dir, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")
    monkeypatch.setenv("MASTER_PORT", "29400")
    p = EngineArgs(model=llama_dir, tensor_parallel_size=2, pipeline_parallel_size=2).create_engine_config().parallel
    assert (p.nnodes, p.node_rank, p.ranks_per_node, p.master_addr, p.master_port) == (4, 3, 1, "10.1.2.3", 29400)


def test_torchrun_world_size_must_match_the_layout(llama_dir, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_PORT", "29400")
    with pytest.raises(ValueError, match=r"WORLD_SIZE=3 .* must equal tensor_parallel_size x pipeline_parallel_size"):
        EngineArgs(model=llama_dir, tensor_parallel_size=2).create_engine_config()


# ---------------------------------------------------------------------- which weights a stage holds
def _stage_model(model_dir: str, stage: PipelineStage):
    config = EngineArgs(model=model_dir).create_engine_config()
    mc = config.model
    model = build_model(get_model_class(mc.architecture), mc.hf_config, get_attention_backend("torch", config.device),
                        mc.max_model_len, mc.dtype, config.device, TensorParallelGroup(), "native", stage)
    load_weights(model, model_dir)
    return model


@pytest.fixture(scope="module")
def three_layer_tied(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("tied3"), "llama", num_hidden_layers=3, tie_word_embeddings=True)


def test_each_stage_loads_only_its_weights(three_layer_tied):
    full = dict(_stage_model(three_layer_tied, PipelineStage.whole(3)).named_parameters())
    first = dict(_stage_model(three_layer_tied, stage_of(3, 2, 0)).named_parameters())
    last = dict(_stage_model(three_layer_tied, stage_of(3, 2, 1)).named_parameters())
    assert {n.split(".")[2] for n in first if n.startswith("model.layers.")} == {"0"}
    assert {n.split(".")[2] for n in last if n.startswith("model.layers.")} == {"1", "2"}
    assert "model.embed_tokens.weight" in first and "lm_head.weight" not in first and "model.norm.weight" not in first
    assert "model.embed_tokens.weight" not in last and "model.norm.weight" in last
    for name, param in [*first.items(), *last.items()]:
        expected = full["model.embed_tokens.weight"] if name == "lm_head.weight" else full[name]
        assert torch.equal(param, expected), name  # a tied LM head on the last stage: the embedding


def test_an_engine_on_a_node_other_than_0_is_refused(llama_dir):
    from pagedllm import LLM
    with pytest.raises(ValueError, match="node_rank=1 hosts no engine"):
        LLM(llama_dir, tensor_parallel_size=2, nnodes=2, node_rank=1, master_port=29400)

"""Every model family's decode step on the path CUDA graphs capture makes no host sync, proven on
the CPU: the engine built as on a GPU (Triton attention, the Triton fused ops and MoE, the Triton
sampler; kernels run by the interpreter), the capture replaced by an eager run over the graph
buffers (``EagerStandIn``), and ``no_host_syncs`` (tests/host_syncs.py) raising at the first
device->host read inside that run and inside the sampler's device part (``Sampler.sample``;
the step's one fetch comes after it). Greedy tokens still equal transformers'."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import ARCHS, FAMILY_CONFIGS, _config, hf_greedy, make_model_dir, random_prompts
from graph_safe_backend import EagerStandIn
from host_syncs import HostSync, no_host_syncs
from triton_devices import INTERPRETED

from pagedllm import LLM, SamplingParams
from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.engine import llm_engine
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.layers import sampler as sampler_module
from pagedllm.layers import sampling_inputs
from pagedllm.layers.fused_moe import FusedMoE
from pagedllm.layers.sampler import Sampler
from pagedllm.models.registry import MODEL_REGISTRY

pytestmark = [pytest.mark.skipif(not INTERPRETED, reason="Triton on CPU tensors needs TRITON_INTERPRET=1"),
              pytest.mark.usefixtures("single_torch_thread")]
# MLA (DeepSeek V2/V3): MLABackend loops over the step's requests on the host (its latent kernels, C and
# Triton, run per step, not under a graph), so these families have no graph path
NO_GRAPH_PATH = ("deepseek_v2", "deepseek_v3")
FAMILIES = tuple(a for a in (*ARCHS, *FAMILY_CONFIGS) if a not in NO_GRAPH_PATH)
# head_dim 64: the smallest the Triton attention kernels take (a smaller one falls back to a
# backend that cannot be captured, and the runner would not take the graph path)
SHAPES = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64)
FETCHES = [(sampler_module, "to_host"), (llm_engine, "to_host")]
UPLOADS = [(sampling_inputs, "to_device")]
MAX_NEW = 2  # the prefill, then one decode step on the graph path (the interpreter is slow)


def test_the_families_are_all_the_registered_ones():
    """Every causal LM the registry serves is here or named in NO_GRAPH_PATH (classifier heads and
    vision-language models run these same decoders)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    causal = {name for name in MODEL_REGISTRY if name.endswith("ForCausalLM")}
    assert {MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[_config(arch).model_type]
            for arch in (*FAMILIES, *NO_GRAPH_PATH)} == causal


@pytest.mark.parametrize("arch", NO_GRAPH_PATH)
def test_mla_families_refuse_the_triton_backend_by_name(arch, tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="does not implement multi-head latent attention"):
        _graph_engine(monkeypatch, make_model_dir(tmp_path, arch, **SHAPES))


def _graph_engine(monkeypatch, path: str, fused_ops: str = "triton") -> LLM:
    """The engine as the GPU would build it, with CUDA graphs on and replayed eagerly."""
    monkeypatch.setattr("pagedllm.worker.model_runner.DecodeGraphs", EagerStandIn)
    config = EngineArgs.create_engine_config
    monkeypatch.setattr(EngineArgs, "create_engine_config", lambda self: replace(config(self), cuda_graphs=True))
    return LLM(path, attention_backend="triton", fused_ops=fused_ops, block_size=8, num_gpu_blocks_override=32,
               max_model_len=64, max_num_seqs=2)


def test_a_layer_that_cannot_be_captured_keeps_the_model_eager(tmp_path, monkeypatch, caplog):
    """MoE experts on the native ops read their counts on the host: the runner does not capture."""
    with caplog.at_level("INFO", logger="pagedllm"):
        llm = _graph_engine(monkeypatch, make_model_dir(tmp_path, "qwen2_moe", **SHAPES), fused_ops="native")
    assert llm.llm_engine.executor.runner.decode_graphs is None
    assert "CUDA graphs off: the MoE experts built with fused_ops='native'" in caplog.text


@pytest.mark.parametrize("arch", FAMILIES)
def test_decode_graph_path_makes_no_host_sync(arch, tmp_path, monkeypatch):
    import transformers as tf
    path = make_model_dir(tmp_path, arch, **SHAPES)
    llm = _graph_engine(monkeypatch, path)
    runner = llm.llm_engine.executor.runner
    assert runner.decode_graphs is not None, "the runner refused the graph path"
    moe = [m for m in runner.model.modules() if isinstance(m, FusedMoE)]
    has_experts = "moe" in arch or arch in ("mixtral", "llama4", "gpt_oss")
    assert all(m.ops == "triton" for m in moe) and bool(moe) == has_experts
    prompts = random_prompts(2, seed=len(arch), lo=3, hi=12)
    params = [SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=MAX_NEW, ignore_eos=True),
              SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=1, max_tokens=MAX_NEW, min_tokens=MAX_NEW,
                             ignore_eos=True)]  # the sampler's filter kernel too
    with no_host_syncs(monkeypatch, FETCHES, UPLOADS, armed=False) as syncs:
        syncs.arm_within(monkeypatch, EagerStandIn, "replay")
        syncs.arm_within(monkeypatch, Sampler, "sample")  # the device part: its inputs uploaded, not fetched
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    # armed: each decode step's replay and every step's sampling; each step's one fetch after them
    assert runner.decode_graphs.replays == MAX_NEW - 1 and syncs.armed_calls == 2 * MAX_NEW - 1
    assert syncs.kernels > 0 and syncs.fetches == MAX_NEW
    hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert outs[0].outputs[0].token_ids == hf_greedy(hf, prompts[0], MAX_NEW)
    assert len(outs[1].outputs[0].token_ids) == MAX_NEW


def test_the_guard_raises_at_a_sync(monkeypatch):
    """A native-ops MoE layer reads its expert counts on the host: the guard names the read."""
    moe = FusedMoE(4, 2, 8, 8, True, tp=TensorParallelGroup())
    moe.w13.normal_(), moe.w2.normal_()
    with no_host_syncs(monkeypatch), pytest.raises(HostSync, match=r"torch\.bincount at .*fused_moe\.py"):
        moe(torch.randn(3, 8), torch.randn(3, 4))


def test_a_sync_on_the_graph_path_fails_the_decode_step(tmp_path, monkeypatch):
    """The same engine with one read slipped into the fused MoE: the first replay raises."""
    from pagedllm.layers.triton_ops import fused_moe
    fused = fused_moe.fused_experts

    def reads_on_host(x, w13, w2, weights, ids, *rest):
        ids.max().item()  # e.g. an output size taken from the data
        return fused(x, w13, w2, weights, ids, *rest)
    monkeypatch.setattr(fused_moe, "fused_experts", reads_on_host)
    llm = _graph_engine(monkeypatch, make_model_dir(tmp_path, "mixtral", **SHAPES))
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    with no_host_syncs(monkeypatch, FETCHES, UPLOADS, armed=False) as syncs:
        syncs.arm_within(monkeypatch, EagerStandIn, "replay")
        with pytest.raises(HostSync, match=r"Tensor\.item at .*test_graph_path_syncs\.py"):
            llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
    assert syncs.armed_calls == 1  # the prefill ran unguarded, the first decode replay raised

"""Multi-LoRA decode steps on the CUDA-graph path, on the CPU: the engine built with graphs on, the
capture replaced by an eager run over the graphs' own buffers (``EagerStandIn``) and a graph-safe
attention backend (tests/graph_safe_backend.py), so the LoRA ops read the step's mapping from the
persistent buffers ``DecodeGraphs.prepare`` refills before each replay. Greedy tokens of a batch
mixing adapters and base requests equal transformers + PEFT's and the eager engine's; an adapter
loaded after the capture (evicting another) is read from the same slot tensors. On a GPU (marked
``gpu``, run by benchmarks/gpu_check.sh) the same with real captures and the Triton kernels."""
from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from adapters import ADAPTERS, make_adapter, peft_model
from conftest import hf_greedy, make_model_dir, random_prompts
from graph_safe_backend import EagerStandIn, GraphSafeDecodeBackend
from host_syncs import no_host_syncs

from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.engine.arg_utils import EngineArgs

pytest.importorskip("peft")


class RecordingGraphs(EagerStandIn):
    """``EagerStandIn`` that keeps each replay's LoRA mapping (graph size, ``lora_seg_start``)."""

    def replay(self, meta):
        assert self.lora.graph and self.lora.perm.data_ptr() == self.buffers["lora_perm"].data_ptr()
        self.mappings.append((meta.num_reqs, tuple(self.buffers["lora_seg_start"].tolist())))
        return super().replay(meta)

    def capture(self, model, kv_caches) -> None:
        super().capture(model, kv_caches)
        self.mappings = []


def _engine(base: str, monkeypatch, graphs: bool) -> LLM:
    """The engine with the graph-safe backend; with ``graphs``, CUDA graphs on (the runner decides
    whether it captures: nothing else is forced) and replayed eagerly."""
    with monkeypatch.context() as m:
        if graphs:
            m.setattr("pagedllm.worker.model_runner.DecodeGraphs", RecordingGraphs)
            config = EngineArgs.create_engine_config
            m.setattr(EngineArgs, "create_engine_config", lambda self: replace(config(self), cuda_graphs=True))
        m.setattr("pagedllm.worker.model_runner.get_attention_backend",
                  lambda name, device, *kind: GraphSafeDecodeBackend())
        return LLM(base, enable_lora=True, max_loras=2, max_lora_rank=16, block_size=8, num_gpu_blocks_override=64,
                   max_model_len=128, max_num_seqs=8)


def _adapters(base: str, tmp_path) -> list[LoRARequest]:
    """Three random PEFT adapters of ``base`` (ranks 4, 8 and 16; tests/lora/adapters.py)."""
    return [LoRARequest(f"a{i}", i + 1, make_adapter(base, tmp_path / f"a{i}", *ADAPTERS[i], seed=i)) for i in range(3)]


def _generate(llm: LLM, prompts, loras, lengths):
    # min_tokens: EOS masked as hf_greedy's min_new_tokens does
    params = [SamplingParams(temperature=0, max_tokens=n, min_tokens=n, ignore_eos=True) for n in lengths]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=loras, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("op", ["c_kernel", "torch_reference"])
def test_mixed_adapter_batches_replay_like_eager_and_peft(op, llama_dir, hf_models, tmp_path, monkeypatch):
    """``op``: what runs the LoRA projections on the CPU (float32: the C kernel; the graph-safe
    torch reference, what a CPU without the C library or with float16 slots runs)."""
    if op == "torch_reference":
        monkeypatch.setattr("pagedllm.layers.lora.bindings", SimpleNamespace(is_available=lambda: False))
    loras = _adapters(llama_dir, tmp_path)
    graphed = _engine(llama_dir, monkeypatch, graphs=True)
    runner = graphed.llm_engine.executor.runner
    graphs = runner.decode_graphs
    assert graphs is not None and graphs.lora is runner.lora.batch, "the runner refused the graph path"
    slot_tensors = [(t.lora.a.data_ptr(), t.lora.b.data_ptr()) for t, _ in runner.lora.targets.values()]

    # 6 requests (2 adapters + base): decode rows 6 -> 5 -> 4 -> 3 -> 1 replay graphs of 8, 8, 4, 4 and 1
    # rows, the mapping changing between replays of one graph as requests finish
    prompts = random_prompts(6, seed=31, lo=3, hi=30)
    first = [loras[0], None, loras[1], None, loras[0], loras[1]]
    lengths = [8, 3, 5, 4, 2, 5]
    with no_host_syncs(monkeypatch, armed=False) as syncs:  # the replays read nothing on the host
        syncs.arm_within(monkeypatch, EagerStandIn, "replay")
        got = _generate(graphed, prompts, first, lengths)
        # then adapter 3 evicts the least recently used one: loaded after the capture, into a
        # captured slot; the last steps run the base request alone (a replay with no LoRA row)
        later = [None, loras[2], None]
        got_later = _generate(graphed, prompts[:3], later, [6, 4, 3])
    assert syncs.armed_calls == len(graphs.mappings) == graphs.replays
    assert [(t.lora.a.data_ptr(), t.lora.b.data_ptr()) for t, _ in runner.lora.targets.values()] == slot_tensors
    assert graphed.llm_engine.scheduler.lora_slots.stats.evictions == 1

    by_size = {}
    for size, seg_start in graphs.mappings:
        by_size.setdefault(size, set()).add(seg_start)
    assert set(by_size) == {8, 4, 2, 1} and len(by_size[8]) == 2 and len(by_size[4]) >= 2
    assert (0, 0, 0) in by_size[1]  # the base request alone

    refs = {None: hf_models["llama"]}
    refs.update({lora.lora_int_id: peft_model(llama_dir, lora.lora_path) for lora in loras})
    for prompt, lora, n, tokens in [*zip(prompts, first, lengths, got), *zip(prompts, later, [6, 4, 3], got_later)]:
        assert tokens == hf_greedy(refs[lora and lora.lora_int_id], prompt, n), lora
    assert any(tokens != hf_greedy(refs[None], p, n) for p, n, tokens in zip(prompts, lengths, got))  # adapters act

    graphed.shutdown()
    eager = _engine(llama_dir, monkeypatch, graphs=False)
    assert eager.llm_engine.executor.runner.decode_graphs is None
    assert _generate(eager, prompts, first, lengths) == got
    eager.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captured_lora_graphs_equal_eager_and_peft_on_gpu(tmp_path):
    """The shipped GPU path (Triton attention, fused ops and LoRA kernels) captured with LoRA, in
    float32: graph replay, eager and transformers + PEFT agree token for token, over mappings that
    change between replays and an adapter loaded into a captured slot."""
    base = make_model_dir(tmp_path / "base", "llama", hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    loras = _adapters(base, tmp_path)
    prompts = random_prompts(5, seed=32, lo=3, hi=40)
    batches = [([loras[0], None, loras[1], loras[0], None], [8, 3, 6, 4, 8]), ([None, loras[2], loras[1]], [5, 8, 3])]

    def run(**kwargs):
        llm = LLM(base, device="cuda", dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16,
                  block_size=16, num_gpu_blocks_override=128, max_model_len=256, max_num_seqs=8, **kwargs)
        tokens = [_generate(llm, prompts[:len(c)], c, n) for c, n in batches]
        runner = llm.llm_engine.executor.runner
        return runner.decode_graphs.replays if runner.decode_graphs is not None else None, tokens

    replays, graphed = run()
    eager_replays, eager = run(enforce_eager=True)
    assert replays >= 10 and eager_replays is None
    assert graphed == eager
    import transformers as tf
    refs = {None: tf.AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float32).eval()}
    refs.update({lora.lora_int_id: peft_model(base, lora.lora_path) for lora in loras})
    for (choice, lengths), tokens in zip(batches, graphed):
        for prompt, lora, n, got in zip(prompts, choice, lengths, tokens):
            assert got == hf_greedy(refs[lora and lora.lora_int_id], prompt, n), lora

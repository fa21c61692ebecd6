"""CUDA-graph decode logic that needs no GPU: batch sizes, which steps replay, padding, and the
persistent input buffers filled by the step's one host->device copy (worker/cuda_graphs.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import hf_greedy, random_prompts
from graph_safe_backend import EagerStandIn, GraphSafeDecodeBackend

from pagedllm import LLM, SamplingParams
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.contracts.host_to_device import to_device
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.layers.lora import LoRABatch
from pagedllm.worker.cuda_graphs import DecodeGraphs, capture_sizes, pad_decode_inputs, replay_size
from pagedllm.worker.model_runner import ModelRunner

BS = 8  # block size


def test_capture_sizes_double_to_8_then_step_by_8_up_to_max_num_seqs():
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 4]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 24]  # the last one covers max_num_seqs
    assert capture_sizes(256) == [1, 2, 4, 8] + list(range(16, 257, 8))
    with pytest.raises(ValueError, match="max_num_seqs=0"):
        capture_sizes(0)


def _decode_host(seq_lens, tables, query_lens=None):
    seq_lens = np.asarray(seq_lens)
    query_lens = np.ones(len(seq_lens), dtype=np.int64) if query_lens is None else np.asarray(query_lens)
    host = AttentionMetadata.host_arrays(query_lens, seq_lens, np.asarray(tables, dtype=np.int32), BS)
    host.update(input_ids=np.arange(100, 100 + int(query_lens.sum()), dtype=np.int64),
                sample_idx=np.cumsum(query_lens) - 1)
    return host


def test_only_decode_steps_within_the_largest_size_replay():
    sizes = capture_sizes(20)
    assert replay_size(sizes, _decode_host([5], [[3]])) == 1
    assert replay_size(sizes, _decode_host([5, 9, 3], [[3, 0], [4, 6], [7, 0]])) == 4  # padded 3 -> 4
    assert replay_size(sizes, _decode_host([9] * 17, [[1, 2]] * 17)) == 24
    assert replay_size(sizes, _decode_host([9] * 25, [[1, 2]] * 25)) is None  # more than the largest graph
    assert replay_size(sizes, _decode_host([5, 9], [[3, 0], [4, 6]], query_lens=[1, 2])) is None  # a prefill chunk
    assert replay_size(sizes, _decode_host([5, 9], [[3, 0], [4, 6]], query_lens=[5, 1])) is None


def test_padding_rows_point_only_at_the_padding_block():
    host = _decode_host([5, 9, 3], [[3, 0], [4, 6], [7, 0]])
    padded = pad_decode_inputs(host, 8, pad_block=50, block_size=BS)
    assert padded["input_ids"].tolist() == [100, 101, 102] + [0] * 5
    assert padded["positions"].tolist() == [4, 8, 2] + [0] * 5
    assert padded["slot_mapping"].tolist() == [3 * BS + 4, 6 * BS + 0, 7 * BS + 2] + [50 * BS] * 5
    assert padded["seq_lens"].tolist() == [5, 9, 3] + [1] * 5
    assert padded["query_start_loc"].tolist() == list(range(9))
    assert padded["block_tables"].tolist() == [[3, 0], [4, 6], [7, 0]] + [[50, 50]] * 5
    assert padded["sample_idx"].tolist() == [0, 1, 2]  # rows to sample: the real ones only
    for name in ("input_ids", "positions", "slot_mapping", "seq_lens", "query_start_loc", "block_tables"):
        assert padded[name].dtype == host[name].dtype, name


@pytest.mark.parametrize("pack", [False, True])
def test_to_device_fills_persistent_buffers_in_place(pack):
    host = dict(a=np.array([1, 2, 3], dtype=np.int32), b=np.array([[4, 5]], dtype=np.int64),
                c=np.array([6], dtype=np.int64))
    buf_a, buf_b = torch.zeros(5, dtype=torch.int32), torch.zeros(2, 4, dtype=torch.int64)
    out = to_device(host, "cpu", pack=pack, out=dict(a=buf_a[:3], b=buf_b[:1, :2]))
    assert out["a"].data_ptr() == buf_a.data_ptr() and out["b"].data_ptr() == buf_b.data_ptr()
    assert buf_a.tolist() == [1, 2, 3, 0, 0] and buf_b.tolist() == [[4, 5, 0, 0], [0, 0, 0, 0]]
    assert out["c"].tolist() == [6]  # not a buffer: a tensor of its own, as before
    with pytest.raises(ValueError, match="shape"):
        to_device(host, "cpu", pack=pack, out=dict(a=buf_a))


def test_prepare_fills_the_buffers_and_hands_out_the_graphs_own_metadata():
    """Everything but capture and replay, on CPU tensors: the padded step lands in the buffers
    and the metadata is the one the graph of that size was (would be) captured with."""
    graphs = DecodeGraphs(capture_sizes(8), max_blocks_per_seq=4, block_size=BS, max_model_len=32, pad_block=50,
                          device=torch.device("cpu"))
    host = _decode_host([5, 9, 3], [[3, 0], [4, 6], [7, 0]])
    input_ids, positions, meta, sample_idx = graphs.prepare(host, 4)
    assert graphs.holds(meta) and (meta.num_reqs, meta.max_query_len, meta.max_seq_len) == (4, 1, 32)
    assert not graphs.holds(AttentionMetadata.from_tensors(to_device(host, "cpu"), host, BS))
    assert input_ids.tolist() == [100, 101, 102, 0] and positions.tolist() == [4, 8, 2, 0]
    assert meta.seq_lens.tolist() == [5, 9, 3, 1] and meta.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert meta.slot_mapping.tolist() == [3 * BS + 4, 6 * BS, 7 * BS + 2, 50 * BS]
    assert meta.block_tables.tolist() == [[3, 0, 50, 50], [4, 6, 50, 50], [7, 0, 50, 50], [50] * 4]
    assert sample_idx.tolist() == [0, 1, 2]
    assert meta.seq_lens.data_ptr() == graphs.buffers["seq_lens"].data_ptr()  # what the graph reads


def test_prepare_fills_the_lora_mapping_buffers_with_padding_rows_as_base_rows():
    """With LoRA the step's token -> slot mapping (set on the shared LoRABatch by the runner) lands
    in two more buffers, padded with base rows, and the batch reads them in graph-safe mode; the
    next eager step's ``set`` leaves that mode."""
    batch, cpu = LoRABatch(num_slots=3), torch.device("cpu")
    graphs = DecodeGraphs(capture_sizes(8), max_blocks_per_seq=4, block_size=BS, max_model_len=32, pad_block=50,
                          device=cpu, lora=batch)
    assert graphs.buffers["lora_seg_start"].tolist() == [0, 0, 0, 0]  # as captured: every row a base row
    host = _decode_host([5, 9, 3], [[3, 0], [4, 6], [7, 0]])
    for slots, perm, seg_start in (([2, -1, 0], [2, 0, 1, 3], [0, 1, 1, 2]), ([1, 1, 1], [0, 1, 2, 3], [0, 0, 3, 3])):
        batch.set(np.array(slots), cpu)
        graphs.prepare(host, 4)
        assert batch.graph and batch.max_segment == 4 and batch.seg_slot.tolist() == [0, 1, 2]
        assert batch.perm.data_ptr() == graphs.buffers["lora_perm"].data_ptr()  # what the graph reads
        assert graphs.buffers["lora_perm"][:4].tolist() == perm and batch.seg_start.tolist() == seg_start
    batch.set(np.array([0, -1]), cpu)
    assert not batch.graph and batch.segments == [(0, 0, 1)]
    with pytest.raises(RuntimeError, match="not set for this step"):  # a mapping of another step's rows
        graphs.prepare(host, 4)


def test_no_graphs_on_cpu_or_with_enforce_eager(llama_dir):
    llm = LLM(llama_dir, block_size=8, num_gpu_blocks_override=32, max_model_len=64)
    assert llm.llm_engine.config.cuda_graphs is False and llm.llm_engine.executor.runner.decode_graphs is None
    assert EngineArgs(llama_dir, device="cuda", enforce_eager=True).create_engine_config().cuda_graphs is False
    assert EngineArgs(llama_dir, device="cuda").create_engine_config().cuda_graphs is True


def test_runner_serves_padded_decode_steps_from_the_graph_buffers(llama_dir, hf_models, monkeypatch):
    monkeypatch.setattr("pagedllm.worker.model_runner.get_attention_backend",
                        lambda name, device, *kind: GraphSafeDecodeBackend())
    monkeypatch.setattr("pagedllm.worker.model_runner.DecodeGraphs", EagerStandIn)
    monkeypatch.setattr(ModelRunner, "_cuda_graphs_apply", lambda self: True)
    llm = LLM(llama_dir, block_size=8, num_gpu_blocks_override=64, max_model_len=128, max_num_seqs=12)
    runner = llm.llm_engine.executor.runner
    assert runner.cache.kv.shape[2] == 65  # the padding rows' block, past the scheduler's 64
    prompts = random_prompts(5, seed=21, lo=3, hi=40)
    lengths = [8, 5, 3, 8, 2]  # the batch shrinks 5 -> 3 -> 2: graphs of 8, 4 and 2 rows, stale rows past n
    # min_tokens: EOS masked like hf_greedy's min_new_tokens does
    params = [SamplingParams(temperature=0, max_tokens=n, min_tokens=n, ignore_eos=True) for n in lengths]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf_models["llama"], p, n)
                                                      for p, n in zip(prompts, lengths)]
    assert runner.decode_graphs.sizes == [1, 2, 4, 8, 16] and runner.decode_graphs.replays == 7
    llm.llm_engine.scheduler.kv.check_integrity()

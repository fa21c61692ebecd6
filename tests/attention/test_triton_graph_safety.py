"""The Triton attention backend under the CUDA-graph contract (``AttentionBackend``), proven on
the CPU with Triton's interpreter: a decode step padded the way ``worker/cuda_graphs.py`` pads
it, with the host maxima at their capture-time upper bounds and every slot nobody may read
holding NaN, gives the real rows exactly what the unpadded step gives; forward makes no host
synchronisation; and the engine's decode steps, served from the graph buffers, match
transformers."""
from __future__ import annotations

import contextlib
from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import hf_greedy, make_model_dir, random_prompts
from graph_safe_backend import EagerStandIn

from pagedllm import LLM, SamplingParams
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.testing import PagedBatch, dense_attention_f64, make_paged_batch
from pagedllm.attention.torch_ref import TorchReferenceBackend
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.worker.cuda_graphs import pad_decode_inputs

triton_backend = pytest.importorskip("pagedllm.attention.triton.backend")
from pagedllm.attention.triton import interpreting  # noqa: E402 - after the importorskip
from pagedllm.attention.triton.backend import TritonAttentionBackend  # noqa: E402
from pagedllm.attention.triton.launch import Launch  # noqa: E402

pytestmark = [pytest.mark.usefixtures("single_torch_thread"),
              pytest.mark.skipif(not interpreting(), reason="CPU tensors need Triton's interpreter")]
H200_SMS = 132  # so the split heuristic splits as it would on the GPU (it never splits for 1 "SM")
BS = 16


def nan_except_visible(batch: PagedBatch, first_visible: list[int]) -> PagedBatch:
    """The pool with NaN in every slot except request r's cached positions ``first_visible[r]
    .. num_cached``: stale blocks, slots past a sequence's end, slots before a window."""
    kc, vc = torch.full_like(batch.key_cache, float("nan")), torch.full_like(batch.value_cache, float("nan"))
    qsl, tables = batch.meta.query_start_loc.tolist(), batch.meta.block_tables.tolist()
    for r, seq_len in enumerate(batch.meta.seq_lens.tolist()):
        for p in range(first_visible[r], seq_len - (qsl[r + 1] - qsl[r])):
            blk, off = tables[r][p // BS], p % BS
            kc[blk, :, off], vc[blk, :, off] = batch.key_cache[blk, :, off], batch.value_cache[blk, :, off]
    return replace(batch, key_cache=kc, value_cache=vc)


def forward(backend, batch: PagedBatch, meta=None, **kwargs):
    kc, vc = batch.fresh_caches()
    out = backend.forward(batch.query, batch.key, batch.value, kc, vc, meta or batch.meta, batch.scale, **kwargs)
    return out, kc, vc


@pytest.mark.parametrize("num_splits", [1, 3])
def test_keys_before_the_window_are_never_read(num_splits):
    """The first key tile starts before the window (tiles are aligned): its out-of-window V rows
    must not be loaded, or a NaN there poisons the row through ``0 * NaN`` in the dot."""
    window = 5
    batch = make_paged_batch([(60, 12), (100, 1), (5, 3)], num_heads=4, num_kv_heads=1, head_dim=64, block_size=BS,
                             seed=11)  # fmt: skip
    lows = [max(0, seq - q - window + 1) for seq, q in [(72, 12), (101, 1), (8, 3)]]  # each request's first query
    out, _, _ = forward(TritonAttentionBackend(num_kv_splits=num_splits), nan_except_visible(batch, lows),
                        sliding_window=window)  # fmt: skip
    torch.testing.assert_close(out.double(), dense_attention_f64(batch, window), atol=1e-5, rtol=1e-5)


MAX_MODEL_LEN = 1024  # the capture's max_seq_len: 4 splits at this size, the real sequences fill 2 at most


def graph_padded(batch: PagedBatch, size: int, pad_block: int) -> tuple[PagedBatch, AttentionMetadata]:
    """The batch as a CUDA graph of ``size`` rows sees it: padding rows (random q/k/v, as the
    model computes from token 0) on the padding block, stale block-table columns up to
    max_model_len, ``max_seq_len = max_model_len`` and ``max_query_len = 1``."""
    m = batch.meta
    host = AttentionMetadata.host_arrays(np.diff(m.query_start_loc.numpy()), m.seq_lens.numpy(),
                                         m.block_tables.numpy(), BS)
    host["input_ids"] = np.zeros(m.num_tokens, dtype=np.int64)  # pad_decode_inputs pads the model's inputs too
    padded = pad_decode_inputs(host, size, pad_block, BS)
    g = torch.Generator().manual_seed(5)
    stale = torch.randint(0, batch.key_cache.shape[0], (size, MAX_MODEL_LEN // BS), generator=g, dtype=torch.int32)
    tables = padded["block_tables"]
    stale[:, : tables.shape[1]] = torch.from_numpy(tables)  # [size, max_model_len // BS]
    meta = AttentionMetadata(
        query_start_loc=torch.from_numpy(padded["query_start_loc"]), seq_lens=torch.from_numpy(padded["seq_lens"]),
        block_tables=stale, slot_mapping=torch.from_numpy(padded["slot_mapping"]), max_query_len=1,
        max_seq_len=MAX_MODEL_LEN, block_size=BS)
    pad = size - m.num_reqs
    rows = lambda t: torch.cat([t, torch.randn(pad, *t.shape[1:], generator=g)])  # noqa: E731
    return replace(batch, query=rows(batch.query), key=rows(batch.key), value=rows(batch.value)), meta


@contextlib.contextmanager
def no_host_sync(monkeypatch):
    """Every tensor -> host conversion raises, except inside a kernel launch (the interpreter
    itself runs on numpy copies; a compiled launch reads device memory)."""
    state = dict(armed=True, launching=False)

    def guard(name, original):
        def method(self, *args, **kwargs):
            if state["armed"] and not state["launching"]:
                raise AssertionError(f"Tensor.{name} (a host synchronisation) inside forward")
            return original(self, *args, **kwargs)
        return method

    for name in ("item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, guard(name, getattr(torch.Tensor, name)))
    run = Launch.run

    def launch(self, kernels):
        state["launching"] = True
        try:
            run(self, kernels)
        finally:
            state["launching"] = False
    monkeypatch.setattr(Launch, "run", launch)
    try:
        yield
    finally:
        state["armed"] = False


@pytest.mark.parametrize("num_heads", [4, 16])  # GQA groups of 2 and 8
def test_graph_padded_step_equals_the_unpadded_one(num_heads, monkeypatch):
    reqs = [(36, 1), (4, 1), (100, 1)]  # decode rows; 3 padded to a graph of 4
    batch = make_paged_batch(reqs, num_heads=num_heads, num_kv_heads=2, head_dim=64, block_size=BS, seed=num_heads)
    batch = nan_except_visible(batch, [0] * len(reqs))  # the padding block too
    pad_block = max(set(range(batch.key_cache.shape[0])) - set(batch.meta.block_tables.flatten().tolist()))
    padded, meta = graph_padded(batch, 4, pad_block)
    monkeypatch.setattr(triton_backend, "_num_sms", lambda device: H200_SMS)
    splits = []
    monkeypatch.setattr(triton_backend.SplitBuffers, "empty", spy(triton_backend.SplitBuffers.empty, splits))

    with no_host_sync(monkeypatch):
        out, kc, vc = forward(TritonAttentionBackend(), padded, meta)
    assert splits == [4]  # fixed by the capture's shape and max_model_len, not by this step's lengths
    ref, kc_ref, vc_ref = forward(TritonAttentionBackend(num_kv_splits=1), batch)
    assert not out[:3].isnan().any()
    torch.testing.assert_close(out[:3], ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out[:3].double(), dense_attention_f64(batch), atol=1e-5, rtol=1e-5)
    # the padding row wrote its K/V into the padding block's slot 0 and nowhere else
    torch.testing.assert_close(kc[:pad_block], kc_ref[:pad_block], equal_nan=True, atol=0, rtol=0)
    torch.testing.assert_close(vc[:pad_block], vc_ref[:pad_block], equal_nan=True, atol=0, rtol=0)
    assert torch.equal(kc[pad_block, :, 0], padded.key[3]) and kc[pad_block, :, 1:].isnan().all()


def spy(split_buffers_empty, calls: list):
    def empty(num_splits, query):
        calls.append(num_splits)
        return split_buffers_empty(num_splits, query)
    return empty


def test_the_host_sync_guard_catches_a_sync(monkeypatch):
    batch = make_paged_batch([(3, 1)], num_heads=2, num_kv_heads=1, head_dim=64, block_size=BS)
    with no_host_sync(monkeypatch), pytest.raises(AssertionError, match=r"Tensor\.tolist .* inside forward"):
        forward(TorchReferenceBackend(), batch)  # loops over requests on the host


def test_cuda_graph_blocker_names_a_fallback_that_cannot_be_captured():
    from pagedllm.attention.sdpa import SdpaBackend
    f16, f32 = torch.float16, torch.float32
    assert TritonAttentionBackend().cuda_graph_blocker(f16, f16, 128, 16) is None
    assert TritonAttentionBackend().cuda_graph_blocker(f16, f16, 16, 16) is None  # forward refuses head_dim 16
    auto = TritonAttentionBackend(fallback=SdpaBackend())
    assert auto.cuda_graph_blocker(torch.bfloat16, torch.bfloat16, 64, 32) is None
    assert auto.cuda_graph_blocker(f32, f32, 16, 16) == (
        "head_dim=16 is not supported by attention_backend='triton'; allowed: (64, 80, 96, 128, 256), so the sdpa "
        "backend runs it: attention backend 'sdpa' is not graph-safe")
    assert SdpaBackend().cuda_graph_blocker(f16, f16, 128, 16) == "attention backend 'sdpa' is not graph-safe"


def test_engine_decode_steps_from_graph_buffers_match_transformers(tmp_path, monkeypatch):
    """The whole GPU path (Triton attention and fused ops) with the runner's own decision
    (``_cuda_graphs_apply``), the capture replaced by an eager run over the graph buffers and
    metadata (padding rows, max_seq_len = max_model_len, split count for an H200): greedy
    tokens equal transformers'."""
    import transformers as tf
    monkeypatch.setattr("pagedllm.worker.model_runner.DecodeGraphs", EagerStandIn)
    monkeypatch.setattr(triton_backend, "_num_sms", lambda device: H200_SMS)
    config = EngineArgs.create_engine_config
    monkeypatch.setattr(EngineArgs, "create_engine_config", lambda self: replace(config(self), cuda_graphs=True))
    model_dir = make_model_dir(tmp_path, "llama", hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    hf = tf.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    llm = LLM(model_dir, attention_backend="triton", fused_ops="triton", block_size=8, num_gpu_blocks_override=64,
              max_model_len=512, max_num_seqs=4)  # fmt: skip
    prompts, lengths = random_prompts(3, seed=4, lo=3, hi=20), [4, 2, 3]  # the batch shrinks 3 -> 2 -> 1
    params = [SamplingParams(temperature=0, max_tokens=n, min_tokens=n, ignore_eos=True) for n in lengths]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, n) for p, n in zip(prompts, lengths)]
    graphs = llm.llm_engine.executor.runner.decode_graphs
    assert graphs is not None and graphs.replays == 3  # decode steps of 3, 2 and 1 sequences
    llm.llm_engine.scheduler.kv.check_integrity()

"""The one-call C decoder (models/cpu_decode.py) against the torch model path.

End-to-end greedy parity with transformers through this path is covered by test_parity.py
(its decode steps and its 32-token chunked-prefill runs are small batches, which take it).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import check_greedy_against, load_benchmark, make_model_dir

from pagedllm import LLM
from pagedllm.attention.metadata import AttentionMetadata, positions_from_lens
from pagedllm.layers import cpu_ops
from pagedllm.models import cpu_decode

pytestmark = pytest.mark.skipif(not cpu_ops.usable(torch.zeros(1)), reason="no C compiler")

BLOCK = 8
# odd sizes: rows and inner dims that are not multiples of the 4-row / 8-lane tiles
ODD = dict(hidden_size=42, num_attention_heads=3, num_key_value_heads=1, intermediate_size=45)


@pytest.fixture(scope="module")
def odd_llama_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("odd"), "llama", **ODD)


@pytest.fixture(scope="module")
def wide_llama_dir(tmp_path_factory):
    """Inputs in whole groups of 128 for quantization="int4" (3 groups in down_proj)."""
    return make_model_dir(tmp_path_factory.mktemp("wide"), "llama", hidden_size=128, num_attention_heads=4,
                          num_key_value_heads=1, intermediate_size=384)


@pytest.fixture(scope="module")
def fp8_dirs(tmp_path_factory, wide_llama_dir):
    """FP8 copies of the wide model, one per activation mode the decoder rounds: "none"
    (compressed-tensors per-channel W8A16), "group" (quant_method fp8, 128 x 128 blocks, dynamic)
    and "token" (the W8A16 copy with dynamic per-token e4m3 activations)."""
    qv = load_benchmark("quant_variants", "quant_variants.py")
    qv.CACHE_DIR = tmp_path_factory.mktemp("fp8")
    dirs = {"none": qv.ensure_variant(Path(wide_llama_dir), "fp8-w8a16"),
            "group": qv.ensure_variant(Path(wide_llama_dir), "fp8-b128")}
    token = qv.CACHE_DIR / "token"
    shutil.copytree(dirs["none"], token)
    config = json.loads((token / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["input_activations"] = {
        "num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "strategy": "token"}
    (token / "config.json").write_text(json.dumps(config))
    return {**dirs, "token": token}


def _model(model_dir, **kwargs):
    llm = LLM(model_dir, num_gpu_blocks_override=40, block_size=BLOCK, max_model_len=256, **kwargs)
    runner = llm.llm_engine.executor.runner
    assert runner.model.model.fused_decoder is not None, "fused path should be on for float32 CPU"
    return runner.model, runner.cache.layer_caches


def decoder_step(model, caches, fused: bool, reqs: list[tuple[list[int], int, list[int]]]) -> torch.Tensor:
    """One forward over requests given as (new token ids, history length, block ids), through the
    one-call decoder (``fused``) or the module path (blocks of ``BLOCK`` tokens)."""
    query_lens = np.array([len(ids) for ids, _, _ in reqs])
    seq_lens = np.array([h + len(ids) for ids, h, _ in reqs])
    tables = np.full((len(reqs), max(len(b) for _, _, b in reqs)), -1, dtype=np.int32)
    for i, (_, _, blocks) in enumerate(reqs):
        tables[i, : len(blocks)] = blocks
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, BLOCK)
    ids = torch.tensor([t for ids, _, _ in reqs for t in ids])
    positions = torch.from_numpy(positions_from_lens(query_lens, seq_lens))
    saved = model.model.fused_decoder
    model.model.fused_decoder = saved if fused else None
    try:
        with torch.inference_mode():
            return model(ids, positions, caches, meta)
    finally:
        model.model.fused_decoder = saved


def _clone(caches):
    return [(k.clone(), v.clone()) for k, v in caches]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "odd", "odd-int8", "wide-int4", "fp8-none", "fp8-token",
                                  "fp8-group"])
def test_fused_matches_torch_path_on_a_ragged_batch(arch, model_dirs, odd_llama_dir, wide_llama_dir, request,
                                                     monkeypatch):
    """The decoder's own kernels: float32 projections on its register tile (the panel GEMM, which
    some hosts take from one token, is test_panel_projections_match_torch_path's)."""
    monkeypatch.setattr(cpu_ops, "DECODE_PANEL_MIN_ROWS", 18)
    quant = arch.split("-")[1] if "-" in arch and not arch.startswith("fp8") else None
    if arch.startswith("fp8"):  # a checkpoint whose config says FP8: its weights load as e4m3
        model_dir = str(request.getfixturevalue("fp8_dirs")[arch.split("-")[1]])
    else:
        model_dir = {"odd": odd_llama_dir, "wide": wide_llama_dir}.get(arch.split("-")[0]) or model_dirs[arch]
    model, caches = _model(model_dir, quantization=quant)
    if arch.startswith("fp8"):
        qkv = model.model.layers[0].self_attn.qkv_proj
        assert qkv.weight.dtype == torch.float8_e4m3fn and qkv.fp8_act == arch.split("-")[1]
    g = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(3, 500, (n,), generator=g).tolist()  # noqa: E731
    # histories written by the torch path: A has 20 tokens (3 blocks), B has 9 (2 blocks)
    hist_a, hist_b = rand(20), rand(9)
    decoder_step(model, caches, False, [(hist_a, 0, [5, 17, 2]), (hist_b, 0, [30, 8])])
    # then: A decodes one token (into its partial 3rd block), B prefills a 7-token chunk with
    # history that crosses into a new block, C is a fresh 3-token prompt; shuffled block ids
    batch = [(rand(1), 20, [5, 17, 2]), (rand(7), 9, [30, 8, 11]), (rand(3), 0, [39])]
    fused_caches, torch_caches = _clone(caches), _clone(caches)
    got = decoder_step(model, fused_caches, True, batch)
    want = decoder_step(model, torch_caches, False, batch)
    assert got.shape == want.shape == (11, model.config.hidden_size)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    for (fk, fv), (tk, tv) in zip(fused_caches, torch_caches):  # same K/V written to the same slots
        torch.testing.assert_close(fk, tk, atol=1e-5, rtol=1e-5, equal_nan=True)  # unwritten: garbage
        torch.testing.assert_close(fv, tv, atol=1e-5, rtol=1e-5, equal_nan=True)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "odd"])
def test_fused_matches_torch_path_on_one_decode_token(arch, model_dirs, odd_llama_dir, monkeypatch):
    """A step of one token: the register-tile hosts' float32 projections (gate/up too) take
    llama_decode.c's two-stream matvec where the row count is even, the tile where it is odd
    (the "odd" model has both); bias values are test_ld_linear's (these checkpoints' are zero)."""
    monkeypatch.setattr(cpu_ops, "DECODE_PANEL_MIN_ROWS", 18)
    model, caches = _model(odd_llama_dir if arch == "odd" else model_dirs[arch])
    g = torch.Generator().manual_seed(1)
    decoder_step(model, caches, False, [(torch.randint(3, 500, (20,), generator=g).tolist(), 0, [5, 17, 2])])
    step = [(torch.randint(3, 500, (1,), generator=g).tolist(), 20, [5, 17, 2])]
    fused_caches, torch_caches = _clone(caches), _clone(caches)
    got = decoder_step(model, fused_caches, True, step)
    want = decoder_step(model, torch_caches, False, step)
    assert got.shape == want.shape == (1, model.config.hidden_size)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    for (fk, fv), (tk, tv) in zip(fused_caches, torch_caches):
        torch.testing.assert_close(fk, tk, atol=1e-5, rtol=1e-5, equal_nan=True)
        torch.testing.assert_close(fv, tv, atol=1e-5, rtol=1e-5, equal_nan=True)


def test_forward_host_computes_what_the_tensor_call_does(llama_dir):
    """The model runner's decode path hands the step's host arrays to the decoder as they are
    (``forward_host``): the same hidden states and K/V, bit for bit, as the call on tensors."""
    model, caches = _model(llama_dir)
    fused = model.model.fused_decoder
    g = torch.Generator().manual_seed(2)
    decoder_step(model, caches, False, [(torch.randint(3, 500, (20,), generator=g).tolist(), 0, [5, 17, 2]),
                                        (torch.randint(3, 500, (9,), generator=g).tolist(), 0, [30, 8])])
    query_lens, seq_lens = np.array([1, 3]), np.array([21, 12])
    tables = np.array([[5, 17, 2], [30, 8, -1]], dtype=np.int32)
    host = AttentionMetadata.host_arrays(query_lens, seq_lens, tables, BLOCK)
    host["input_ids"] = np.array([7, 8, 9, 10], dtype=np.int64)
    host_caches, call_caches = _clone(caches), _clone(caches)
    with torch.inference_mode():
        assert fused.applies(4, host_caches)
        got = fused.forward_host(host)
        assert fused.applies(4, call_caches)
        want = fused(torch.from_numpy(host["input_ids"]), torch.from_numpy(host["positions"]),
                     AttentionMetadata.from_tensors({k: torch.from_numpy(v) for k, v in host.items()}, host, BLOCK))
    assert torch.equal(got, want)
    for (hk, hv), (ck, cv) in zip(host_caches, call_caches):
        assert torch.equal(hk.nan_to_num(), ck.nan_to_num()) and torch.equal(hv.nan_to_num(), cv.nan_to_num())


def test_engine_decode_steps_skip_the_tensor_inputs(llama_dir, hf_models, monkeypatch):
    """Every decode step of a greedy run goes through ``forward_host`` (no metadata tensors), and
    the tokens are transformers' greedy ones."""
    calls = []
    original = cpu_decode.FusedCpuDecoder.forward_host
    monkeypatch.setattr(cpu_decode.FusedCpuDecoder, "forward_host",
                        lambda self, host: calls.append(len(host["input_ids"])) or original(self, host))
    llm = LLM(llama_dir, num_gpu_blocks_override=40, block_size=BLOCK, max_model_len=256)
    prompts = [[5, 9, 14, 200, 3], [17, 18, 19]]
    check_greedy_against(llm, hf_models["llama"], prompts, 6, logprob_prompts=0)
    assert calls and calls.count(2) >= 5  # the prompts' step, then 5 decode steps of both requests


@pytest.mark.parametrize("arch,panel_min", [("llama", 16), ("llama", 1), ("qwen2", 16), ("qwen2", 1),
                                            ("wide-int4", None)])
@pytest.mark.parametrize("prefill", [3, 20, 71])  # 11 / 28 / 79 tokens: past the tile's 64 only panels
def test_panel_projections_match_torch_path(arch, panel_min, prefill, model_dirs, wide_llama_dir, monkeypatch):
    """Projections with panel copies (float32: every output a multiple of 32, AVX-512 build;
    int4: quant_gemm.c's): the decoder takes up to PANEL_MAX_ROWS tokens and runs them on the
    module path's panel GEMM (dense_gemm.c from cpu_ops.DECODE_PANEL_MIN_ROWS tokens: 16 on Intel
    CPUs, 1 elsewhere, both tested on every host; quant_gemm.c from 3)."""
    if panel_min is not None:
        monkeypatch.setattr(cpu_ops, "DECODE_PANEL_MIN_ROWS", panel_min)
    if arch == "wide-int4":
        model, caches = _model(wide_llama_dir, quantization="int4")
        assert model.model.fused_decoder._struct.panel_min == 3
    else:
        model, caches = _model(model_dirs[arch])
        assert model.model.fused_decoder._struct.panel_min == panel_min
    if cpu_decode._panels(model.model.layers[0].self_attn.qkv_proj) is None:
        pytest.skip("no panel copies here (the library's panel GEMM has no AVX-512 tile on this CPU)")
    assert model.model.fused_decoder.max_tokens == cpu_ops.PANEL_MAX_ROWS
    g = torch.Generator().manual_seed(1)
    rand = lambda n: torch.randint(3, 500, (n,), generator=g).tolist()  # noqa: E731
    hist = rand(10)
    decoder_step(model, caches, False, [(hist, 0, [4, 21])])
    blocks = [3, 9, 30, 1, 12, 25, 7, 33, 18, 2]  # shuffled; 10 blocks of 8 hold 79 tokens
    batch = [(rand(1), 10, [4, 21]), (rand(prefill), 0, blocks[: -(-prefill // BLOCK)]), (rand(7), 0, [39])]
    fused_caches, torch_caches = _clone(caches), _clone(caches)
    got = decoder_step(model, fused_caches, True, batch)
    want = decoder_step(model, torch_caches, False, batch)
    assert got.shape == want.shape == (prefill + 8, model.config.hidden_size)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    for (fk, fv), (tk, tv) in zip(fused_caches, torch_caches):
        torch.testing.assert_close(fk, tk, atol=1e-5, rtol=1e-5, equal_nan=True)
        torch.testing.assert_close(fv, tv, atol=1e-5, rtol=1e-5, equal_nan=True)


def test_past_the_tile_limit_the_decoder_needs_every_panel(llama_dir):
    """ld_forward refuses more than the register tile's 64 tokens when a projection has no panel
    copy, instead of overrunning its tile buffers."""
    model, caches = _model(llama_dir)
    fused = model.model.fused_decoder
    if fused.max_tokens <= 64:
        pytest.skip("no panel copies here")
    fused._arrays["down_p"][1] = None  # the last layer's down projection loses its panel copy
    with pytest.raises(ValueError, match="ld_forward: bad dimensions"):
        decoder_step(model, caches, True, [(list(range(3, 68)), 0, list(range(9)))])
    decoder_step(model, caches, True, [(list(range(3, 67)), 0, list(range(8)))])  # 64 tokens: the tile runs


def test_batches_over_the_limit_take_the_torch_path(llama_dir):
    model, caches = _model(llama_dir)
    fused = model.model.fused_decoder
    assert fused.applies(1, caches) and fused.applies(fused.max_tokens, caches)
    assert not fused.applies(fused.max_tokens + 1, caches)
    half = [(k.half(), v.half()) for k, v in caches]
    assert not fused.applies(1, half)  # only a float32 cache


def test_bad_metadata_raises_instead_of_writing_outside_the_cache(llama_dir):
    model, caches = _model(llama_dir)
    with pytest.raises(ValueError, match="out of range"):
        decoder_step(model, caches, True, [([5, 6], 0, [10_000])])


@pytest.mark.parametrize("field", ["qkv_group", "o_group", "gate_up_group", "down_group"])
def test_a_group_size_the_kernel_refuses_raises_instead_of_returning_garbage(wide_llama_dir, field):
    model, caches = _model(wide_llama_dir, quantization="int4")
    struct = model.model.fused_decoder._struct
    setattr(struct, field, 7)  # not a multiple of 8: qg_linear's ERR_ARG must reach the caller
    with pytest.raises(ValueError, match="ld_forward: bad dimensions"):
        decoder_step(model, caches, True, [([5, 6], 0, [3])])


def test_fused_path_off_when_not_applicable(llama_dir, monkeypatch):
    llm = LLM(llama_dir, num_gpu_blocks_override=40, max_model_len=256, attention_backend="torch")
    assert llm.llm_engine.executor.runner.model.model.fused_decoder is None
    model, _ = _model(llama_dir)
    assert "backend" in cpu_decode.unsupported_reason(model.model, object())
    monkeypatch.setenv("PAGEDLLM_FUSED_DECODE", "0")
    assert "PAGEDLLM_FUSED_DECODE" in model.enable_fused_decode(llm.llm_engine.executor.runner.backend)
    assert model.model.fused_decoder is None

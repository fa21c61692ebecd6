"""FP8 KV cache (``kv_cache_dtype="fp8"`` / ``"fp8_e4m3"`` / ``"fp8_e5m2"``) against transformers,
in every attention backend.

Two references, each on the model where its rule is meaningful:

* transformers with the same fp8 rounding of K (after rotary) and V, at the same scales
  (``fp8_rounded_transformers``): what the cache must compute. Greedy tokens equal on every
  prompt and logprobs within 1e-4 with given scales; tokens equal with the scales
  ``calculate_kv_scales`` set from the first batch (see the last paragraph). On
  ``make_model_dir``'s tiny Llama (``llama_dir``).
* transformers' plain float32 run: what fp8 costs. Issue 14's rule: every prompt's greedy tokens
  equal transformers', or agree up to a first divergence where transformers' logit gap between
  its token and ours is below GAP_BOUND = 1e-2. On ``scaled_embeddings``.

Why two models (measured teacher-forced over PROMPTS' float32 greedy continuations, 64
positions; "max shift" is the largest |logit change| fp8 rounding of K/V makes there):

    model                     attention moves   max shift e4m3    max shift e5m2
                              greedy tokens     (1.0/calc/ckpt)   (1.0/calc/ckpt)
    llama_dir (std 0.05)      94%               .047/.053/.056    .171/.093/.114
      same, embeddings x4     39%               .021/.020/.026    .044/.050/.044
      same, embeddings x10     8%               .010/.009/.010    .019/.019/.016
      same, embeddings x30     9%               .002/.003/.004    .006/.007/.005
      init std 0.2 (x1)        -                1.42/1.09          2.15/3.34
    ("attention moves": greedy tokens that change when every o_proj is zeroed)

Our K/V quantization is right: the engine equals the fp8-rounded reference (first rule) at
every scale source, and scales calibrated on the first batch alone still leave K at least 1.6x
and V 3.1x headroom before e4m3 saturates, over every token of these prompts. The float32 gap
comes from the model: in ``llama_dir`` the embeddings are so small that each attention output
outweighs the residual stream, so fp8's rounding of every K/V element (up to 6% in e4m3, 12.5%
in e5m2) reaches the logits nearly undamped, and a greedy token flips wherever transformers'
top two are closer than that shift (first divergences measured at gaps up to 0.037, e5m2). A
larger init scale does not help: the random network turns chaotic and the shift grows faster
than the logits' spread. Larger embeddings make each attention layer an update to the residual
stream rather than all of it; at x30 every shift is below 1e-2, so a flip can only happen at a
gap below it and the issue's rule holds by construction. ``check_tracks_transformers`` asserts
that premise (the max shift at the engine's own scales) as well as the rule, with no prompt
skipped. The price: attention decides fewer of that model's tokens (9%), so the float32
comparison says less about attention than the fp8-rounded one, which is why both run.

A value that lands within float32 noise of an fp8 rounding midpoint may round either way in
two float32 implementations (one K element of PROMPTS[0] in ``scaled_embeddings`` x4 sits on
one: the engine's logprobs then differ from the rounded reference by 2e-3). The fp8-rounded
reference comparisons run on ``llama_dir``, whose PROMPTS have no value that close at given
scales. Calculated scales put one there by design: ``k_scale = max|k| / 200`` (vLLM's constant)
maps the largest K element to 200.0, the midpoint of e4m3's 192 and 208 (V: 100.0, between 96
and 104), so float32 noise decides how the most influential element rounds, and logprobs
differ from the reference by up to 2.4e-3 (measured); the tokens are equal.
"""
from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from conftest import check_greedy_against, hf_greedy, make_model_dir, random_prompts
from fp8_kv_reference import fp8_rounded_transformers, with_kv_scales, with_scaled_embeddings
from safetensors.torch import load_file, save_file

from pagedllm import LLM, SamplingParams
from pagedllm.attention import kv_quant
from pagedllm.config import FP8_KV_CACHE_DTYPES

PROMPTS = random_prompts(8, seed=3, lo=2, hi=40)
MAX_NEW = 8
GAP_BOUND = 1e-2  # issue 14's rule, for every fp8 format
EMBEDDING_SCALE = 30.0  # see the module docstring's table


@pytest.fixture(scope="module")
def scaled_embeddings(llama_dir, tmp_path_factory):
    """``llama_dir`` with its embeddings x EMBEDDING_SCALE, and transformers' float32 model of it."""
    import transformers as tf
    path = with_scaled_embeddings(llama_dir, tmp_path_factory.mktemp("fp8") / "scaled", EMBEDDING_SCALE)
    return path, tf.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()


def _generate(llm, prompts=PROMPTS):
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _scales(llm) -> tuple[list[float], list[float]]:
    layers = [layer.self_attn for layer in llm.llm_engine.executor.runner.model.model.layers]
    return [float(a.k_scale) for a in layers], [float(a.v_scale) for a in layers]


def check_tracks_transformers(llm, got: list[list[int]], hf, cache_dtype: str, monkeypatch) -> int:
    """Asserts issue 14's rule (module docstring) for ``got`` and its premise, that fp8 rounding
    at the engine's scales shifts no logit by GAP_BOUND on these positions; returns how many
    prompts matched transformers exactly."""
    refs = [hf_greedy(hf, p, MAX_NEW) for p in PROMPTS]
    exact = 0
    for prompt, tokens, ref in zip(PROMPTS, got, refs):
        if tokens == ref:
            exact += 1
            continue
        i = next(i for i, (a, b) in enumerate(zip(tokens, ref)) if a != b)
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + ref[:i]])).logits[0, -1]
        gap = float(logits[ref[i]] - logits[tokens[i]])
        assert 0 <= gap < GAP_BOUND, (prompt, i, gap)
    assert _max_logit_shift(hf, refs, cache_dtype, *_scales(llm), monkeypatch) < GAP_BOUND
    return exact


def _max_logit_shift(hf, refs, cache_dtype: str, k_scales, v_scales, monkeypatch) -> float:
    """Largest |logit change| fp8 rounding of K/V makes at the positions that produce ``refs``."""
    with torch.no_grad():
        plain = [hf(torch.tensor([p + r])).logits[0, len(p) - 1:-1] for p, r in zip(PROMPTS, refs)]
        # patched after the float32 run: the patch rounds K in every Llama of this process
        rounded = fp8_rounded_transformers(copy.deepcopy(hf), monkeypatch, FP8_KV_CACHE_DTYPES[cache_dtype],
                                           k_scales, v_scales)
        shifted = [rounded(torch.tensor([p + r])).logits[0, len(p) - 1:-1] for p, r in zip(PROMPTS, refs)]
    monkeypatch.undo()
    return max(float((a - b).abs().max()) for a, b in zip(plain, shifted))


@pytest.mark.parametrize("backend, cache_dtype", [("auto", "fp8"), ("sdpa", "fp8_e5m2"), ("torch", "fp8_e4m3"),
                                                  ("auto", "fp8_e5m2")])
def test_fp8_cache_equals_transformers_on_fp8_rounded_kv(llama_dir, hf_models, backend, cache_dtype, tmp_path,
                                                         monkeypatch):
    path = with_kv_scales(llama_dir, tmp_path / "scaled", [0.02, 0.02], [0.015, 0.015], scalar_k=True)
    llm = _llm(path, kv_cache_dtype=cache_dtype, attention_backend=backend, max_num_batched_tokens=32)
    hf = fp8_rounded_transformers(copy.deepcopy(hf_models["llama"]), monkeypatch,
                                  FP8_KV_CACHE_DTYPES[cache_dtype], [0.02, 0.02], [0.015, 0.015])
    check_greedy_against(llm, hf, PROMPTS, MAX_NEW)


def _llm(model_dir, **kw):
    return LLM(model_dir, block_size=8, max_model_len=128, **{"num_gpu_blocks_override": 64, **kw})


@pytest.mark.parametrize("backend, cache_dtype, calculate", [
    ("auto", "fp8", True), ("auto", "fp8_e5m2", False), ("auto", "fp8_e4m3", False),
    ("sdpa", "fp8", True), ("sdpa", "fp8_e5m2", True), ("torch", "fp8", False), ("torch", "fp8_e5m2", True),
])
def test_fp8_cache_tracks_transformers(scaled_embeddings, backend, cache_dtype, calculate, monkeypatch):
    path, hf = scaled_embeddings
    llm = _llm(path, kv_cache_dtype=cache_dtype, attention_backend=backend, calculate_kv_scales=calculate,
               max_num_batched_tokens=32)  # chunked prefill too
    runner = llm.llm_engine.executor.runner
    assert runner.cache.kv.dtype == FP8_KV_CACHE_DTYPES[cache_dtype]
    exact = check_tracks_transformers(llm, _generate(llm), hf, cache_dtype, monkeypatch)
    assert exact >= len(PROMPTS) // 2
    attn = runner.model.model.layers[0].self_attn
    assert (float(attn.k_scale) != 1.0) == calculate and not attn.calibrate_kv_scales
    assert llm.get_kv_cache_stats().num_used_blocks == 0


@pytest.mark.parametrize("backend, cache_dtype", [("auto", "fp8"), ("torch", "fp8_e5m2")])
def test_calculated_scales_equal_transformers_on_fp8_rounded_kv(llama_dir, hf_models, backend, cache_dtype,
                                                                monkeypatch):
    """``calculate_kv_scales``: the scales the first batch set, then the reference at those
    scales; greedy tokens only (the largest K/V element sits on an e4m3 rounding tie: docstring)."""
    llm = _llm(llama_dir, kv_cache_dtype=cache_dtype, attention_backend=backend, calculate_kv_scales=True,
               max_num_batched_tokens=32)
    _generate(llm, PROMPTS[:1])  # the first batch sets the scales, once
    k_scales, v_scales = _scales(llm)
    hf = fp8_rounded_transformers(copy.deepcopy(hf_models["llama"]), monkeypatch,
                                  FP8_KV_CACHE_DTYPES[cache_dtype], k_scales, v_scales)
    check_greedy_against(llm, hf, PROMPTS, MAX_NEW, logprob_prompts=0)


@pytest.mark.parametrize("cache_dtype", ["fp8", "fp8_e5m2"])
def test_fp8_cache_with_the_triton_kernels(cache_dtype, tmp_path, monkeypatch):
    """Triton's interpreter; head_dim 64, the kernels' smallest; against transformers on the
    same fp8-rounded K/V."""
    pytest.importorskip("pagedllm.attention.triton.backend")
    import transformers as tf
    model_dir = make_model_dir(tmp_path / "m", "llama", hidden_size=128, num_attention_heads=2,
                               num_key_value_heads=1, head_dim=64)
    path = with_kv_scales(model_dir, tmp_path / "scaled", [0.02, 0.02], [0.015, 0.015], scalar_k=True)
    hf = tf.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    hf = fp8_rounded_transformers(hf, monkeypatch, FP8_KV_CACHE_DTYPES[cache_dtype], [0.02, 0.02], [0.015, 0.015])
    llm = _llm(path, kv_cache_dtype=cache_dtype, attention_backend="triton", max_num_batched_tokens=16,
               num_gpu_blocks_override=32)
    prompts = PROMPTS[:3]
    assert _generate(llm, prompts) == [hf_greedy(hf, p, MAX_NEW) for p in prompts]


def test_calibration_skips_the_profiling_forward_and_runs_once(llama_dir):
    llm = _llm(llama_dir, kv_cache_dtype="fp8", calculate_kv_scales=True, num_gpu_blocks_override=None,
               kv_cache_memory="1MiB")  # sized by a profiling forward
    layers = [layer.self_attn for layer in llm.llm_engine.executor.runner.model.model.layers]
    assert all(a.calibrate_kv_scales and float(a.k_scale) == 1.0 for a in layers)
    _generate(llm, PROMPTS[:2])
    scales = [(float(a.k_scale), float(a.v_scale)) for a in layers]
    assert all(a.calibrate_kv_scales is False and k != 1.0 and v != 1.0 for a, (k, v) in zip(layers, scales))
    _generate(llm, PROMPTS[2:4])
    assert [(float(a.k_scale), float(a.v_scale)) for a in layers] == scales  # set once


def test_checkpoint_kv_scales_are_loaded(scaled_embeddings, tmp_path, monkeypatch):
    """``self_attn.k_scale`` / ``v_scale`` as vLLM and llm-compressor write them."""
    path, hf = scaled_embeddings
    path = with_kv_scales(path, tmp_path / "scaled", [0.01, 0.02], [0.01, 0.01], scalar_k=True)
    llm = _llm(path, kv_cache_dtype="fp8")
    k_scales, v_scales = _scales(llm)
    assert k_scales == pytest.approx([0.01, 0.02]) and v_scales == pytest.approx([0.01, 0.01])
    check_tracks_transformers(llm, _generate(llm), hf, "fp8", monkeypatch)


def test_checkpoint_kv_scale_neither_per_tensor_nor_per_head_is_refused(llama_dir, tmp_path):
    """One scale per tensor or per KV head (2 here; tests/models/test_ct_kv_cache_scheme.py reads
    those); 3 is neither."""
    dst = tmp_path / "three"
    shutil.copytree(llama_dir, dst)
    state = load_file(str(dst / "model.safetensors"))
    state["model.layers.0.self_attn.k_scale"] = torch.ones(3)
    save_file(state, str(dst / "model.safetensors"))
    with pytest.raises(ValueError, match=r"shape \(3,\).*one element \(per tensor\) or num_key_value_heads=2"):
        _llm(str(dst), kv_cache_dtype="fp8")


def test_fp8_cache_holds_four_times_the_float32_blocks(llama_dir):
    full = _llm(llama_dir, kv_cache_memory="1MiB", num_gpu_blocks_override=None)
    fp8 = _llm(llama_dir, kv_cache_memory="1MiB", num_gpu_blocks_override=None, kv_cache_dtype="fp8")
    assert fp8.get_kv_cache_stats().num_blocks == 4 * full.get_kv_cache_stats().num_blocks


def test_fp8_cache_survives_swap_preemption(llama_dir):
    """Blocks swapped out to the CPU pool and back (cache_engine copies) keep their fp8 bytes."""
    prompts = random_prompts(12, seed=3, lo=20, hi=40)
    roomy = _llm(llama_dir, kv_cache_dtype="fp8", num_gpu_blocks_override=400)
    tight = _llm(llama_dir, kv_cache_dtype="fp8", num_gpu_blocks_override=24, preemption_mode="swap",
                 watermark=0.0, swap_space=0.01)
    assert _generate(tight, prompts) == _generate(roomy, prompts)
    assert tight.get_kv_cache_stats().preemptions_by_mode["swap"] > 0


def test_the_one_call_c_decoder_stays_off_with_an_fp8_cache(llama_dir):
    runner = _llm(llama_dir, kv_cache_dtype="fp8").llm_engine.executor.runner
    decoder = runner.model.model.fused_decoder
    assert decoder is not None and not decoder.applies(1, runner.cache.layer_caches)


def test_calculate_kv_scales_needs_an_fp8_cache(llama_dir):
    with pytest.raises(ValueError, match="calculate_kv_scales=True needs an fp8 kv_cache_dtype"):
        _llm(llama_dir, calculate_kv_scales=True)


def test_saturating_write_never_stores_nan():
    x = torch.tensor([1e6, -1e6, 3.0])
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        stored = kv_quant.to_cache_dtype(x, dtype).float()
        assert torch.equal(stored, torch.tensor([torch.finfo(dtype).max, -torch.finfo(dtype).max, 3.0]))

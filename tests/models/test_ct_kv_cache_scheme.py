"""compressed-tensors checkpoints with a ``kv_cache_scheme`` (llm-compressor's FP8 KV cache):
the per-layer K/V scales read into the FP8 KV cache, against transformers running the same
dequantized weights with K (after rotary) and V rounded to e4m3 at those scales.

Not made by the tool: llm-compressor is not installed here, and compressed-tensors 0.20.1 (in
/work/wt/quant-venv) attaches its KV-cache hooks only to attention modules whose ``forward``
takes ``past_key_value(s)`` (``is_cached_attention_module``); transformers 5's attention takes
``cache``, so ``apply_quantization_config`` silently skips the KV scheme. The checkpoint is
written to the format as that source defines it: the ``kv_cache_scheme`` below is what
``QuantizationConfig(kv_cache_scheme=QuantizationArgs(num_bits=8, type="float",
strategy="tensor", dynamic=False, symmetric=True)).model_dump(mode="json")`` serializes, and
``initialize_qparams(attn, "k"/"v", ...)`` registers ``<attention>.k_scale`` / ``v_scale`` of
shape ``[1]`` (per-tensor strategy) in the model's dtype; older releases quantized the outputs
of ``k_proj`` / ``v_proj`` instead (``k_proj.output_scale``, renamed by vLLM's ``get_cache_scale``).
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from conftest import check_greedy_against
from fp8_kv_reference import fp8_rounded_transformers, with_kv_scales
from safetensors.torch import load_file, save_file
from test_quantized_checkpoints import CASES, PROMPTS, check_against_reference, write_checkpoint

from pagedllm import LLM, SamplingParams
from pagedllm.layers.quantization.compressed_tensors import CompressedTensorsMethod

KV_CACHE_SCHEME = {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "strategy": "tensor",
                   "dynamic": False}  # as compressed-tensors 0.20.1 serializes it
K_SCALES, V_SCALES = [0.03, 0.05], [0.02, 0.04]  # per layer (a misplaced scale changes the tokens)
# per layer and KV head (the tiny Llama has 2); heads apart by 4-8x, so a head given the other's
# scale rounds its K/V 2-3 bits off and changes the tokens
K_HEAD_SCALES, V_HEAD_SCALES = [[0.01, 0.06], [0.05, 0.012]], [[0.04, 0.006], [0.008, 0.05]]
SCALE_NAMES = {"current": "model.layers.{i}.self_attn.{kv}_scale",
               "legacy": "model.layers.{i}.self_attn.{kv}_proj.output_scale"}
MAX_NEW = 8


def write_kv_checkpoint(model_dirs, hf_models, dst: Path, naming: str = "current", per_head: bool = False):
    """A W4A16 compressed-tensors checkpoint plus the FP8 kv_cache_scheme and per-layer scales
    (``per_head``: the ``attn_head`` strategy, ``[kv_heads, 1, 1]`` per layer, as
    ``initialize_qparams`` shapes them); returns its path and transformers' model on the
    dequantized weights."""
    case = CASES["ct-packed-w4a16-g64-asym"]
    path, reference = write_checkpoint(model_dirs[case[0]], dst, case, hf_models[case[0]])
    state = load_file(str(dst / "model.safetensors"))
    k_scales, v_scales = (K_HEAD_SCALES, V_HEAD_SCALES) if per_head else (K_SCALES, V_SCALES)
    shape = (-1, 1, 1) if per_head else (1,)
    for i, (k, v) in enumerate(zip(k_scales, v_scales)):
        state[SCALE_NAMES[naming].format(i=i, kv="k")] = torch.tensor(k).reshape(shape)
        state[SCALE_NAMES[naming].format(i=i, kv="v")] = torch.tensor(v).reshape(shape)
    save_file(state, str(dst / "model.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"]["kv_cache_scheme"] = {**KV_CACHE_SCHEME,
                                                        "strategy": "attn_head" if per_head else "tensor"}
    (dst / "config.json").write_text(json.dumps(config))
    return path, reference


def kv_only_checkpoint(model_dir: str, dst: Path, k_scales, v_scales, strategy: str = "tensor") -> str:
    """Float weights plus a ``kv_cache_scheme`` and its scales, no ``config_groups``."""
    with_kv_scales(model_dir, dst, k_scales, v_scales)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "dense", "config_groups": {},
                                     "kv_cache_scheme": {**KV_CACHE_SCHEME, "strategy": strategy}, "ignore": []}
    (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


def _llm(path: str, **kwargs) -> LLM:
    return LLM(path, block_size=8, num_gpu_blocks_override=200, max_num_batched_tokens=32, **kwargs)


def _attention_scales(llm: LLM) -> tuple[list[float], list[float]]:
    layers = [layer.self_attn for layer in llm.llm_engine.executor.runner.model.model.layers]
    return [float(a.k_scale) for a in layers], [float(a.v_scale) for a in layers]


@pytest.mark.parametrize("naming", list(SCALE_NAMES))
def test_kv_cache_scheme_scales_drive_the_fp8_cache(naming, model_dirs, hf_models, tmp_path, monkeypatch):
    path, reference = write_kv_checkpoint(model_dirs, hf_models, tmp_path / naming, naming)
    llm = _llm(path, kv_cache_dtype="fp8")
    assert llm.llm_engine.executor.runner.cache.kv.dtype == torch.float8_e4m3fn
    assert _attention_scales(llm) == (pytest.approx(K_SCALES), pytest.approx(V_SCALES))  # read, not 1.0
    hf = fp8_rounded_transformers(reference, monkeypatch, torch.float8_e4m3fn, K_SCALES, V_SCALES)
    check_greedy_against(llm, hf, PROMPTS, MAX_NEW)


def test_per_head_kv_scales_drive_the_fp8_cache(model_dirs, hf_models, tmp_path, monkeypatch):
    """llm-compressor's ``attn_head`` strategy: one K and one V scale per KV head and layer; query
    head h uses its KV head's (h // 2 here), against transformers rounding each head at its own."""
    path, reference = write_kv_checkpoint(model_dirs, hf_models, tmp_path / "per_head", per_head=True)
    llm = _llm(path, kv_cache_dtype="fp8")
    layers = [layer.self_attn for layer in llm.llm_engine.executor.runner.model.model.layers]
    assert [a.k_scale.tolist() for a in layers] == [pytest.approx(s) for s in K_HEAD_SCALES]
    assert [a.v_scale.tolist() for a in layers] == [pytest.approx(s) for s in V_HEAD_SCALES]
    hf = fp8_rounded_transformers(reference, monkeypatch, torch.float8_e4m3fn, K_HEAD_SCALES, V_HEAD_SCALES)
    check_greedy_against(llm, hf, PROMPTS, MAX_NEW)


def test_per_head_kv_scales_shard_with_the_heads_under_tp2(llama_dir, hf_models, tmp_path, monkeypatch):
    """Two ranks, one KV head each (float weights, a kv_cache_scheme only): each rank must read its
    own head's scales; against transformers rounding each head at its own."""
    path = kv_only_checkpoint(llama_dir, tmp_path / "per_head_tp", K_HEAD_SCALES, V_HEAD_SCALES, "attn_head")
    tp = _llm(path, kv_cache_dtype="fp8", tensor_parallel_size=2, num_threads=1)
    try:
        hf = fp8_rounded_transformers(copy.deepcopy(hf_models["llama"]), monkeypatch, torch.float8_e4m3fn,
                                      K_HEAD_SCALES, V_HEAD_SCALES)
        check_greedy_against(tp, hf, PROMPTS[:6], MAX_NEW, logprob_prompts=0)
    finally:
        tp.llm_engine.shutdown()


def test_kv_cache_only_checkpoint_has_float_weights(llama_dir, hf_models, tmp_path, monkeypatch):
    """A kv_cache_scheme and no config_groups: only the KV cache is quantized."""
    dst = tmp_path / "kv_only"
    kv_only_checkpoint(llama_dir, dst, K_SCALES, V_SCALES)
    config = json.loads((dst / "config.json").read_text())
    llm = _llm(str(dst), kv_cache_dtype="fp8")
    runner = llm.llm_engine.executor.runner
    assert runner.model.model.layers[0].mlp.down_proj.weight.dtype == torch.float32
    assert _attention_scales(llm) == (pytest.approx(K_SCALES), pytest.approx(V_SCALES))
    hf = fp8_rounded_transformers(copy.deepcopy(hf_models["llama"]), monkeypatch, torch.float8_e4m3fn,
                                  K_SCALES, V_SCALES)
    check_greedy_against(llm, hf, PROMPTS[:6], MAX_NEW)
    config["quantization_config"]["kv_cache_scheme"] = {**KV_CACHE_SCHEME, "num_bits": 4}
    (dst / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"kv_cache_scheme\.num_bits=4"):
        _llm(str(dst), kv_cache_dtype="fp8")


def test_auto_cache_dtype_keeps_the_model_dtype_as_vllm_does(model_dirs, hf_models, tmp_path):
    """vLLM resolves kv_cache_dtype="auto" to fp8 only for ModelOpt checkpoints; for this one it
    keeps the model's dtype and leaves the scales unused: so do we (the float run, exactly)."""
    path, reference = write_kv_checkpoint(model_dirs, hf_models, tmp_path / "auto")
    llm = _llm(path)
    assert llm.llm_engine.executor.runner.cache.kv.dtype == torch.float32
    check_against_reference(llm, reference, PROMPTS[:4])


@pytest.mark.parametrize("field, value", [
    ("type", "int"), ("num_bits", 4), ("strategy", "token"), ("strategy", "channel"), ("symmetric", False),
    ("dynamic", True), ("group_size", 64),
])
def test_other_kv_cache_schemes_are_refused_naming_the_field(field, value):
    cfg = {"quant_method": "compressed-tensors", "format": "pack-quantized",
           "kv_cache_scheme": {**KV_CACHE_SCHEME, field: value}, "config_groups": {"group_0": {
               "targets": ["Linear"], "format": "pack-quantized", "input_activations": None,
               "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}}}}
    with pytest.raises(ValueError, match=rf"kv_cache_scheme\.{field}={value!r} is not supported"):
        CompressedTensorsMethod.from_config(cfg)
    del cfg["kv_cache_scheme"][field]  # absent: compressed-tensors' default (only type's is refused)
    if field == "type":
        with pytest.raises(ValueError, match=r"kv_cache_scheme\.type='int'"):
            CompressedTensorsMethod.from_config(cfg)
    else:
        assert CompressedTensorsMethod.from_config(cfg).bits == 4


def test_kv_cache_scheme_beside_fp8_weights_is_read():
    """llm-compressor's usual FP8 recipe: float-quantized weights and activations plus the KV scheme."""
    scheme = {"targets": ["Linear"], "format": "float-quantized",
              "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"},
              "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token",
                                    "dynamic": True}}
    method = CompressedTensorsMethod.from_config({"quant_method": "compressed-tensors", "format": "float-quantized",
                                                  "kv_cache_scheme": KV_CACHE_SCHEME, "config_groups": {"g": scheme}})
    assert method.name == "fp8"

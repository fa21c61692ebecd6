"""Pre-quantized checkpoints (GPTQ, AWQ, compressed-tensors) and our own int4, end to end:
pagedllm loading the packed checkpoint against transformers running the same dequantized
weights (W = (code - zero) * scale, built here from the codes before packing).

The packers below follow each format's published layout; that our unpacking reads that layout
as the tools themselves do is pinned in test_quant_kernels.py against tensors packed and
dequantized by compressed-tensors and AutoAWQ (GPTQ: against its spec, no tool installs here).
"""
from __future__ import annotations

import contextlib
import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import check_greedy_against, hf_greedy, load_benchmark, make_model_dir, random_prompts
from safetensors.torch import load_file, save_file

from pagedllm import LLM, SamplingParams
from pagedllm.layers.quantization.awq import SLOT_OF_COLUMN
from pagedllm.layers.quantization.base import pack_int32

qv = load_benchmark("quant_variants", "quant_variants.py")
# the format packers both the tests and the benchmarks write checkpoints with
quantize_groups, gptq_tensors, ct_packed_tensors = qv.quantize_groups, qv.gptq_tensors, qv.ct_packed_tensors
gptq_config, ct_config = qv.gptq_config, qv.ct_config

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
INPUT_OF = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "o_proj": "o", "gate_proj": "mlp",
            "up_proj": "mlp", "down_proj": "down"}  # projections that read the same input share act order
PROMPTS = random_prompts(12, seed=5, lo=2, hi=40)
MAX_NEW = 8


def quantize_act_order(w, bits, group, sym, perm):
    """GPTQ desc_act: groups are contiguous along ``perm`` of the input columns."""
    codes, scale, zero = quantize_groups(w[:, perm], bits, group, sym)
    g_idx = torch.empty(w.shape[1], dtype=torch.int32)
    g_idx[perm] = (torch.arange(w.shape[1]) // group).int()
    return codes[:, torch.argsort(perm)], scale, zero, g_idx


def dequantize(codes, scale, zero, g_idx):
    return (codes.float() - zero[:, g_idx.long()]) * scale[:, g_idx.long()]


# --- the formats' layouts ------------------------------------------------------------------------

def awq_tensors(codes, scale, zero, g_idx, bits, v2):
    return {"qweight": pack_int32(codes.t(), 4, 1, SLOT_OF_COLUMN), "qzeros": pack_int32(zero.t().long(), 4, 1,
            SLOT_OF_COLUMN), "scales": scale.t().half().contiguous()}


def ct_naive_tensors(codes, scale, zero, g_idx, bits, sym):
    offset = 2 ** (bits - 1)
    return {"weight": (codes - offset).to(torch.int8), "weight_scale": scale,
            "weight_zero_point": (zero - offset).to(torch.int8)}


# case id: (arch, bits, group, sym, act_order, writer, writer flag, quantization_config)
CASES = {
    "gptq-v1-w4-g32-act_order": ("llama", 4, 32, True, True, gptq_tensors, False,
                                 gptq_config(4, 32, True, True, "gptq")),
    "gptq-v2-w8-channel-asym": ("qwen2", 8, -1, False, False, gptq_tensors, True,
                                gptq_config(8, -1, False, False, "gptq_v2")),
    "gptq-v2-w4-g32-asym": ("qwen2", 4, 32, False, False, gptq_tensors, True,
                            gptq_config(4, 32, False, False, "gptq_v2")),
    "awq-w4-g32": ("qwen2", 4, 32, False, False, awq_tensors, None,
                   {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}),
    "ct-packed-w4a16-g64-asym": ("llama", 4, 64, False, False, ct_packed_tensors, False,
                                 ct_config(4, 64, False, "pack-quantized")),
    "ct-packed-w8a16-channel": ("llama", 8, -1, True, False, ct_packed_tensors, True,
                                ct_config(8, -1, True, "pack-quantized")),
    "ct-naive-w4-g32": ("qwen2", 4, 32, True, False, ct_naive_tensors, True, ct_config(4, 32, True, "naive-quantized")),
}


# --- shared by the quantized-checkpoint tests (test_fp8_weights imports these) ----------------------

def start_checkpoint(src: str, dst: Path, hf_model):
    """``dst`` gets ``src``'s files but its weights; returns those weights (to quantize and write
    with ``finish_checkpoint``) and a copy of ``hf_model`` (to take the weights they dequantize to)."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in Path(src).iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    return load_file(str(Path(src) / "model.safetensors")), copy.deepcopy(hf_model)


def projection_weights(state: dict) -> list[str]:
    """The names of the attention and MLP projection weights in ``state``."""
    return [n for n in state if n.rsplit(".", 2)[-2] in PROJECTIONS and n.endswith(".weight")]


def finish_checkpoint(dst: Path, state: dict, qcfg: dict) -> str:
    """Writes ``state`` and ``qcfg`` (as config.json's quantization_config) into ``dst``."""
    save_file(state, str(dst / "model.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": qcfg}))
    return str(dst)


@contextlib.contextmanager
def tp2_llm(path: str):
    """The checkpoint at ``path`` under TP=2 (gloo ranks), shut down after the block."""
    llm = LLM(path, num_gpu_blocks_override=200, tensor_parallel_size=2, num_threads=1)
    try:
        yield llm
    finally:
        llm.llm_engine.shutdown()


def write_checkpoint(src: str, dst: Path, case: tuple, hf_model):
    """The packed checkpoint at ``dst`` and transformers' model on its dequantized weights."""
    arch, bits, group, sym, act_order, writer, flag, qcfg = case
    state, reference = start_checkpoint(src, dst, hf_model)
    ref_params = dict(reference.named_parameters())
    perms = {}
    for name in projection_weights(state):
        w = state.pop(name)
        prefix, proj = name[: -len(".weight")], name.rsplit(".", 2)[-2]
        if act_order:
            key = (name.split(".layers.")[1].split(".")[0], INPUT_OF[proj])
            seed = torch.Generator().manual_seed(len(perms))
            perm = perms.setdefault(key, torch.randperm(w.shape[1], generator=seed))
            codes, scale, zero, g_idx = quantize_act_order(w, bits, group, sym, perm)
        else:
            codes, scale, zero = quantize_groups(w, bits, group, sym)
            g_idx = (torch.arange(w.shape[1]) // (w.shape[1] if group == -1 else group)).int()
        packed = writer(codes, scale, zero, g_idx, bits, flag)
        state.update({f"{prefix}.{k}": v.contiguous() for k, v in packed.items()})
        with torch.no_grad():
            ref_params[name].copy_(dequantize(codes, scale, zero, g_idx))
    return finish_checkpoint(dst, state, qcfg), reference


def check_against_reference(llm, reference, prompts=PROMPTS):
    check_greedy_against(llm, reference, prompts, MAX_NEW)


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("case_id", list(CASES))
def test_checkpoint_greedy_matches_transformers_on_dequantized_weights(case_id, block_size, model_dirs, hf_models,
                                                                       tmp_path):
    case = CASES[case_id]
    path, reference = write_checkpoint(model_dirs[case[0]], tmp_path / case_id, case, hf_models[case[0]])
    chunked = dict(max_num_batched_tokens=32) if block_size == 16 else {}
    llm = LLM(path, block_size=block_size, num_gpu_blocks_override=300, **chunked)
    qkv = llm.llm_engine.executor.runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.uint8 and qkv.quant_bits == case[1]
    # decode steps take the one-call C decoder, except with act order (a per-call input gather)
    assert (llm.llm_engine.executor.runner.model.model.fused_decoder is None) == case[4]
    check_against_reference(llm, reference)
    assert llm.get_kv_cache_stats().num_used_blocks == 0


@pytest.mark.parametrize("case_id", ["gptq-v2-w8-channel-asym", "gptq-v2-w4-g32-asym"])
def test_tensor_parallel_shards_codes_scales_and_zeros(case_id, model_dirs, hf_models, tmp_path):
    """TP=2: column-parallel layers split output rows (q/k/v, gate/up offsets); row-parallel
    layers split input columns, g_idx and whole groups (one group: replicated)."""
    case = CASES[case_id]
    path, reference = write_checkpoint(model_dirs[case[0]], tmp_path / case_id, case, hf_models[case[0]])
    with tp2_llm(path) as llm:
        check_against_reference(llm, reference, PROMPTS[:4])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case_id", ["gptq-v1-w4-g32-act_order", "ct-packed-w8a16-channel", "awq-w4-g32"])
def test_checkpoint_on_cuda_takes_the_triton_gemm(case_id, model_dirs, hf_models, tmp_path, monkeypatch):
    """On a GPU every projection is the Triton dequant-in-GEMM (float32 model: IEEE dots), and
    the outputs are transformers' on the dequantized weights as on the CPU."""
    from pagedllm.layers.triton_ops import grouped_gemm
    calls = []
    kernel = grouped_gemm.grouped_gemm
    monkeypatch.setattr(grouped_gemm, "grouped_gemm", lambda *a: calls.append(a[-1]) or kernel(*a))
    case = CASES[case_id]
    path, reference = write_checkpoint(model_dirs[case[0]], tmp_path / case_id, case, hf_models[case[0]])
    llm = LLM(path, device="cuda", dtype="float32", block_size=16, num_gpu_blocks_override=300, enforce_eager=True,
              max_num_batched_tokens=32)
    check_against_reference(llm, reference)
    assert calls and set(calls) == {case[1]}


# --- our own int4 ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory):
    """Group 128 needs inputs that are multiples of 128."""
    import transformers as tf
    path = make_model_dir(tmp_path_factory.mktemp("wide"), "llama", hidden_size=128, intermediate_size=256)
    return path, tf.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()


def test_own_int4_matches_transformers_on_fake_quantized_weights(wide_llama):
    path, hf_model = wide_llama
    reference = copy.deepcopy(hf_model)
    with torch.no_grad():
        for name, p in reference.named_parameters():
            if name.rsplit(".", 2)[-2] in PROJECTIONS:
                s = p.abs().reshape(p.shape[0], -1, 128).amax(-1) / 7  # int4.py keeps float32 scales
                q = torch.round(p.reshape(p.shape[0], -1, 128) / s[..., None]).clamp(-7, 7)
                p.copy_((q * s[..., None]).reshape(p.shape))
    llm = LLM(path, block_size=16, num_gpu_blocks_override=300, quantization="int4", max_num_batched_tokens=32)
    layer = llm.llm_engine.executor.runner.model.model.layers[0].mlp.down_proj
    assert layer.weight.dtype == torch.uint8 and layer.weight.shape == (128, 128)  # two nibbles a byte
    check_against_reference(llm, reference)


def test_own_int4_refuses_inputs_that_are_not_whole_groups(llama_dir):
    with pytest.raises(ValueError, match="int4 group size=128"):
        LLM(llama_dir, num_gpu_blocks_override=64, quantization="int4")


# --- refusals -------------------------------------------------------------------------------------

def _with_config(src: str, dst: Path, qcfg: dict | None) -> str:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    if qcfg is not None:
        config["quantization_config"] = qcfg
    (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


@pytest.mark.parametrize("qcfg, match", [
    ({"quant_method": "fp4"}, "quant_method='fp4'"),  # (fp8 is read since: tests/models/test_fp8_weights.py)
    (gptq_config(3, 32, True, False, "gptq"), "bits=3"),
    (gptq_config(4, 32, True, False, "marlin"), "checkpoint_format='marlin'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"}, "version='gemv'"),
    ({**ct_config(4, 32, True, "float-quantized")}, r"weights.\(type, num_bits\)=\('int', 4\)"),
    ({**ct_config(4, 32, True, "pack-quantized"), "ignore": ["lm_head", "model.layers.0.mlp.down_proj"]}, "ignore"),
])
def test_unsupported_quantization_config_is_refused_naming_the_field(qcfg, match, llama_dir, tmp_path):
    path = _with_config(llama_dir, tmp_path / "m", qcfg)
    with pytest.raises(ValueError, match=match):
        LLM(path, num_gpu_blocks_override=64)


def test_config_that_does_not_match_the_tensors_is_refused(model_dirs, hf_models, tmp_path):
    case = CASES["awq-w4-g32"]
    path, _ = write_checkpoint(model_dirs[case[0]], tmp_path / "awq", case, hf_models[case[0]])
    config = json.loads((Path(path) / "config.json").read_text())
    config["quantization_config"]["group_size"] = 64  # the tensors have groups of 32
    (Path(path) / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="does not match the tensors"):
        LLM(path, num_gpu_blocks_override=64)


def test_quantization_flag_forces_or_refuses(model_dirs, hf_models, llama_dir, tmp_path):
    case = CASES["ct-packed-w8a16-channel"]
    path, _ = write_checkpoint(model_dirs[case[0]], tmp_path / "ct", case, hf_models[case[0]])
    with pytest.raises(ValueError, match="quantized with 'compressed-tensors'"):
        LLM(path, num_gpu_blocks_override=64, quantization="int8")
    with pytest.raises(ValueError, match="has no quantization_config"):
        LLM(llama_dir, num_gpu_blocks_override=64, quantization="gptq")
    llm = LLM(path, num_gpu_blocks_override=64, quantization="compressed-tensors")
    assert llm.llm_engine.executor.runner.model.model.layers[0].mlp.down_proj.weight.dtype == torch.uint8

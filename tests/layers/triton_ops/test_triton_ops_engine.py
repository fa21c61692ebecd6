"""The engine on CPU with the Triton fused ops selected (fused_ops="triton", kernels run by the
interpreter) against transformers, and the selection mechanism itself."""
from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy, make_model_dir, random_prompts
from triton_devices import INTERPRETED

from pagedllm import LLM, SamplingParams
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.norm import RMSNorm
from pagedllm.layers.ops import resolve_fused_ops
from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.layers.sampler import Sampler, SamplingRow

needs_interpreter = pytest.mark.skipif(not INTERPRETED, reason="Triton on CPU tensors needs TRITON_INTERPRET=1")
MAX_NEW = 6


def _triton_llm(model_dir, **kwargs):
    # the torch reference attention: the Triton path must not lean on the C kernels anywhere
    return LLM(model_dir, fused_ops="triton", attention_backend="torch", block_size=8, num_gpu_blocks_override=64,
               max_model_len=128, **kwargs)


@needs_interpreter
@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # qwen3: the q/k norms over [tokens, heads, head_dim]
def test_triton_ops_greedy_matches_transformers(arch, model_dirs, hf_models):
    llm = _triton_llm(model_dirs[arch])
    model = llm.llm_engine.executor.runner.model
    layer = model.model.layers[0]
    assert (layer.input_layernorm.ops, layer.self_attn.rotary.ops, layer.mlp.act_fn.ops) == ("triton",) * 3
    assert model.model.fused_decoder is None  # the one-call C decoder stays off on the Triton path
    prompts = random_prompts(3, seed=11, lo=3, hi=20)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=MAX_NEW, ignore_eos=True)  # as hf_greedy
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf_models[arch], p, MAX_NEW) for p in prompts]


@needs_interpreter
@pytest.mark.parametrize("arch, overrides", [("phi3", {"partial_rotary_factor": 0.5}), ("qwen3_moe", {}),
                                             ("olmo2", {})], ids=["phi3-partial-rotary", "qwen3_moe", "olmo2"])
def test_triton_ops_families_match_transformers(arch, overrides, tmp_path):
    """The skeleton's families on the Triton ops: the rotary kernel on half of each head (a strided
    view), SiLU in the experts and the shared MLPs, torch-only norms beside Triton ones."""
    import transformers as tf
    path = make_model_dir(tmp_path, arch, **overrides)
    hf = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = random_prompts(2, seed=12, lo=3, hi=20)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, min_tokens=MAX_NEW, ignore_eos=True)
    llm = _triton_llm(path)
    layer = llm.llm_engine.executor.runner.model.model.layers[0]
    assert (layer.post_attention_layernorm.ops, getattr(layer.self_attn.rotary, "rotary", layer.self_attn.rotary).ops
            ) == ("triton", "triton")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, MAX_NEW) for p in prompts]


@needs_interpreter
def test_triton_sampler_draws_what_the_torch_sampler_draws():
    """Same seeds, same exponential noise: the kernel's filter must keep exactly the tokens the
    sorting filter keeps (a different kept set changes the draws)."""
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(5)) * 2
    params = [SamplingParams(temperature=0.8, top_k=20, seed=1), SamplingParams(temperature=1.0, top_p=0.7, seed=2),
              SamplingParams(temperature=1.2, min_p=0.2, seed=3), SamplingParams(temperature=0.0)]

    def draw(ops):
        rows = [SamplingRow(p, [1], 1, None if p.seed is None else torch.Generator().manual_seed(p.seed))
                for p in params]
        return [Sampler(ops)(logits.clone(), rows).token_ids for _ in range(5)]

    assert draw("triton") == draw("native")


def test_fused_ops_choice_is_validated_and_resolved():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_fused_ops("auto", cpu) == "native" and resolve_fused_ops("native", cuda) == "native"
    assert resolve_fused_ops("auto", cuda) == "triton"  # the test extras install triton
    with pytest.raises(ValueError, match="fused_ops='cuda'"):
        resolve_fused_ops("cuda", cpu)
    for layer in (lambda: RMSNorm(8, ops="fast"), lambda: SiluAndMul("fast"),
                  lambda: RotaryEmbedding(8, 4, torch.ones(4), ops="fast"), lambda: Sampler("fast")):
        with pytest.raises(ValueError, match="ops='fast'"):
            layer()


@needs_interpreter
def test_compile_model_with_interpreted_triton_ops_is_refused(llama_dir):
    with pytest.raises(ValueError, match="compile_model=True cannot be combined with fused_ops='triton'"):
        EngineArgs(llama_dir, fused_ops="triton", compile_model=True).create_engine_config()
    assert EngineArgs(llama_dir, fused_ops="triton", compile_model=True, enforce_eager=True).create_engine_config()


def test_triton_on_cpu_without_the_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        resolve_fused_ops("triton", torch.device("cpu"))


def test_native_is_the_default_on_cpu(llama_dir):
    llm = LLM(llama_dir, block_size=8, num_gpu_blocks_override=64, max_model_len=128)
    layer = llm.llm_engine.executor.runner.model.model.layers[0]
    assert (layer.input_layernorm.ops, layer.mlp.act_fn.ops, llm.llm_engine.sampler.ops) == ("native",) * 3

"""Shared fixtures: tiny random-weight models built with transformers at test time."""
from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

# Under pytest-xdist (pyproject's -n 2) OpenMP threads that wait sleep instead of spinning: with
# two workers on two cores a spinning thread holds the core the other worker needs (measured on
# two model test files: 46-52 s spinning, 28.6 s passive). OpenMP reads this once, when torch
# loads it, hence before the import.
_XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _XDIST_WORKERS > 1:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402 - after OMP_WAIT_POLICY is set (see above)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# engines start with the fixed kernel thresholds (no timing per test); tests/layers/test_kernel_tuning.py turns it on
os.environ.setdefault("PAGEDLLM_KERNEL_TUNING", "off")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Triton kernels on CPU tensors need the interpreter, chosen when a kernel is decorated, i.e.
# before pagedllm's kernel modules are first imported (only ever lazily, by tests/layers/triton_ops or
# a model built with fused_ops="triton"). On a GPU machine they run compiled, on the device.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if importlib.util.find_spec("triton") is None:
    collect_ignore_glob = ["layers/triton_ops/*"]  # the Triton path's tests need triton (test extra)
# two torch threads; under pytest-xdist (-n N) each worker gets its share of the cores instead, so
# N workers do not oversubscribe a small machine (engines still set their own, physical cores)
torch.set_num_threads(2 if _XDIST_WORKERS == 1 else max(1, min(2, (os.cpu_count() or 1) // _XDIST_WORKERS)))

ARCHS = ("llama", "mistral", "qwen2", "qwen3")


def load_benchmark(name: str, file: str):
    """Import benchmarks/<file> (a script, not a package) as module ``name``, with benchmarks/ on
    sys.path as when the script runs (its imports of sibling modules such as ``common``)."""
    bench_dir = Path(__file__).resolve().parents[1] / "benchmarks"
    if str(bench_dir) not in sys.path:
        sys.path.insert(0, str(bench_dir))
    spec = importlib.util.spec_from_file_location(name, bench_dir / file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _config(arch: str, **overrides):
    import transformers as tf
    common = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0)
    common.update(overrides)
    if arch == "llama":
        return tf.LlamaConfig(**common)
    if arch == "mistral":
        return tf.MistralConfig(**{"sliding_window": None, **common})
    if arch == "qwen2":
        return tf.Qwen2Config(**common)
    if arch == "qwen3":
        return tf.Qwen3Config(**{"head_dim": 16, **common})
    if arch in FAMILY_CONFIGS:
        cls_name, extra = FAMILY_CONFIGS[arch]
        return getattr(tf, cls_name)(**{**extra, **common})
    raise ValueError(arch)


# the families past Llama (tests/models/test_families.py): config class and what each exercises
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
FAMILY_CONFIGS = {
    "olmo2": ("Olmo2Config", {}),
    "granite": ("GraniteConfig", dict(embedding_multiplier=6.0, residual_multiplier=0.5,
                                      attention_multiplier=0.0625, logits_scaling=4.0)),
    "phi3": ("Phi3Config", {}),
    "mixtral": ("MixtralConfig", dict(num_local_experts=8, num_experts_per_tok=2, sliding_window=None)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=8, shared_expert_intermediate_size=48, **MOE)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=8, norm_topk_prob=True, mlp_only_layers=[1], head_dim=16,
                                         **MOE)),
    "gemma3": ("Gemma3TextConfig", dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=16,
                                        layer_types=["sliding_attention", "full_attention"],
                                        rope_local_base_freq=100.0, final_logit_softcapping=0.5)),
    # DeepSeek (tests/models/test_deepseek.py): MLA (a direct q_proj like V2-Lite, a q_lora_rank bottleneck
    # like V3), grouped top-k routing (4 groups of 2, 2 kept), a dense first layer, YaRN with mscale on V3;
    # built with num_key_value_heads=num_attention_heads (an override: MLA has no KV-head grouping)
    "deepseek_v2": ("DeepseekV2Config", dict(
        q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=12, n_routed_experts=8, n_shared_experts=2, first_k_dense_replace=1, n_group=4, topk_group=2,
        topk_method="group_limited_greedy", routed_scaling_factor=1.5, **MOE)),
    "deepseek_v3": ("DeepseekV3Config", dict(
        q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=12, n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, norm_topk_prob=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 128, "mscale": 0.707, "mscale_all_dim": 1.0,
                         "beta_fast": 32, "beta_slow": 1}, **MOE)),
    # Llama 4 (tests/models/test_llama4.py, built with num_hidden_layers=4): the 4th layer NoPE and global,
    # the others chunked (chunk 16: prompts cross it) with the L2 q/k norm; temperature tuning that moves
    # from position 7 on; MoE on layers 1 and 3 (4 experts, top-1, a shared expert), dense MLPs of another
    # width on 0 and 2; llama3 RoPE
    "llama4": ("Llama4TextConfig", dict(
        head_dim=16, num_local_experts=4, num_experts_per_tok=1, intermediate_size=32,
        intermediate_size_mlp=96, interleave_moe_layer_step=2, attention_chunk_size=16, use_qk_norm=True,
        attn_temperature_tuning=True, floor_scale=8, attn_scale=0.5,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    # GPT-OSS (tests/models/test_gpt_oss.py builds its own, with sinks and biases non-trivial): sinks,
    # alternating windows, biased clamped-SwiGLU experts
    "gpt_oss": ("GptOssConfig", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=16, head_dim=16,
                                     attn_implementation="eager")),
    # both soft caps bind (tests/models/test_families.py checks): attention scores reach ~0.3, logits ~1.7
    "gemma2": ("Gemma2Config", dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=16,
                                    layer_types=["sliding_attention", "full_attention"],
                                    attn_logit_softcapping=0.1, final_logit_softcapping=2.0)),
}


def _tokenizer():
    """A byte-level BPE tokenizer trained on a few sentences (no network)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = ["the quick brown fox jumps over the lazy dog", "paged attention keeps a block table",
            "hello world, this is a tiny tokenizer for tests", "héllo wörld ünïcode ✓ 日本語"] * 50
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(text, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def make_model_dir(path, arch: str = "llama", std: float = 0.05, seed: int = 0, **overrides) -> str:
    import transformers as tf
    cfg = _config(arch, **overrides)
    cfg.initializer_range = std
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    _tokenizer().save_pretrained(path)
    return str(path)


def make_classifier_dir(path, arch: str = "qwen2", num_labels: int = 1, seed: int = 0, **overrides) -> str:
    """A tiny random ``<Family>ForSequenceClassification`` checkpoint (num_labels=1: a cross-encoder)."""
    import transformers as tf
    cfg = _config(arch, num_labels=num_labels, **overrides)
    cfg.initializer_range = 0.05
    torch.manual_seed(seed)
    model = tf.AutoModelForSequenceClassification.from_config(cfg, torch_dtype=torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    _tokenizer().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    """One tiny checkpoint per supported architecture."""
    return {a: make_model_dir(tmp_path_factory.mktemp(a), a) for a in ARCHS}


@pytest.fixture(scope="session")
def llama_dir(model_dirs):
    return model_dirs["llama"]


@pytest.fixture(scope="session")
def hf_models(model_dirs):
    import transformers as tf
    return {a: tf.AutoModelForCausalLM.from_pretrained(d, torch_dtype=torch.float32).eval()
            for a, d in model_dirs.items()}


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             min_new_tokens=max_new_tokens, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def first_divergence_is_a_near_tie(oracle, prompt: list[int], ours: list[int], ref: list[int], bound: float) -> int:
    """The index where ``ours`` leaves the oracle's greedy ``ref`` (len if never), asserting that the
    oracle's own logits there prefer its token over ours by less than ``bound``."""
    d = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), len(ref))
    if d < len(ref):
        with torch.no_grad():
            logits = oracle(torch.tensor([prompt + ref[:d]])).logits[0, -1]
        gap = (logits[ref[d]] - logits[ours[d]]).item()
        assert 0 <= gap < bound, f"step {d}: the oracle prefers {ref[d]} over our {ours[d]} by {gap:.4f}"
    return d


def token_logprobs(model, prompt: list[int], gen: list[int]) -> torch.Tensor:
    """``model``'s (transformers) logprob of each token of ``gen`` after ``prompt``: ``[len(gen)]``."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + gen])).logits[0].float()
    return torch.log_softmax(logits, -1)[len(prompt) - 1:-1].gather(1, torch.tensor(gen)[:, None]).squeeze(1)


def check_greedy_against(llm, reference, prompts: list[list[int]], max_new: int, logprob_prompts: int = 4,
                         atol: float = 1e-4) -> None:
    """Greedy tokens of ``llm`` equal transformers' ``reference`` on every prompt; with
    ``logprob_prompts`` > 0 the chosen tokens' logprobs on that many prompts within ``atol``."""
    from pagedllm import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True,
                            logprobs=0 if logprob_prompts else None)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(reference, p, max_new) for p in prompts]
    for prompt, out in list(zip(prompts, outs))[:logprob_prompts]:
        gen = out.outputs[0].token_ids
        got = torch.tensor([lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, gen)])
        torch.testing.assert_close(got, token_logprobs(reference, prompt, gen), atol=atol, rtol=0)


def random_prompts(n: int, seed: int = 0, lo: int = 3, hi: int = 60, vocab: int = 512) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for length in lens]


@pytest.fixture
def single_torch_thread():
    """The attention oracles are loops of tiny torch ops; intra-op threads only add sync
    overhead there (3x slower on a busy 2-core box). Kernel threading is tested explicitly."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def fp8_act_hook(mode: str, group: int, input_scale: float | None):
    """A forward pre-hook rounding a reference model's activations as an FP8 checkpoint's
    ``mode`` (token / group / static) defines it, written out from the formats."""
    def hook(module, args):
        x = args[0]
        if mode == "static":
            s = torch.tensor(input_scale)
        else:
            xs = x.unflatten(-1, (-1, group)) if mode == "group" else x
            s = xs.abs().amax(-1, keepdim=True) / 448
            s = torch.where(s == 0, torch.finfo(torch.float32).eps, s)
            if mode == "group":
                return ((xs / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s).flatten(-2),
        return (x / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s,
    return hook


@pytest.fixture
def isolated_ray(monkeypatch):
    """A Ray temp dir of the test's own (``RAY_TMPDIR``, short for Ray's socket paths): there,
    ``ray.init()`` finds only a cluster this test records (``ray start``), never one another pytest-xdist
    worker's test started (and will shut down under it). ``RAY_ADDRESS`` is unset for the same reason.
    (``ray.init(address="auto")`` would still find the other worker's Ray, by scanning processes:
    pagedllm never calls it.)"""
    path = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    monkeypatch.setenv("RAY_TMPDIR", path)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    yield path
    shutil.rmtree(path, ignore_errors=True)

"""User-facing engine arguments (the keywords ``LLM(...)`` and the CLI accept)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm import envs
from pagedllm.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    default_device,
    parse_swap_space,
    resolve_dtype,
    resolve_kv_cache_dtype,
)
from pagedllm.layers.ops import FUSED_OPS, resolve_fused_ops
from pagedllm.layers.quantization import check_method as check_quantization
from pagedllm.models.loader import DEMO_MODEL_NAME, checkpoint_dtype, resolve_model_path
from pagedllm.models.registry import resolve_architecture
from pagedllm.utils import parse_size


@dataclass
class EngineArgs:
    model: str = DEMO_MODEL_NAME
    tokenizer: str | None = None
    dtype: str = "auto"
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | str | None = None
    swap_space: float | str = 4
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    preemption_mode: str = "recompute"
    seed: int = 0
    enforce_eager: bool = False  # no compilation and no CUDA graphs (vLLM's meaning); wins over compile_model
    compile_model: bool = False
    quantization: str | None = None  # "int8": weight-only int8 projections (layers/quantization.py)
    kv_cache_dtype: str = "auto"  # "auto" (model dtype), "float16", "bfloat16", "float32"
    tensor_parallel_size: int = 1
    trust_remote_code: bool = False
    num_gpu_blocks_override: int | None = None
    attention_backend: str = "auto"
    num_threads: int | None = None
    device: str = "auto"
    watermark: float = 0.01
    disable_log_stats: bool = True
    log_stats_interval: float = 10.0  # seconds between engine log lines when stats are logged
    served_model_name: str | None = None
    tokenizer_mode: str = "auto"
    preallocation: str = "none"  # benchmark knob: emulate contiguous pre-allocation
    fused_ops: str = "auto"  # "auto", "native" or "triton": the layers' fused ops (layers/ops.py)

    def create_engine_config(self) -> EngineConfig:
        device = default_device() if self.device == "auto" else torch.device(self.device)
        model_config = self._model_config(device)
        max_batched = self.max_num_batched_tokens or (2048 if device.type == "cpu" else 8192)
        layer_ops = resolve_fused_ops(self.fused_ops, device)
        if layer_ops == "triton" and device.type == "cpu" and self.compile_model and not self.enforce_eager:
            raise ValueError("compile_model=True cannot be combined with fused_ops='triton' on the CPU (torch.compile "
                             "cannot trace the Triton interpreter); use fused_ops='native' or leave compile_model off")
        return EngineConfig(
            model=model_config,
            cache=CacheConfig(
                block_size=self.block_size,
                gpu_memory_utilization=self.gpu_memory_utilization,
                kv_cache_memory=(None if self.kv_cache_memory is None
                                 else parse_size(self.kv_cache_memory, "kv_cache_memory")),
                swap_space=parse_swap_space(self.swap_space),
                enable_prefix_caching=self.enable_prefix_caching,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
                watermark=self.watermark,
                cache_dtype=resolve_kv_cache_dtype(self.kv_cache_dtype),
            ),
            scheduler=SchedulerConfig(self.max_num_seqs, max_batched, model_config.max_model_len, self.preemption_mode,
                                      self.preallocation),
            parallel=ParallelConfig(self.tensor_parallel_size),
            device=device,
            attention_backend=self.attention_backend,
            num_threads=self.num_threads,
            log_stats_interval=0 if self.disable_log_stats else self.log_stats_interval,
            compile_model=self.compile_model and not self.enforce_eager,
            layer_ops=layer_ops,
            cuda_graphs=device.type == "cuda" and not self.enforce_eager,
        )

    def _model_config(self, device: torch.device) -> ModelConfig:
        from transformers import AutoConfig
        path = resolve_model_path(self.model)
        hf = AutoConfig.from_pretrained(path, trust_remote_code=self.trust_remote_code)
        arch = resolve_architecture(getattr(hf, "architectures", None))
        limit = getattr(hf, "max_position_embeddings", None) or 2048
        max_len = self.max_model_len or limit
        if not isinstance(max_len, int) or max_len < 1:
            raise ValueError(f"max_model_len={self.max_model_len!r} must be a positive integer")
        if max_len > limit and not envs.PAGEDLLM_ALLOW_LONG_MAX_MODEL_LEN:
            raise ValueError(f"max_model_len={max_len} exceeds the model's max_position_embeddings={limit}")
        heads = hf.num_attention_heads
        return ModelConfig(
            model=path,
            tokenizer=resolve_model_path(self.tokenizer) if self.tokenizer else path,
            hf_config=hf,
            architecture=arch,
            dtype=resolve_dtype(self.dtype, checkpoint_dtype(path), device),
            max_model_len=max_len,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            num_layers=hf.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
            seed=self.seed,
            quantization=check_quantization(self.quantization),
        )


def _bool_flag(parser, name: str, default: bool, help: str) -> None:
    import argparse
    parser.add_argument(f"--{name}", default=default, action=argparse.BooleanOptionalAction, help=help)


def add_engine_args(parser) -> None:
    """Engine flags, named as vLLM names them."""
    d = EngineArgs()
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=d.model, help="local checkpoint directory, Hub id, or 'pagedllm-demo' (bundled)")
    g.add_argument("--tokenizer", default=None, help="tokenizer path or Hub id (default: the model's)")
    g.add_argument("--dtype", default=d.dtype,
                   help="auto (float32 on CPU, checkpoint dtype on CUDA), float32, float16, bfloat16")
    g.add_argument("--block-size", type=int, default=d.block_size, choices=[8, 16, 32, 64, 128],
                   help="tokens per KV block")
    g.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                   help="fraction of device memory (on CPU: of available RAM, capped) for weights, activations and KV")
    g.add_argument("--kv-cache-memory", default=None,
                   help="KV cache size, bytes or e.g. '4GiB' (overrides utilization)")
    g.add_argument("--swap-space", default=d.swap_space, help="CPU swap space for preempted KV, GiB or e.g. '16GiB'")
    g.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="sequences per step")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per step (default 2048 CPU, 8192 GPU)")
    g.add_argument("--tensor-parallel-size", type=int, default=d.tensor_parallel_size)
    _bool_flag(g, "enable-prefix-caching", d.enable_prefix_caching, "reuse KV of shared prompt prefixes")
    g.add_argument("--preemption-mode", default=d.preemption_mode, choices=["recompute", "swap"])
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument("--num-gpu-blocks-override", type=int, default=None, help="force the number of KV blocks")
    g.add_argument("--attention-backend", default=d.attention_backend, choices=["auto", "torch", "sdpa", "cpu"])
    g.add_argument("--num-threads", type=int, default=None, help="torch threads on CPU (default: physical cores)")
    g.add_argument("--device", default=d.device, help="auto, cpu or cuda")
    g.add_argument("--compile-model", action="store_true",
                   help="torch.compile each decoder layer (start-up cost; no speed-up measured on CPU)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="never compile (overrides --compile-model) and capture no CUDA graphs")
    g.add_argument("--fused-ops", default=d.fused_ops, choices=list(FUSED_OPS),
                   help="norm/rotary/activation/sampling kernels: auto (Triton on CUDA), native (C/torch), "
                        "triton (everywhere; CPU only under TRITON_INTERPRET=1)")
    g.add_argument("--kv-cache-dtype", default="auto",
                   help="KV cache storage: auto (model dtype), float16, bfloat16 or float32")
    g.add_argument("--quantization", "-q", default=None, choices=["int8"],
                   help="weight-only int8 projections, quantized at load (per-channel, symmetric)")


def engine_args_from_cli(args) -> EngineArgs:
    return EngineArgs(
        model=args.model, tokenizer=args.tokenizer, dtype=args.dtype, block_size=args.block_size,
        gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_memory=args.kv_cache_memory,
        swap_space=args.swap_space, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, tensor_parallel_size=args.tensor_parallel_size,
        enable_prefix_caching=args.enable_prefix_caching, preemption_mode=args.preemption_mode, seed=args.seed,
        num_gpu_blocks_override=args.num_gpu_blocks_override, attention_backend=args.attention_backend,
        num_threads=args.num_threads, device=args.device, compile_model=args.compile_model,
        enforce_eager=args.enforce_eager, quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
        fused_ops=args.fused_ops,
    )

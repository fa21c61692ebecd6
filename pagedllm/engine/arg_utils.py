"""User-facing engine arguments (the keywords ``LLM(...)`` and the CLI accept)."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from pagedllm.config import (CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig,
                             default_device, parse_swap_space, resolve_dtype)
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
    enforce_eager: bool = False
    tensor_parallel_size: int = 1
    trust_remote_code: bool = False
    num_gpu_blocks_override: int | None = None
    attention_backend: str = "auto"
    num_threads: int | None = None
    device: str = "auto"
    watermark: float = 0.01
    disable_log_stats: bool = True
    served_model_name: str | None = None
    tokenizer_mode: str = "auto"

    def create_engine_config(self) -> EngineConfig:
        device = default_device() if self.device == "auto" else torch.device(self.device)
        model_config = self._model_config(device)
        max_batched = self.max_num_batched_tokens or (2048 if device.type == "cpu" else 8192)
        return EngineConfig(
            model=model_config,
            cache=CacheConfig(
                block_size=self.block_size,
                gpu_memory_utilization=self.gpu_memory_utilization,
                kv_cache_memory=None if self.kv_cache_memory is None else parse_size(self.kv_cache_memory, "kv_cache_memory"),
                swap_space=parse_swap_space(self.swap_space),
                enable_prefix_caching=self.enable_prefix_caching,
                num_gpu_blocks_override=self.num_gpu_blocks_override,
                watermark=self.watermark,
            ),
            scheduler=SchedulerConfig(self.max_num_seqs, max_batched, model_config.max_model_len, self.preemption_mode),
            parallel=ParallelConfig(self.tensor_parallel_size),
            device=device,
            attention_backend=self.attention_backend,
            num_threads=self.num_threads,
            log_stats_interval=0 if self.disable_log_stats else 10.0,
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
        if max_len > limit and os.environ.get("PAGEDLLM_ALLOW_LONG_MAX_MODEL_LEN") != "1":
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
        )

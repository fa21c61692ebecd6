"""Architecture name (config.json ``architectures``) -> model class."""
from __future__ import annotations

from pagedllm.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM

MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def resolve_architecture(architectures: list[str] | None) -> str:
    for arch in architectures or []:
        if arch in MODEL_REGISTRY:
            return arch
    raise ValueError(
        f"model architectures {architectures} are not supported; supported: {sorted(MODEL_REGISTRY)}")

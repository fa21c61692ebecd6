"""Architecture name (config.json ``architectures``) -> model class."""
from __future__ import annotations

from pagedllm.models.deepseek import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from pagedllm.models.gemma2 import Gemma2ForCausalLM
from pagedllm.models.gemma3 import Gemma3ForCausalLM
from pagedllm.models.gemma3_vl import Gemma3ForConditionalGeneration
from pagedllm.models.gpt_oss import GptOssForCausalLM
from pagedllm.models.granite import GraniteForCausalLM
from pagedllm.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from pagedllm.models.llama4 import Llama4ForCausalLM, Llama4ForConditionalGeneration
from pagedllm.models.llava import LlavaForConditionalGeneration, LlavaNextForConditionalGeneration
from pagedllm.models.moe import MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from pagedllm.models.olmo2 import Olmo2ForCausalLM
from pagedllm.models.phi3 import Phi3ForCausalLM
from pagedllm.models.qwen2_vl import Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration
from pagedllm.models.seq_cls import SEQUENCE_CLASSIFIERS

MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "GraniteForCausalLM": GraniteForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "Llama4ForCausalLM": Llama4ForCausalLM,
    "Llama4ForConditionalGeneration": Llama4ForConditionalGeneration,  # text-only (models/llama4.py)
    "GptOssForCausalLM": GptOssForCausalLM,
    "LlavaForConditionalGeneration": LlavaForConditionalGeneration,  # vision-language (multimodal/)
    "LlavaNextForConditionalGeneration": LlavaNextForConditionalGeneration,
    "Qwen2VLForConditionalGeneration": Qwen2VLForConditionalGeneration,  # M-RoPE (multimodal/mrope.py)
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLForConditionalGeneration,
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,  # bidirectional image runs
    **SEQUENCE_CLASSIFIERS,  # runner="pooling" only (resolve_architecture)
}


def resolve_architecture(architectures: list[str] | None, runner: str = "generate") -> str:
    """The registry key of the first supported architecture. Under ``runner="pooling"`` a bare
    decoder checkpoint (``LlamaModel``, ``MistralModel``: no ``model.`` prefix, no LM head, as
    embedding models such as e5-mistral ship) resolves to its family's ``*ForCausalLM``; a
    ``*ForSequenceClassification`` checkpoint runs under ``runner="pooling"`` only."""
    for arch in architectures or []:
        if arch in SEQUENCE_CLASSIFIERS and runner != "pooling":
            raise ValueError(f"{arch} is a sequence classifier (a score head, no LM head): it cannot generate "
                             "text; start it with runner='pooling' (LLM.classify / LLM.score, /classify, /score, "
                             "/rerank)")
        if arch in MODEL_REGISTRY:
            return arch
        if runner == "pooling" and bare_model_family(arch) in MODEL_REGISTRY:
            return bare_model_family(arch)
    bare = [a for a in architectures or [] if bare_model_family(a) in MODEL_REGISTRY]
    hint = f" ({bare[0]} is a bare decoder: it serves embeddings with runner='pooling')" if bare else ""
    raise ValueError(
        f"model architectures {architectures} are not supported; supported: {sorted(MODEL_REGISTRY)}{hint}")


def bare_model_family(arch: str) -> str | None:
    """``LlamaModel`` -> ``LlamaForCausalLM`` (None for a name that is not ``*Model``)."""
    return arch[: -len("Model")] + "ForCausalLM" if arch.endswith("Model") else None


"""pagedllm: an LLM inference and serving engine built around PagedAttention."""
from pagedllm.entrypoints.llm import LLM
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, Logprob, RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams, StructuredOutputsParams
from pagedllm.version import __version__ as __version__

__all__ = ["LLM", "LoRARequest", "SamplingParams", "BeamSearchParams", "StructuredOutputsParams", "PoolingParams",
           "RequestOutput", "CompletionOutput", "EmbeddingRequestOutput", "EmbeddingOutput", "Logprob",
           "RequestOutputKind"]

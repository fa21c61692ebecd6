"""pagedllm: an LLM inference and serving engine built around PagedAttention."""
from pagedllm.entrypoints.llm import LLM
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "StructuredOutputsParams", "RequestOutput",
           "CompletionOutput", "Logprob"]
__version__ = "0.1.0"

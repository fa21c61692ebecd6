"""pagedllm: an LLM inference and serving engine built around PagedAttention."""
from pagedllm import cpu_threads as _cpu_threads

# before anything imports torch, which loads libgomp: it reads OMP_WAIT_POLICY only then
_cpu_threads.configure_openmp()

from pagedllm.entrypoints.llm import LLM  # noqa: E402
from pagedllm.lora.request import LoRARequest  # noqa: E402
from pagedllm.outputs import CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, Logprob, RequestOutput  # noqa: E402
from pagedllm.pooling_params import PoolingParams  # noqa: E402
from pagedllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams, StructuredOutputsParams  # noqa: E402
from pagedllm.version import __version__ as __version__  # noqa: E402

__all__ = ["LLM", "LoRARequest", "SamplingParams", "BeamSearchParams", "StructuredOutputsParams", "PoolingParams",
           "RequestOutput", "CompletionOutput", "EmbeddingRequestOutput", "EmbeddingOutput", "Logprob",
           "RequestOutputKind"]

"""Request outputs, shaped like vLLM's."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# one dict per generated token: token id -> Logprob (the sampled token plus the top-k)
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    # per-step latency record, so observers see every step even when the caller asked only for
    # the final output: this is the request's first output (it carries the first token), and the
    # gaps between consecutive steps that gave the request tokens since its previous output
    is_first_output: bool = False
    inter_token_latencies: list[float] = field(default_factory=list)
    # the request's sizes, on its final output only, for the observers (vLLM's request_* histograms)
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0  # over all its returned sequences
    max_num_generation_tokens: int = 0  # its longest sequence's
    n: int = 1
    max_tokens: int | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = field(default=None, repr=False)


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """A pooling request's result, as vLLM's (``LLM.embed``): one vector for the prompt."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    metrics: RequestMetrics | None = field(default=None, repr=False)


@dataclass
class BeamSearchSequence:
    """One finished beam, as vLLM's: ``tokens`` holds prompt + generated ids."""

    tokens: list[int]
    cum_logprob: float
    score: float  # cum_logprob / generated_len ** length_penalty
    num_prompt_tokens: int
    text: str | None = None
    finish_reason: str | None = None  # "stop" (EOS) | "length"

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens:]


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first

    def as_request_output(self, request_id: str, prompt: str | None, prompt_token_ids: list[int]) -> RequestOutput:
        """The beams as one finished RequestOutput, one completion per beam (best first), for the
        server's reply builders (vLLM's OpenAI server answers ``use_beam_search`` the same way)."""
        outputs = [CompletionOutput(j, seq.text or "", seq.output_token_ids, seq.cum_logprob, None, seq.finish_reason)
                   for j, seq in enumerate(self.sequences)]
        return RequestOutput(request_id, prompt, prompt_token_ids, outputs, finished=True)


@dataclass
class PoolingOutput:
    """A pooling request's raw result, as vLLM's: ``data`` is the pooled tensor (an embedding, or
    the class probabilities / logits of a classifier)."""

    data: torch.Tensor


@dataclass
class PoolingRequestOutput:
    """``LLM.encode``'s result for one prompt, as vLLM's."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    metrics: RequestMetrics | None = field(default=None, repr=False)


@dataclass
class ClassificationOutput:
    """One prompt's class probabilities (the logits with ``use_activation=False``)."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    """``LLM.classify``'s result for one prompt, as vLLM's."""

    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """``LLM.score``'s result for one pair, as vLLM's: a cross-encoder's relevance, or the cosine
    similarity of two embeddings (``prompt_token_ids``: the pair's tokens)."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True

"""Request and response bodies of vLLM's pooling routes: /pooling, /classify, /score (/v1/score)
and /rerank (/v1/rerank, /v2/rerank: Jina- and Cohere-compatible), with vLLM's field names.

Requests are strict like the others (protocol.RequestModel): an undeclared field is refused by
name. ``softmax`` and ``activation`` are vLLM's deprecated spellings of ``use_activation``."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, field_validator

from .protocol import ApiObject, CompletionRequest, Int64, OpenAIBaseModel, RequestModel, TokenId, UsageInfo

PoolingInput = str | list[str] | list[TokenId] | list[list[TokenId]]
ScoreSide = str | list[str]


class PoolingBaseRequest(RequestModel):
    """What every pooling route takes (vLLM's PoolingBasicRequestMixin and ClassifyRequestMixin)."""

    model: str | None = None
    user: str | None = None  # OpenAI's end-user id: recorded by nobody, changes nothing
    request_id: str | None = None
    truncate_prompt_tokens: Int64 | None = None
    priority: Int64 = 0
    cache_salt: str | None = None
    use_activation: bool | None = None
    activation: bool | None = None  # deprecated: use_activation
    softmax: bool | None = None  # deprecated: use_activation

    def activation_choice(self) -> bool | None:
        """``use_activation``, else its deprecated spellings (vLLM reads them the same way)."""
        return next((v for v in (self.use_activation, self.activation, self.softmax) if v is not None), None)


class InputRequest(PoolingBaseRequest):
    input: PoolingInput
    add_special_tokens: bool = True

    @field_validator("input", mode="before")
    @classmethod
    def _bounded_input_list(cls, value):
        return CompletionRequest._bounded_prompt_list(value)


class ClassificationRequest(InputRequest):
    """``POST /classify``: class probabilities per input."""


class PoolingRequest(InputRequest):
    """``POST /pooling``: each input's pooled data for ``task`` (None: the model's own)."""

    task: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    normalize: bool | None = None
    dimensions: Int64 | None = None  # refused: no matryoshka truncation


class ScoreRequest(PoolingBaseRequest):
    """``POST /score`` and ``/v1/score``: the two sides under any of vLLM's names (``text_1``/
    ``text_2``, ``data_1``/``data_2``, ``queries``/``documents``, ``queries``/``items``)."""

    text_1: ScoreSide | None = None
    text_2: ScoreSide | None = None
    data_1: ScoreSide | None = None
    data_2: ScoreSide | None = None
    queries: ScoreSide | None = None
    documents: ScoreSide | None = None
    items: ScoreSide | None = None

    @field_validator("text_1", "text_2", "data_1", "data_2", "queries", "documents", "items", mode="before")
    @classmethod
    def _bounded_side(cls, value):
        return CompletionRequest._bounded_prompt_list(value)


class RerankRequest(PoolingBaseRequest):
    """``POST /rerank``, ``/v1/rerank``, ``/v2/rerank``: ``top_n`` 0 returns every document."""

    query: str
    documents: list[str]
    top_n: Int64 = 0
    return_documents: bool = True

    @field_validator("documents", mode="before")
    @classmethod
    def _bounded_documents(cls, value):
        return CompletionRequest._bounded_prompt_list(value)


class ClassificationData(OpenAIBaseModel):
    index: int
    label: str | None
    probs: list[float]
    num_classes: int


class ClassificationResponse(ApiObject):
    object: Literal["list"] = "list"
    model: str
    data: list[ClassificationData]
    usage: UsageInfo


class PoolingResponseData(OpenAIBaseModel):
    index: int
    object: Literal["pooling"] = "pooling"
    # per-token tasks: one row per prompt token; str: encoding_format "base64" (float32, little-endian, rows
    # one after another)
    data: list[float] | list[list[float]] | str


class PoolingResponse(ApiObject):
    object: Literal["list"] = "list"
    model: str
    data: list[PoolingResponseData]
    usage: UsageInfo


class ScoreResponseData(OpenAIBaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(ApiObject):
    object: Literal["list"] = "list"
    model: str
    data: list[ScoreResponseData]
    usage: UsageInfo


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    document: RerankDocument | None = None  # None with return_documents=false
    relevance_score: float


class RerankUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(OpenAIBaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]

"""vLLM's pooling routes on a server run with ``--runner pooling``: ``/pooling``, ``/classify``,
``/score`` (``/v1/score``) and ``/rerank`` (``/v1/rerank``, ``/v2/rerank``).

``/classify`` needs a ``*ForSequenceClassification`` model; ``/score`` and ``/rerank`` score text
pairs with a cross-encoder (a classifier with one label, reading each pair as the tokenizer's text
pair) or with an embedding model (cosine similarity of the two embeddings); ``/pooling`` returns
each input's pooled data for any task the model has. A server that generates text answers every
one of them with a 400 naming the model.
"""
from __future__ import annotations

import re
import time

from fastapi import APIRouter, Request

from pagedllm.engine import pooling
from pagedllm.entrypoints import score_utils
from pagedllm.pooling_params import PoolingParams

from .pooling_protocol import (
    ClassificationData,
    ClassificationRequest,
    ClassificationResponse,
    InputRequest,
    PoolingBaseRequest,
    PoolingRequest,
    PoolingResponse,
    PoolingResponseData,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreRequest,
    ScoreResponse,
    ScoreResponseData,
)
from .protocol import ErrorResponse, UsageInfo
from .serving import OpenAIServing, ServingError, _encode_embedding, check_fields, collect, response_id

router = APIRouter()
_ERRORS = {400: {"model": ErrorResponse}, 401: {"model": ErrorResponse}, 500: {"model": ErrorResponse}}
# ScoreRequest's names for its two sides, vLLM's current names first
_SCORE_SIDES = (("data_1", "data_2"), ("text_1", "text_2"), ("queries", "documents"), ("queries", "items"))


class PoolingServing:
    """The pooling handlers over the server's OpenAIServing (its engine, model names and prompt helpers)."""

    def __init__(self, serving: OpenAIServing):
        self.serving = serving
        self.engine = serving.engine
        self.model_config = serving.model_config

    def check(self, req: PoolingBaseRequest, route: str) -> str:
        """The served model's name; refuses unknown fields and a server that generates text."""
        model = self.serving.check_model(req.model)
        check_fields(req)
        if self.engine.engine.config.pooler is None:
            raise ServingError(f"this server generates text (--runner generate): {route} needs a pooling model "
                               "served with --runner pooling (a *ForSequenceClassification model, or an embedding "
                               "model for /pooling, /score and /rerank)", 400, "model")
        return model

    def params(self, req: PoolingBaseRequest, task: str | None, task_param: str = "model", **fields) -> PoolingParams:
        """The request's PoolingParams for ``task`` (None: the model's own), checked against the model."""
        try:
            params = PoolingParams(task=task, truncate_prompt_tokens=req.truncate_prompt_tokens,
                                   use_activation=req.activation_choice(), **fields)
        except ValueError as exc:  # PoolingParams names the field first ("task='x' is ...")
            name = re.match(r"\w*", str(exc)).group(0)
            raise ServingError(str(exc), 400, name if name in type(req).model_fields else None) from None
        try:
            return pooling.resolve_task(params, self.model_config)
        except ValueError as exc:
            raise ServingError(str(exc), 400, task_param) from None

    async def run(self, rid: str, prompts: list, params: PoolingParams, arrival: float, req: PoolingBaseRequest,
                  param: str = "input") -> list:
        """Every prompt's finished output, in order; an engine error about the prompt names ``param``."""
        try:
            group = await self.serving.start(rid, prompts, params, arrival, req)
        except ServingError as exc:
            exc.param = param if exc.param in (None, "prompt") else exc.param
            raise
        return await collect(group)

    async def inputs(self, req: InputRequest) -> list:
        prompts = self.serving.completion_prompts(req.input, "input")
        if not req.add_special_tokens:
            prompts = [await self.serving.encoded_without_special(p) for p in prompts]
        return prompts

    # ------------------------------------------------------------------ /classify, /pooling
    async def classify(self, req: ClassificationRequest, arrival: float) -> ClassificationResponse:
        model = self.check(req, "/classify")
        params = self.params(req, "classify")
        rid = response_id("classify", req)
        outs = await self.run(rid, await self.inputs(req), params, arrival, req)
        id2label = getattr(self.model_config.hf_config, "id2label", None) or {}
        data = []
        for i, out in enumerate(outs):
            probs = out.outputs.data.tolist()
            label = id2label.get(max(range(len(probs)), key=probs.__getitem__))
            data.append(ClassificationData(index=i, label=label, probs=probs, num_classes=len(probs)))
        return ClassificationResponse(id=rid, model=model, data=data, usage=_usage(outs))

    async def pooling(self, req: PoolingRequest, arrival: float) -> PoolingResponse:
        model = self.check(req, "/pooling")
        params = self.params(req, req.task, "task" if req.task is not None else "model", normalize=req.normalize,
                             dimensions=req.dimensions)
        rid = response_id("pool", req)
        outs = await self.run(rid, await self.inputs(req), params, arrival, req)
        data = [PoolingResponseData(index=i, data=_encode_embedding(_vector(out), req.encoding_format))
                for i, out in enumerate(outs)]
        return PoolingResponse(id=rid, model=model, data=data, usage=_usage(outs))

    # ------------------------------------------------------------------ /score, /rerank
    async def score(self, req: ScoreRequest, arrival: float) -> ScoreResponse:
        model = self.check(req, "/score")
        names = _score_names(req)
        rid = response_id("score", req)
        scores, tokens = await self.pair_scores(req, names, getattr(req, names[0]), getattr(req, names[1]), rid,
                                                arrival)
        data = [ScoreResponseData(index=i, score=s) for i, s in enumerate(scores)]
        return ScoreResponse(id=rid, model=model, data=data, usage=UsageInfo(prompt_tokens=tokens, total_tokens=tokens))

    async def rerank(self, req: RerankRequest, arrival: float) -> RerankResponse:
        model = self.check(req, "/rerank")
        if req.top_n < 0:
            raise ServingError(f"top_n={req.top_n} is invalid: 0 (every document) or a positive count", 400, "top_n")
        rid = response_id("rerank", req)
        scores, tokens = await self.pair_scores(req, ("query", "documents"), req.query, req.documents, rid, arrival)
        ranked = sorted(range(len(scores)), key=lambda i: -scores[i])[:req.top_n or None]
        results = [RerankResult(index=i, relevance_score=scores[i],
                                document=RerankDocument(text=req.documents[i]) if req.return_documents else None)
                   for i in ranked]
        return RerankResponse(id=rid, model=model, usage=RerankUsage(prompt_tokens=tokens, total_tokens=tokens),
                              results=results)

    async def pair_scores(self, req: PoolingBaseRequest, names: tuple[str, str], data_1, data_2, rid: str,
                          arrival: float) -> tuple[list[float], int]:
        """Each pair's score, in ``data_2``'s order, and the prompt tokens they took."""
        try:
            texts_1, texts_2 = score_utils.as_texts(data_1, names[0]), score_utils.as_texts(data_2, names[1])
            score_utils.check_pair_counts(len(texts_1), len(texts_2), names)
        except ValueError as exc:
            raise ServingError(str(exc), 400, names[0] if str(exc).startswith(names[0]) else names[1]) from None
        if not self.model_config.is_classifier:  # an embedding model: cosine similarity of the two sides
            outs = await self.run(rid, texts_1 + texts_2, self.params(req, "embed"), arrival, req, names[1])
            vectors = [_vector(out) for out in outs]
            return score_utils.embedding_scores(vectors[:len(texts_1)], vectors[len(texts_1):]), _tokens(outs)
        params = self.params(req, "score")
        pairs = score_utils.pair_up(texts_1, texts_2, names)
        prompts = await self.engine.with_tokenizer(lambda tok: [
            {"prompt_token_ids": score_utils.cross_encoder_ids(tok, a, b)} for a, b in pairs])
        outs = await self.run(rid, prompts, params, arrival, req, names[1])
        return [out.outputs.data[0].item() for out in outs], _tokens(outs)


def _score_names(req: ScoreRequest) -> tuple[str, str]:
    """The one pair of names the request uses for its two sides (a 400 naming the field otherwise)."""
    given = [pair for pair in _SCORE_SIDES if getattr(req, pair[0]) is not None and getattr(req, pair[1]) is not None]
    used = {name for pair in _SCORE_SIDES for name in pair if getattr(req, name) is not None}
    if len(given) == 1 and used == set(given[0]):
        return given[0]
    if len(given) == 1:  # a name from another pair besides
        param = sorted(used - set(given[0]))[0]
    else:  # none complete (the missing partner is named) or several
        missing = [b if getattr(req, a) is not None else a for a, b in _SCORE_SIDES
                   if (getattr(req, a) is None) != (getattr(req, b) is None)]
        param = missing[0] if missing and not given else sorted(used)[0] if used else "data_1"
    raise ServingError(f"give the two sides of the pairs under one pair of names, one of {list(_SCORE_SIDES)}; "
                       f"got {sorted(used)}", 400, param)


def _vector(out) -> list[float] | list[list[float]]:
    """A pooling output's data: an embedding's vector, a classifier's probabilities, or a
    per-token task's rows."""
    return out.outputs.embedding if hasattr(out.outputs, "embedding") else out.outputs.data.tolist()


def _tokens(outs: list) -> int:
    return sum(len(out.prompt_token_ids) for out in outs)


def _usage(outs: list) -> UsageInfo:
    return UsageInfo(prompt_tokens=_tokens(outs), total_tokens=_tokens(outs))


def _handlers(raw: Request) -> PoolingServing:
    return PoolingServing(raw.app.state.serving)


# ---------------------------------------------------------------------- routes
@router.post("/pooling", responses=_ERRORS)
async def create_pooling(request: PoolingRequest, raw: Request):
    return await _handlers(raw).pooling(request, time.time())


@router.post("/classify", responses=_ERRORS)
async def create_classify(request: ClassificationRequest, raw: Request):
    return await _handlers(raw).classify(request, time.time())


@router.post("/score", responses=_ERRORS)
@router.post("/v1/score", responses=_ERRORS)
async def create_score(request: ScoreRequest, raw: Request):
    return await _handlers(raw).score(request, time.time())


@router.post("/rerank", responses=_ERRORS)
@router.post("/v1/rerank", responses=_ERRORS)
@router.post("/v2/rerank", responses=_ERRORS)
async def do_rerank(request: RerankRequest, raw: Request):
    return await _handlers(raw).rerank(request, time.time())

"""``POST /v1/embeddings`` (a server run with ``--runner pooling``)."""
from __future__ import annotations

import base64
import time

import numpy as np
from fastapi import APIRouter, Request

from pagedllm.entrypoints.http_common import with_cancellation
from pagedllm.pooling_params import PoolingParams

from .protocol import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    UsageInfo,
)
from .serving_base import (
    ERROR_RESPONSES,
    ServingBase,
    ServingError,
    bad_request,
    check_fields,
    collect,
    response_id,
    serving_of,
)

router = APIRouter()


class EmbeddingServing(ServingBase):
    """One vector per input."""

    async def create_embedding(self, req: EmbeddingRequest, arrival: float) -> EmbeddingResponse:
        """``POST /v1/embeddings`` (a server run with ``--runner pooling``): one vector per input."""
        model = self.check_model(req.model)
        check_fields(req)
        if self.engine.engine.config.pooler is None:
            raise ServingError("this server generates text (--runner generate): /v1/embeddings needs a server "
                               "started with --runner pooling", 400, "model")
        try:
            params = PoolingParams(task="embed", normalize=req.normalize, dimensions=req.dimensions,
                                   truncate_prompt_tokens=req.truncate_prompt_tokens)
        except ValueError as exc:
            raise bad_request(exc) from None
        prompts = self.completion_prompts(req.input, "input")
        if not req.add_special_tokens:
            prompts = [await self.encoded_without_special(p) for p in prompts]
        rid = response_id("embd", req)
        try:
            group = await self.start(rid, prompts, params, arrival, req)
        except ServingError as exc:  # the engine names the prompt: here it is the input
            exc.param = "input" if exc.param == "prompt" else exc.param
            raise
        finals = await collect(group)
        data = [EmbeddingData(index=i, embedding=_encode_embedding(out.outputs.embedding, req.encoding_format))
                for i, out in enumerate(finals)]
        prompt_tokens = sum(len(out.prompt_token_ids) for out in finals)
        usage = UsageInfo(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens)
        return EmbeddingResponse(id=rid, model=model, data=data, usage=usage)


def _encode_embedding(vector: list[float], encoding_format: str) -> list[float] | str:
    """OpenAI's encodings: the floats, or base64 of their float32 little-endian bytes."""
    if encoding_format == "float":
        return vector
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")




@router.post("/v1/embeddings", responses=ERROR_RESPONSES)
async def create_embedding(request: EmbeddingRequest, raw: Request):
    return await with_cancellation(raw, serving_of(raw).create_embedding(request, time.time()))

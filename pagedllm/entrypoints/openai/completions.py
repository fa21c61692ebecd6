"""``POST /v1/completions`` and vLLM's legacy ``POST /generate``."""
from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from pagedllm.entrypoints.http_common import with_cancellation
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import BeamSearchParams, SamplingParams

from .protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    GenerateRequest,
    SamplingFields,
)
from .request_fields import RequestFieldError
from .response_pieces import (
    StreamState,
    completion_logprobs,
    prompt_logprobs_entries,
    prompt_logprobs_json,
    usage_of,
)
from .serving_base import (
    ERROR_RESPONSES,
    RequestGroup,
    ServingBase,
    ServingError,
    bad_request,
    check_fields,
    collect,
    continuous_usage,
    refuse_streamed_best_of,
    response_id,
    serving_of,
    sse,
    start_streaming,
    unsupported,
)

router = APIRouter()


class CompletionServing(ServingBase):
    """The completions handlers (text prompts or token ids; echo, logprobs, beam search)."""

    # ------------------------------------------------------------------ completions
    async def create_completion(self, req: CompletionRequest, arrival: float):
        """``POST /v1/completions``: a JSON response, or server-sent events when streaming."""
        model = self.check_model(req.model)
        check_fields(req)
        unsupported(req.suffix, "suffix", "suffix")
        refuse_streamed_best_of(req)
        scored_prompt = req.echo and req.logprobs is not None  # echo + logprobs: score the prompt too
        prompt_logprobs = req.prompt_logprobs if req.prompt_logprobs is not None or not scored_prompt else req.logprobs
        params = self.completion_beams(req) if req.use_beam_search else self.sampling_params(
            req, "delta" if req.stream else "final_only", max_tokens=req.max_tokens, best_of=req.best_of,
            logprobs=req.logprobs, prompt_logprobs=prompt_logprobs)
        rid = response_id("cmpl", req)
        prompts = self.completion_prompts(req.prompt)
        if not req.add_special_tokens:
            prompts = [await self.encoded_without_special(p) for p in prompts]
        group = await self.start(rid, prompts, params, arrival, req)
        if req.stream:
            return await self.stream_sse(self.completion_events(group, rid, model, req), group)
        return await self.completion_json(rid, model, req, await collect(group))

    def completion_beams(self, req: CompletionRequest) -> BeamSearchParams:
        try:
            return self.beam_search_params(req, req.max_tokens)
        except RequestFieldError as exc:
            raise ServingError(str(exc), 400, exc.param) from None

    async def completion_json(self, rid: str, model: str, req: CompletionRequest,
                              finals: list[RequestOutput]) -> Response:
        """The whole reply, built and serialized on a tokenizer thread (with that thread's tokenizer
        for echoed token-id prompts): a reply of 100k choices takes seconds to build and encode,
        which on the event loop would hold every stream and ``/health`` for as long."""
        def build(tokenizer) -> bytes:
            return self.completion_response(rid, model, req, finals, tokenizer).model_dump_json().encode()
        return Response(await self.engine.with_tokenizer(build), media_type="application/json")

    def completion_response(self, rid: str, model: str, req: CompletionRequest,
                            finals: list[RequestOutput], tokenizer=None) -> CompletionResponse:
        choices = []
        for i, out in enumerate(finals):
            prefix = self.prompt_text(out, tokenizer) if req.echo else ""
            prompt_lp = prompt_logprobs_json(out) if req.prompt_logprobs is not None else None
            for j, c in enumerate(out.outputs):
                lp = self.choice_logprobs(req, out, c, 0, echoed=bool(req.echo), tokenizer=tokenizer)
                choices.append(CompletionChoice(index=i * (req.n or 1) + j, text=prefix + c.text, logprobs=lp,
                                                finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                                prompt_logprobs=prompt_lp, **_token_ids(req, out, c)))
        usage = usage_of(finals, self.response_options.enable_prompt_tokens_details)
        return CompletionResponse(id=rid, model=model, choices=choices, usage=usage)

    async def completion_events(self, group: RequestGroup, rid: str, model: str,
                                req: CompletionRequest) -> AsyncIterator[str]:
        state, created = self.stream_state(req, req.logprobs is not None), int(time.time())
        async for i, out in group.outputs():
            for idx, c in state.news(i, out):
                yield sse(self.completion_chunk(state, idx, c, out, req, rid, model, created))
        if self.include_usage(req):
            yield sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                       "choices": [], "usage": state.usage().model_dump()})

    def completion_chunk(self, state: StreamState, idx: int, c: CompletionOutput, out: RequestOutput,
                         req: CompletionRequest, rid: str, model: str, created: int) -> dict:
        text = c.text
        first = idx not in state.started
        echo_now = bool(req.echo) and first
        if echo_now:
            text = self.prompt_text(out) + text
        state.started.add(idx)
        lp = self.choice_logprobs(req, out, c, state.token_chars.get(idx, 0), echoed=echo_now)
        if lp is not None and lp.tokens:
            state.token_chars[idx] = lp.text_offset[-1] + len(lp.tokens[-1])
        choice = CompletionChoice(index=idx, text=text, logprobs=lp, finish_reason=c.finish_reason,
                                  stop_reason=c.stop_reason, **_token_ids(req, out, c, with_prompt=first))
        return CompletionResponse(id=rid, model=model, created=created, choices=[choice],
                                  usage=continuous_usage(req, state, idx)).model_dump()

    def choice_logprobs(self, req: CompletionRequest, out: RequestOutput, c: CompletionOutput, offset: int,
                        echoed: bool, tokenizer=None) -> CompletionLogprobs | None:
        """A choice's logprobs; with echo the prompt's come first (generated offsets then continue
        after the prompt's tokens)."""
        if req.logprobs is None:
            return None
        as_ids = self.tokens_as_ids(req)
        if not echoed:
            return completion_logprobs(c, offset, as_ids=as_ids)
        tokenizer = tokenizer or self.tokenizer
        prompt_lp = prompt_logprobs_entries(out, lambda t: tokenizer.decode([t]), as_ids)
        return completion_logprobs(c, offset, prompt_lp, as_ids)

    # ------------------------------------------------------------------ legacy /generate
    async def generate(self, req: GenerateRequest, arrival: float):
        """vLLM's simple api_server: ``{"text": [prompt + completion, ...]}``; streams NDJSON."""
        refuse_streamed_best_of(req)
        unsupported(req.logprobs is not None, "logprobs", "logprobs on /generate (its reply is text only; "
                     "use /v1/completions)")
        fields = req.model_dump(exclude={"prompt", "stream"})
        try:
            params = SamplingParams(**fields, output_kind="cumulative" if req.stream else "final_only")
        except (ValueError, TypeError) as exc:
            raise bad_request(exc) from None
        prompt = req.prompt if isinstance(req.prompt, str) else {"prompt_token_ids": req.prompt}
        group = await self.start(f"generate-{uuid.uuid4().hex}", [prompt], params, arrival)
        if req.stream:
            return await start_streaming(self.generate_lines(group), "application/x-ndjson")
        return JSONResponse(self.generate_json((await collect(group))[0]))

    def generate_json(self, out: RequestOutput) -> dict:
        prompt = self.prompt_text(out)
        return {"text": [prompt + c.text for c in out.outputs]}

    async def generate_lines(self, group: RequestGroup) -> AsyncIterator[str]:
        """One JSON object per line (vLLM's format); an error after the first line ends the stream."""
        try:
            async for _, out in group.outputs():
                yield json.dumps(self.generate_json(out)) + "\n"
        finally:
            group.close()

def _token_ids(req: SamplingFields, out: RequestOutput, c: CompletionOutput, with_prompt: bool = True) -> dict:
    """``return_token_ids``: a completion choice's ``token_ids`` (and its prompt's, once)."""
    if not req.return_token_ids:
        return {}
    return {"token_ids": c.token_ids, "prompt_token_ids": out.prompt_token_ids if with_prompt else None}




_GENERATE_BODY = {"requestBody": {"required": True, "content": {
    "application/json": {"schema": GenerateRequest.model_json_schema()}}}}


@router.post("/v1/completions", responses=ERROR_RESPONSES)
async def create_completion(request: CompletionRequest, raw: Request):
    return await with_cancellation(raw, serving_of(raw).create_completion(request, time.time()))


@router.post("/generate", responses=ERROR_RESPONSES, openapi_extra=_GENERATE_BODY)
async def generate(raw: Request):
    """vLLM's legacy endpoint; like vLLM it reads JSON whatever the content type (``curl -d``)."""
    try:
        request = GenerateRequest.model_validate_json(await raw.body())
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False)) from None
    return await with_cancellation(raw, serving_of(raw).generate(request, time.time()))

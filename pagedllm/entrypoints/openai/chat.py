"""``POST /v1/chat/completions``: the chat template, tool calls and reasoning, then generation.

``start_chat``, ``render_chat``, ``chat_response`` and ``chat_events`` are the chat path other
endpoints build on (the Responses API renders and runs its conversations through them).
"""
from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request

from pagedllm.entrypoints.http_common import with_cancellation
from pagedllm.entrypoints.openai_common import message_text, render_chat, template_options
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import StructuredOutputsParams

from .chat_features import (
    ChoiceParser,
    MessagePiece,
    check_tools,
    is_forced,
    keeps_special_tokens,
    resolve_tool_choice,
)
from .media import MediaPolicy, load_images, load_videos
from .protocol import (
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
)
from .request_fields import RequestFieldError
from .response_pieces import chat_logprobs, prompt_logprobs_json, usage_of
from .serving_base import (
    ERROR_RESPONSES,
    RequestGroup,
    ServingBase,
    ServingError,
    check_fields,
    collect,
    constraint_source,
    continuous_usage,
    refuse_streamed_best_of,
    response_id,
    serving_of,
    sse,
)
from .tool_parsers.forced import forced_call_schema

# engine messages name the completion fields; a chat request sent these instead
_CHAT_PARAMS = {"prompt": "messages", "logprobs": "top_logprobs"}

router = APIRouter()


class ChatServing(ServingBase):
    """The chat handlers over the server's chat template and ChatOptions."""

    # ------------------------------------------------------------------ chat
    async def create_chat_completion(self, req: ChatCompletionRequest, arrival: float):
        """``POST /v1/chat/completions``: renders the chat template, then generates."""
        model = self.check_model(req.model)
        check_fields(req)
        rid = response_id("chatcmpl", req)
        try:
            tool_choice = resolve_tool_choice(req.tools, req.tool_choice, self.chat_options)
            check_tools(req.tools, tool_choice)
            group = await self.start_chat(rid, req, arrival, tool_choice)
        except RequestFieldError as exc:
            raise ServingError(str(exc), 400, exc.param) from None
        except ServingError as exc:
            raise _as_chat_error(exc, req) from None
        parsers = [ChoiceParser.for_request(self.chat_options, tool_choice, req.parallel_tool_calls,
                                            req.include_reasoning, req.tools, req.chat_template_kwargs)
                   for _ in range(req.n or 1)]
        if req.stream:
            return await self.stream_sse(self.chat_events(group, rid, model, req, parsers), group)
        return self.chat_response(rid, model, req, (await collect(group))[0], parsers)

    async def start_chat(self, rid: str, req: ChatCompletionRequest, arrival: float,
                         tool_choice: Any = "none") -> RequestGroup:
        if req.top_logprobs is not None and not req.logprobs:
            raise ServingError("top_logprobs requires logprobs=true", 400, "top_logprobs")
        refuse_streamed_best_of(req)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if req.use_beam_search:
            if tool_choice != "none" and req.tools:
                raise RequestFieldError("tools cannot be combined with use_beam_search", "tools")
            params = self.beam_search_params(req, max_tokens)
        else:
            params = self.sampling_params(req, "delta" if req.stream else "final_only", max_tokens=max_tokens,
                                          logprobs=logprobs, best_of=req.best_of, prompt_logprobs=req.prompt_logprobs,
                                          **forced_call_fields(req, tool_choice), skip_special_tokens=(
                                              req.skip_special_tokens
                                              and not keeps_special_tokens(self.chat_options, tool_choice)))
        text = await self.render_chat(req.messages, req.add_generation_prompt,
                                      **self.server_template_options(req, tool_choice))
        media = await self.chat_media(req.messages)
        if media:  # the model's processor tokenizes the text and expands each image's / video's placeholder
            prompt = {"prompt": text, "multi_modal_data": media, "add_special_tokens": req.add_special_tokens}
            if req.mm_processor_kwargs is not None:
                prompt["mm_processor_kwargs"] = req.mm_processor_kwargs
            return await self.start(rid, [prompt], params, arrival, req)
        if req.mm_processor_kwargs is not None:
            raise ServingError(f"mm_processor_kwargs={req.mm_processor_kwargs!r:.80} needs image_url or video_url "
                               "parts in the messages (for a vision-language model)", 400, "mm_processor_kwargs")
        try:  # on a tokenizer thread, bounded like any prompt; by default no extra BOS: the template writes its own
            ids = await self.engine.encode(text, add_special_tokens=req.add_special_tokens, field="messages")
        except ValueError as exc:
            raise ServingError(str(exc), 400, "messages") from None
        return await self.start(rid, [{"prompt": text, "prompt_token_ids": ids}], params, arrival, req)

    async def chat_media(self, messages: list[ChatMessage]) -> dict:
        """The ``multi_modal_data`` of a chat's ``image_url`` and ``video_url`` parts, after
        ``limit_mm_per_prompt`` is checked (before any is fetched); fetched and decoded on worker
        threads (media.py). Empty for a text-only chat."""
        policy, media = MediaPolicy.of(self.model_config), {}
        for modality, load in (("image", load_images), ("video", load_videos)):
            urls = image_urls(messages, f"{modality}_url")
            limit = dict(self.model_config.limit_mm_per_prompt).get(modality)
            if limit is not None and len(urls) > limit:
                raise ServingError(f"the messages have {len(urls)} {modality}s, over limit_mm_per_prompt="
                                   f"{{{modality!r}: {limit}}}", 400, "limit_mm_per_prompt")
            if urls:
                media[modality] = await load(urls, policy)
        return media

    template_options = staticmethod(template_options)

    def server_template_options(self, req: ChatCompletionRequest, tool_choice: Any = "none") -> dict:
        """``template_options`` under the server's chat flags: the request's template only when trusted,
        the default template variables under the request's, tools left out for tool_choice 'none' when
        asked (--exclude-tools-when-tool-choice-none)."""
        opts = self.chat_options
        if req.chat_template is not None and not opts.trust_request_chat_template:
            raise ServingError("chat_template in a request is refused: the server was not started with "
                               "--trust-request-chat-template", 400, "chat_template")
        options = {**opts.default_chat_template_kwargs, **self.template_options(req)}
        if tool_choice == "none" and opts.exclude_tools_when_tool_choice_none:
            options["tools"] = None
        return options

    async def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool,
                          template: str | None = None, **kwargs) -> str:
        """The chat template (the request's, else the server's, else the tokenizer's) applied to the
        messages: the prompt text, rendered on a tokenizer thread. ``kwargs`` go to
        ``apply_chat_template`` (tools, template variables)."""
        content_format = self.chat_options.chat_template_content_format
        multimodal = self.engine.engine.multimodal
        image, video = (multimodal.placeholder, multimodal.video_placeholder) if multimodal else (None, None)
        return await self.engine.with_tokenizer(lambda tokenizer: render_chat(
            tokenizer, self.chat_template, messages, add_generation_prompt, template, content_format,
            image_placeholder=image, video_placeholder=video, **kwargs))

    def response_role(self, req: ChatCompletionRequest) -> str:
        """vLLM's rule: ``--response-role`` after a generation prompt; else the reply continues the
        last message, in its role."""
        if req.add_generation_prompt or not req.messages:
            return self.response_options.response_role
        return req.messages[-1].role

    def chat_response(self, rid: str, model: str, req: ChatCompletionRequest, out: RequestOutput,
                      parsers: list[ChoiceParser]) -> ChatCompletionResponse:
        choices = []
        as_ids = self.tokens_as_ids(req)
        for j, c in enumerate(out.outputs):
            message = parsers[j].message(c.text)
            if req.echo:
                message["content"] = _echo_prefix(req) + (message["content"] or "")
            lp = chat_logprobs(c, req.top_logprobs or 0, as_ids) if req.logprobs else None
            message = ChatResponseMessage(**{**message, "role": self.response_role(req)})
            choices.append(ChatCompletionChoice(index=j, message=message, logprobs=lp,
                                                finish_reason=parsers[j].finish_reason(c.finish_reason),
                                                stop_reason=c.stop_reason,
                                                token_ids=c.token_ids if req.return_token_ids else None))
        return ChatCompletionResponse(
            id=rid, model=model, choices=choices,
            usage=usage_of([out], self.response_options.enable_prompt_tokens_details),
            prompt_logprobs=prompt_logprobs_json(out) if req.prompt_logprobs is not None else None,
            prompt_token_ids=out.prompt_token_ids if req.return_token_ids else None)

    async def chat_events(self, group: RequestGroup, rid: str, model: str, req: ChatCompletionRequest,
                          parsers: list[ChoiceParser]) -> AsyncIterator[str]:
        state, created = self.stream_state(req, bool(req.logprobs)), int(time.time())
        as_ids, role = self.tokens_as_ids(req), self.response_role(req)

        def chunk(choice: ChatStreamChoice, **fields) -> str:
            return sse(ChatCompletionChunk(id=rid, model=model, created=created, choices=[choice],
                                           usage=continuous_usage(req, state, choice.index), **fields).model_dump())
        async for _, out in group.outputs():
            for idx, c in state.news(0, out):
                if idx not in state.started:  # OpenAI streams open each choice with the role
                    state.started.add(idx)
                    opening = _echo_prefix(req) if req.echo else ""
                    yield chunk(ChatStreamChoice(index=idx, delta=DeltaMessage(role=role, content=opening)),
                                prompt_token_ids=out.prompt_token_ids if req.return_token_ids else None)
                for choice in chat_stream_choices(idx, c, parsers[c.index], req, as_ids):
                    yield chunk(choice)
        if self.include_usage(req):
            yield sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                       "choices": [], "usage": state.usage().model_dump()})


def forced_call_fields(req: ChatCompletionRequest, tool_choice: Any) -> dict:
    """``tool_choice`` "required" or a named function: the output is constrained to the call(s),
    compact JSON (free whitespace would only let a model pad the call)."""
    if not is_forced(tool_choice):
        return {}
    if constraint_source(req) is not None:
        raise ServingError(f"tool_choice={tool_choice if isinstance(tool_choice, str) else 'a named function'!r} "
                           "constrains the output to the call: it cannot be combined with response_format, "
                           "structured_outputs or guided_*", 400, "tool_choice")
    schema = forced_call_schema(req.tools, tool_choice, req.parallel_tool_calls)
    try:
        return {"structured_outputs": StructuredOutputsParams(json=schema, disable_any_whitespace=True)}
    except ValueError as exc:  # a tool schema the grammar compiler cannot take
        raise ServingError(f"tools: cannot constrain the output to the call: {exc}", 400, "tools") from None


def chat_stream_choices(idx: int, c: CompletionOutput, parser: ChoiceParser,
                        req: ChatCompletionRequest, as_ids: bool = False) -> list[ChatStreamChoice]:
    """One engine delta of a choice as stream choices: one per parsed piece (a tool call's name and
    its arguments go in separate chunks, as OpenAI sends them); the finish, the logprobs and the
    token ids ride on the last. Nothing to send (text held back by a parser) and no finish: no chunk."""
    pieces = parser.feed(c.text, final=c.finish_reason is not None)
    lp = chat_logprobs(c, req.top_logprobs or 0, as_ids) if req.logprobs else None
    token_ids = c.token_ids if req.return_token_ids else None
    if not pieces and c.finish_reason is None and not (lp and lp.content) and not token_ids:
        return []
    pieces = pieces or [MessagePiece(content="")]
    choices = [ChatStreamChoice(index=idx, delta=DeltaMessage(**vars(p))) for p in pieces]
    choices[-1].logprobs = lp
    choices[-1].token_ids = token_ids
    choices[-1].finish_reason = parser.finish_reason(c.finish_reason)
    choices[-1].stop_reason = c.stop_reason
    return choices



def _as_chat_error(exc: ServingError, req: ChatCompletionRequest) -> ServingError:
    """Names the chat field: engine and SamplingParams messages name the prompt, logprobs and
    max_tokens, which a chat request may have sent as max_completion_tokens."""
    if exc.param == "max_tokens" and req.max_completion_tokens is not None:
        exc.param = "max_completion_tokens"
        exc.message = re.sub(r"^max_tokens\b", "max_completion_tokens", exc.message)
    exc.param = _CHAT_PARAMS.get(exc.param, exc.param)
    return exc


def _echo_prefix(req: ChatCompletionRequest) -> str:
    """vLLM's chat ``echo``: the last message's content, when it is the assistant's (being continued)."""
    last = req.messages[-1] if req.messages else None
    return message_text(last) if last is not None and last.role == "assistant" else ""


def image_urls(messages: list[ChatMessage], part: str = "image_url") -> list[str]:
    """The ``image_url`` (or ``part``: ``video_url``) parts' URLs, in message and part order (the
    placeholders' order)."""
    return [getattr(p, part).url for m in messages if isinstance(m.content, list) for p in m.content
            if p.type == part and getattr(p, part) is not None]




@router.post("/v1/chat/completions", responses=ERROR_RESPONSES)
async def create_chat_completion(request: ChatCompletionRequest, raw: Request):
    return await with_cancellation(raw, serving_of(raw).create_chat_completion(request, time.time()))

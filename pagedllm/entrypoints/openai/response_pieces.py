"""Pieces of replies shared by the endpoint families: usage, logprobs in OpenAI's two formats,
vLLM's prompt_logprobs, and what a stream has sent so far."""
from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.outputs import CompletionOutput, RequestOutput

from .protocol import (
    ChatChoiceLogprobs,
    ChatLogprob,
    ChatLogprobContent,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
    PromptTokenUsageInfo,
    UsageInfo,
)


@dataclass(frozen=True)
class ResponseOptions:
    """Server flags that shape replies (vLLM's names): ``--enable-prompt-tokens-details`` adds
    ``usage.prompt_tokens_details.cached_tokens`` (prompt tokens served by the prefix cache);
    ``--return-tokens-as-token-ids`` shows logprobs tokens as ``token_id:N`` unless a request says
    otherwise (its ``return_tokens_as_token_ids``); ``--enable-force-include-usage`` ends every stream
    with the usage chunk, as ``stream_options.include_usage`` does; ``--response-role``: the role of
    a chat reply that follows a generation prompt (otherwise the last message's role, continued);
    ``--sse-keep-alive-interval``: seconds of silence after which a stream sends a keep-alive comment
    (0: never)."""

    enable_prompt_tokens_details: bool = False
    return_tokens_as_token_ids: bool = False
    enable_force_include_usage: bool = False
    response_role: str = "assistant"
    sse_keep_alive_interval: float = 0

    def __post_init__(self):
        if not (isinstance(self.sse_keep_alive_interval, (int, float)) and 0 <= self.sse_keep_alive_interval
                < float("inf")):
            raise ValueError(f"sse_keep_alive_interval={self.sse_keep_alive_interval!r} is invalid: must be a "
                             "number of seconds >= 0 (0: no keep-alive comments)")
        if not self.response_role:
            raise ValueError("response_role='' is invalid: give a role name, e.g. 'assistant'")


def make_usage(prompt: int, completion: int, cached: int | None = None) -> UsageInfo:
    """``cached``: prompt tokens served by the prefix cache, shown when not None."""
    details = PromptTokenUsageInfo(cached_tokens=cached) if cached is not None else None
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=details)


def usage_of(outputs: list[RequestOutput], details: bool = False) -> UsageInfo:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return make_usage(prompt, completion, sum(o.num_cached_tokens for o in outputs) if details else None)


def token_text(token_id: int, decoded: str | None, as_ids: bool) -> str:
    """A logprobs entry's token as replies show it: its text, or ``token_id:N``
    (``return_tokens_as_token_ids``: tokens that are not whole characters stay distinct)."""
    return f"token_id:{token_id}" if as_ids else decoded or ""


LOGPROB_FLOOR = -9999.0  # vLLM's: JSON has no -Infinity


def prompt_logprobs_json(out: RequestOutput) -> PromptLogprobs:
    """The request's ``prompt_logprobs`` as vLLM replies with them: per prompt position (the
    first None), token id -> ``{logprob, rank, decoded_token}``, -inf floored."""
    return [None if entry is None else
            {str(t): PromptLogprob(logprob=max(e.logprob, LOGPROB_FLOOR), rank=e.rank, decoded_token=e.decoded_token)
             for t, e in entry.items()}
            for entry in out.prompt_logprobs or []]


def completion_logprobs(c: CompletionOutput, offset: int, lp: CompletionLogprobs | None = None,
                        as_ids: bool = False) -> CompletionLogprobs:
    """OpenAI's legacy format; each top_logprobs dict holds the sampled token and the top-k.

    ``text_offset`` counts the characters of the ``tokens`` before each one (vLLM's rule), from
    ``offset`` (those sent in earlier chunks): a token holding part of a multi-byte character
    shows as U+FFFD, so the tokens need not join to the text, and offsets taken from the text
    would go backwards. ``lp`` may already hold the echoed prompt's entries
    (``prompt_logprobs_entries``); the generated tokens' offsets continue after them."""
    lp = lp or CompletionLogprobs()
    if lp.tokens:
        offset = lp.text_offset[-1] + len(lp.tokens[-1])
    for token_id, entry in zip(c.token_ids, c.logprobs or []):
        token = token_text(token_id, entry[token_id].decoded_token, as_ids)
        lp.tokens.append(token)
        lp.token_logprobs.append(entry[token_id].logprob)
        lp.top_logprobs.append({token_text(t, e.decoded_token, as_ids): e.logprob for t, e in entry.items()})
        lp.text_offset.append(offset)
        offset += len(token)
    return lp


def prompt_logprobs_entries(out: RequestOutput, decode_one, as_ids: bool = False) -> CompletionLogprobs:
    """echo + logprobs: the prompt's tokens first; the first has no logprob (null, as OpenAI)."""
    lp, offset = CompletionLogprobs(), 0
    for pos, token_id in enumerate(out.prompt_token_ids):
        entry = out.prompt_logprobs[pos] if out.prompt_logprobs else None
        token = token_text(token_id, entry[token_id].decoded_token if entry else decode_one(token_id), as_ids)
        lp.tokens.append(token)
        lp.token_logprobs.append(entry[token_id].logprob if entry else None)
        lp.top_logprobs.append({token_text(t, e.decoded_token, as_ids): e.logprob for t, e in entry.items()}
                               if entry else None)
        lp.text_offset.append(offset)
        offset += len(token)
    return lp


def _chat_logprob(token: str, logprob: float) -> ChatLogprob:
    return ChatLogprob(token=token, logprob=logprob, bytes=list(token.encode("utf-8", "replace")))


def chat_logprobs(c: CompletionOutput, top: int, as_ids: bool = False) -> ChatChoiceLogprobs:
    content = []
    for token_id, entry in zip(c.token_ids, c.logprobs or []):
        best = sorted(entry.items(), key=lambda item: -item[1].logprob)[:top]
        sampled = _chat_logprob(token_text(token_id, entry[token_id].decoded_token, as_ids), entry[token_id].logprob)
        content.append(ChatLogprobContent(**sampled.model_dump(), top_logprobs=[
            _chat_logprob(token_text(t, e.decoded_token, as_ids), e.logprob) for t, e in best]))
    return ChatChoiceLogprobs(content=content)


@dataclass
class StreamState:
    """What a stream has sent so far: opened choices, logprobs text offsets (of the tokens the
    client got, echoed prompt included), token counts. The engine's delta outputs carry each completion only
    when it has something new, and its finish once."""

    started: set[int] = field(default_factory=set)
    token_chars: dict[int, int] = field(default_factory=dict)  # characters of the logprobs tokens sent
    prompt_tokens: dict[int, int] = field(default_factory=dict)
    cached_tokens: dict[int, int] = field(default_factory=dict)  # per prompt: served by the prefix cache
    choice_tokens: dict[int, int] = field(default_factory=dict)  # per choice: generated so far
    completion_tokens: int = 0
    logprobs: bool = False  # per-token logprobs must reach the client even when the text is held back
    token_ids: bool = False  # return_token_ids: every new token must reach the client too
    details: bool = False  # --enable-prompt-tokens-details
    n: int = 1  # choices per prompt: choice idx belongs to prompt idx // n

    def news(self, i: int, out: RequestOutput) -> list[tuple[int, CompletionOutput]]:
        """The choices of this output that carry something new, with their global index."""
        self.prompt_tokens[i] = len(out.prompt_token_ids)
        self.cached_tokens[i] = out.num_cached_tokens
        fresh = []
        for c in out.outputs:
            idx = i * self.n + c.index
            self.completion_tokens += len(c.token_ids)
            self.choice_tokens[idx] = self.choice_tokens.get(idx, 0) + len(c.token_ids)
            if not (c.text or c.finish_reason or ((self.logprobs or self.token_ids) and c.token_ids)):
                continue  # nothing to show: text held back (a partial character, a possible stop string)
            fresh.append((idx, c))
        return fresh

    def usage(self) -> UsageInfo:
        """The whole request's, for the last chunk (``include_usage``)."""
        cached = sum(self.cached_tokens.values()) if self.details else None
        return make_usage(sum(self.prompt_tokens.values()), self.completion_tokens, cached)

    def choice_usage(self, idx: int) -> UsageInfo:
        """One choice's so far (``continuous_usage_stats``, vLLM's): its prompt's tokens and its own."""
        i = idx // self.n
        return make_usage(self.prompt_tokens[i], self.choice_tokens.get(idx, 0),
                          self.cached_tokens[i] if self.details else None)



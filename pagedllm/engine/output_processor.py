"""Incremental detokenization, stop strings and RequestOutput assembly: the one output accumulator.

Every output kind is shaped here and nowhere else: ``delta`` (what is new since the request's
previous output, only for sequences that got something new), ``cumulative`` (everything so
far) and ``final_only`` (one output, when the request finishes; nothing is built before). The
per-step latency record (``RequestMetrics.inter_token_latencies``) is kept for every kind, so
a final-only request still reports each step to the metrics.

Text is decoded over a sliding window ``ids[prefix_offset:]`` and only the part after
``read_offset`` is emitted; a piece that ends in U+FFFD (an incomplete multi-byte character) is
held back until the next token completes it, so no character is ever split.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from pagedllm.engine.request import Request
from pagedllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput

_CONTEXT_TOKENS = 5  # prompt tokens decoded with the output so the first word gets its spacing


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def add(self, token_ids: list[int]) -> str:
        """Appends tokens; returns the newly completed text (maybe empty)."""
        self.ids.extend(token_ids)
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=self.skip)  # noqa: E731
        prefix = decode(self.ids[self.prefix_offset:self.read_offset])
        full = decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix):]
        return ""

    def flush(self) -> str:
        """At the end of a sequence: whatever is still held back, even an incomplete character."""
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=self.skip)  # noqa: E731
        prefix = decode(self.ids[self.prefix_offset:self.read_offset])
        full = decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix):]


@dataclass
class SequenceState:
    detok: IncrementalDetokenizer | None
    text: str = ""
    num_tokens_seen: int = 0
    stopped_by_string: str | None = None
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)  # converted so far


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: object
    seqs: dict[int, SequenceState] = field(default_factory=dict)
    sent_text: dict[int, int] = field(default_factory=dict)  # index -> chars already streamed
    sent_tokens: dict[int, int] = field(default_factory=dict)
    sent_finished: set[int] = field(default_factory=set)  # indices whose finish was streamed
    prompt_logprobs: list | None = None  # converted once, when the first output carries them
    num_outputs: int = 0
    last_token_time: float | None = None  # the latest step that gave the request tokens
    itls: list[float] = field(default_factory=list)  # step gaps since the previous output


class OutputProcessor:
    """Turns sequences that got tokens into RequestOutputs; finds stop strings."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params) -> None:
        self.states[request_id] = RequestState(request_id, prompt, prompt_token_ids, params)

    def update_text(self, req: Request) -> str | None:
        """Detokenizes the sequence's new tokens; returns the stop string it hit, if any.

        With no stop strings and only a final output wanted, nobody looks at the text before
        the end, so it is decoded once when the sequence finishes.
        """
        state = self.states[req.parent_id]
        params = req.params
        if params.output_kind == "final_only" and not params.stop and not req.is_finished:
            return None
        seq = state.seqs.get(req.index)
        if seq is None:
            detok = None
            if req.params.detokenize and self.tokenizer is not None:
                detok = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, req.params.skip_special_tokens)
            seq = state.seqs[req.index] = SequenceState(detok)
        new_ids = req.all_token_ids[req.num_prompt_tokens + seq.num_tokens_seen:]
        seq.num_tokens_seen = req.num_output_tokens
        if seq.detok is None or not new_ids or seq.stopped_by_string:
            return None
        new_text = seq.detok.add(new_ids)
        if req.is_finished:
            new_text += seq.detok.flush()
        seq.text += new_text
        return self._find_stop(seq, req.params, len(new_text))

    @staticmethod
    def _find_stop(seq: SequenceState, params, new_len: int) -> str | None:
        """Cuts the text at the stop string that ends first in it. One step's new text can hold
        several (a multi-character token, a character held back until complete), so the first
        one listed is not necessarily the one generation reached first."""
        hits = []  # (end, start, stop): the earliest end wins; at equal ends, the longer string
        for stop in params.stop:
            start = max(0, len(seq.text) - new_len - len(stop) + 1)
            idx = seq.text.find(stop, start)
            if idx != -1:
                hits.append((idx + len(stop), idx, stop))
        if not hits:
            return None
        end, idx, stop = min(hits)
        seq.text = seq.text[:end if params.include_stop_str_in_output else idx]
        seq.stopped_by_string = stop
        return stop

    def make_output(self, parent_id: str, seqs: list[Request], finished: bool) -> RequestOutput | None:
        """Called every step the request got tokens: records the step's latency and returns
        its RequestOutput in the request's output kind (None for final_only until finished)."""
        state = self.states[parent_id]
        self._record_step(state, seqs)
        params = state.params
        if params.output_kind == "final_only" and not finished:
            return None
        if finished and params.best_of and params.best_of > params.n:
            seqs = sorted(seqs, key=lambda r: r.cumulative_logprob, reverse=True)[: params.n]
        delta = params.output_kind == "delta"
        outputs = [c for c in (self._completion(state, r, finished, delta) for r in seqs) if c is not None]
        out = RequestOutput(parent_id, state.prompt, state.prompt_token_ids, outputs, finished,
                            prompt_logprobs=self._prompt_logprobs(state, seqs, delta),
                            num_cached_tokens=seqs[0].num_cached_tokens if seqs else 0,
                            metrics=self._metrics(state, seqs, finished))
        if finished:
            del self.states[parent_id]
        return out

    @staticmethod
    def _record_step(state: RequestState, seqs: list[Request]) -> None:
        last = max((s.last_token_time for s in seqs if s.last_token_time is not None), default=None)
        if last is None or (state.last_token_time is not None and last <= state.last_token_time):
            return
        if state.last_token_time is not None:
            state.itls.append(last - state.last_token_time)
        state.last_token_time = last

    @staticmethod
    def _metrics(state: RequestState, seqs: list[Request], finished: bool) -> RequestMetrics:
        """Timestamps over the request's sequences (earliest first token, latest last token),
        plus the step gaps recorded since the previous output, which this output hands on."""
        firsts = [s.first_token_time for s in seqs if s.first_token_time is not None]
        itls, state.itls = state.itls, []
        state.num_outputs += 1
        return RequestMetrics(arrival_time=seqs[0].arrival_time, first_scheduled_time=seqs[0].first_scheduled_time,
                              first_token_time=min(firsts, default=None), last_token_time=state.last_token_time,
                              finished_time=time.time() if finished else None,
                              is_first_output=state.num_outputs == 1, inter_token_latencies=itls,
                              **(_request_sizes(state, seqs) if finished else {}))

    def _completion(self, state: RequestState, req: Request, finished: bool, delta: bool) -> CompletionOutput | None:
        """Cumulative output, or (delta) only what is new since the last call, None if nothing
        is; nothing is copied from the start of the sequence in delta mode, so streaming stays
        O(new tokens) per step."""
        seq = state.seqs.get(req.index) or SequenceState(None)
        visible = self._visible_len(seq, req, state.params)
        t0 = c0 = 0
        if delta:
            t0, c0 = state.sent_tokens.get(req.index, 0), state.sent_text.get(req.index, 0)
            newly_finished = req.is_finished and req.index not in state.sent_finished
            if t0 == req.num_output_tokens and c0 == visible and not newly_finished:
                return None
            state.sent_tokens[req.index], state.sent_text[req.index] = req.num_output_tokens, visible
            if req.is_finished:
                state.sent_finished.add(req.index)
        logprobs = self._convert_logprobs(seq, req)
        stop_reason = seq.stopped_by_string if seq.stopped_by_string is not None else req.stop_reason
        return CompletionOutput(req.index, seq.text[c0:visible], req.all_token_ids[req.num_prompt_tokens + t0:],
                                req.cumulative_logprob if req.logprobs is not None else None,
                                logprobs[t0:] if logprobs is not None else None, req.finish_reason, stop_reason)

    @staticmethod
    def _visible_len(seq: SequenceState, req: Request, params) -> int:
        """While running, hold back a tail that could still turn out to start a stop string."""
        if req.is_finished or not params.stop or params.include_stop_str_in_output:
            return len(seq.text)
        return max(0, len(seq.text) - (max(len(s) for s in params.stop) - 1))

    def _convert_logprobs(self, seq: SequenceState, req: Request) -> list[dict[int, Logprob]] | None:
        """Converts new logprob entries once; rank is the position among the returned top-k."""
        if req.logprobs is None:
            return None
        for entry in req.logprobs[len(seq.logprobs):]:
            ranked = sorted(entry.items(), key=lambda kv: -kv[1])
            seq.logprobs.append({tok: Logprob(lp, rank + 1, self._decode_one(tok))
                                 for rank, (tok, lp) in enumerate(ranked)})
        return seq.logprobs

    def _prompt_logprobs(self, state: RequestState, seqs: list[Request], delta: bool) -> list | None:
        """vLLM's ``prompt_logprobs``: None for the first prompt token, then per token a dict
        token id -> Logprob (the prompt token with its vocabulary rank, plus the top-k).
        A delta stream carries them once, in its first output."""
        if state.prompt_logprobs is not None:
            return None if delta else state.prompt_logprobs
        source = next((r.prompt_logprobs for r in seqs  # the sequence that computed the prompt
                       if r.prompt_logprobs is not None and all(e is not None for e in r.prompt_logprobs[1:])), None)
        if source is None:
            return None
        state.prompt_logprobs = [None] + [
            {tok: Logprob(lp, rank, self._decode_one(tok)) for tok, (lp, rank) in entry.items()}
            for entry in source[1:]]
        return state.prompt_logprobs

    def _decode_one(self, token_id: int) -> str | None:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else None

    def abort(self, parent_id: str) -> None:
        self.states.pop(parent_id, None)


def _request_sizes(state: RequestState, seqs: list[Request]) -> dict:
    """RequestMetrics' size fields, filled on a request's final output only (what reads them)."""
    lengths = [s.num_output_tokens for s in seqs]
    return dict(num_prompt_tokens=len(state.prompt_token_ids), num_generation_tokens=sum(lengths),
                max_num_generation_tokens=max(lengths, default=0), n=state.params.n,
                max_tokens=state.params.max_tokens)

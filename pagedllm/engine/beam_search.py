"""Beam search on forks and copy-on-write, with Hugging Face ``generate(num_beams=W)`` semantics.

Every beam is a sequence in the scheduler. Beams share their common history by reference
count: a beam chosen k times this step is forked k-1 times (each child shares all its blocks;
the partial last block is copied on the first write), and a beam not chosen is finished at
once, releasing its blocks. Selection per step mirrors transformers' vectorised beam search:

- candidates are the top ``2W`` of ``beam_score + logprob`` over all beams and tokens;
- the next running beams are the top ``W`` candidates that do not stop (EOS or max length);
- stopping candidates among the first ``W`` join the finished set with score
  ``cum_logprob / generated_len ** length_penalty``; the finished set keeps the best ``W``;
- ``early_stopping``: True stops once W beams finished; False / "never" stop when the best
  running beam can no longer beat the worst finished one (transformers' heuristic).

The search runs inside ``LLMEngine.step()``, beside any other requests: beam sequences are
ordinary scheduled requests whose sampler rows report their top ``2W`` raw log-probs; the step
hands those rows to :meth:`BeamSearchManager.consume` instead of appending the sampled token,
and a search advances once every one of its beams has reported (a beam held back by the token
budget or a preemption simply reports in a later step).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from pagedllm.contracts.sampled_tokens import SampledTokens
from pagedllm.engine.request import Request, RequestStatus
from pagedllm.engine.scheduler import Scheduler
from pagedllm.outputs import BeamSearchOutput, BeamSearchSequence
from pagedllm.sampling_params import BeamSearchParams, SamplingParams

_NEG = -1.0e9


@dataclass
class _Finished:
    score: float
    tokens: list[int]
    cum_logprob: float
    reason: str


@dataclass
class _BeamState:
    """The beams of one prompt."""

    request_id: str
    params: BeamSearchParams
    eos_token_ids: frozenset[int]  # empty with ignore_eos
    prompt_len: int
    max_length: int
    beams: list[Request]
    scores: list[float]
    finished: list[_Finished] = field(default_factory=list)
    pending: dict[str, tuple[list[float], list[int]]] = field(default_factory=dict)
    heuristic_unsatisfied: bool = True
    done: bool = False


class BeamSearchManager:
    """The beam searches in flight in one engine, advanced by the engine's own steps.

    ``add`` registers a queued request as a search; every step, ``consume`` takes the sampler
    rows of beam sequences and forks, drops or extends beams through the scheduler's public
    ``fork`` / ``finish`` / ``release``; ``take_output`` hands back a finished search's beams.
    """

    def __init__(self, scheduler: Scheduler, tokenizer, max_model_len: int):
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self._by_seq: dict[str, _BeamState] = {}  # live beam sequence id -> its search
        self._searches: dict[str, _BeamState] = {}  # request id -> search (running or done)
        self._ids = itertools.count()

    @staticmethod
    def sampling_params(params: BeamSearchParams, vocab_size: int) -> SamplingParams:
        """What each beam runs with: greedy rows that report the top 2W raw log-probs."""
        sp = SamplingParams(temperature=0, max_tokens=params.max_tokens, ignore_eos=True)
        # set after validation: the public cap of 20 logprobs bounds API responses, while beam
        # rows are internal and need 2W candidates each
        sp.logprobs = min(2 * params.beam_width, vocab_size)
        return sp

    def add(self, req: Request, params: BeamSearchParams, eos_token_ids: frozenset[int]) -> None:
        """Makes the queued request ``req`` the first beam of a new search."""
        eos = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        n = req.num_prompt_tokens
        state = _BeamState(req.request_id, params, eos, n, n + params.max_tokens, [req], [0.0])
        self._searches[req.request_id] = state
        self._by_seq[req.request_id] = state

    def consume(self, sampled: list[SampledTokens]) -> list[SampledTokens]:
        """Takes the rows of beam sequences and advances every search whose beams have all
        reported; returns the other rows untouched (the same list when no search is running)."""
        if not self._by_seq:
            return sampled
        rest, touched = [], {}
        for s in sampled:
            state = self._by_seq.get(s.request_id)
            if state is None:
                rest.append(s)
                continue
            top = s.top_logprobs[0]  # token -> logprob, best first
            state.pending[s.request_id] = (list(top.values()), list(top))
            touched[state.request_id] = state
        for state in touched.values():
            if not state.done and len(state.pending) == len(state.beams):
                self._advance(state)
        return rest

    def take_output(self, request_id: str) -> BeamSearchOutput | None:
        """The finished search's beams (best first), once; None while it still runs."""
        state = self._searches.get(request_id)
        if state is None or not state.done:
            return None
        del self._searches[request_id]
        return self._output(state)

    def abort(self, request_id: str) -> None:
        """Forgets a search whose sequences the scheduler has already aborted."""
        state = self._searches.pop(request_id, None)
        if state is not None:
            for beam in state.beams:
                self._by_seq.pop(beam.request_id, None)

    # ------------------------------------------------------------------ selection
    def _advance(self, state: _BeamState) -> None:
        w = state.params.beam_width
        cur_len = state.beams[0].num_tokens
        cands = sorted(((state.scores[b] + v, b, t) for b, beam in enumerate(state.beams)
                        for v, t in zip(*state.pending[beam.request_id])), key=lambda c: -c[0])[: 2 * w]
        state.pending.clear()
        hits = [self._stops(t, cur_len, state) for _, _, t in cands]
        self._update_finished(state, cands[:w], hits[:w], cur_len)
        order = sorted(range(len(cands)), key=lambda i: -(cands[i][0] + (_NEG if hits[i] else 0.0)))[:w]
        chosen = [(cands[i][1], cands[i][2], cands[i][0] + (_NEG if hits[i] else 0.0)) for i in order]
        all_hit = all(hits)
        self._apply(state, chosen)
        self._check_heuristic(state, cur_len + 1)
        early_full = len(state.finished) == w and state.params.early_stopping is True
        if not state.heuristic_unsatisfied or early_full or all_hit:
            self._finish(state)

    def _stops(self, token: int, cur_len: int, state: _BeamState) -> bool:
        return token in state.eos_token_ids or cur_len + 1 >= min(state.max_length, self.max_model_len)

    def _update_finished(self, state: _BeamState, top: list, hits: list[bool], cur_len: int) -> None:
        w, lp = state.params.beam_width, state.params.length_penalty
        if not state.heuristic_unsatisfied or (len(state.finished) == w and state.params.early_stopping is True):
            return
        for (score, b, t), hit in zip(top, hits):
            if hit:
                tokens = state.beams[b].all_token_ids + [t]
                reason = "stop" if t in state.eos_token_ids else "length"
                norm = score / ((cur_len + 1 - state.prompt_len) ** lp)
                state.finished.append(_Finished(norm, tokens, score, reason))
        state.finished = sorted(state.finished, key=lambda f: -f.score)[:w]

    def _apply(self, state: _BeamState, chosen: list[tuple[int, int, float]]) -> None:
        """Forks beams picked more than once, drops beams not picked, appends the new tokens."""
        sched = self.scheduler
        picks: dict[int, list[tuple[int, float]]] = {}
        for b, t, score in chosen:
            picks.setdefault(b, []).append((t, score))
        new_beams, new_scores = [], []
        for b, beam in enumerate(state.beams):
            if b not in picks:
                self._drop(beam)
                continue
            forks = [sched.fork(beam, f"{state.request_id}.{next(self._ids)}", 0) for _ in picks[b][1:]]
            for seq, (t, score) in zip([beam] + forks, picks[b]):
                seq.append_token(t)
                seq.cumulative_logprob = score
                self._by_seq[seq.request_id] = state
                new_beams.append(seq)
                new_scores.append(score)
        ranked = sorted(range(len(new_beams)), key=lambda i: -new_scores[i])
        state.beams = [new_beams[i] for i in ranked]
        state.scores = [new_scores[i] for i in ranked]

    def _check_heuristic(self, state: _BeamState, cur_len: int) -> None:
        w, lp = state.params.beam_width, state.params.length_penalty
        if state.params.early_stopping == "never" and lp > 0.0:
            best_len = state.max_length - state.prompt_len
        else:
            best_len = cur_len - state.prompt_len
        best_possible = state.scores[0] / (best_len ** lp)
        if len(state.finished) == w:
            worst = min(f.score for f in state.finished)
            state.heuristic_unsatisfied = state.heuristic_unsatisfied and best_possible > worst

    # ------------------------------------------------------------------ teardown
    def _drop(self, beam: Request) -> None:
        self.scheduler.finish(beam.request_id, RequestStatus.FINISHED_ABORTED)
        self._by_seq.pop(beam.request_id, None)

    def _finish(self, state: _BeamState) -> None:
        for beam in state.beams:
            self._drop(beam)
        self.scheduler.release(state.request_id)
        state.done = True

    def _output(self, state: _BeamState) -> BeamSearchOutput:
        tok = self.tokenizer
        seqs = [BeamSearchSequence(f.tokens, f.cum_logprob, f.score, state.prompt_len,
                                   tok.decode(f.tokens[state.prompt_len:]) if tok is not None else None, f.reason)
                for f in state.finished]
        return BeamSearchOutput(seqs)

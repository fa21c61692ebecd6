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
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from pagedllm.engine.request import Request, RequestStatus
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
    prompt_len: int
    max_length: int
    beams: list[Request]
    scores: list[float]
    finished: list[_Finished] = field(default_factory=list)
    pending: dict[str, tuple[list[float], list[int]]] = field(default_factory=dict)
    heuristic_unsatisfied: bool = True
    done: bool = False


class BeamSearchDriver:
    """Runs beam search for a batch of prompts on an (otherwise idle) LLMEngine."""

    def __init__(self, engine, params: BeamSearchParams):
        self.engine = engine
        self.params = params
        self.width = params.beam_width
        self._ids = itertools.count()

    def run(self, prompts: list) -> list[BeamSearchOutput]:
        states = [self._add(p) for p in prompts]
        by_seq: dict[str, _BeamState] = {b.request_id: s for s in states for b in s.beams}
        while not all(s.done for s in states):
            self._step(by_seq)
        return [self._output(s) for s in states]

    # ------------------------------------------------------------------ setup
    def _add(self, prompt) -> _BeamState:
        engine = self.engine
        _, ids = engine._tokenize(prompt)
        params = SamplingParams(temperature=0, max_tokens=self.params.max_tokens, ignore_eos=True)
        engine._validate(ids, params)
        rid = f"beam-{next(self._ids)}"
        req = Request(rid, ids, params, engine.eos_token_ids)
        engine.scheduler.add_request(req)
        return _BeamState(rid, len(ids), len(ids) + self.params.max_tokens, [req], [0.0])

    # ------------------------------------------------------------------ one engine step
    def _step(self, by_seq: dict[str, _BeamState]) -> None:
        engine = self.engine
        out = engine.scheduler.schedule()
        logits = engine.executor.execute(out).logits
        rows = [c.request_id for c in out.chunks if c.num_samples]
        if rows:
            logprobs = torch.log_softmax(logits.float(), dim=-1)  # [rows, vocab]
            values, ids = logprobs.topk(min(2 * self.width, logprobs.shape[-1]), dim=-1)
            for rid, v, i in zip(rows, values.tolist(), ids.tolist()):
                by_seq[rid].pending[rid] = (v, i)
        for state in {id(s): s for s in by_seq.values()}.values():
            if not state.done and len(state.pending) == len(state.beams):
                self._advance(state, by_seq)
        kv = engine.scheduler.kv
        engine.counters.peak_used_blocks = max(engine.counters.peak_used_blocks, kv.num_blocks - kv.num_free_blocks)

    # ------------------------------------------------------------------ selection
    def _advance(self, state: _BeamState, by_seq: dict[str, _BeamState]) -> None:
        w = self.width
        cur_len = state.beams[0].num_tokens
        cands = sorted(((state.scores[b] + v, b, t) for b, beam in enumerate(state.beams)
                        for v, t in zip(*state.pending[beam.request_id])), key=lambda c: -c[0])[: 2 * w]
        state.pending.clear()
        hits = [self._stops(t, cur_len, state) for _, _, t in cands]
        self._update_finished(state, cands[:w], hits[:w], cur_len)
        order = sorted(range(len(cands)), key=lambda i: -(cands[i][0] + (_NEG if hits[i] else 0.0)))[:w]
        chosen = [(cands[i][1], cands[i][2], cands[i][0] + (_NEG if hits[i] else 0.0)) for i in order]
        all_hit = all(hits)
        self._apply(state, chosen, by_seq)
        self._check_heuristic(state, cur_len + 1)
        early_full = len(state.finished) == w and self.params.early_stopping is True
        if not state.heuristic_unsatisfied or early_full or all_hit:
            self._finish(state, by_seq)

    def _stops(self, token: int, cur_len: int, state: _BeamState) -> bool:
        eos = token in self.engine.eos_token_ids and not self.params.ignore_eos
        return eos or cur_len + 1 >= min(state.max_length, self.engine.model_config.max_model_len)

    def _update_finished(self, state: _BeamState, top: list, hits: list[bool], cur_len: int) -> None:
        w, lp = self.width, self.params.length_penalty
        if not state.heuristic_unsatisfied or (len(state.finished) == w and self.params.early_stopping is True):
            return
        for (score, b, t), hit in zip(top, hits):
            if hit:
                tokens = state.beams[b].all_token_ids + [t]
                reason = "stop" if t in self.engine.eos_token_ids and not self.params.ignore_eos else "length"
                norm = score / ((cur_len + 1 - state.prompt_len) ** lp)
                state.finished.append(_Finished(norm, tokens, score, reason))
        state.finished = sorted(state.finished, key=lambda f: -f.score)[:w]

    def _apply(self, state: _BeamState, chosen: list[tuple[int, int, float]], by_seq) -> None:
        """Forks beams picked more than once, drops beams not picked, appends the new tokens."""
        sched = self.engine.scheduler
        picks: dict[int, list[tuple[int, float]]] = {}
        for b, t, score in chosen:
            picks.setdefault(b, []).append((t, score))
        new_beams, new_scores = [], []
        for b, beam in enumerate(state.beams):
            if b not in picks:
                self._drop(beam, by_seq)
                continue
            forks = [sched.fork(beam, f"{state.request_id}.{next(self._ids)}", 0) for _ in picks[b][1:]]
            for seq, (t, score) in zip([beam] + forks, picks[b]):
                seq.append_token(t)
                seq.cumulative_logprob = score
                by_seq[seq.request_id] = state
                new_beams.append(seq)
                new_scores.append(score)
        ranked = sorted(range(len(new_beams)), key=lambda i: -new_scores[i])
        state.beams = [new_beams[i] for i in ranked]
        state.scores = [new_scores[i] for i in ranked]

    def _check_heuristic(self, state: _BeamState, cur_len: int) -> None:
        w, lp = self.width, self.params.length_penalty
        if self.params.early_stopping == "never" and lp > 0.0:
            best_len = state.max_length - state.prompt_len
        else:
            best_len = cur_len - state.prompt_len
        best_possible = state.scores[0] / (best_len ** lp)
        if len(state.finished) == w:
            worst = min(f.score for f in state.finished)
            state.heuristic_unsatisfied = state.heuristic_unsatisfied and best_possible > worst

    # ------------------------------------------------------------------ teardown
    def _drop(self, beam: Request, by_seq) -> None:
        self.engine.scheduler.finish(beam.request_id, RequestStatus.FINISHED_ABORTED)
        by_seq.pop(beam.request_id, None)

    def _finish(self, state: _BeamState, by_seq) -> None:
        for beam in state.beams:
            self._drop(beam, by_seq)
        self.engine.scheduler.release(state.request_id)
        state.done = True

    def _output(self, state: _BeamState) -> BeamSearchOutput:
        tok = self.engine.tokenizer
        seqs = [BeamSearchSequence(f.tokens, f.cum_logprob, f.score, state.prompt_len,
                                   tok.decode(f.tokens[state.prompt_len:]) if tok is not None else None, f.reason)
                for f in state.finished]
        return BeamSearchOutput(seqs)

"""The engine's side of speculative decoding: proposes drafts before the step is scheduled,
verifies them against the target's logits after the forward, and backs off where drafts are
rejected.

Per step (``LLMEngine.step``)::

    propose(running)     decoding requests get ``spec_token_ids`` (n-gram lookup or draft model)
    schedule()           each runs its last token + drafts as one chunk: k + 1 positions, one forward
    verify(chunks, ...)  rejection sampling -> accepted drafts + one target token per request
    (engine)             appends them token by token (stops end a run exactly), then
                         Scheduler.end_verification rolls the K/V back past the accepted tokens

A request gets no drafts before its first output token, while its structured-output grammar
constrains it, when its remaining ``max_tokens`` or ``max_model_len`` leave no room, or while it
is backing off: after a verified run with nothing accepted it sits out 2, 4, ... 16 steps (reset
by the next accepted draft), so low-acceptance text decodes at plain speed.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.config import EngineConfig
from pagedllm.contracts.sampled_tokens import SampledTokens
from pagedllm.contracts.scheduler_output import ScheduledChunk
from pagedllm.contracts.speculative_config import SpeculativeConfig
from pagedllm.layers.sampler import Sampler, SamplingRow
from pagedllm.metrics.stats import Metric
from pagedllm.spec_decode.draft_model import DraftModelProposer, Proposal
from pagedllm.spec_decode.metrics import SpecDecodeStats
from pagedllm.spec_decode.ngram import NgramProposer
from pagedllm.spec_decode.rejection_sampler import rejection_sample
from pagedllm.spec_decode.sequence import DraftedSequence

MAX_BACKOFF_STEPS = 16


@dataclass
class _Backoff:
    misses: int = 0  # verified runs in a row with no draft accepted
    resume_step: int = 0  # first step it may speculate again


class Speculator:
    """Proposes, verifies and counts speculative drafts for one engine (see the module doc)."""

    def __init__(self, config: EngineConfig, num_blocks: int, eos_token_ids: frozenset[int]):
        self.spec: SpeculativeConfig = config.speculative
        self.max_model_len = config.model.max_model_len
        self.eos_token_ids = tuple(eos_token_ids)
        self.ngram = None
        self.draft = None
        if self.spec.method == "ngram":
            self.ngram = NgramProposer(self.spec.prompt_lookup_min, self.spec.prompt_lookup_max)
        else:
            self.draft = DraftModelProposer(config, num_blocks)
        self.sampler = Sampler(persistent_penalties=False)  # rows are new lists every step
        self.stats = SpecDecodeStats(self.spec.num_speculative_tokens)
        self.proposals: dict[str, Proposal] = {}
        self.backoff: dict[str, _Backoff] = {}
        self.step = 0

    # ------------------------------------------------------------------ propose
    def propose(self, running: list[DraftedSequence]) -> None:
        """Sets ``spec_token_ids`` on every running request that may speculate this step."""
        self.step += 1
        for req in running:
            req.spec_token_ids = []
        batch = [(req, k) for req in running if (k := self._num_drafts(req)) > 0]
        if self.ngram is not None:
            self.proposals = {}
            for req, k in batch:
                drafts = self.ngram.propose(req.all_token_ids, k)
                if drafts:
                    self.proposals[req.request_id] = Proposal(drafts, None)
        else:
            self.proposals = self.draft.propose(batch) if batch else {}
        for req, _ in batch:
            if req.request_id in self.proposals:
                req.spec_token_ids = list(self.proposals[req.request_id].token_ids)

    def _num_drafts(self, req: DraftedSequence) -> int:
        """0 unless the request is decoding (one token to compute, at least one generated: a prompt
        whose last token a token budget left for the next chunk has one to compute too, and its
        siblings still to fork), unconstrained and not backing off."""
        decoding = req.num_computed_tokens == req.num_tokens - 1 and req.num_output_tokens > 0
        if not decoding or req.grammar is not None:
            return 0
        backoff = self.backoff.get(req.request_id)
        if backoff is not None and self.step < backoff.resume_step:
            return 0
        room = min(req.params.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens) - 1
        return max(0, min(self.spec.num_speculative_tokens, room))

    # ------------------------------------------------------------------ verify
    def verify(self, chunks: list[ScheduledChunk], logits: torch.Tensor,
               requests: dict[str, DraftedSequence]) -> list[SampledTokens]:
        """Checks every speculative chunk against its verify rows (``logits``: ``[sum of k + 1,
        vocab]``, chunk by chunk); returns one consecutive run of tokens per request. Greedy
        requests go through the ordinary sampler (argmax), sampled ones through rejection sampling."""
        spec = [c for c in chunks if c.num_spec_tokens]
        offsets = np.cumsum([0] + [c.num_verify_rows for c in spec])
        greedy = [i for i, c in enumerate(spec) if requests[c.request_id].params.greedy]
        random = [i for i, c in enumerate(spec) if not requests[c.request_id].params.greedy]
        runs: dict[int, SampledTokens] = {}
        for group, method in ((greedy, self._accept_greedy), (random, self._accept_sampled)):
            if group:
                row_idx = np.concatenate([np.arange(offsets[i], offsets[i + 1]) for i in group])
                runs.update(zip(group, method([spec[i] for i in group], logits[torch.from_numpy(row_idx)], requests)))
        out = [runs[i] for i in range(len(spec))]
        for c, run in zip(spec, out):
            self._record(c.request_id, c.num_spec_tokens, len(run.token_ids) - 1)
        return out

    def _accept_greedy(self, spec: list[ScheduledChunk], logits: torch.Tensor,
                       requests: dict[str, DraftedSequence]) -> list[SampledTokens]:
        rows = [row for c in spec for row in self._rows(requests[c.request_id], _drafts(c))]
        result = self.sampler(logits, rows)  # each row's argmax, with its raw logprobs
        out, i = [], 0
        for c in spec:
            tokens = _greedy_accept(result.token_ids[i:i + c.num_verify_rows], _drafts(c))
            n = len(tokens)
            tops = result.top_logprobs[i:i + n] if result.top_logprobs else None
            out.append(SampledTokens(c.request_id, tokens, result.logprobs[i:i + n], tops, consecutive=True))
            i += c.num_verify_rows
        return out

    def _accept_sampled(self, spec: list[ScheduledChunk], logits: torch.Tensor,
                        requests: dict[str, DraftedSequence]) -> list[SampledTokens]:
        rows = [row for c in spec for row in self._rows(requests[c.request_id], _drafts(c))]
        probs, raw = self.sampler.distributions(logits, rows)
        accepted, i = [], 0  # per chunk: (first row, accepted tokens)
        for c in spec:
            req, drafts, rows_c = requests[c.request_id], _drafts(c), slice(i, i + c.num_verify_rows)
            proposal = self.proposals.get(c.request_id)
            q = proposal.probs[:len(drafts)] if proposal is not None and proposal.probs is not None else None
            accepted.append((i, rejection_sample(probs[rows_c], drafts, q, req.generator)))
            i += c.num_verify_rows
        # every accepted token's logprob and its row's top logprobs: one fetch for the step
        index = [first + j for first, tokens in accepted for j in range(len(tokens))]
        logprobs, tops = self.sampler.chosen_logprobs(raw, index, [t for _, tokens in accepted for t in tokens],
                                                      [rows[r] for r in index])
        out, at = [], 0
        for c, (_, tokens) in zip(spec, accepted, strict=True):
            n = len(tokens)
            out.append(SampledTokens(c.request_id, tokens, logprobs[at:at + n], tops[at:at + n] if tops else None,
                                     consecutive=True))
            at += n
        return out

    def _rows(self, req: DraftedSequence, drafts: list[int]) -> list[SamplingRow]:
        """Row j predicts the token after draft j - 1: its history holds the drafts before it
        (penalties, bad words) and min_tokens counts them."""
        rows = []
        for j in range(len(drafts) + 1):
            banned = () if req.num_output_tokens + j >= req.params.min_tokens else (
                self.eos_token_ids + tuple(req.params.stop_token_ids))
            history = req.all_token_ids + drafts[:j] if j else req.all_token_ids
            rows.append(SamplingRow(req.params, history, req.num_prompt_tokens, req.generator, banned))
        return rows

    def _record(self, request_id: str, num_drafted: int, num_accepted: int) -> None:
        self.stats.record(num_drafted, num_accepted)
        backoff = self.backoff.setdefault(request_id, _Backoff())
        if num_accepted:
            backoff.misses = 0
            return
        backoff.misses += 1
        backoff.resume_step = self.step + 1 + min(2 ** backoff.misses, MAX_BACKOFF_STEPS)

    # ------------------------------------------------------------------ bookkeeping
    def retain(self, live_ids: set[str]) -> None:
        """Forgets requests that are gone (and frees their draft K/V)."""
        for rid in [rid for rid in self.backoff if rid not in live_ids]:
            del self.backoff[rid]
        if self.draft is not None:
            self.draft.retain(live_ids)

    def metrics(self) -> list[Metric]:
        return self.stats.metrics()

    def shutdown(self) -> None:
        if self.draft is not None:
            self.draft.release()


def _drafts(chunk: ScheduledChunk) -> list[int]:
    return chunk.token_ids[-chunk.num_spec_tokens:]


def _greedy_accept(target: list[int], drafts: list[int]) -> list[int]:
    """Drafts while they equal the target's argmax, then the target's own token."""
    for j, d in enumerate(drafts):
        if target[j] != d:
            return drafts[:j] + [target[j]]
    return drafts + [target[len(drafts)]]


def split_rounds(sampled: list[SampledTokens]) -> list[list[SampledTokens]]:
    """Round 0: every entry, a consecutive run cut to its first token; round j: the j-th token of
    each run that long (one token per sequence per round)."""
    rounds = [[_one(s, 0) if s.consecutive else s for s in sampled]]
    runs = [s for s in sampled if s.consecutive]
    for j in range(1, max((len(s.token_ids) for s in runs), default=1)):
        rounds.append([_one(s, j) for s in runs if len(s.token_ids) > j])
    return rounds


def _one(s: SampledTokens, j: int) -> SampledTokens:
    tops = [s.top_logprobs[j]] if s.top_logprobs else None
    return SampledTokens(s.request_id, [s.token_ids[j]], [s.logprobs[j]], tops)

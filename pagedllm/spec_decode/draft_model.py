"""Draft-model proposals: a small model with the target's vocabulary runs ``k`` decode steps ahead.

The draft has its own ModelRunner (its own KV pool and persistent block tables) and its own
KVCacheManager (no prefix caching); only rank 0 runs it. Per request it keeps a copy of the
tokens it has seen and how many of them are in its cache::

    draft tokens:  [ target's tokens at the last step ..... | d1 ... dk ]
    draft K/V:     [ computed ............................. d1 .. d(k-1) ]   (dk is never fed)

Next step the target has appended the accepted drafts and one token of its own; the draft keeps
its K/V up to the first position where the two token lists differ (rolling the rest back, blocks
freed) and catches up from there in the first of its ``k`` forwards.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from pagedllm.config import EngineConfig, ParallelConfig
from pagedllm.contracts.scheduler_output import ScheduledChunk, SchedulerOutput
from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.kv_cache.kv_cache_manager import KVCacheManager
from pagedllm.layers.sampler import NO_TOKEN, Sampler, SamplingRow
from pagedllm.spec_decode.rejection_sampler import best, draw
from pagedllm.spec_decode.sequence import DraftedSequence
from pagedllm.worker.model_runner import ModelRunner


@dataclass
class DraftSequence:
    """The draft's view of one request (what KVCacheManager needs of a request)."""

    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    cache_salt: str | None = None
    drafts: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)  # [vocab] per draft: what it was drawn from
    stuck: bool = False  # its last row allowed no token: no more drafts this step
    long_rope: bool = False  # LongRoPE draft: its K/V is computed with the long factors

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


@dataclass(frozen=True)
class Proposal:
    token_ids: list[int]
    probs: torch.Tensor | None  # [k, vocab] the draft's distributions (None: point masses, n-gram)


def draft_engine_config(target: EngineConfig) -> EngineConfig:
    """The target's engine config with the draft's model: one rank, no prefix caching, eager, no
    adapters (drafts come from the base draft model; the target verifies them with its adapter)."""
    spec = target.speculative
    cache = dataclasses.replace(target.cache, enable_prefix_caching=False)
    return dataclasses.replace(target, model=spec.draft, cache=cache, parallel=ParallelConfig(1),
                               cuda_graphs=False, compile_model=False, speculative=None,
                               lora=None)


class DraftModelProposer:
    """Proposes drafts for a batch of decoding requests with ``k`` batched forwards of the draft.

    ``num_blocks``: the draft's KV pool (as many blocks as the target's). A request whose draft
    blocks do not fit gets no proposal that step (it decodes plainly). ``retain`` drops the
    state of requests that are gone.
    """

    def __init__(self, target: EngineConfig, num_blocks: int):
        config = draft_engine_config(target)
        self.runner = ModelRunner(config, TensorParallelGroup())
        self.runner.init_cache(num_blocks)
        self.kv = KVCacheManager(num_blocks, config.cache.block_size, enable_caching=False)
        self.sampler = Sampler(persistent_penalties=False)  # rows are new lists every step
        self.seqs: dict[str, DraftSequence] = {}

    def propose(self, batch: list[tuple[DraftedSequence, int]]) -> dict[str, Proposal]:
        """``batch``: (request, its number of drafts). Returns the proposals by request id."""
        active = [(req, k, self._sync(req)) for req, k in batch]
        requests = {req.request_id: req for req, _, _ in active}
        for step in range(max((k for _, k, _ in active), default=0)):
            active = [(r, k, seq) for r, k, seq in active if k > step and not seq.stuck and self._allocate(seq, r)]
            if not active:
                break
            self._step(active, requests)
        return {rid: Proposal(seq.drafts, torch.stack(seq.probs)) for rid, seq in self.seqs.items()
                if rid in requests and seq.drafts}

    def _sync(self, req: DraftedSequence) -> DraftSequence:
        """Keeps the draft K/V of the longest common prefix with the target's tokens, but never
        the last token's (it is fed again for its logits: the target may not have run last step)."""
        seq = self.seqs.get(req.request_id)
        if seq is None:
            seq = self.seqs[req.request_id] = DraftSequence(req.request_id, [], cache_salt=None)
        same = _common_prefix(seq.all_token_ids, req.all_token_ids, min(seq.num_computed_tokens, req.num_tokens - 1))
        seq.all_token_ids = list(req.all_token_ids)
        seq.num_computed_tokens = same
        seq.drafts, seq.probs, seq.stuck = [], [], False
        self.kv.rollback(seq)
        return seq

    def _allocate(self, seq: DraftSequence, req: DraftedSequence) -> bool:
        limit = getattr(self.runner.model, "long_rope_offset", None)
        if limit is not None and not seq.long_rope and seq.num_tokens > limit:
            # LongRoPE draft past its original context: all its K/V again with the long factors
            # (layers/rotary_variants.py), as the target's scheduler does
            self.kv.free(seq)
            seq.num_computed_tokens, seq.long_rope = 0, True
        if self.kv.allocate_slots(seq, seq.num_tokens - seq.num_computed_tokens):
            return True
        self.kv.free(seq)  # no room: this request decodes plainly; its draft restarts later
        seq.num_computed_tokens, seq.drafts, seq.probs = 0, [], []
        return False

    def _step(self, active: list[tuple[DraftedSequence, int, DraftSequence]],
              requests: dict[str, DraftedSequence]) -> None:
        """One draft forward over every active sequence's uncomputed tokens; draws one draft each."""
        chunks = [self._chunk(seq) for _, _, seq in active]
        out = SchedulerOutput(chunks=chunks, released_ids=self.kv.take_released())
        logits = self.runner.execute(out).logits  # [num active, vocab]
        rows = [SamplingRow(req.params, seq.all_token_ids, req.num_prompt_tokens, req.generator)
                for req, _, seq in active]
        probs, _ = self.sampler.distributions(logits, rows)
        for (req, _, seq), p in zip(active, probs):
            token = best(p) if req.params.greedy else draw(p, req.generator)
            if token == NO_TOKEN:  # the target's row there allows no token either: it ends the request
                seq.stuck = True
                continue
            seq.all_token_ids.append(token)
            seq.drafts.append(token)
            seq.probs.append(p)

    def _chunk(self, seq: DraftSequence) -> ScheduledChunk:
        start = seq.num_computed_tokens
        seq.num_computed_tokens = seq.num_tokens
        block_start, new_blocks = self.kv.take_block_update(seq.request_id)
        return ScheduledChunk(seq.request_id, seq.all_token_ids[start:], start, block_start, new_blocks, num_samples=1,
                              long_rope=seq.long_rope)

    def retain(self, live_ids: set[str]) -> None:
        """Frees the draft state of every request not in ``live_ids``."""
        for rid in [rid for rid in self.seqs if rid not in live_ids]:
            self.kv.free(self.seqs.pop(rid))

    def release(self) -> None:
        self.runner.release()


def _common_prefix(a: list[int], b: list[int], limit: int) -> int:
    n = min(len(a), len(b), limit)
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n

"""Continuous-batching scheduler with chunked prefill and preemption by recompute or swap.

Each step re-decides what runs (docs/design.md, core idea 1): every request gets up to
``num_tokens - num_computed_tokens`` new tokens within the step's token budget, in this order:

1. running requests, oldest first; when blocks run out, the most recently admitted running
   request is preempted: ``recompute`` frees its blocks and puts it at the front of the waiting
   queue with all its tokens; ``swap`` moves all its blocks to the CPU pool (falling back to
   recompute when the CPU pool is full);
2. swapped requests come back (oldest first) when their blocks fit above the watermark;
3. waiting requests are admitted in FCFS order, only once nothing is swapped out. With KV tiers
   (``kv_cache/offload/``), one whose prefix continues in the CPU or disk tier gets its blocks
   and a load instead of a chunk: it waits out this step in ``loading`` (the ranks load while the
   others run) and joins the running requests with those tokens computed.

No step that preempted admits or swaps in anything, so a block freed by a swap-out is never
reused in the same step before the cache engine has copied it out.

``scheduling_policy="priority"`` (vLLM's) replaces arrival order by ``(priority, arrival)``,
lowest first, everywhere: the waiting and swapped queues are kept in that order (a preempted
request goes back to its place in it, not to the front), and the running requests are sorted by
it before each step, so they get the token budget in that order and the one preempted when
blocks run out is the last: the lowest priority, latest arrival (vLLM's victim). Running
requests are never preempted to admit a waiting one, whatever its priority (as in vLLM).

With ``enable_lora`` the adapters' device slots are admitted by like blocks (lora/slot_pool.py):
a waiting request takes a reference on its adapter's slot when admitted (its adapter is loaded
into a free or least recently used unreferenced slot if not resident: ``out.lora_loads``); one
whose adapter can get no slot keeps its place while the requests behind it go ahead. Running and
swapped requests hold their reference; finishing or preemption by recompute drops it.
"""
from __future__ import annotations

import bisect
import logging
import time
from collections import deque
from dataclasses import dataclass, field

from pagedllm.config import CacheConfig, LoRAConfig, SchedulerConfig
from pagedllm.contracts.sampled_tokens import SampledTokens
from pagedllm.contracts.scheduler_output import ScheduledChunk, SchedulerOutput
from pagedllm.contracts.tier_ops import LoadReport
from pagedllm.engine.request import Request, RequestStatus, make_generator
from pagedllm.kv_cache.kv_cache_manager import KVCacheManager
from pagedllm.kv_cache.offload.manager import OffloadManager
from pagedllm.layers.sampler import NO_TOKEN
from pagedllm.lora.slot_pool import LoRASlotPool
from pagedllm.metrics.stats import KVCacheStats, SchedulerSnapshot
from pagedllm.multimodal.encoder_cache import EncoderCacheManager
from pagedllm.multimodal.inputs import attend_ends, cut_before_split_runs

logger = logging.getLogger(__name__)


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    preemptions_by_mode: dict[str, int] = field(default_factory=lambda: {"recompute": 0, "swap": 0})


class Scheduler:
    """Decides, each step, which requests run and with how many tokens; applies the results."""

    def __init__(self, config: SchedulerConfig, cache_config: CacheConfig, num_blocks: int,
                 num_cpu_blocks: int = 0, offload: OffloadManager | None = None, lora: LoRAConfig | None = None):
        self.config = config
        self.block_size = cache_config.block_size
        self.kv = KVCacheManager(num_blocks, cache_config.block_size, cache_config.enable_prefix_caching,
                                 num_cpu_blocks, offload)
        self.watermark_blocks = int(cache_config.watermark * num_blocks)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.loading: dict[str, Request] = {}  # admitted this step to load tier hits (finish_loads)
        self.requests: dict[str, Request] = {}  # every live sequence by its id
        self.sequences: dict[str, list[str]] = {}  # parent request id -> its sequence ids
        self.stats = SchedulerStats()
        self.finished_ids: list[str] = []  # sequences finished since the last step (for the runner)
        self.failed: list[Request] = []  # ended because their grammar failed to compile (take_failed)
        self.by_priority = config.scheduling_policy == "priority"
        # enable_lora: the adapters' device slots, admitted by like KV blocks (lora/slot_pool.py)
        self.lora_slots = LoRASlotPool(lora.max_loras) if lora is not None else None
        # images' encoder outputs (multimodal/encoder_cache.py): one step encodes at most a step's token
        # budget of image rows, and the cache holds as many (the input processor refuses a larger image)
        self.encoder = EncoderCacheManager(config.max_num_batched_tokens, config.max_num_batched_tokens)

    # ------------------------------------------------------------------ admission
    def check_fits(self, num_prompt_tokens: int, max_tokens: int, num_seqs: int) -> None:
        """Raises ValueError for a request that could never run."""
        total = num_prompt_tokens + max_tokens
        capacity = self.kv.num_blocks * self.block_size
        if total > self.config.max_model_len:
            raise ValueError(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} exceeds "
                f"max_model_len={self.config.max_model_len}; shorten the prompt or lower max_tokens")
        if total > capacity:
            raise ValueError(
                f"prompt + max_tokens = {total} tokens can never fit in the KV cache "
                f"({self.kv.num_blocks} blocks x {self.block_size} = {capacity} tokens); "
                "raise kv_cache_memory / gpu_memory_utilization or lower max_tokens")
        if num_seqs > self.config.max_num_seqs:
            raise ValueError(f"n/best_of={num_seqs} exceeds max_num_seqs={self.config.max_num_seqs}")

    def add_request(self, req: Request) -> None:
        req.num_forks_pending = req.params.num_sequences - 1
        req.fork_generators = [make_generator(req.params.seed, i) for i in range(1, req.num_forks_pending + 1)]
        self.requests[req.request_id] = req
        self.sequences[req.parent_id] = [req.request_id]
        self._enqueue(self.waiting, req)

    def _enqueue(self, queue: deque[Request], req: Request, front: bool = False) -> None:
        """Puts ``req`` in a waiting or swapped queue: at the back (or the front when preempted) in
        arrival order; in its ``(priority, arrival)`` place under the priority policy."""
        if self.by_priority:
            bisect.insort_right(queue, req, key=_priority_key)
        elif front:
            queue.appendleft(req)
        else:
            queue.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped or self.loading)

    # ------------------------------------------------------------------ scheduling
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        self.encoder.begin_step()
        if self.by_priority:  # stable: forks and equal keys keep their admission order
            self.running.sort(key=_priority_key)
        self._recompute_past_short_rope()
        budget = self._schedule_running(out, budget)
        if not out.preempted_ids:
            budget = self._schedule_swapped(out, budget)
        if not out.preempted_ids and not self.swapped:
            self._schedule_waiting(out, budget)
        out.blocks_to_copy = self.kv.take_copies()
        out.released_ids = self.kv.take_released()
        out.tier_ops = self.kv.take_tier_ops()
        if self.lora_slots is not None:
            out.lora_loads = self.lora_slots.take_loads()
        out.encoder_frees = self.encoder.take_frees()
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = self._fit_encoder(req, min(req.num_tokens - req.num_computed_tokens, budget))
            if num_new <= 0:
                i += 1
                continue
            if req.spec_token_ids:
                num_new += self._num_drafts(req, num_new, budget)
            if not self._allocate_or_preempt(req, num_new, out):
                break  # req itself was the last running request and got preempted
            self._add_chunk(out, req, num_new)
            budget -= num_new
            i += 1
        return budget

    def _num_drafts(self, req: Request, num_new: int, budget: int) -> int:
        """How many of the request's speculative drafts run with its next token: those the
        budget leaves room for, or none when their blocks are not free (never a preemption)."""
        num = min(len(req.spec_token_ids), budget - num_new, self._short_rope_room(req, num_new))
        if num > 0 and self.kv.blocks_needed(req, num_new + num) > self.kv.num_free_blocks:
            return 0
        return num

    def _allocate_or_preempt(self, req: Request, num_new: int, out: SchedulerOutput) -> bool:
        while not self.kv.allocate_slots(req, num_new):
            victim = self.running.pop()
            self._preempt(victim, out)
            out.preempted_ids.append(victim.request_id)
            if victim is req:
                return False
        return True

    def _schedule_swapped(self, out: SchedulerOutput, budget: int) -> int:
        while self.swapped and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.swapped[0]
            num_new = self._fit_encoder(req, min(req.num_tokens - req.num_computed_tokens, budget))
            if num_new <= 0:  # its next image does not fit this step's encoder budget
                break
            # room for the blocks coming back, the new tokens' blocks and the watermark
            if not self.kv.can_swap_in(req, num_new, reserve=self.watermark_blocks):
                break
            self.swapped.popleft()
            out.blocks_to_swap_in.extend(self.kv.swap_in(req))
            if not self.kv.allocate_slots(req, num_new):
                raise AssertionError("swap-in reserved room for the next tokens")
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._add_chunk(out, req, num_new)
            budget -= num_new
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Admits waiting requests in FCFS order; one whose grammar is still compiling keeps its
        place while the requests behind it go ahead."""
        skipped: deque[Request] = deque()
        try:
            self._admit_waiting(out, budget, skipped)
        finally:
            self.waiting.extendleft(reversed(skipped))

    def _admit_waiting(self, out: SchedulerOutput, budget: int, skipped: deque[Request]) -> None:
        # seats: running sequences plus the siblings they will fork once their prompt is done
        seats = sum(1 + r.num_forks_pending for r in self.running)
        while self.waiting and budget > 0:
            req = self.waiting[0]
            if req.is_waiting_for_grammar() or self._grammar_failed(req):
                if not req.is_finished:
                    skipped.append(self.waiting.popleft())
                continue
            if not self._lora_slot_available(req):  # it waits for a slot; others may run meanwhile
                skipped.append(self.waiting.popleft())
                continue
            if seats + 1 + req.num_forks_pending > self.config.max_num_seqs:
                break
            req.long_rope = self._needs_long_rope(req)  # (before its block hashes: they key on it)
            # prompt logprobs and MEAN / CLS pooling need every prompt position computed: no prefix hits
            every_position = req.params.prompt_logprobs is not None or req.pools_every_position
            hits, num_hit = ([], 0) if every_position else self.kv.get_computed_blocks(req)
            # tier misses count once, on admission: a waiting request walks its prefix every step
            plan, misses = ([], {}) if every_position else self.kv.get_tier_hits(req, len(hits))
            if plan is None:  # its prefix is being loaded for another request: it hits it next step
                break
            if plan:
                if not self.kv.start_load(req, hits, plan, reserve=self.watermark_blocks):
                    break
                self.kv.count_tier_misses(misses)
                self.loading[req.request_id] = self.waiting.popleft()
                self._take_lora_slot(req)
                seats += 1 + req.num_forks_pending
                continue
            num_new = self._fit_encoder(req, min(req.num_tokens - req.num_computed_tokens - num_hit, budget),
                                        num_hit)
            if num_new <= 0:  # its first image does not fit this step's encoder budget
                break
            if not self.kv.allocate_slots(req, num_new, hits, reserve=self.watermark_blocks,
                                          reserve_tokens=self._preallocation(req)):
                break
            self.kv.count_tier_misses(misses)
            self.waiting.popleft()
            self._take_lora_slot(req)
            req.num_computed_tokens += num_hit
            req.num_cached_tokens = num_hit
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.time()
            self.running.append(req)
            self._add_chunk(out, req, num_new)
            budget -= num_new
            seats += 1 + req.num_forks_pending

    def _lora_slot_available(self, req: Request) -> bool:
        return req.lora_request is None or self.lora_slots.can_acquire(req.lora_request)

    def _take_lora_slot(self, req: Request) -> None:
        """On admission: a reference on its adapter's slot (loaded into one if not resident)."""
        if req.lora_request is not None:
            req.lora_slot = self.lora_slots.acquire(req.lora_request)

    def _drop_lora_slot(self, req: Request) -> None:
        """It no longer runs (finished, or preempted by recompute): its adapter may be evicted."""
        if req.lora_slot >= 0:
            self.lora_slots.release(req.lora_slot)
            req.lora_slot = -1

    def finish_loads(self, report: LoadReport | None) -> None:
        """The ranks' loads of this step arrived (``report``): each loading request, with its
        intact leading blocks computed, joins the running requests (it holds blocks, so it must
        not wait behind swapped requests that may need them)."""
        if report is None:
            return
        self.kv.offload.note_report(report)
        for rid, num_ok in report.num_ok.items():
            req = self.loading.pop(rid)
            req.num_computed_tokens = req.num_cached_tokens = self.kv.finish_load(req, num_ok)
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.time()
            self.running.append(req)

    def _grammar_failed(self, req: Request) -> bool:
        """A grammar that did not compile ends its request (aborted; ``take_failed`` reports it)."""
        if req.grammar is None or req.grammar.error is None:
            return False
        logger.error("request %s: structured output grammar failed to compile: %s", req.parent_id,
                     req.grammar.error)
        self.finish(req.request_id, RequestStatus.FINISHED_ABORTED)
        self.failed.append(req)
        return True

    def take_failed(self) -> list[Request]:
        """Requests ended since the last call because their grammar failed to compile."""
        failed, self.failed = self.failed, []
        return failed

    def waiting_grammars(self) -> list:
        """The GrammarStates that waiting requests are waiting for."""
        return [r.grammar for r in self.waiting if r.is_waiting_for_grammar()]

    def _preallocation(self, req: Request) -> int:
        mode = self.config.preallocation
        if mode == "max_model_len":
            return self.config.max_model_len
        if mode == "request":
            return req.num_prompt_tokens + req.params.max_tokens
        return 0

    def _fit_encoder(self, req: Request, num_new: int, num_hit: int = 0) -> int:
        """``num_new`` cut before the first image the chunk needs encoded that does not fit this
        step's encoder budget (``num_hit``: prefix-cache hits not yet counted as computed)."""
        if not req.mm_items:
            return num_new
        # images whose runs earlier steps computed (one this step finishes is read by this step's
        # forward: released next step, never evicted and freed under it by a later chunk)
        self.encoder.release_done(req.request_id, req.mm_items, req.num_computed_tokens)
        start = req.num_computed_tokens + num_hit
        num_new = self.encoder.fit(req.mm_items, start, num_new)
        # a bidirectional run (with disable_chunked_mm_input: any item's run) is never split
        return cut_before_split_runs(req.mm_items, start, num_new, self.config.disable_chunked_mm_input)

    def _add_chunk(self, out: SchedulerOutput, req: Request, num_new: int) -> None:
        start = req.num_computed_tokens
        req.num_computed_tokens += num_new
        mm_spans = ()
        if req.mm_items:
            end = min(start + num_new, req.num_prompt_tokens)
            out.encoder_inputs.extend(self.encoder.schedule(req.request_id, req.mm_items, start, end))
            mm_spans = tuple((m.hash, m.offset, m.length) for m in req.mm_items if m.overlaps(start, end))
        # speculative drafts run past the request's tokens (verified, then rolled back: end_verification)
        num_spec = max(0, req.num_computed_tokens - req.num_tokens)
        samples = 0
        if req.num_computed_tokens == req.num_tokens:
            samples = 1 + req.num_forks_pending
        block_start, new_blocks = self.kv.take_block_update(req.request_id)
        prompt_rows = 0
        if req.prompt_logprobs is not None:  # positions start.. predicting prompt tokens start+1..
            prompt_rows = max(0, min(start + num_new, req.num_prompt_tokens - 1) - start)
        out.chunks.append(ScheduledChunk(
            request_id=req.request_id,
            token_ids=req.all_token_ids[start:start + num_new - num_spec] + req.spec_token_ids[:num_spec],
            start=start,
            new_block_start=block_start,
            new_block_ids=new_blocks,
            num_samples=samples,
            num_prompt_logprob_rows=prompt_rows,
            num_spec_tokens=num_spec,
            mm_spans=mm_spans,
            long_rope=req.long_rope,
            mrope_positions=req.mrope.rows(start, start + num_new) if req.mrope is not None else None,
            lora_slot=req.lora_slot,
            attend_ends=attend_ends(req.mm_items, start, num_new) if req.mm_items else None,
        ))

    def end_verification(self, request_id: str) -> None:
        """After a speculative run was verified and its accepted tokens appended: the request's
        K/V is valid for all its tokens but the last (rejected drafts' slots are not), so its
        progress moves back there and blocks holding only rejected drafts are freed."""
        req = self.requests.get(request_id)
        if req is None or req.is_finished or req.status != RequestStatus.RUNNING:
            return
        req.num_computed_tokens = req.num_tokens - 1
        self.kv.rollback(req)

    def _needs_long_rope(self, req: Request) -> bool:
        limit = self.config.long_rope_from
        return limit is not None and req.num_tokens > limit

    def _short_rope_room(self, req: Request, num_new: int) -> int:
        """Drafts a short-factor request may verify: none past the original context (their K/V
        would need the long factors; the request switches once it has grown past it)."""
        limit = self.config.long_rope_from
        if limit is None or req.long_rope:
            return len(req.spec_token_ids)
        return limit - (req.num_computed_tokens + num_new)

    def _recompute_past_short_rope(self) -> None:
        """LongRoPE (layers/rotary_variants.py): a running request whose K/V was computed with the
        short factors and that has grown past the original context is recomputed with the long ones:
        its blocks are freed and it waits at the front of the queue, as after a recompute preemption
        (not counted as one), so no sequence's K/V mixes the two factor sets."""
        for req in [r for r in self.running if not r.long_rope and self._needs_long_rope(r)]:
            self.running.remove(req)
            self.encoder.release(req.request_id)
            self.kv.free(req)
            req.num_computed_tokens = 0
            req.status = RequestStatus.PREEMPTED
            self._enqueue(self.waiting, req, front=True)

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        """Swap the victim's blocks out when asked and possible, else recompute it later."""
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.encoder.release(req.request_id)  # its images are encoded again if evicted before it resumes
        if self.config.preemption_mode == "swap" and self.kv.can_swap_out(req):
            out.blocks_to_swap_out.extend(self.kv.swap_out(req))
            req.status = RequestStatus.SWAPPED
            self._enqueue(self.swapped, req)
            self.stats.preemptions_by_mode["swap"] += 1
            return
        self.kv.free(req)  # recompute: drop the K/V, keep the tokens, requeue at the front
        self._drop_lora_slot(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        self._enqueue(self.waiting, req, front=True)
        self.stats.preemptions_by_mode["recompute"] += 1

    # ------------------------------------------------------------------ results
    def update(self, sampled: list[SampledTokens]) -> list[Request]:
        """Appends sampled tokens, forks pending siblings, finishes stopped sequences.

        Returns every sequence that received tokens this step (including newly forked ones).
        """
        touched = []
        now = time.time()
        for s in sampled:
            req = self.requests.get(s.request_id)
            if req is None or req.is_finished:
                continue
            children = self._fork(req, s) if req.num_forks_pending else []
            for seq, k in [(req, 0)] + [(c, i + 1) for i, c in enumerate(children)]:
                self._append(seq, s, k, now)
                touched.append(seq)
        return touched

    def _append(self, req: Request, s: SampledTokens, k: int, now: float) -> None:
        token = s.token_ids[k]
        if token == NO_TOKEN:
            self.finish(req.request_id, _no_token_status(req))
            return
        req.append_token(token)
        req.cumulative_logprob += s.logprobs[k]
        if req.logprobs is not None:
            req.logprobs.append({token: s.logprobs[k], **(s.top_logprobs[k] if s.top_logprobs else {})})
        if req.first_token_time is None:
            req.first_token_time = now
        req.last_token_time = now
        status = self._check_stop(req, token)
        if status is not None:
            self.finish(req.request_id, status)

    def _fork(self, parent: Request, s: SampledTokens) -> list[Request]:
        """Creates the parent's siblings now that the prompt is computed; they share its blocks."""
        children = [self.fork(parent, f"{parent.parent_id}#{i}", i) for i in range(1, parent.num_forks_pending + 1)]
        for child, gen in zip(children, parent.fork_generators):
            child.generator = gen
        parent.num_forks_pending = 0
        return children

    def fork(self, parent: Request, child_id: str, index: int) -> Request:
        """A running copy of ``parent`` (same tokens and progress) sharing all its blocks."""
        child = Request(child_id, parent.prompt_token_ids, parent.params, parent.eos_token_ids,
                        parent.arrival_time, parent.parent_id, index, parent.cache_salt, parent.priority,
                        mm_items=parent.mm_items,  # its block hashes key on the same images
                        lora_request=parent.lora_request)
        if parent.lora_slot >= 0:
            child.lora_slot = self.lora_slots.retain(parent.lora_slot)
        child.all_token_ids = list(parent.all_token_ids)
        child.num_computed_tokens = parent.num_computed_tokens
        child.cumulative_logprob = parent.cumulative_logprob
        child.status = RequestStatus.RUNNING
        child.first_scheduled_time = parent.first_scheduled_time
        child.grammar = parent.grammar.fork() if parent.grammar is not None else None
        child.long_rope = parent.long_rope
        self.kv.fork(parent, child)
        self.requests[child_id] = child
        self.sequences[parent.parent_id].append(child_id)
        self.running.append(child)
        return child

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        params = req.params
        if req.grammar is not None:
            if req.grammar.rejected_token is not None:  # a bug: never sampled outside the mask
                return RequestStatus.FINISHED_ABORTED
            if req.grammar.is_terminated():  # the grammar is complete (it accepted EOS)
                return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= params.min_tokens:
            if token in req.eos_token_ids and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= params.max_tokens or req.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish(self, request_id: str, status: RequestStatus) -> None:
        """Ends one sequence and frees its blocks at once."""
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            return
        req.status = status
        for queue in (self.running, self.waiting, self.swapped):
            if req in queue:
                queue.remove(req)
                break
        self.loading.pop(request_id, None)
        self.kv.free(req)
        self._drop_lora_slot(req)
        self.encoder.release(request_id)
        if req.grammar is not None:  # a compile no other request waits for is dropped if still queued
            req.grammar.release()
        self.finished_ids.append(request_id)

    def abort(self, parent_id: str) -> None:
        """Aborts every sequence of a user request."""
        for rid in self.sequences.get(parent_id, []):
            self.finish(rid, RequestStatus.FINISHED_ABORTED)

    def is_done(self, parent_id: str) -> bool:
        """Every sequence of the user request exists (all forks made) and has finished, or it
        ended before it could fork (its grammar failed to compile)."""
        seqs = [self.requests[s] for s in self.sequences.get(parent_id, [])]
        if not seqs or not all(s.is_finished for s in seqs):
            return False
        return len(seqs) == seqs[0].params.num_sequences or seqs[0].num_forks_pending > 0

    def release(self, parent_id: str) -> None:
        """Forgets a finished user request's bookkeeping."""
        for rid in self.sequences.pop(parent_id, []):
            self.requests.pop(rid, None)

    # ------------------------------------------------------------------ stats
    def make_stats(self) -> SchedulerSnapshot:
        """Queue sizes and blocks in use, O(1): the engine takes one every step for its peaks."""
        used = self.kv.num_blocks - self.kv.num_free_blocks
        return SchedulerSnapshot(num_running=len(self.running), num_waiting=len(self.waiting),
                                 num_swapped=len(self.swapped), num_used_blocks=used)

    def kv_cache_stats(self) -> KVCacheStats:
        """Block, prefix-cache, swap and preemption accounting (walks every block table)."""
        kv = self.kv
        used = kv.num_blocks - kv.num_free_blocks
        stored = kv.num_tokens_stored()
        ps = kv.prefix_stats
        return KVCacheStats(
            block_size=kv.block_size, num_blocks=kv.num_blocks, num_free_blocks=kv.num_free_blocks,
            num_used_blocks=used, num_cached_blocks=kv.num_cached_blocks, usage=kv.usage(),
            num_tokens_stored=stored, utilization=stored / (used * kv.block_size) if used else 0.0,
            prefix_cache_queries=ps.queries, prefix_cache_hits=ps.hits, prefix_cache_hit_rate=ps.hit_rate,
            num_cpu_blocks=kv.num_cpu_blocks, num_cpu_free_blocks=kv.num_cpu_free_blocks,
            cpu_usage=kv.cpu_usage(), num_preemptions=self.stats.num_preemptions,
            preemptions_by_mode=dict(self.stats.preemptions_by_mode),
            offload=kv.offload.snapshot() if kv.offload is not None else {},
        )

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()

    def persist_ops(self):
        """KV tier disk writes of every cached prefix, for a shutdown (None without tiers)."""
        return self.kv.persist_tier_ops()

    def take_finished_ids(self) -> list[str]:
        ids, self.finished_ids = self.finished_ids, []
        return ids


def _priority_key(req: Request) -> tuple[int, float]:
    return req.priority, req.arrival_time


def _no_token_status(req: Request) -> RequestStatus:
    """A sequence whose sampler row allowed no token (``NO_TOKEN``): ``stop`` when its grammar has
    matched a whole string (only the stop token, excluded by another rule, could follow), else
    ``constraint``."""
    if req.grammar is not None and req.grammar.is_complete():
        return RequestStatus.FINISHED_STOPPED
    logger.warning("request %s: its constraints allow no next token after %d tokens; it ends with "
                   "finish_reason 'constraint'", req.parent_id, req.num_output_tokens)
    return RequestStatus.FINISHED_CONSTRAINT

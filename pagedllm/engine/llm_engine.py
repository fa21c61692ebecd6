"""The engine: add requests, step the scheduler/executor/sampler loop, collect outputs."""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence

import torch

from pagedllm import envs
from pagedllm.config import EngineConfig
from pagedllm.contracts.device_to_host import to_host
from pagedllm.contracts.sampled_tokens import SampledTokens
from pagedllm.contracts.scheduler_output import SchedulerOutput
from pagedllm.engine import pooling, prompt_logprobs
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.beam_search import BeamSearchManager
from pagedllm.engine.input_processor import InputProcessor, ProcessedRequest, PromptType, with_client
from pagedllm.engine.kv_events import KVEventFeed
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.request import Request, RequestStatus
from pagedllm.engine.scheduler import Scheduler
from pagedllm.kv_cache.offload.setup import build_offload_manager, tiers_enabled
from pagedllm.layers.sampler import NO_TOKEN, Sampler, SamplingRow
from pagedllm.lora.registry import LoRARegistry
from pagedllm.lora.request import LoRARequest
from pagedllm.metrics.stats import EngineCounters, KVCacheStats, Metric, StepTimes, offload_metrics
from pagedllm.models.loader import get_model_class
from pagedllm.multimodal.processor import MultiModalLimits, MultiModalProcessor, image_layout
from pagedllm.multimodal.processor_cache import ProcessorCache
from pagedllm.outputs import (
    BeamSearchOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
)
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import BeamSearchParams, SamplingParams
from pagedllm.spec_decode.speculator import Speculator, split_rounds
from pagedllm.structured_output import StructuredOutputManager
from pagedllm.worker import sleep_mode
from pagedllm.worker.executor import make_executor
from pagedllm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

GRAMMAR_WAIT_S = 0.05  # step()'s longest wait for a compile when nothing else can run

RowSpan = tuple[Request, bool, int]  # a per-token pooling span: its request, whether it starts the prompt, its rows

__all__ = ["EngineSleepingError", "LLMEngine", "PromptType"]

# ModelRunner methods that change the weights: cached prefixes were computed with the old ones
_WEIGHT_UPDATES = frozenset({"load_weights", "update_weights", "reload_weights"})


class EngineSleepingError(RuntimeError):
    """A request reached an engine put to sleep (``LLMEngine.sleep``); it serves again after ``wake_up``."""


class LLMEngine:
    """Owns scheduler, executor, sampler, input/output processors and beam searches; one
    ``step()`` = one forward.

    ``add_request`` validates (``input_processor``) and queues; ``add_processed_request`` queues
    a request processed elsewhere (the async engine's tokenizer threads). ``step`` returns a
    RequestOutput, in the request's output kind, for every request that made progress
    (``finished=True`` once all its sequences are done). Beam searches (``add_beam_search``)
    advance in the same steps. Invalid input raises ``ValueError`` before anything is queued.
    """

    def __init__(self, config: EngineConfig, tokenizer=None):
        pooling.check_pooler(config.model, config.pooler)
        self.config = config
        self.model_config = config.model
        self._idle_wake: threading.Event | None = None  # set_idle_wake
        _check_sleep_mode_fits(config)
        tokenizer = tokenizer if tokenizer is not None else _load_tokenizer(config.model)
        self.executor = make_executor(config)
        self.scheduler = Scheduler(config.scheduler, config.cache, self.executor.num_blocks,
                                   self.executor.num_cpu_blocks,
                                   build_offload_manager(config, self.executor.block_bytes(),
                                                         self.executor.tier_fingerprints),
                                   config.lora)
        self.lora_registry = LoRARegistry(config.lora, config.model.hf_config) if config.lora is not None else None
        self.kv_events = KVEventFeed(self.scheduler)  # the dashboard's feed: idle until a viewer subscribes
        self.multimodal = _multimodal_processor(config)  # a vision-language model's processor, else None
        self._use_tokenizer(tokenizer)
        self._asleep: set[str] = set()  # the sleep_mode.TAGS still asleep
        self._profiling = False
        self.speculator = (Speculator(config, self.executor.num_blocks, self.eos_token_ids)
                           if config.speculative is not None else None)
        self.counters = EngineCounters()
        self.step_times = StepTimes()
        self._last_log = time.time()
        self._log_window = [0, 0]  # prompt, generation tokens since the last log line

    def _use_tokenizer(self, tokenizer) -> None:
        """Builds everything that reads the tokenizer (input and output processing, grammars, beam search)."""
        config = self.config
        self.tokenizer = tokenizer
        self.eos_token_ids = _eos_ids(tokenizer, config.model)
        self.structured_output = StructuredOutputManager(tokenizer, config.model.vocab_size, self.eos_token_ids,
                                                         config.structured_output)
        self.sampler = Sampler(config.layer_ops, self.structured_output)
        self.output_processor = OutputProcessor(tokenizer)
        self.input_processor = InputProcessor(tokenizer, config.model.vocab_size, config.model.max_model_len,
                                              self.scheduler.check_fits, config.model.max_logprobs,
                                              self.eos_token_ids, config.scheduler.scheduling_policy,
                                              config.structured_output, self.multimodal)
        self.beam_search = BeamSearchManager(self.scheduler, tokenizer, config.model.max_model_len)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args.create_engine_config())

    def get_tokenizer(self):
        return self.tokenizer

    def set_tokenizer(self, tokenizer) -> None:
        """Replaces the tokenizer (prompts, detokenization, stop tokens, grammars); refused while
        requests are unfinished or with speculative decoding (its drafter holds the stop tokens)."""
        if self.has_unfinished_requests():
            raise RuntimeError("set_tokenizer() needs an idle engine: requests are unfinished")
        if self.speculator is not None:
            raise ValueError("set_tokenizer() cannot be combined with speculative_config")
        old = self.structured_output
        self._use_tokenizer(tokenizer)
        old.shutdown()

    def get_model_config(self):
        """The resolved model config (``ModelConfig``: path, dtype, max_model_len, hf_config, ...)."""
        return self.model_config

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None, cache_salt: str | None = None, priority: int = 0,
                    lora_request: LoRARequest | None = None, *, client_id: str | None = None) -> None:
        """Tokenizes, validates and queues a request (ValueError/TypeError before anything is queued).
        ``priority`` (scheduling_policy="priority" only): lower values are scheduled first;
        ``lora_request``: the adapter it runs with (an engine with ``enable_lora``).
        ``client_id``: who sent it; its grammar compile queues as that client's (one client's many
        compiles take turns with other clients' as one), default: the request is its own client."""
        self._check_new_id(request_id)
        processed = self.input_processor.process(request_id, prompt, params, arrival_time, cache_salt, priority,
                                                 lora_request=lora_request)
        self.add_processed_request(with_client(processed, client_id))

    def add_processed_request(self, processed: ProcessedRequest) -> None:
        """Queues a request the input processor already tokenized and validated (possibly on
        another thread: nothing here tokenizes, so the engine thread never waits on a prompt)."""
        self._check_new_id(processed.request_id)
        self._check_runner(processed.pooling is not None)
        self.check_lora(processed.lora_request)
        req = Request(processed.request_id, processed.prompt_token_ids, processed.params, self.eos_token_ids,
                      processed.arrival_time, cache_salt=processed.cache_salt, priority=processed.priority,
                      pooling=processed.pooling, mm_items=processed.mm_items, lora_request=processed.lora_request)
        req.pools_every_position = processed.pooling is not None and (
            self.config.pooler.pooling_type != "LAST" or pooling.per_token(processed.pooling))
        if processed.params.structured_outputs is not None:  # compiles on the pool; the request waits
            req.grammar = self.structured_output.grammar_for(processed.params.structured_outputs,
                                                             owner=processed.client_id or processed.request_id)
        self.scheduler.add_request(req)
        self.output_processor.add_request(processed.request_id, processed.prompt, processed.prompt_token_ids,
                                          processed.params)

    def add_pooling_request(self, request_id: str, prompt: PromptType, params: PoolingParams | None = None,
                            arrival_time: float | None = None, cache_salt: str | None = None,
                            priority: int = 0, lora_request: LoRARequest | None = None) -> None:
        """Queues a pooling request (``runner="pooling"``): ``step()`` returns an
        EmbeddingRequestOutput for it once its prompt is computed (task "embed"), a
        PoolingRequestOutput for the other tasks (``params.task``, engine/pooling.py)."""
        self._check_new_id(request_id)
        self.add_processed_request(self.process_pooling(self.input_processor, request_id, prompt, params,
                                                        arrival_time, cache_salt, priority, lora_request))

    def process_pooling(self, processor: InputProcessor, request_id: str, prompt: PromptType,
                        params: PoolingParams | None = None, arrival_time: float | None = None,
                        cache_salt: str | None = None, priority: int = 0,
                        lora_request: LoRARequest | None = None) -> ProcessedRequest:
        """A pooling request's prompt, tokenized and checked by ``processor`` (any thread's copy).

        Why a one-token generation: the scheduler, chunked prefill, preemption and tensor
        parallelism then need nothing new; the step that computes the prompt's last token samples
        one token (dropped) and hands the engine that position's hidden state (``_pool``)."""
        params = params or PoolingParams()
        if not isinstance(params, PoolingParams):
            raise TypeError(f"pooling params must be PoolingParams, got {type(params).__name__}")
        params = pooling.resolve_task(params, self.model_config)
        run = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, output_kind="final_only",
                             truncate_prompt_tokens=params.truncate_prompt_tokens)
        return processor.process(request_id, prompt, run, arrival_time, cache_salt, priority, pooling=params,
                                 lora_request=lora_request)

    def _check_runner(self, pooling: bool) -> None:
        runner = "generate" if self.config.pooler is None else "pooling"
        if pooling != (runner == "pooling"):
            what, use = (("an embedding", "runner='pooling'") if pooling else
                         ("a generation", "runner='generate' (the default)"))
            raise ValueError(f"this engine runs runner={runner!r}: {what} request needs an engine built with {use}")

    def add_beam_search(self, request_id: str, prompt: PromptType, params: BeamSearchParams,
                        arrival_time: float | None = None, priority: int = 0,
                        lora_request: LoRARequest | None = None) -> None:
        """Queues a beam search; its beams run in ordinary steps beside every other request.

        ``step()`` returns no RequestOutput for it; ``take_beam_search_output`` returns its
        beams once finished.
        """
        self._check_new_id(request_id)
        processed = self.process_beam_search(self.input_processor, request_id, prompt, params, arrival_time,
                                             priority=priority, lora_request=lora_request)
        self.add_processed_beam_search(processed, params)

    def process_beam_search(self, processor: InputProcessor, request_id: str, prompt: PromptType,
                            params: BeamSearchParams, arrival_time: float | None = None,
                            cache_salt: str | None = None, priority: int = 0,
                            lora_request: LoRARequest | None = None) -> ProcessedRequest:
        """A beam search's prompt, tokenized and checked by ``processor`` (any thread's copy:
        nothing here touches engine state), with the beams' own sampling params."""
        if self.speculator is not None:
            raise ValueError("beam search cannot be combined with speculative_config (its beams rank every "
                             "candidate of every step); start the engine without speculative_config")
        max_seqs = self.config.scheduler.max_num_seqs
        if params.beam_width > max_seqs:
            raise ValueError(f"beam_width={params.beam_width} exceeds max_num_seqs={max_seqs}")
        sp = BeamSearchManager.sampling_params(params, self.model_config.vocab_size)
        candidates, sp.logprobs = sp.logprobs, None  # internal rows: not bounded by max_logprobs
        processed = processor.process(request_id, prompt, sp, arrival_time, cache_salt, priority,
                                      lora_request=lora_request)
        processed.params.logprobs = candidates
        return processed

    def add_processed_beam_search(self, processed: ProcessedRequest, params: BeamSearchParams) -> None:
        """Queues a beam search ``process_beam_search`` prepared (on the engine's thread)."""
        self._check_new_id(processed.request_id)
        self._check_runner(False)
        self.check_lora(processed.lora_request)
        if params.max_tokens is None:  # the input processor filled in what max_model_len leaves
            params = dataclasses.replace(params, max_tokens=processed.params.max_tokens)
        req = Request(processed.request_id, processed.prompt_token_ids, processed.params, self.eos_token_ids,
                      processed.arrival_time, cache_salt=processed.cache_salt, priority=processed.priority,
                      mm_items=processed.mm_items, lora_request=processed.lora_request)
        self.scheduler.add_request(req)
        self.beam_search.add(req, params, self.eos_token_ids)

    def take_beam_search_output(self, request_id: str) -> BeamSearchOutput | None:
        """A finished beam search's beams, best first (handed out once); None while it runs."""
        return self.beam_search.take_output(request_id)

    def check_lora(self, lora_request: LoRARequest | None) -> None:
        """A request's adapter can run here: LoRA is enabled and the adapter fits the base model
        (checked once per adapter id, ValueError naming what is wrong)."""
        if lora_request is None:
            return
        if self.lora_registry is None:
            raise ValueError(f"lora_request={lora_request.lora_name!r} needs an engine started with enable_lora=True")
        self.lora_registry.check(lora_request)

    def _check_new_id(self, request_id: str) -> None:
        """Every way in checks here: a sleeping engine takes nothing, and ids are unique."""
        self.check_awake()
        if request_id in self.scheduler.sequences:
            raise ValueError(f"request_id={request_id!r} is already in use")

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults (vLLM's; plain
        SamplingParams() with ``generation_config="vllm"`` or when the model sets none)."""
        return SamplingParams(**dict(self.model_config.generation_defaults))

    def abort_request(self, request_id: str | Sequence[str]) -> None:
        """Stops a request (or several) at once and frees its KV blocks."""
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            if rid in self.scheduler.sequences:
                self.scheduler.abort(rid)
                self.counters.request_success["abort"] += 1
                self.scheduler.release(rid)
                self.output_processor.abort(rid)
                self.beam_search.abort(rid)
        self.kv_events.publish(self.counters.num_steps)  # freed between steps: viewers see it now

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return len(self.scheduler.sequences)

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        """Schedules, runs the model once, samples, and returns progress of every touched request."""
        if self.speculator is not None:  # drafts first: the scheduler runs them with each request's next token
            t = time.perf_counter()
            self.speculator.propose(self.scheduler.running)
            self.step_times.add(forward=time.perf_counter() - t)
        t0 = time.perf_counter()
        sched_out = self.scheduler.schedule()
        self._record_peaks()
        self.step_times.add(schedule=time.perf_counter() - t0)
        if sched_out.is_empty:
            self._wait_for_grammars()
        sampled = self._execute(sched_out)
        t2 = time.perf_counter()
        touched = self._apply(sampled)
        self._count(sched_out, sampled, touched)
        outputs = self._collect_outputs({r.parent_id for r in touched})
        self._publish_finished(outputs)
        if self.speculator is not None:
            self.speculator.retain(set(self.scheduler.requests))
        self.step_times.add(update=time.perf_counter() - t2, steps=1)
        self.counters.num_steps += 1
        if self.kv_events.listening:
            self.kv_events.publish(self.counters.num_steps, sched_out)
        self._maybe_log()
        return outputs

    def _publish_finished(self, outputs: list[RequestOutput]) -> None:
        """A producer (``kv_role`` producer / both): the blocks of the requests finished this step are
        written to the remote tier, and the writes awaited, before their last outputs leave: a
        prefill's response tells the router the decode replica will find them
        (kv_cache/offload/kv_transfer.py)."""
        offload = self.scheduler.kv.offload
        if offload is not None and offload.publishes_sync and any(o.finished for o in outputs):
            self.publish_tier_moves()

    def publish_tier_moves(self) -> None:
        """Carries out the tier moves queued since the last step (e.g. the blocks finished requests
        let go, bound for the remote tier) and waits for them. The async engine calls it as it goes
        idle: other replicas find those blocks without waiting for this engine's next step."""
        moves = self.scheduler.kv.take_tier_moves()
        if moves:
            self.executor.persist_kv_tiers(moves)

    def _apply(self, sampled: list[SampledTokens]) -> list[Request]:
        """Appends the step's tokens, finishing sequences on stops (stop strings included).

        A verified speculative run goes in one token per round, each round checked for stops
        before the next, so a run ends exactly where plain decoding would have stopped; then
        its rejected K/V is rolled back. Runs are trimmed to what was appended (for ``_count``).
        """
        rounds = split_rounds(sampled)
        touched = self.scheduler.update(self.beam_search.consume(rounds[0])) + self.scheduler.take_failed()
        self._apply_stop_strings(touched)
        appended = {r.request_id: 1 for r in touched}
        for later in rounds[1:]:
            more = self.scheduler.update(later)
            self._apply_stop_strings(more)
            for req in more:
                appended[req.request_id] = appended.get(req.request_id, 0) + 1
        touched = list({id(r): r for r in touched}.values())
        for s in sampled:
            if s.consecutive:
                self.scheduler.end_verification(s.request_id)
                n = appended.get(s.request_id, 0)
                s.token_ids, s.logprobs = s.token_ids[:n], s.logprobs[:n]
        return touched

    def _apply_stop_strings(self, touched: list[Request]) -> None:
        for req in touched:
            if self.output_processor.update_text(req) is not None:
                self.scheduler.finish(req.request_id, RequestStatus.FINISHED_STOPPED)

    def set_idle_wake(self, event: threading.Event | None) -> None:
        """``event`` ends ``step()``'s wait for a grammar (below) when set: the async engine's, so that
        a request or abort arriving while only grammar-bound requests wait is taken at once (each new
        request waited up to the whole wait while a big schema compiled)."""
        self._idle_wake = event

    def _wait_for_grammars(self) -> None:
        """Nothing could run: if requests wait for their grammars, wait (briefly) for one to
        compile instead of spinning through empty steps."""
        self.structured_output.wait_for_any(self.scheduler.waiting_grammars(), timeout=GRAMMAR_WAIT_S,
                                            wake=self._idle_wake)

    def _execute(self, sched_out: SchedulerOutput) -> list[SampledTokens]:
        if sched_out.is_empty:
            return []
        t0 = time.perf_counter()
        sched_out.return_hidden = self.config.pooler is not None
        span_owners, row_owners = self._pool_spans(sched_out) if sched_out.return_hidden else ([], [])
        result = self.executor.execute(sched_out)
        t1 = time.perf_counter()
        if result.span_sums is not None:
            self._accumulate(span_owners, result.span_sums)
        if result.span_rows is not None:
            self._collect_rows(row_owners, result.span_rows)
        if result.hidden is not None:
            self._pool(sched_out, result.hidden, result.logits)
        self.scheduler.finish_loads(result.tier_report)
        if sched_out.encoder_inputs:
            self.scheduler.encoder.record_encoder_time(result.encoder_time)
        logits, prepare = result.logits, result.prepare_time  # rank 0's share of execute()
        self.step_times.add(prepare=prepare, forward=t1 - t0 - prepare)
        num_sample_rows, num_prompt_rows = sched_out.num_sample_rows, sched_out.num_prompt_logprob_rows
        prompt_rows = logits[num_sample_rows:num_sample_rows + num_prompt_rows]
        sampled = self._sample(sched_out, logits[:num_sample_rows], prompt_rows)
        if sched_out.num_verify_rows:
            verify = logits[num_sample_rows + num_prompt_rows:]  # [sum of k + 1 per speculative chunk, vocab]
            sampled += self.speculator.verify(sched_out.chunks, verify, self.scheduler.requests)
        self.step_times.add(sample=time.perf_counter() - t1)
        return sampled

    def _pool_spans(self, sched_out: SchedulerOutput) -> tuple[list[tuple[Request, bool]], list[RowSpan]]:
        """MEAN / CLS pooling: the token rows of this step each such request needs summed (all of a
        chunk's for MEAN, position 0's for CLS) as ``sched_out.pool_spans``; per-token tasks: all
        of a chunk's rows, whole, as ``sched_out.pool_rows``. Returns, for the sums and for the
        rows, each span's request and whether the span starts its prompt (a recomputed request
        starts over); for the rows, also the span's length."""
        kind, sums, rows, offset = self.config.pooler.pooling_type, [], [], 0
        for chunk in sched_out.chunks:
            req = self.scheduler.requests[chunk.request_id]
            if req.pools_every_position and pooling.per_token(req.pooling):
                sched_out.pool_rows.append((offset, chunk.num_new_tokens))
                rows.append((req, chunk.start == 0, chunk.num_new_tokens))
            elif req.pools_every_position and (kind == "MEAN" or chunk.start == 0):
                sched_out.pool_spans.append((offset, chunk.num_new_tokens if kind == "MEAN" else 1))
                sums.append((req, chunk.start == 0))
            offset += chunk.num_new_tokens
        return sums, rows

    @staticmethod
    def _accumulate(owners: list[tuple[Request, bool]], sums: torch.Tensor) -> None:
        for (req, first), total in zip(owners, sums.cpu()):
            req.pool_acc = total if first or req.pool_acc is None else req.pool_acc + total

    @staticmethod
    def _collect_rows(owners: list[RowSpan], rows: torch.Tensor) -> None:
        """Per-token tasks: appends each span's rows to its request's (``rows``: the spans' rows in order)."""
        start = 0
        for req, first, n in owners:
            part = rows[start:start + n].cpu()
            req.pool_acc = part if first or req.pool_acc is None else torch.cat([req.pool_acc, part])
            start += n

    def _pool(self, sched_out: SchedulerOutput, hidden: torch.Tensor, logits: torch.Tensor) -> None:
        """A pooling request's sampling row is its prompt's last position: there its vector is
        done. LAST: that row's final-normed hidden state (``hidden``: the rows logits came from);
        MEAN: the accumulated rows over the prompt's length; CLS: position 0's row. A sequence
        classifier's row is that position's class logits (its head is the model's
        ``compute_logits``). ``pooling.finish`` makes it the request's result (normalized, or
        through the classifier's activation)."""
        row, classifier = 0, self.model_config.is_classifier
        for chunk in sched_out.chunks:
            req = self.scheduler.requests[chunk.request_id]
            if chunk.num_samples and req.pooling is not None:
                vec = (req.pool_acc if pooling.per_token(req.pooling)  # [prompt tokens, num_labels or hidden]
                       else logits[row] if classifier else self._pooled(req, hidden[row]))  # [num_labels] / [hidden]
                req.embedding = pooling.finish(vec, req.pooling, self.model_config, self.config.pooler).cpu().tolist()
            row += chunk.num_samples

    def _pooled(self, req: Request, last_row: torch.Tensor) -> torch.Tensor:
        kind = self.config.pooler.pooling_type
        if kind == "LAST":
            return last_row.float()
        return req.pool_acc / req.num_prompt_tokens if kind == "MEAN" else req.pool_acc

    def _sample(self, sched_out: SchedulerOutput, logits: torch.Tensor,
                prompt_logits: torch.Tensor) -> list[SampledTokens]:
        """Samples the step's rows and records its prompt logprobs, fetching both results in one
        device->host transfer."""
        rows, owners = self._sampling_rows(sched_out)
        prompt = prompt_logprobs.plan(sched_out, self.scheduler.requests)
        # the step's one upload: the sampler's inputs with the prompt-logprob targets
        inputs = self.sampler.prepare(logits, rows, prompt_logprobs.host_arrays(prompt)) if rows else None
        uploaded = inputs.tensors if inputs else None
        pending = prompt_logprobs.device_tensors(prompt_logits, prompt, uploaded) if prompt else {}
        if rows:
            pending.update(self.sampler.sample(logits, rows, inputs))
        host = to_host(pending) if pending else {}  # a step with nothing to sample fetches nothing
        if prompt:
            prompt_logprobs.store(prompt, host)
        if not rows:
            return []
        result = self.sampler.finish(host, rows)
        sampled, i = [], 0
        for rid, n in owners:
            tops = result.top_logprobs[i:i + n] if result.top_logprobs else None
            sampled.append(SampledTokens(rid, result.token_ids[i:i + n], result.logprobs[i:i + n], tops))
            i += n
        return sampled

    def _sampling_rows(self, sched_out: SchedulerOutput):
        rows, owners = [], []
        for chunk in sched_out.chunks:
            if not chunk.num_samples:
                continue
            req = self.scheduler.requests[chunk.request_id]
            gens = [req.generator] + req.fork_generators[: chunk.num_samples - 1]
            banned = self._banned(req)
            for gen in gens:
                rows.append(SamplingRow(req.params, req.all_token_ids, req.num_prompt_tokens, gen, banned,
                                        req.grammar))
            owners.append((req.request_id, chunk.num_samples))
        return rows, owners

    def _banned(self, req: Request) -> tuple[int, ...]:
        """EOS and stop token ids are masked until ``min_tokens`` tokens have been generated."""
        if req.num_output_tokens >= req.params.min_tokens:
            return ()
        return tuple(self.eos_token_ids) + tuple(req.params.stop_token_ids)

    def _collect_outputs(self, parent_ids: set[str]) -> list[RequestOutput]:
        outputs = []
        for pid in sorted(parent_ids, key=lambda p: self.scheduler.requests[p].arrival_time
                          if p in self.scheduler.requests else 0):
            seqs = [self.scheduler.requests[s] for s in self.scheduler.sequences.get(pid, [])]
            if not seqs:
                continue
            finished = self.scheduler.is_done(pid)
            out = self.output_processor.make_output(pid, sorted(seqs, key=lambda s: s.index), finished)
            if out is not None and seqs[0].pooling is not None:
                out = _embedding_output(out, seqs[0])
            if finished:
                for s in seqs:
                    self.counters.request_success[s.finish_reason] += 1
                self.scheduler.release(pid)
            if out is not None:
                outputs.append(out)
        return outputs

    # ------------------------------------------------------------------ stats
    def _record_peaks(self) -> None:
        """Right after scheduling, before finished requests free their blocks."""
        snap, c = self.scheduler.make_stats(), self.counters
        c.peak_used_blocks = max(c.peak_used_blocks, snap.num_used_blocks)
        c.peak_running = max(c.peak_running, snap.num_running)

    def _count(self, sched_out: SchedulerOutput, sampled: list[SampledTokens], touched: list[Request]) -> None:
        self.counters.prompt_tokens += sum(r.num_prompt_tokens for r in touched
                                           if r.index == 0 and r.num_output_tokens == 1)
        prompt = 0
        for c in sched_out.chunks:
            req = self.scheduler.requests.get(c.request_id)
            if req is not None and c.start < req.num_prompt_tokens:
                prompt += min(c.seq_len, req.num_prompt_tokens) - c.start
        gen = 0 if self.config.pooler is not None else sum(len(s.token_ids) - s.token_ids.count(NO_TOKEN)
                                                           for s in sampled)  # pooling: its tokens are dropped
        if sched_out.chunks:
            self.counters.iteration_tokens.observe(sched_out.num_tokens)
        self.counters.prompt_tokens_computed += prompt
        self.counters.generation_tokens += gen
        self._log_window[0] += prompt
        self._log_window[1] += gen

    def _maybe_log(self) -> None:
        interval = self.config.log_stats_interval
        now = time.time()
        if not interval or now - self._last_log < interval:
            return
        elapsed, (p, g) = now - self._last_log, self._log_window
        s, q = self.get_kv_cache_stats(), self.scheduler.make_stats()
        logger.info("Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                    "Running: %d reqs, Swapped: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, "
                    "CPU KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
                    p / elapsed, g / elapsed, q.num_running, q.num_swapped, q.num_waiting,
                    100 * s.usage, 100 * s.cpu_usage, 100 * s.prefix_cache_hit_rate)
        self._last_log, self._log_window = now, [0, 0]

    def get_kv_cache_stats(self) -> KVCacheStats:
        return self.scheduler.kv_cache_stats()

    def get_metrics(self) -> list[Metric]:
        s, c, q = self.get_kv_cache_stats(), self.counters, self.scheduler.make_stats()
        metrics = [
            Metric("pagedllm:num_requests_running", q.num_running),
            Metric("pagedllm:num_requests_waiting", q.num_waiting),
            Metric("pagedllm:num_requests_swapped", q.num_swapped),
            Metric("pagedllm:kv_cache_usage_perc", s.usage),
            Metric("pagedllm:cpu_kv_cache_usage_perc", s.cpu_usage),
            Metric("pagedllm:prefix_cache_queries", s.prefix_cache_queries, kind="counter"),
            Metric("pagedllm:prefix_cache_hits", s.prefix_cache_hits, kind="counter"),
            Metric("pagedllm:num_preemptions", s.num_preemptions, kind="counter"),
            Metric("pagedllm:prompt_tokens", c.prompt_tokens, kind="counter"),
            Metric("pagedllm:generation_tokens", c.generation_tokens, kind="counter"),
            Metric("pagedllm:cache_config_info", 1, self._cache_config_labels(), kind="info"),
            Metric("pagedllm:iteration_tokens_total", c.iteration_tokens.total, kind="histogram",
                   buckets=c.iteration_tokens.cumulative()),
        ]
        metrics += [Metric("pagedllm:request_success", v, {"finished_reason": k}, "counter")
                    for k, v in c.request_success.items()]
        metrics += [Metric("pagedllm:num_preemptions_by_mode", v, {"mode": k}, "counter")
                    for k, v in s.preemptions_by_mode.items()]
        if self.speculator is not None:
            metrics += self.speculator.metrics()
        metrics += self.structured_output.metrics()
        if self.multimodal is not None:
            metrics += self.scheduler.encoder.metrics()
            metrics += self.multimodal.cache.metrics() if self.multimodal.cache is not None else []
        if self.scheduler.lora_slots is not None:
            metrics += self._lora_metrics()
        return metrics + offload_metrics(s.offload)

    def _lora_metrics(self) -> list[Metric]:
        """vLLM's ``lora_requests_info`` (a gauge of the time, its labels the adapters of running and
        waiting requests), and the slot pool's loads, hits and evictions."""
        sched, stats = self.scheduler, self.scheduler.lora_slots.stats

        def names(queue) -> str:
            return ",".join(sorted({r.lora_request.lora_name for r in queue if r.lora_request is not None}))
        labels = {"running_lora_adapters": names(sched.running), "waiting_lora_adapters": names(sched.waiting),
                  "max_lora": str(self.config.lora.max_loras)}
        return [Metric("pagedllm:lora_requests_info", time.time(), labels),
                Metric("pagedllm:lora_loads", stats.loads, kind="counter"),
                Metric("pagedllm:lora_hits", stats.hits, kind="counter"),
                Metric("pagedllm:lora_evictions", stats.evictions, kind="counter")]

    def _cache_config_labels(self) -> dict[str, str]:
        cache = self.config.cache
        return {"block_size": str(cache.block_size), "num_gpu_blocks": str(self.executor.num_blocks),
                "num_cpu_blocks": str(self.executor.num_cpu_blocks), "cache_dtype": str(cache.cache_dtype),
                "enable_prefix_caching": str(cache.enable_prefix_caching)}

    def reset_prefix_cache(self, reset_disk: bool = False) -> bool:
        """Forgets every cached prefix in the device pool and the CPU tier, and with ``reset_disk``
        this engine's disk-tier entries; refused (False) while any request holds blocks."""
        if not self.scheduler.reset_prefix_cache():
            return False
        self.kv_events.publish(self.counters.num_steps)
        self.executor.sync_kv_tiers(reset_disk)
        return True

    def flush_kv_tiers(self) -> None:
        """Returns once every KV block queued for the disk or remote tier is there, on every rank (evicted
        blocks are written in the background; until then a lookup misses them). Moves the scheduler
        queued since the last step (e.g. finished requests' blocks bound for the remote tier) are
        carried out first."""
        self.publish_tier_moves()
        self.executor.sync_kv_tiers()

    # ------------------------------------------------------------------ sleep mode, RPC, profiling
    def sleep(self, level: int = 1) -> None:
        """Frees the KV pool on every rank (cached prefixes are forgotten) and offloads the weights
        to host memory (level 1; on the CPU they are there already) or discards them (level 2:
        ``wake_up`` gives them uninitialized storage, to be filled by a weight update through
        ``collective_rpc``, e.g. ``"reload_weights"`` or ``"load_weights"``). Until ``wake_up``
        every new request raises EngineSleepingError. Needs ``enable_sleep_mode=True`` and an idle
        engine (vLLM's contract: let the requests finish, or abort them, first)."""
        level = sleep_mode.check_level(level)
        self._check_sleep_mode()
        if self.has_unfinished_requests():
            raise RuntimeError(f"sleep() needs an idle engine: {self.get_num_unfinished_requests()} request(s) "
                               "are unfinished; wait for them or abort them first")
        self.scheduler.reset_prefix_cache()  # the pool's contents are about to go
        self.executor.sleep(level)
        self._asleep = set(sleep_mode.TAGS)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Brings back what ``sleep`` freed: ``tags`` None for everything, or some of "weights"
        and "kv_cache" (vLLM's: wake the weights, update them, then the KV cache, so both are never
        allocated beside a training step's memory). The KV pool comes back empty, with as many blocks."""
        tags = sleep_mode.check_tags(tags)
        self._check_sleep_mode()
        self.executor.wake_up(tags)
        self._asleep -= set(tags)

    def is_sleeping(self) -> bool:
        """True from ``sleep`` until everything is awake again."""
        return bool(self._asleep)

    def check_awake(self) -> None:
        """Raises EngineSleepingError while asleep (any part): no request can run then."""
        if self._asleep:
            raise EngineSleepingError(f"the engine is asleep ({', '.join(sorted(self._asleep))} released): "
                                      "call wake_up() before sending requests")

    def _check_sleep_mode(self) -> None:
        if not self.model_config.enable_sleep_mode:
            raise ValueError("sleep mode is off: build the engine with enable_sleep_mode=True "
                             "(the server: --enable-sleep-mode)")

    def collective_rpc(self, method: str | Callable, timeout: float | None = None, args: tuple = (),
                       kwargs: dict | None = None) -> list:
        """Runs ``method`` on every rank's ModelRunner (a method name, or a callable taking the
        runner as its first argument) and returns each rank's result, in rank order (see
        ``Executor.collective_rpc`` for errors and ``timeout``). After a weight update by name
        (``load_weights``, ``update_weights``, ``reload_weights``) the cached prefixes are
        forgotten; after a callable that changes weights, call ``reset_prefix_cache()``."""
        if isinstance(method, str) and not callable(getattr(ModelRunner, method, None)):
            raise ValueError(f"method={method!r} is not a ModelRunner method (e.g. 'load_weights', "
                             "'update_weights', 'reload_weights'); pass a callable to run your own code")
        if not isinstance(method, str) and not callable(method):
            raise TypeError(f"method must be a method name or a callable, got {type(method).__name__}")
        results = self.executor.collective_rpc(method, timeout, args, kwargs or {})
        if isinstance(method, str) and method in _WEIGHT_UPDATES and not self.reset_prefix_cache():
            logger.warning("%s: requests still hold KV blocks computed with the old weights", method)
        return results

    def start_profile(self) -> None:
        """Starts the torch profiler on every rank; ``stop_profile`` writes one trace per rank into
        ``PAGEDLLM_TORCH_PROFILER_DIR`` (or vLLM's ``VLLM_TORCH_PROFILER_DIR``)."""
        directory = envs.PAGEDLLM_TORCH_PROFILER_DIR or envs.VLLM_TORCH_PROFILER_DIR
        if not directory:
            raise RuntimeError("profiling is off: set PAGEDLLM_TORCH_PROFILER_DIR (or VLLM_TORCH_PROFILER_DIR) to "
                               "the directory for the traces before starting the engine")
        if self._profiling:
            raise RuntimeError("the profiler is already running; call stop_profile() first")
        self.executor.start_profile(os.path.abspath(directory))
        self._profiling = True

    def stop_profile(self) -> None:
        """Stops the profiler; every rank writes its trace (``*.pt.trace.json``, Chrome's format)."""
        if not self._profiling:
            raise RuntimeError("the profiler is not running; call start_profile() first")
        self._profiling = False
        self.executor.stop_profile()

    def health_error(self) -> str | None:
        """Why this engine can no longer step (e.g. a tensor-parallel worker died), or None."""
        return self.executor.health_error()

    def shutdown(self) -> None:
        """Stops the executor's ranks (worker processes, process group), frees the KV pool and the
        weights, and stops the grammar compiler's threads; idempotent. Later steps raise RuntimeError.
        With a KV disk tier, the cached prefixes still in the device pool or the CPU tier are written
        to disk first, so a restart finds them."""
        ops = self.scheduler.persist_ops()
        if ops and self.executor.health_error() is None:
            self.executor.persist_kv_tiers(ops)
        self.executor.shutdown()
        self.structured_output.shutdown()
        if self.speculator is not None:
            self.speculator.shutdown()


def _check_sleep_mode_fits(config: EngineConfig) -> None:
    """Sleep mode frees the pool and the weights of the target model on every rank: what else
    points into them is refused."""
    if not config.model.enable_sleep_mode:
        return
    if tiers_enabled(config.cache):
        raise ValueError("enable_sleep_mode=True cannot be combined with KV tiers (kv_offload_cpu_gb, "
                         "kv_offload_dir, kv_offload_remote): their copies point into the pool that sleep frees")
    if config.speculative is not None:
        raise ValueError("enable_sleep_mode=True cannot be combined with speculative_config: the draft model's "
                         "weights and pool do not sleep")




def _load_tokenizer(model_config):
    """tokenizer_mode "slow" asks for the Python tokenizer (vLLM's use_fast=False) and refuses a fast one:
    transformers 5 ignores use_fast and has a Python tokenizer for few models."""
    from transformers import AutoTokenizer
    slow = model_config.tokenizer_mode == "slow"
    tokenizer = AutoTokenizer.from_pretrained(model_config.tokenizer, use_fast=not slow,
                                              trust_remote_code=model_config.trust_remote_code)
    if slow and tokenizer.is_fast:
        raise ValueError(f"tokenizer_mode='slow' but {model_config.tokenizer!r} has no slow (Python) tokenizer "
                         f"here (got {type(tokenizer).__name__}); use tokenizer_mode='auto'")
    return tokenizer


def _multimodal_processor(config: EngineConfig) -> MultiModalProcessor | None:
    """A vision-language model's HF processor with the engine's limits (None for a text-only model)."""
    mc = config.model
    if not getattr(get_model_class(mc.architecture), "is_multimodal", False):
        for name, value in (("limit_mm_per_prompt", mc.limit_mm_per_prompt),
                            ("mm_processor_kwargs", mc.mm_processor_kwargs)):
            if value:
                raise ValueError(f"{name}={dict(value)!r} needs a vision-language model; {mc.architecture} is "
                                 "text-only")
        return None
    if config.parallel.pipeline_parallel_size > 1:
        raise ValueError(f"{mc.architecture} is a vision-language model: pipeline_parallel_size > 1 is not "
                         "supported for it (use tensor parallelism)")
    hf = mc.hf_config
    image_token_id = getattr(hf, "image_token_id", None)
    image_token_id = image_token_id if image_token_id is not None else hf.image_token_index
    limits = MultiModalLimits(mc.limit_mm_per_prompt, mc.mm_processor_kwargs, config.scheduler.max_num_batched_tokens,
                              mc.language_model_only)
    model_cls = get_model_class(mc.architecture)
    return MultiModalProcessor.from_pretrained(mc.tokenizer, image_token_id, limits,
                                               functools.partial(model_cls.image_rows, hf), mc.trust_remote_code,
                                               image_layout(model_cls, hf),
                                               ProcessorCache.from_gb(mc.mm_processor_cache_gb))


def _eos_ids(tokenizer, model_config) -> frozenset[int]:
    ids = set()
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    gen_eos = getattr(model_config.hf_config, "eos_token_id", None)
    try:
        from transformers import GenerationConfig
        gen_eos = GenerationConfig.from_pretrained(model_config.model).eos_token_id
    except Exception:  # no generation_config.json: the model config's eos stands
        pass
    ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
    return frozenset(ids)


def _embedding_output(out: RequestOutput, req: Request) -> EmbeddingRequestOutput | PoolingRequestOutput:
    """A finished pooling request's output: its result instead of its (dropped) token, an
    EmbeddingRequestOutput for task "embed", else a PoolingRequestOutput. An aborted one (no
    result) reports an empty vector."""
    metrics = out.metrics and dataclasses.replace(out.metrics, num_generation_tokens=0, max_num_generation_tokens=0)
    if req.pooling.task != "embed":
        data = torch.tensor(req.embedding or [], dtype=torch.float32)
        return PoolingRequestOutput(out.request_id, PoolingOutput(data), out.prompt_token_ids, out.finished, metrics)
    return EmbeddingRequestOutput(out.request_id, EmbeddingOutput(req.embedding or []), out.prompt_token_ids,
                                  out.finished, metrics)

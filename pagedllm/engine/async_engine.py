"""An asyncio front end to LLMEngine: one engine thread steps, each request streams its outputs.

Threading model: the LLMEngine is owned by a single dedicated engine thread. Every engine
mutation (add, abort) and every read of engine state (stats, metrics) is an *op* put on a
thread-safe queue and run by that thread between two ``step()`` calls, so nothing needs a lock
and the event loop never waits for a forward pass. Results come back to the event loop with
``call_soon_threadsafe``: op results resolve asyncio futures, step outputs go to per-request
asyncio queues.

Prompts are tokenized and validated *before* they reach the engine thread, on a small pool of
tokenizer threads (each with its own tokenizer copy), so a huge prompt delays only itself and
the engine loop only ever receives processed requests. Outputs arrive already shaped in the
request's ``output_kind`` (the engine's output processor is the one accumulator); each carries
its per-step latency record for the observers.
"""
from __future__ import annotations

import asyncio
import copy
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from pagedllm.config import ModelConfig
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.input_processor import InputProcessor, ProcessedRequest, with_client
from pagedllm.engine.llm_engine import LLMEngine, PromptType
from pagedllm.kv_cache.events import Subscription
from pagedllm.lora.request import LoRARequest
from pagedllm.metrics.stats import KVCacheStats, Metric
from pagedllm.outputs import RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import BeamSearchParams, SamplingParams

logger = logging.getLogger(__name__)

# prompts tokenized at once; the work per prompt is bounded (InputProcessor), so a few threads
# keep small requests flowing past large ones without one tokenizer copy per request
_TOKENIZER_THREADS = 4


class EngineDeadError(RuntimeError):
    """The engine loop stopped (crashed or shut down); no request can make progress."""


class OutputObserver(Protocol):
    """Receives every output as it leaves the engine (for metrics); ``out.metrics`` carries the
    request's per-step latencies since its previous output."""

    def observe(self, out: RequestOutput) -> None: ...


class RequestStream:
    """The outputs of one request, in its output_kind, as an asyncio queue. Several streams may
    share one ``queue`` (the requests of one HTTP request): its reader tells the outputs apart by
    ``request_id`` and iterates the queue itself, not the streams."""

    def __init__(self, request_id: str, queue: asyncio.Queue | None = None):
        self.request_id = request_id
        self.queue: asyncio.Queue[RequestOutput | BaseException] = queue if queue is not None else asyncio.Queue()
        self.finished = False  # the engine has released the request: no abort needed

    def put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, RequestOutput) and item.finished or isinstance(item, BaseException):
            self.finished = True
        self.queue.put_nowait(item)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while True:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finished:
                return


class AsyncLLMEngine:
    """Runs an LLMEngine on a background thread and serves requests as async generators.

    Call ``start()`` from inside the event loop that will consume outputs (the server does it
    at start-up), ``generate()`` per request, and ``shutdown()`` at exit. If ``step()`` raises,
    the engine is dead: every in-flight request and every later call raises EngineDeadError
    and ``is_healthy`` is False.
    """

    def __init__(self, engine: LLMEngine, observers: list[OutputObserver] | None = None):
        self.engine = engine
        self.observers = list(observers or [])
        self._ops: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()  # set by every op queued for the engine thread (and by a finished compile)
        engine.set_idle_wake(self._wake)  # an op never waits out step()'s wait for a grammar
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.dead_error: EngineDeadError | None = None
        self._tokenizer_pool = ThreadPoolExecutor(_TOKENIZER_THREADS, thread_name_prefix="pagedllm-tokenize")
        self._processors: queue.SimpleQueue[InputProcessor] = queue.SimpleQueue()  # idle per-thread copies
        self._beams: dict[str, ProcessedRequest] = {}  # beam searches running (engine thread only)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> AsyncLLMEngine:
        return cls(LLMEngine.from_engine_args(args))

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Starts the engine thread; outputs are delivered to the running event loop."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="pagedllm-engine", daemon=True)
        self._thread.start()

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the engine thread and fails whatever is still in flight."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout)
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)
        self._fail_everything(EngineDeadError("the server is shutting down"))
        if self._thread is None or not self._thread.is_alive():  # a step still running owns the engine
            self.engine.shutdown()  # tensor-parallel workers end with the server

    @property
    def is_healthy(self) -> bool:
        alive = self.dead_error is None and self._thread is not None and self._thread.is_alive()
        return alive and self.engine.health_error() is None  # a dead TP worker shows before the next step

    # ------------------------------------------------------------------ requests
    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                          arrival_time: float | None = None, *, cache_salt: str | None = None,
                          priority: int = 0, client_id: str | None = None,
                          lora_request: LoRARequest | None = None) -> RequestStream:
        """Tokenizes and validates the request on a tokenizer thread (raises ValueError on bad
        input), then queues it on the engine thread; returns its stream. ``client_id``: as
        ``LLMEngine.add_request``'s (the server passes the HTTP client's)."""
        return (await self.add_requests([(request_id, prompt)], params, arrival_time,
                                        cache_salt=cache_salt, priority=priority, client_id=client_id,
                                        lora_request=lora_request))[0]

    async def add_requests(self, requests: list[tuple[str, PromptType]], params: SamplingParams,
                           arrival_time: float | None = None,
                           queue: asyncio.Queue | None = None, *, cache_salt: str | None = None,
                           priority: int = 0, client_id: str | None = None,
                           lora_request: LoRARequest | None = None) -> list[RequestStream]:
        """``add_request`` for a batch of ``(request_id, prompt)`` with one tokenizer-thread job and
        one engine-thread op for all of them: each hop costs the event loop tens of microseconds,
        which, per prompt, held it (and ``/health``) for seconds on a request of 100k prompts.
        Raises the first invalid prompt's error (in order); none of the batch stays queued then.
        ``queue``: one queue shared by the batch's streams (see ``RequestStream``); ``lora_request``:
        the adapter all of them run with (an engine with ``enable_lora``)."""
        return await self._add_streams(requests, queue, lambda proc: [
            with_client(proc.process(rid, prompt, params, arrival_time, cache_salt, priority,
                                     lora_request=lora_request), client_id)
            for rid, prompt in requests], self._add_processed)

    async def _add_streams(self, requests: list[tuple[str, PromptType]], queue: asyncio.Queue | None,
                           process: Callable[[InputProcessor], list[ProcessedRequest]],
                           add: Callable[[list[ProcessedRequest]], None]) -> list[RequestStream]:
        """Registers the requests' streams, runs ``process`` on a tokenizer thread and ``add`` on
        the engine thread; on any error none of them stays queued."""
        self.engine.check_awake()  # early, before tokenizing (the engine thread checks again)
        for request_id, _ in requests:
            if request_id in self._streams:
                raise ValueError(f"request_id={request_id!r} is already in use")
        streams = [RequestStream(request_id, queue) for request_id, _ in requests]
        for stream in streams:  # registered first: reserves the ids, no output can be missed
            self._streams[stream.request_id] = stream
        try:
            processed = await self._on_tokenizer_thread(process)
            await self._call(add, processed)
        except BaseException:
            for stream in streams:
                self.abort(stream.request_id)  # queued after the add, so a late add is undone too
            raise
        return streams

    def _add_processed(self, processed: list[ProcessedRequest]) -> None:
        for p in processed:  # on the engine thread
            self.engine.add_processed_request(p)

    async def add_pooling_requests(self, requests: list[tuple[str, PromptType]], params: PoolingParams,
                                   arrival_time: float | None = None, queue: asyncio.Queue | None = None, *,
                                   cache_salt: str | None = None, priority: int = 0,
                                   lora_request: LoRARequest | None = None) -> list[RequestStream]:
        """``add_requests`` for embeddings (``runner="pooling"``): each stream gets one
        EmbeddingRequestOutput."""
        return await self._add_streams(requests, queue, lambda proc: [
            self.engine.process_pooling(proc, rid, prompt, params, arrival_time, cache_salt, priority, lora_request)
            for rid, prompt in requests], self._add_processed)

    async def add_beam_searches(self, requests: list[tuple[str, PromptType]], params: BeamSearchParams,
                                arrival_time: float | None = None, queue: asyncio.Queue | None = None, *,
                                cache_salt: str | None = None, priority: int = 0,
                                lora_request: LoRARequest | None = None) -> list[RequestStream]:
        """``add_requests`` for beam searches: each stream gets one finished RequestOutput, its
        beams best first (``BeamSearchOutput.as_request_output``), when the search ends."""
        return await self._add_streams(requests, queue, lambda proc: [
            self.engine.process_beam_search(proc, rid, prompt, params, arrival_time, cache_salt, priority,
                                            lora_request)
            for rid, prompt in requests], lambda processed: self._add_beams(processed, params))

    def _add_beams(self, processed: list[ProcessedRequest], params: BeamSearchParams) -> None:
        for p in processed:  # on the engine thread
            self.engine.add_processed_beam_search(p, params)
            self._beams[p.request_id] = p

    def _finished_beams(self) -> list[RequestOutput]:
        """The beam searches that ended this step, as RequestOutputs (engine thread)."""
        done = []
        for rid, p in list(self._beams.items()):
            out = self.engine.take_beam_search_output(rid)
            if out is not None:
                del self._beams[rid]
                done.append(out.as_request_output(rid, p.prompt, p.prompt_token_ids))
        return done

    async def generate(self, prompt: PromptType, params: SamplingParams,
                       request_id: str, arrival_time: float | None = None, *,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yields the request's outputs; closing or cancelling the generator aborts it."""
        stream = await self.add_request(request_id, prompt, params, arrival_time, priority=priority)
        async with self.aborting_on_exit(stream):
            async for out in stream:
                yield out

    def aborting_on_exit(self, stream: RequestStream) -> _AbortOnExit:
        """Context manager: on exit, forgets the stream and aborts the request unless finished."""
        return _AbortOnExit(self, stream)

    def abort(self, request_id: str) -> None:
        """Aborts a request; its KV blocks are freed before the engine's next step."""
        stream = self._forget(request_id)
        if stream is None or stream.finished:
            return  # finished, failed, or already aborted
        self._submit(self._abort, (request_id,), None)

    def _abort(self, request_id: str) -> None:
        self.engine.abort_request(request_id)  # on the engine thread
        self._beams.pop(request_id, None)

    def _forget(self, request_id: str) -> RequestStream | None:
        return self._streams.pop(request_id, None)

    # ------------------------------------------------------------------ input processing
    async def process_input(self, request_id: str, prompt: PromptType, params: SamplingParams,
                            arrival_time: float | None = None) -> ProcessedRequest:
        """The engine's input processing, run on a tokenizer thread (never the engine thread)."""
        return await self._on_tokenizer_thread(
            lambda proc: proc.process(request_id, prompt, params, arrival_time))

    async def encode(self, text: str, *, add_special_tokens: bool = True, field: str = "prompt") -> list[int]:
        """Token ids of a prompt text with the engine's length bound (``InputProcessor.encode``),
        on a tokenizer thread; ValueError names ``field``."""
        return await self._on_tokenizer_thread(
            lambda proc: proc.encode(text, add_special_tokens=add_special_tokens, field=field))

    async def with_tokenizer(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(tokenizer)`` on a tokenizer thread, with that thread's own tokenizer copy: long
        tokenizer work (the server's /tokenize, /detokenize and chat templates) never holds the
        event loop, where every stream and /health wait for it."""
        return await self._on_tokenizer_thread(lambda proc: fn(proc.tokenizer))

    async def _on_tokenizer_thread(self, fn: Callable[[InputProcessor], Any]) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, self._with_processor, fn)

    def _with_processor(self, fn: Callable[[InputProcessor], Any]) -> Any:
        """Runs ``fn`` with an idle processor copy (made on first need: at most one per thread)."""
        try:
            proc = self._processors.get_nowait()
        except queue.Empty:
            proc = self.engine.input_processor.clone()
        try:
            return fn(proc)
        finally:
            self._processors.put(proc)

    @property
    def model_config(self) -> ModelConfig:
        return self.engine.model_config

    async def get_model_config(self) -> ModelConfig:
        return self.engine.model_config

    def get_tokenizer(self):
        """A copy of the engine's tokenizer for the caller's thread (a fast tokenizer must not be
        shared with the engine thread, which detokenizes concurrently)."""
        return copy.deepcopy(self.engine.tokenizer)

    # ------------------------------------------------------------------ sleep mode, RPC, profiling
    async def sleep(self, level: int = 1) -> None:
        """``LLMEngine.sleep`` on the engine thread (refused while requests are in flight)."""
        await self._call(self.engine.sleep, level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self._call(self.engine.wake_up, tags)

    async def is_sleeping(self) -> bool:
        return await self._read(self.engine.is_sleeping)

    async def collective_rpc(self, method: str | Callable, timeout: float | None = None, args: tuple = (),
                             kwargs: dict | None = None) -> list:
        """``LLMEngine.collective_rpc`` between two steps (every rank's result, in rank order)."""
        return await self._call(self.engine.collective_rpc, method, timeout, args, kwargs)

    async def start_profile(self) -> None:
        await self._call(self.engine.start_profile)

    async def stop_profile(self) -> None:
        await self._call(self.engine.stop_profile)

    async def reset_prefix_cache(self, reset_disk: bool = False) -> bool:
        """``LLMEngine.reset_prefix_cache`` between two steps; False while requests hold blocks."""
        return await self._call(self.engine.reset_prefix_cache, reset_disk)

    # ------------------------------------------------------------------ reads
    async def get_kv_cache_stats(self) -> KVCacheStats:
        return await self._read(self.engine.get_kv_cache_stats)

    async def check_lora(self, lora_request: LoRARequest) -> None:
        """``LLMEngine.check_lora`` on the engine thread (ValueError naming what is wrong)."""
        await self._read(lambda: self.engine.check_lora(lora_request))

    async def get_metrics(self) -> list[Metric]:
        return await self._read(self.engine.get_metrics)

    async def get_kv_snapshot(self) -> dict:
        """The block pool, block tables and queues now (``engine/kv_events.py``), between two steps."""
        return await self._read(lambda: self.engine.kv_events.snapshot(self.engine.counters.num_steps))

    async def subscribe_kv_events(self, maxlen: int) -> tuple[Subscription, dict]:
        """A bounded queue of per-step KV events and the snapshot they start from; ``close()`` it when done."""
        return await self._call(lambda: self.engine.kv_events.subscribe(maxlen, self.engine.counters.num_steps))

    async def _read(self, fn: Callable[[], Any]) -> Any:
        """A read of engine state: on the engine thread while it runs, directly once it has stopped."""
        if self.is_healthy:
            return await self._call(fn)
        return fn()  # no engine thread left to race with (not started, stopped, or dead)

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    # ------------------------------------------------------------------ ops
    async def _call(self, fn: Callable, *args: Any) -> Any:
        """Runs ``fn(*args)`` on the engine thread between steps and returns its result."""
        if self._thread is None and not self._stopping:
            self.start()  # used without a server lifespan: start on first use
        if self.dead_error is not None or self._stopping:
            raise self.dead_error or EngineDeadError("the engine has been shut down")
        fut = self._loop.create_future()
        self._submit(fn, args, fut)
        return await fut

    def _submit(self, fn: Callable, args: tuple, fut: asyncio.Future | None) -> None:
        self._ops.put((fn, args, fut))
        self._wake.set()
        if self.dead_error is not None:  # the thread may have died before it could drain this op
            self._drain_failing(self.dead_error)

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._wake.clear()  # cleared before draining, so an op queued later wakes us
                self._run_ops()
                if self.engine.has_unfinished_requests():
                    self._step()
                elif not self._stopping:
                    self.engine.publish_tier_moves()  # the last requests' blocks reach the shared tier now
                    self._wake.wait()
        except BaseException as exc:  # noqa: BLE001 - whatever killed the loop is reported to clients
            logger.exception("engine loop died")
            self.dead_error = EngineDeadError(f"engine loop died: {type(exc).__name__}: {exc}")
            self._fail_everything(self.dead_error)

    def _run_ops(self) -> None:
        while True:
            try:
                fn, args, fut = self._ops.get_nowait()
            except queue.Empty:
                return
            try:
                result, error = fn(*args), None
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as exc:  # noqa: BLE001 - a bad request (even a tokenizer panic) must not kill the loop
                result, error = None, exc
            self._settle(fut, result, error)

    def _step(self) -> None:
        outputs = self.engine.step()
        if self._beams:
            outputs = list(outputs or []) + self._finished_beams()
        if outputs:
            self._loop.call_soon_threadsafe(self._dispatch, outputs)

    # ------------------------------------------------------------------ event-loop side
    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted by its consumer; the abort op is already queued
            for obs in self.observers:
                obs.observe(out)
            stream.put(out)
            if out.finished:
                self._forget(out.request_id)

    def _settle(self, fut: asyncio.Future | None, result: Any, error: BaseException | None) -> None:
        if fut is None:
            if error is not None:
                logger.warning("engine op failed: %r", error)
            return
        self._call_soon(_resolve, fut, result, error)

    def _call_soon(self, fn: Callable, *args: Any) -> None:
        if self._loop is None:  # never started (every request was refused before reaching it)
            return
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody is left to tell
            pass

    def _fail_everything(self, error: EngineDeadError) -> None:
        self._drain_failing(error)
        self._call_soon(self._fail_streams, error)

    def _drain_failing(self, error: BaseException) -> None:
        while True:
            try:
                _, _, fut = self._ops.get_nowait()
            except queue.Empty:
                return
            if fut is not None:
                self._call_soon(_resolve, fut, None, error)

    def _fail_streams(self, error: BaseException) -> None:
        for stream in list(self._streams.values()):
            stream.put(error)
        self._streams.clear()


class _AbortOnExit:
    """Aborts the request when its consumer goes away early (cancelled, closed, or failed)."""

    def __init__(self, engine: AsyncLLMEngine, stream: RequestStream):
        self.engine, self.stream = engine, stream

    async def __aenter__(self) -> RequestStream:
        return self.stream

    async def __aexit__(self, *exc: object) -> None:
        self.engine.abort(self.stream.request_id)


def _resolve(fut: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if fut.done():  # the awaiting caller was cancelled
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)

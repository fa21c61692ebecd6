"""An asyncio front end to LLMEngine: one engine thread steps, each request streams its outputs.

Threading model: the LLMEngine is owned by a single dedicated engine thread. Every engine
mutation (add, abort) and every read of engine state (stats, metrics) is an *op* put on a
thread-safe queue and run by that thread between two ``step()`` calls, so nothing needs a lock
and the event loop never waits for a forward pass. Results come back to the event loop with
``call_soon_threadsafe``: op results resolve asyncio futures, step outputs go to per-request
asyncio queues.

The engine always runs requests with ``output_kind="delta"`` (so inter-token latency can be
observed for every request); each ``RequestStream`` re-assembles cumulative or final-only
outputs for callers that asked for those.
"""
from __future__ import annotations

import asyncio
import copy
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any, Protocol

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine, PromptType
from pagedllm.metrics.stats import KVCacheStats, Metric
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop stopped (crashed or shut down); no request can make progress."""


class OutputObserver(Protocol):
    """Receives every output as it leaves the engine (for metrics)."""

    def observe(self, out: RequestOutput, prev_token_time: float | None) -> None: ...


class RequestStream:
    """The outputs of one request: an asyncio queue plus re-assembly to the caller's output_kind."""

    def __init__(self, request_id: str, output_kind: str):
        self.request_id = request_id
        self.output_kind = output_kind
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False  # the engine has released the request: no abort needed
        self.last_token_time: float | None = None
        self._acc: RequestOutput | None = None

    def put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, RequestOutput) and item.finished or isinstance(item, BaseException):
            self.finished = True
        self.queue.put_nowait(item)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while True:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            out = self._shape(item)
            if out is not None:
                yield out
            if item.finished:
                return

    def _shape(self, delta: RequestOutput) -> RequestOutput | None:
        if self.output_kind == "delta":
            return delta
        self._acc = delta if self._acc is None else _merge(self._acc, delta)
        if self.output_kind == "final_only" and not delta.finished:
            return None
        return _snapshot(self._acc)


def _merge(acc: RequestOutput, delta: RequestOutput) -> RequestOutput:
    """Appends a delta output to the accumulated one (per completion index)."""
    by_index = {c.index: c for c in acc.outputs}
    for c in delta.outputs:
        old = by_index.get(c.index)
        by_index[c.index] = c if old is None else _merge_completion(old, c)
    # a finished best_of > n request lists only its n best sequences, in rank order
    order = [c.index for c in delta.outputs] if delta.finished else sorted(by_index)
    # a delta stream carries prompt_logprobs once; the accumulated output keeps them
    prompt_logprobs = delta.prompt_logprobs if delta.prompt_logprobs is not None else acc.prompt_logprobs
    return replace(delta, outputs=[by_index[i] for i in order], prompt_logprobs=prompt_logprobs)


def _merge_completion(old: CompletionOutput, new: CompletionOutput) -> CompletionOutput:
    logprobs = None if old.logprobs is None else old.logprobs + (new.logprobs or [])
    return replace(new, text=old.text + new.text, token_ids=old.token_ids + new.token_ids, logprobs=logprobs)


def _snapshot(out: RequestOutput) -> RequestOutput:
    """A copy the caller may keep: later merges build new objects but share nothing mutable."""
    return replace(out, outputs=[copy.copy(c) for c in out.outputs])


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
        self._wake = threading.Event()
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.dead_error: EngineDeadError | None = None

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
        self._fail_everything(EngineDeadError("the server is shutting down"))

    @property
    def is_healthy(self) -> bool:
        return self.dead_error is None and self._thread is not None and self._thread.is_alive()

    # ------------------------------------------------------------------ requests
    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                          arrival_time: float | None = None) -> RequestStream:
        """Validates and queues a request (raises ValueError on bad input); returns its stream."""
        if request_id in self._streams:
            raise ValueError(f"request_id={request_id!r} is already in use")
        stream = RequestStream(request_id, params.output_kind)
        params = replace(params, output_kind="delta")
        self._streams[request_id] = stream  # registered first so no output can be missed
        try:
            await self._call(self.engine.add_request, request_id, prompt, params, arrival_time)
        except BaseException:
            self.abort(request_id)  # queued after the add, so a late add is undone too
            raise
        return stream

    async def generate(self, prompt: PromptType, params: SamplingParams,
                       request_id: str, arrival_time: float | None = None) -> AsyncIterator[RequestOutput]:
        """Yields the request's outputs; closing or cancelling the generator aborts it."""
        stream = await self.add_request(request_id, prompt, params, arrival_time)
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
        self._submit(self.engine.abort_request, (request_id,), None)

    def _forget(self, request_id: str) -> RequestStream | None:
        return self._streams.pop(request_id, None)

    # ------------------------------------------------------------------ reads
    async def get_kv_cache_stats(self) -> KVCacheStats:
        return await self._read(self.engine.get_kv_cache_stats)

    async def get_metrics(self) -> list[Metric]:
        return await self._read(self.engine.get_metrics)

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
        if outputs:
            self._loop.call_soon_threadsafe(self._dispatch, outputs)

    # ------------------------------------------------------------------ event-loop side
    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted by its consumer; the abort op is already queued
            self._observe(stream, out)
            stream.put(out)
            if out.finished:
                self._forget(out.request_id)

    def _observe(self, stream: RequestStream, out: RequestOutput) -> None:
        for obs in self.observers:
            obs.observe(out, stream.last_token_time)
        if out.metrics is not None and out.metrics.last_token_time is not None:
            stream.last_token_time = out.metrics.last_token_time

    def _settle(self, fut: asyncio.Future | None, result: Any, error: BaseException | None) -> None:
        if fut is None:
            if error is not None:
                logger.warning("engine op failed: %r", error)
            return
        self._call_soon(_resolve, fut, result, error)

    def _call_soon(self, fn: Callable, *args: Any) -> None:
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

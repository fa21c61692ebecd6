"""Grammar compilation off the engine thread, per-sequence matchers, and the step's bitmask.

    add request ──> StructuredOutputManager.grammar_for(params, owner) ──> GrammarState (a future)
                        │ cache hit: the same future      │ miss: queued on the CompileQueue
    schedule: a request waits (others run) until GrammarState.is_ready(); one that waits longer
              than the compile timeout fails (finish_reason abort, the error names the option)
    finish:   GrammarState.release(); a compile no request wants any more is dropped if still queued
    sample:   fill the bitmask of the constrained rows (one batched xgrammar call); the sampler
              uploads it with its other inputs and applies it on the device (apply_token_bitmask)
    update:   Request.append_token -> GrammarState.accept(token); a terminated matcher ends the sequence

xgrammar is imported on first use, so engines that never see a constraint do not pay for it.
"""
from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import Counter, OrderedDict
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.config import StructuredOutputConfig
from pagedllm.contracts.grammar import spec_bytes, to_grammar
from pagedllm.metrics.stats import Metric
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output.compile_queue import SMALL_SPEC_BYTES, CompileJob, CompileQueue

logger = logging.getLogger(__name__)

_COMPILE_THREADS = 2  # general compile threads (C++, releases the GIL), plus the queue's small-job lane
_CACHE_SIZE = 256  # compiled grammars kept (least recently requested dropped first)


@dataclass
class StructuredOutputStats:
    """Compile and bitmask time, for benchmarks: seconds and counts since the engine started."""

    num_compiled: int = 0
    compile_seconds: float = 0.0
    num_timed_out: int = 0  # requests failed because their grammar was not ready in time
    num_cancelled: int = 0  # queued compiles dropped because no request wanted them any more
    num_bitmask_steps: int = 0
    bitmask_seconds: float = 0.0


class GrammarState:
    """One sequence's constraint: the compiled grammar (a future until ready) and its matcher.

    The matcher lives with the sequence, so preemption (recompute or swap) keeps it: the tokens
    it has accepted are exactly the sequence's output tokens, which preemption keeps too.
    """

    def __init__(self, compiled: Future, matcher=None, deadline: float | None = None,
                 on_release: Callable[[bool], None] | None = None):
        self._compiled = compiled
        self._matcher = matcher
        self._deadline = deadline  # time.monotonic() past which a grammar still compiling fails the request
        self._on_release = on_release
        self.rejected_token: int | None = None  # a sampled token the grammar refused (a bug if ever set)

    def is_ready(self) -> bool:
        """The grammar is compiled, or failed, or took too long (see ``error``)."""
        return self._compiled.done() or self._timed_out()

    def _timed_out(self) -> bool:
        return self._deadline is not None and time.monotonic() > self._deadline and not self._compiled.done()

    def release(self) -> None:
        """The sequence is done with its grammar: a compile nobody else waits for may be dropped."""
        on_release, self._on_release = self._on_release, None
        if on_release is not None:
            on_release(self._timed_out())

    @property
    def compiled(self) -> Future:
        """The compilation's future (shared by every sequence with the same spec)."""
        return self._compiled

    @property
    def error(self) -> str | None:
        """Why compilation failed, once ready; None when it succeeded."""
        if self._timed_out():
            return ("TimeoutError: the grammar did not compile in time (structured_output_compile_timeout); "
                    "use a smaller schema or raise the timeout")
        if not self._compiled.done():
            return None
        if self._compiled.cancelled():
            return "CancelledError: the grammar's compilation was cancelled"
        exc = self._compiled.exception()
        return None if exc is None else f"{type(exc).__name__}: {exc}"

    def matcher(self):
        """The xgrammar matcher, created on first use (the grammar must be ready)."""
        if self._matcher is None:
            import xgrammar as xgr
            self._matcher = xgr.GrammarMatcher(self._compiled.result())
        return self._matcher

    def accept(self, token_id: int) -> None:
        """Advances the matcher over a sampled token; a refused token is recorded, not raised."""
        if self.rejected_token is None and not self.matcher().accept_token(token_id):
            self.rejected_token = token_id
            logger.error("structured output: the grammar refused sampled token %d", token_id)

    def is_terminated(self) -> bool:
        """The grammar is complete and has accepted its stop token: the sequence ends."""
        return self._matcher is not None and self._matcher.is_terminated()

    def is_complete(self) -> bool:
        """What it has accepted is a whole match: only the stop token may follow (or nothing)."""
        return self._matcher is not None and self._matcher.is_completed()

    def fork(self) -> GrammarState:
        """A copy for a forked sequence: same grammar, matcher state copied (the grammar is
        compiled by then, so the fork holds no claim on a queued compile)."""
        return GrammarState(self._compiled, self.matcher().fork())


class StructuredOutputManager:
    """Compiles grammars on a CompileQueue (cached by key) and applies bitmasks to the sampler's logits.

    One per engine. The xgrammar tokenizer info is built once, by the first compilation job; it
    only reads the tokenizer's vocabulary, which the engine thread never changes. ``grammar_for``,
    ``release`` and ``fill_bitmask`` run on the engine thread. A compile is shared by every
    request with the same spec; it is dropped while still queued when the last of them leaves.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: frozenset[int],
                 config: StructuredOutputConfig | None = None):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self.config = config or StructuredOutputConfig()
        self._queue = CompileQueue(_COMPILE_THREADS)
        self._compiler = None
        self._compiler_lock = threading.Lock()
        self._stats_lock = threading.Lock()
        self._cache: OrderedDict[tuple, CompileJob] = OrderedDict()
        self._claims: Counter[CompileJob] = Counter()  # live GrammarStates per job not yet compiled
        self._batch_matcher = None
        self._wakes_on_done: weakref.WeakSet[Future] = weakref.WeakSet()  # compiles that set wait_for_any's wake
        self._bitmask = np.empty((8, (vocab_size + 31) // 32), dtype=np.int32)  # fill_bitmask's buffer
        self.stats = StructuredOutputStats()

    # ------------------------------------------------------------------ compilation
    def grammar_for(self, params: StructuredOutputsParams, owner: str = "") -> GrammarState:
        """A new sequence's GrammarState; compilation is queued now (under ``owner``, the client the
        compile is charged to for fairness) unless the spec is cached or already queued."""
        if self._tokenizer is None:
            raise ValueError("structured_outputs needs a tokenizer; this engine has none")
        key = params.key
        job = self._cache.get(key)
        if job is None or job.future.cancelled():
            job = self._cache[key] = CompileJob(lambda: self._compile(params), owner,
                                                small=spec_bytes(params) <= SMALL_SPEC_BYTES)
            self._queue.submit(job)
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        if job.future.done():
            return GrammarState(job.future)
        self._claims[job] += 1
        timeout = self.config.compile_timeout
        deadline = time.monotonic() + timeout if timeout > 0 else None
        return GrammarState(job.future, deadline=deadline,
                            on_release=lambda timed_out: self._release(key, job, timed_out))

    def _release(self, key: tuple, job: CompileJob, timed_out: bool) -> None:
        """One claim on ``job`` is gone; the last one cancels it if it is still queued."""
        self.stats.num_timed_out += timed_out
        self._claims[job] -= 1
        if self._claims[job] > 0:
            return
        del self._claims[job]
        if self._queue.cancel(job):
            self.stats.num_cancelled += 1
            if self._cache.get(key) is job:
                del self._cache[key]

    def _compile(self, params: StructuredOutputsParams):
        t0 = time.perf_counter()
        compiled = self._get_compiler().compile_grammar(to_grammar(params))
        with self._stats_lock:  # two pool threads may finish at once: += is not atomic
            self.stats.num_compiled += 1
            self.stats.compile_seconds += time.perf_counter() - t0
        return compiled

    def _get_compiler(self):
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar as xgr
                info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self._stop_token_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=_COMPILE_THREADS)
            return self._compiler

    def metrics(self) -> list[Metric]:
        """Compile time and queue state for /metrics."""
        s = self.stats
        return [Metric("pagedllm:structured_output_compile_seconds", s.compile_seconds, kind="counter"),
                Metric("pagedllm:structured_output_compiles", s.num_compiled, kind="counter"),
                Metric("pagedllm:structured_output_compile_timeouts", s.num_timed_out, kind="counter"),
                Metric("pagedllm:structured_output_compiles_cancelled", s.num_cancelled, kind="counter"),
                Metric("pagedllm:structured_output_compile_queue_depth", self._queue.depth()),
                Metric("pagedllm:structured_output_compiles_running", self._queue.num_running())]

    def wait_for_any(self, states: list[GrammarState], timeout: float, wake: threading.Event | None = None) -> None:
        """Blocks until one of ``states`` is compiled or ``timeout`` passes (an idle engine's wait).
        ``wake``: an event that also ends the wait (the async engine's, set by a new request or an
        abort, which must not wait out a compile); every pending compile sets it when it ends."""
        pending = [s.compiled for s in states]
        if not pending:
            return
        if wake is None:
            wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)
            return
        for future in pending:
            if future not in self._wakes_on_done:  # one callback per compile, not one per idle step
                self._wakes_on_done.add(future)
                future.add_done_callback(lambda _: wake.set())
        wake.wait(timeout)

    # ------------------------------------------------------------------ sampling
    def fill_bitmask(self, grammars: list[GrammarState | None]) -> np.ndarray | None:
        """The step's token bitmask on the host, int32 ``[rows, ceil(vocab / 32)]`` (bit ``j % 32``
        of word ``j // 32`` set: token ``j`` allowed), every bit set in unconstrained rows; None
        when no row is constrained. ``apply_token_bitmask`` applies it on the device. A view of
        one buffer reused across steps: valid until the next call."""
        rows = [i for i, g in enumerate(grammars) if g is not None]
        if not rows:
            return None
        import xgrammar as xgr
        t0 = time.perf_counter()
        if self._bitmask.shape[0] < len(grammars):  # grown to capacity, reused across steps
            self._bitmask = np.empty((max(len(grammars), 2 * self._bitmask.shape[0]), self._bitmask.shape[1]),
                                     dtype=np.int32)
        bitmask = self._bitmask[:len(grammars)]
        bitmask.fill(-1)
        if self._batch_matcher is None:
            self._batch_matcher = xgr.BatchGrammarMatcher(max_threads=1)
        self._batch_matcher.batch_fill_next_token_bitmask([grammars[i].matcher() for i in rows],
                                                          torch.from_numpy(bitmask), rows)
        self.stats.num_bitmask_steps += 1
        self.stats.bitmask_seconds += time.perf_counter() - t0
        return bitmask

    def shutdown(self) -> None:
        self._queue.shutdown()


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, vocab_size: int) -> None:
    """Sets to -inf, in place, every logit ``[rows, >= vocab_size]`` whose bit in ``bitmask``
    (int32 ``[rows, ceil(vocab_size / 32)]``, on the logits' device) is clear; columns past
    ``vocab_size`` (a padded LM head) are left alone, as xgrammar does. No index list, no host
    sync: on CUDA xgrammar's own kernel (``indices=None``: nothing uploaded or read back), on the
    CPU (and for a logits view whose columns are strided) tensor ops."""
    if logits.is_cuda and logits.stride(-1) == 1 and bitmask.is_contiguous():
        import xgrammar as xgr
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab_size)
        return
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    bits = (bitmask[:, :, None] >> shifts) & 1  # [rows, words, 32]
    allowed = bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()  # [rows, vocab_size]
    logits[:, :vocab_size].masked_fill_(~allowed, float("-inf"))

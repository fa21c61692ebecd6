"""Grammar compilation off the engine thread, per-sequence matchers, and the step's bitmask.

    add request ──> StructuredOutputManager.grammar_for(params) ──> GrammarState (a future)
                        │ cache hit: the same future      │ miss: compile on the pool
    schedule: a request waits (others run) until GrammarState.is_ready()
    sample:   fill the bitmask of the constrained rows (one batched xgrammar call); the sampler
              uploads it with its other inputs and applies it on the device (apply_token_bitmask)
    update:   Request.append_token -> GrammarState.accept(token); a terminated matcher ends the sequence

xgrammar is imported on first use, so engines that never see a constraint do not pay for it.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output.grammar import to_grammar

logger = logging.getLogger(__name__)

_COMPILE_THREADS = 2  # compilation is C++ and releases the GIL; two keep a slow schema from blocking others
_CACHE_SIZE = 256  # compiled grammars kept (least recently requested dropped first)


@dataclass
class StructuredOutputStats:
    """Compile and bitmask time, for benchmarks: seconds and counts since the engine started."""

    num_compiled: int = 0
    compile_seconds: float = 0.0
    num_bitmask_steps: int = 0
    bitmask_seconds: float = 0.0


class GrammarState:
    """One sequence's constraint: the compiled grammar (a future until ready) and its matcher.

    The matcher lives with the sequence, so preemption (recompute or swap) keeps it: the tokens
    it has accepted are exactly the sequence's output tokens, which preemption keeps too.
    """

    def __init__(self, compiled: Future, matcher=None):
        self._compiled = compiled
        self._matcher = matcher
        self.rejected_token: int | None = None  # a sampled token the grammar refused (a bug if ever set)

    def is_ready(self) -> bool:
        """The grammar is compiled (or failed: see ``error``)."""
        return self._compiled.done()

    @property
    def compiled(self) -> Future:
        """The compilation's future (shared by every sequence with the same spec)."""
        return self._compiled

    @property
    def error(self) -> str | None:
        """Why compilation failed, once ready; None when it succeeded."""
        exc = self._compiled.exception() if self._compiled.done() else None
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
        """A copy for a forked sequence: same grammar, matcher state copied."""
        return GrammarState(self._compiled, self.matcher().fork())


class StructuredOutputManager:
    """Compiles grammars on a thread pool (cached by key) and applies bitmasks to the sampler's logits.

    One per engine. The xgrammar tokenizer info is built once, by the first compilation job; it
    only reads the tokenizer's vocabulary, which the engine thread never changes. ``grammar_for``
    and ``fill_bitmask`` run on the engine thread.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: frozenset[int]):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self._pool: ThreadPoolExecutor | None = None
        self._compiler = None
        self._compiler_lock = threading.Lock()
        self._stats_lock = threading.Lock()
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._batch_matcher = None
        self._bitmask = np.empty((8, (vocab_size + 31) // 32), dtype=np.int32)  # fill_bitmask's buffer
        self.stats = StructuredOutputStats()

    # ------------------------------------------------------------------ compilation
    def grammar_for(self, params: StructuredOutputsParams) -> GrammarState:
        """A new sequence's GrammarState; compilation starts now on the pool unless cached."""
        if self._tokenizer is None:
            raise ValueError("structured_outputs needs a tokenizer; this engine has none")
        key = params.key
        future = self._cache.get(key)
        if future is None:
            future = self._cache[key] = self._executor().submit(self._compile, params)
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        return GrammarState(future)

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(_COMPILE_THREADS, thread_name_prefix="pagedllm-grammar")
        return self._pool

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

    def wait_for_any(self, states: list[GrammarState], timeout: float) -> None:
        """Blocks until one of ``states`` is compiled or ``timeout`` passes (an idle engine's wait)."""
        pending = [s.compiled for s in states]
        if pending:
            wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)

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
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


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

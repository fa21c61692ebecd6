"""A request (one sequence) and its single progress counter (docs/design.md, core idea 1)."""
from __future__ import annotations

import enum
import random
import struct
import time

import torch

from pagedllm.lora.request import LoRARequest
from pagedllm.multimodal.inputs import MultiModalItem
from pagedllm.multimodal.mrope import MRopePositions
from pagedllm.outputs import Logprob
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output import GrammarState


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    # its constraints (structured output, allowed_token_ids, bad_words, min_tokens) left no token
    # to sample: it ends without one (never a token they forbid)
    FINISHED_CONSTRAINT = "constraint"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_CONSTRAINT)


# torch's CPU generator state (CPUGeneratorImplState, kept stable for saved states): a header
# {uint64 initial seed; int32 left; int32 seeded; uint64 next}, then the 624 Mersenne-Twister
# words as uint64, then cached normal samples
_MT_WORDS = 624
_STATE_HEADER = struct.Struct("<QiiQ")
_STATE_WORDS = struct.Struct(f"<{_MT_WORDS}Q")


def make_generator(seed: int | None, index: int) -> torch.Generator | None:
    """The generator of sequence ``index`` of a request seeded ``seed`` (an int64).

    ``manual_seed`` keeps only the low 32 bits on the CPU (seeds -1, 2**32 - 1 and 2**63 - 1
    draw the same numbers) and ``seed + index`` makes request (5, sibling 1) equal (6, sibling 0).
    Instead, the whole Mersenne-Twister state comes from ``init_by_array`` over the words of
    ``(index, seed mod 2**64)`` (as CPython's ``random.seed`` and numpy do for large seeds), so
    distinct pairs get distinct streams.
    """
    if seed is None:
        return None
    key = (index << 64) | (seed & 0xFFFF_FFFF_FFFF_FFFF)
    words = random.Random(key).getstate()[1][:_MT_WORDS]  # the state right after init_by_array
    gen = torch.Generator()
    state = gen.get_state()  # [5056] uint8
    # left=1, next=0: the first draw twists the state, as after init_by_array
    head = _STATE_HEADER.pack(key & 0xFFFF_FFFF_FFFF_FFFF, 1, 1, 0) + _STATE_WORDS.pack(*words)
    state[:len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
    gen.set_state(state)
    return gen


class Request:
    """One sequence being generated.

    ``num_tokens`` = prompt + output tokens; ``num_computed_tokens`` = tokens whose K/V are in
    the cache. Each step may compute up to the difference. Prefill is not a state: a request
    is "prefilling" while ``num_computed_tokens < num_prompt_tokens``.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_ids: frozenset[int], arrival_time: float | None = None,
                 parent_id: str | None = None, index: int = 0, cache_salt: str | None = None,
                 priority: int = 0, pooling: PoolingParams | None = None,
                 mm_items: tuple[MultiModalItem, ...] = (), lora_request: LoRARequest | None = None):
        self.request_id = request_id
        self.parent_id = parent_id or request_id
        self.index = index  # which of the parent's n sequences this is
        self.prompt_token_ids = list(prompt_token_ids)
        self.all_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.cache_salt = cache_salt
        self.lora_request = lora_request  # the adapter it runs with (None: the base model)
        self.lora_slot = -1  # its adapter's device slot while it holds a reference (lora/slot_pool.py)
        self.mm_items = mm_items  # its images' placeholder runs, in prompt order (multimodal/)
        self.mrope = MRopePositions.of(len(prompt_token_ids), mm_items)  # M-RoPE positions (None: plain)
        self.priority = priority  # scheduling_policy="priority": lower values are scheduled first
        self.pooling = pooling  # a pooling request: its one sampled token is dropped, this is its result
        self.embedding: list[float] | None = None  # set by the engine once its prompt is computed
        self.pools_every_position = False  # MEAN / CLS / per-token pooling: prefix-cache hits would skip positions
        # MEAN / CLS: the pooled rows so far [hidden]; per-token tasks: every row so far [tokens, hidden or labels]
        self.pool_acc: torch.Tensor | None = None
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache on admission
        self.cumulative_logprob = 0.0
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        # prompt_logprobs: entry p (p >= 1) = {prompt token p: (logprob, vocab rank), top-k...}
        # from the logits at position p - 1; entry 0 stays None (nothing predicts the first token)
        self.prompt_logprobs: list[dict[int, tuple[float, int]] | None] | None = (
            [None] * self.num_prompt_tokens if params.prompt_logprobs is not None else None)
        self.stop_reason: int | str | None = None
        self.num_forks_pending = 0  # siblings to fork off once the prompt is computed
        self.generator = make_generator(params.seed, index)
        self.fork_generators: list[torch.Generator | None] = []  # for siblings not forked yet
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.num_preemptions = 0
        self.grammar: GrammarState | None = None  # structured_outputs: this sequence's matcher
        self.spec_token_ids: list[int] = []  # speculative drafts to verify in the next step
        self.long_rope = False  # LongRoPE: its K/V is computed with the long factors (engine/scheduler.py)

    def hash_extra_keys(self) -> tuple:
        """What its prefix-cache block hashes mix in besides the tokens: its cache salt, its adapter
        (two adapters, like two salts, never share K/V) and LongRoPE's long factors (long-factor K/V
        is another block's content)."""
        extra = (self.cache_salt,) if self.cache_salt else ()
        if self.lora_request is not None:
            extra += self.lora_request.cache_key()
        return extra + ("long_rope",) if self.long_rope else extra

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.accept(token_id)

    def is_waiting_for_grammar(self) -> bool:
        """Its structured-output grammar is still compiling: it cannot be scheduled yet."""
        return self.grammar is not None and not self.grammar.is_ready()

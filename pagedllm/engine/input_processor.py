"""Prompt -> validated token ids: the one place a request is tokenized and checked.

``LLMEngine.add_request``, ``LLM``, the async engine (on its tokenizer threads, off the engine
thread) and beam search all go through :class:`InputProcessor`, so every entry point refuses the
same inputs with the same messages.

Bounded work on huge prompts. A prompt must fit in ``max_model_len - 1`` tokens, so a 20 MB
string must be refused without tokenizing 20 MB (minutes of CPU, gigabytes of token lists).
No token of the vocabulary spells more than ``max_token_chars`` characters (its longest entry;
byte-level entries spell one byte per character, so they over-count multi-byte characters, which
only makes the bound looser), hence a text of ``C`` characters makes at least
``C / max_token_chars`` tokens, as long as the tokenizer's normalizer does not delete characters.
A longer text than ``max_model_len * max_token_chars`` characters is therefore tokenized only up
to that many characters: if that prefix alone is already too long the prompt is refused (the
rest can only add tokens); if not (a normalizer dropped characters) the whole text is tokenized
and checked like any other. Either way the work is bounded by what an acceptable prompt costs,
except for tokenizers that delete most of their input.
"""
from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

from pagedllm.config import StructuredOutputConfig
from pagedllm.contracts.grammar import check_spec_size, spec_bytes
from pagedllm.lora.request import LoRARequest
from pagedllm.multimodal.inputs import MultiModalItem
from pagedllm.multimodal.processor import MultiModalProcessor
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams

PromptType = str | dict | list[int]
_PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "cache_salt"})
# vision-language models only; "add_special_tokens" (pagedllm's, with multi_modal_data): False for a chat
# template's text, which the model's processor must not prefix with another BOS
_MM_KEYS = frozenset({"multi_modal_data", "mm_processor_kwargs", "add_special_tokens"})


@dataclass(frozen=True)
class ProcessedRequest:
    """A request ready for the scheduler: its prompt text (if any), token ids and own params."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams  # a private copy with max_tokens filled in
    arrival_time: float | None = None
    cache_salt: str | None = None
    priority: int = 0
    pooling: PoolingParams | None = None  # a pooling (embedding) request: params is its one-token run
    mm_items: tuple[MultiModalItem, ...] = ()  # its images' placeholder runs and processor tensors
    client_id: str | None = None  # who sent it, for per-client fairness (None: the request is its own client)
    lora_request: LoRARequest | None = None  # the adapter it runs with (None: the base model)


def with_client(processed: ProcessedRequest, client_id: str | None) -> ProcessedRequest:
    """``processed`` charged to ``client_id`` (None: left as it is); an empty or non-string id is refused."""
    if client_id is None:
        return processed
    if not isinstance(client_id, str) or not client_id:
        raise ValueError(f"client_id={client_id!r} is invalid: give a non-empty string naming the client, or None")
    return dataclasses.replace(processed, client_id=client_id)


class InputProcessor:
    """Tokenizes and validates prompts against the model and the KV cache.

    Not thread-safe (a fast tokenizer must not be used from two threads at once): a thread
    that tokenizes concurrently with others uses its own ``clone()``.
    """

    def __init__(self, tokenizer, vocab_size: int, max_model_len: int,
                 check_fits: Callable[[int, int, int], None], max_logprobs: int = 20,
                 eos_token_ids: frozenset[int] = frozenset(), scheduling_policy: str = "fcfs",
                 structured_output: StructuredOutputConfig | None = None,
                 multimodal: MultiModalProcessor | None = None):
        self.tokenizer = tokenizer
        self.multimodal = multimodal  # a vision-language model's processor (None: text-only model)
        self.structured_output = structured_output or StructuredOutputConfig()
        self.scheduling_policy = scheduling_policy  # a priority other than 0 needs "priority"
        self.eos_token_ids = eos_token_ids  # banned with stop_token_ids until min_tokens
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_logprobs = vocab_size if max_logprobs == -1 else max_logprobs  # vLLM: -1 = no cap
        self.check_fits = check_fits  # (prompt tokens, max_tokens, sequences) -> raises ValueError
        self._max_token_chars: int | None = None

    def clone(self) -> InputProcessor:
        """A processor with its own tokenizer copy, for another thread."""
        other = copy.copy(self)
        other.tokenizer = copy.deepcopy(self.tokenizer)
        if self.multimodal is not None:
            other.multimodal = self.multimodal.clone()
        return other

    # ------------------------------------------------------------------ the whole request
    def process(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                arrival_time: float | None = None, cache_salt: str | None = None,
                priority: int = 0, pooling: PoolingParams | None = None,
                lora_request: LoRARequest | None = None) -> ProcessedRequest:
        """Raises ValueError/TypeError naming the field for anything the engine cannot run.

        ``cache_salt`` (or the prompt dict's ``"cache_salt"``, vLLM's key) is mixed into the
        prompt's block hashes: only requests with the same salt share prefix-cache blocks.
        ``arrival_time`` (None: now, before any processing, as vLLM's processor takes it) is where
        the request's queue time and TTFT start: an image's HF processing counts in them."""
        if arrival_time is None:
            arrival_time = time.time()
        cache_salt = self.check_cache_salt(self._salt_of(prompt, cache_salt))
        self.check_priority(priority)
        if params is None:
            params = SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        params = params.clone()  # max_tokens is filled in below; the caller's object stays as given
        text, ids, mm_items = self.tokenize_multimodal(prompt)
        if mm_items and params.truncate_prompt_tokens is not None:
            raise ValueError("truncate_prompt_tokens cannot be combined with multi_modal_data (it could cut an "
                             "image's placeholder run); leave it unset")
        if params.truncate_prompt_tokens is not None:
            text, ids = self.truncate(text, ids, params.truncate_prompt_tokens)
        self.validate(ids, params)
        self.resolve_logprobs(params)
        if params.bad_words:
            params.bad_words_token_ids = self.bad_words_token_ids(params.bad_words)
        self.check_allowed_reachable(params)
        self.check_structured_output_size(params)
        if lora_request is not None and not isinstance(lora_request, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
        return ProcessedRequest(request_id, text, ids, params, arrival_time, cache_salt, priority, pooling,
                                mm_items=mm_items, lora_request=lora_request)

    @staticmethod
    def _salt_of(prompt: PromptType, cache_salt: str | None) -> object:
        """The salt given as an argument or as the prompt dict's ``"cache_salt"``; two different
        ones are refused (neither may be dropped)."""
        in_prompt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if in_prompt is not None and cache_salt is not None and in_prompt != cache_salt:
            raise ValueError(f"cache_salt={cache_salt!r:.80} differs from the prompt's cache_salt={in_prompt!r:.80}; "
                             "give one")
        return in_prompt if in_prompt is not None else cache_salt

    @staticmethod
    def check_cache_salt(salt: object) -> str | None:
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise ValueError(f"cache_salt={salt!r:.80} is invalid: it must be a non-empty string")
        return salt

    def check_priority(self, priority: object) -> None:
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority={priority!r:.80} is invalid: it must be an integer")
        if priority != 0 and self.scheduling_policy != "priority":
            raise ValueError(f"priority={priority} needs scheduling_policy='priority' (this engine schedules "
                             f"{self.scheduling_policy!r}, where every request has priority 0)")

    def tokenize_multimodal(self, prompt: PromptType) -> tuple[str | None, list[int], tuple[MultiModalItem, ...]]:
        """``tokenize``, and for a prompt dict with ``multi_modal_data`` the model's processor
        (each image placeholder expanded) and the images' items."""
        if not (isinstance(prompt, dict) and _MM_KEYS & set(prompt)):
            return *self.tokenize(prompt), ()
        self._check_prompt_keys(prompt)
        if "multi_modal_data" not in prompt:
            raise ValueError(f"prompt keys {sorted(_MM_KEYS & set(prompt))} need multi_modal_data in the same prompt")
        if "prompt_token_ids" in prompt or not isinstance(prompt.get("prompt"), str):
            raise ValueError("a prompt with multi_modal_data must give its text as 'prompt' (the model's processor "
                             "expands its image placeholders); prompt_token_ids cannot carry images")
        text = prompt["prompt"]
        special = prompt.get("add_special_tokens", True)
        if not isinstance(special, bool):
            raise ValueError(f"add_special_tokens={special!r:.80} must be true or false")
        self.encode(text)  # the text alone must fit (bounded work on a huge string)
        ids, items = self.multimodal.process(text, prompt["multi_modal_data"], prompt.get("mm_processor_kwargs"),
                                             special)
        return text, ids, items

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """The prompt's text (None for token ids alone) and token ids."""
        if isinstance(prompt, str):
            return prompt, self.encode(prompt)
        if isinstance(prompt, dict):
            self._check_prompt_keys(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), self._id_list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and "prompt" in prompt:
            return self.tokenize(prompt["prompt"])
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"prompt={prompt!r:.80} must be a string, a list of token ids or "
                         "a dict with 'prompt' or 'prompt_token_ids'")

    def _check_prompt_keys(self, prompt: dict) -> None:
        """vLLM's TextPrompt / TokensPrompt keys that this engine reads; any other (multi_modal_data,
        a typo) is refused rather than ignored."""
        keys = _PROMPT_KEYS | _MM_KEYS if self.multimodal is not None else _PROMPT_KEYS
        unknown = sorted(set(prompt) - keys, key=str)
        if unknown:
            what = "" if self.multimodal is not None else " (this is a text-only model)"
            raise ValueError(f"prompt has keys {unknown}: a prompt dict takes {sorted(keys)}{what}")

    def truncate(self, text: str | None, ids: list[int], keep: int) -> tuple[str | None, list[int]]:
        """``truncate_prompt_tokens``: the prompt's last ``keep`` tokens (-1: as many as
        max_model_len leaves room for); the text is then the kept tokens' decoding."""
        keep = self.max_model_len - 1 if keep == -1 else keep
        if len(ids) <= keep:
            return text, ids
        ids = ids[-keep:]
        return (self.tokenizer.decode(ids) if self.tokenizer is not None else None), ids

    def resolve_logprobs(self, params: SamplingParams) -> None:
        """``logprobs`` / ``prompt_logprobs`` of -1 mean the whole vocabulary; both are bounded
        by the engine's ``max_logprobs`` (vLLM's check)."""
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value == -1:
                value = self.vocab_size
                setattr(params, name, value)
            if value is not None and value > self.max_logprobs:
                raise ValueError(f"{name}={value} is invalid: must be <= max_logprobs={self.max_logprobs} "
                                 "(an engine option; -1 there allows the whole vocabulary)")

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word's token ids, with and without a leading space (vLLM's rule: the spaced
        form counts when it is a different token sequence of the same length)."""
        if self.tokenizer is None:
            raise ValueError("bad_words needs a tokenizer; this engine has none")
        result = []
        for word in words:
            plain = self._encode(word.lstrip(), False, "bad_words")
            spaced = self._encode(" " + word.lstrip(), False, "bad_words")
            result.append(plain)
            if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
                result.append(spaced)
        self._check_ids("bad_words", [t for ids in result for t in ids])
        return result

    def check_allowed_reachable(self, params: SamplingParams) -> None:
        """Refuses ``allowed_token_ids`` that the other fields mask at the first step: every one a
        one-token bad word, or (with ``min_tokens``) every one a bad word or a stop/EOS token. Masks
        that only bite later (longer bad words, a grammar) end the sequence with finish_reason
        ``constraint`` instead (the sampler's NO_TOKEN)."""
        if not params.allowed_token_ids:
            return
        blocked = {w[0] for w in params.bad_words_token_ids or () if len(w) == 1}
        if params.min_tokens > 0:
            blocked |= set(self.eos_token_ids) | set(params.stop_token_ids)
        if set(params.allowed_token_ids) <= blocked:
            why = "bad_words" + (" and the stop/EOS tokens masked until min_tokens" if params.min_tokens else "")
            raise ValueError(f"allowed_token_ids={params.allowed_token_ids[:8]} leaves no token to sample: {why} "
                             f"mask every one of them; allow another token or drop the conflicting field")

    def check_structured_output_size(self, params: SamplingParams) -> None:
        """Refuses a constraint whose spec is over ``max_structured_output_bytes``: compiling it could
        take minutes, and a running compile cannot be interrupted."""
        so = params.structured_outputs
        if so is not None:
            check_spec_size(so.kind, spec_bytes(so), self.structured_output.max_spec_bytes)

    @staticmethod
    def _id_list(ids) -> list[int]:
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"prompt_token_ids={ids!r:.80} must be a list of integers")
        return list(ids)

    def validate(self, ids: list[int], params: SamplingParams) -> None:
        """Checks ids and params against the vocabulary, max_model_len and the KV cache;
        fills in ``params.max_tokens`` (None = up to max_model_len)."""
        max_len = self.max_model_len
        if not ids:
            raise ValueError("prompt_token_ids=[] is empty; give at least one token")
        if len(ids) >= max_len:  # before the per-token scan: a huge id list is refused in O(1)
            raise ValueError(f"prompt of {len(ids)} tokens is too long: max_model_len={max_len} "
                             "leaves no room to generate")
        self._check_ids("prompt_token_ids", ids)
        for name, tokens in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or ()),
                             ("allowed_token_ids", params.allowed_token_ids or ())):
            self._check_ids(name, list(tokens))
        if params.max_tokens is None:
            params.max_tokens = max_len - len(ids)
        self.check_fits(len(ids), params.max_tokens, params.num_sequences)

    def _check_ids(self, name: str, ids: list) -> None:
        vocab = self.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"{name} contains {bad[:5]}: token ids must be integers in [0, {vocab})")

    # ------------------------------------------------------------------ text
    def encode(self, text: str, *, add_special_tokens: bool = True, field: str = "prompt") -> list[int]:
        """Token ids of ``text``; a text that cannot fit in max_model_len is refused after
        bounded work (see the module docstring). ``field`` names the input in error messages."""
        if self.tokenizer is None:
            raise ValueError(f"{field} is text but the engine has no tokenizer; pass prompt_token_ids")
        if not text:
            raise ValueError(f"{field}='' is empty; give at least one token")
        limit = self.max_model_len * self.max_token_chars()
        if len(text) > limit:
            num_prefix = len(self._encode(text[:limit], add_special_tokens, field))
            if num_prefix >= self.max_model_len:
                raise ValueError(f"{field} of {len(text)} characters is too long: its first {limit} characters "
                                 f"alone are {num_prefix} tokens and max_model_len={self.max_model_len}")
        return self._encode(text, add_special_tokens, field)

    def _encode(self, text: str, add_special_tokens: bool, field: str) -> list[int]:
        _check_unicode(text, field)
        try:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{field} cannot be tokenized: {exc}") from None

    def max_token_chars(self) -> int:
        """Characters spelled by the vocabulary's longest token (computed once)."""
        if self._max_token_chars is None:
            self._max_token_chars = max(1, max((len(t) for t in self.tokenizer.get_vocab()), default=1))
        return self._max_token_chars


def _check_unicode(text: str, field: str) -> None:
    """A lone UTF-16 surrogate (e.g. from a JSON "\\ud800" escape) is not text any tokenizer takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{field} contains a lone surrogate U+{ord(text[exc.start]):04X} at character "
                         f"{exc.start}: text must be valid Unicode (surrogates only come in UTF-16 pairs)") from None

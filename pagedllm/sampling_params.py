"""Sampling parameters, compatible with vLLM's ``SamplingParams``."""
from __future__ import annotations

import json as _json
from dataclasses import dataclass, field
from enum import Enum

# OpenAI's seed is an integer; like vLLM we take the int64 range, where every value gets its own
# random stream (see engine.request.make_generator)
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


def _check(cond: bool, name: str, value, allowed: str) -> None:
    if not cond:
        raise ValueError(f"{name}={value!r} is invalid: {allowed}")


def _token_id(key, name: str) -> int:
    """A token id given as an int or (OpenAI's JSON maps) a decimal string."""
    if isinstance(key, int) and not isinstance(key, bool) and key >= 0:
        return key
    if isinstance(key, str) and key.isdigit():
        return int(key)
    raise ValueError(f"{name} key {key!r} is invalid: must be a non-negative token id")


_CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar", "json_object")


class RequestOutputKind(str, Enum):
    """vLLM's ``RequestOutputKind``: what each RequestOutput of a running request holds. A member
    equals its string (``RequestOutputKind.DELTA == "delta"``), the form SamplingParams stores."""

    CUMULATIVE = "cumulative"  # everything generated so far
    DELTA = "delta"  # only what is new since the previous output
    FINAL_ONLY = "final_only"  # nothing until the request finishes


@dataclass
class StructuredOutputsParams:
    """Output constrained to a JSON schema, a regex, a list of choices, an EBNF grammar or any JSON
    object (vLLM's ``StructuredOutputsParams``); exactly one kind is set. Checked at construction:
    an invalid schema, regex or grammar is a ValueError naming the field."""

    json: str | dict | None = None  # a JSON schema, as a dict or its JSON text
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (xgrammar/GBNF syntax), root rule ``root``
    json_object: bool | None = None
    disable_any_whitespace: bool = False  # JSON: no free whitespace between tokens
    disable_fallback: bool = False  # there is one backend (xgrammar) and never a fallback
    # vLLM fields with no xgrammar equivalent here: only None is accepted
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self):
        set_kinds = [k for k in _CONSTRAINT_KINDS if getattr(self, k) not in (None, False)]
        _check(len(set_kinds) == 1, "structured_outputs", set_kinds or None,
               f"exactly one of {', '.join(_CONSTRAINT_KINDS)} must be set")
        _check(self.whitespace_pattern is None, "structured_outputs.whitespace_pattern", self.whitespace_pattern,
               "is not supported (use disable_any_whitespace)")
        _check(self.structural_tag is None, "structured_outputs.structural_tag", self.structural_tag,
               "is not supported")
        _check(isinstance(self.disable_any_whitespace, bool), "structured_outputs.disable_any_whitespace",
               self.disable_any_whitespace, "must be a bool")
        self._normalise()
        from pagedllm.contracts.grammar import check_grammar  # xgrammar is imported on first use
        check_grammar(self)

    def _normalise(self) -> None:
        if self.json is not None:
            self.json = _schema_text(self.json)
        if self.regex is not None:
            _check(isinstance(self.regex, str) and self.regex, "regex", self.regex, "must be a non-empty string")
        if self.grammar is not None:
            _check(isinstance(self.grammar, str) and self.grammar.strip(), "grammar", self.grammar,
                   "must be a non-empty EBNF string")
        if self.choice is not None:
            _check(isinstance(self.choice, (list, tuple)) and len(self.choice) > 0
                   and all(isinstance(c, str) and c for c in self.choice),
                   "choice", self.choice, "must be a non-empty list of non-empty strings")
            self.choice = list(self.choice)
        if self.json_object is not None:
            _check(self.json_object is True, "json_object", self.json_object, "must be True when given")

    @property
    def kind(self) -> str:
        """Which constraint: one of json, regex, choice, grammar, json_object."""
        return next(k for k in _CONSTRAINT_KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple:
        """What a compiled grammar is cached by: equal keys compile to the same grammar."""
        spec = getattr(self, self.kind)
        return self.kind, tuple(spec) if isinstance(spec, list) else spec, self.disable_any_whitespace


def _schema_text(schema) -> str:
    """A JSON schema as compact JSON text: a dict and its JSON text share a cache key. Key order is
    kept (it is the order properties are generated in)."""
    if isinstance(schema, str):
        try:
            schema = _json.loads(schema)
        except ValueError as exc:
            raise ValueError(f"json={schema!r:.80} is invalid: not JSON ({exc})") from None
    _check(isinstance(schema, (dict, bool)), "json", schema, "must be a JSON schema (an object)")
    return _json.dumps(schema, ensure_ascii=False)


@dataclass
class SamplingParams:
    """How to sample one request. ``temperature == 0`` means greedy."""

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None  # an int64, in [SEED_MIN, SEED_MAX]
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    logit_bias: dict[int, float] | None = None  # added to the logits of those tokens, in [-100, 100]
    allowed_token_ids: list[int] | None = None  # only these tokens may be sampled
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # text is what the tokenizer's decode() gives; False (slow tokenizers only in HF) is refused
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    output_kind: str | RequestOutputKind = "cumulative"  # a RequestOutputKind is stored as its string
    structured_outputs: StructuredOutputsParams | None = None  # a dict is converted
    # words never generated: a one-token word is masked always, a longer one when the output ends
    # with all its tokens but the last (vLLM's semantics; tokenized by the input processor)
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens (-1: max_model_len - 1)
    # vLLM passes these to custom samplers and plugins; pagedllm has none, so only None/{} is accepted
    extra_args: dict | None = None
    # bad_words as token id sequences, filled in by the input processor (it has the tokenizer)
    bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias is not None:
            _check(isinstance(self.logit_bias, dict), "logit_bias", self.logit_bias, "must be a dict token id -> bias")
            self.logit_bias = {_token_id(k, "logit_bias"): v for k, v in self.logit_bias.items()} or None
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.top_k == 0 or self.top_k is None:  # vLLM: 0 (and None) mean "off", like -1
            self.top_k = -1
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.bad_words is not None:
            _check(isinstance(self.bad_words, list) and all(isinstance(w, str) and w.strip() for w in self.bad_words),
                   "bad_words", self.bad_words, "must be a list of non-blank strings")
        self._validate()
        self._validate_structured()

    def _validate(self) -> None:
        _check(isinstance(self.n, int) and self.n >= 1, "n", self.n, "must be an integer >= 1")
        if self.best_of is not None:
            _check(isinstance(self.best_of, int) and self.best_of >= self.n, "best_of", self.best_of,
                   f"must be an integer >= n ({self.n})")
        _check(self.temperature >= 0, "temperature", self.temperature, "must be >= 0")
        _check(0 < self.top_p <= 1, "top_p", self.top_p, "must be in (0, 1]")
        _check(isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 1), "top_k", self.top_k,
               "must be -1 or 0 (disabled) or >= 1")
        _check(0 <= self.min_p <= 1, "min_p", self.min_p, "must be in [0, 1]")
        _check(-2 <= self.presence_penalty <= 2, "presence_penalty", self.presence_penalty, "must be in [-2, 2]")
        _check(-2 <= self.frequency_penalty <= 2, "frequency_penalty", self.frequency_penalty, "must be in [-2, 2]")
        _check(self.repetition_penalty > 0, "repetition_penalty", self.repetition_penalty, "must be > 0")
        if self.max_tokens is not None:
            _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", self.max_tokens,
                   "must be an integer >= 1")
        _check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", self.min_tokens,
               "must be an integer >= 0")
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens", self.min_tokens,
                   f"must be <= max_tokens ({self.max_tokens})")
        # the upper bound is the engine's max_logprobs, checked by the input processor
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check(isinstance(value, int) and not isinstance(value, bool) and value >= -1, name, value,
                       "must be an integer >= 0, or -1 (the whole vocabulary)")
        if self.truncate_prompt_tokens is not None:
            _check(isinstance(self.truncate_prompt_tokens, int) and not isinstance(self.truncate_prompt_tokens, bool)
                   and (self.truncate_prompt_tokens >= 1 or self.truncate_prompt_tokens == -1),
                   "truncate_prompt_tokens", self.truncate_prompt_tokens, "must be an integer >= 1, or -1")
        if self.seed is not None:
            _check(isinstance(self.seed, int) and not isinstance(self.seed, bool) and SEED_MIN <= self.seed <= SEED_MAX,
                   "seed", self.seed, f"must be an integer in [{SEED_MIN}, {SEED_MAX}] (int64)")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", self.stop, "must be non-empty strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               self.stop_token_ids, "must be non-negative integers")
        for token, bias in (self.logit_bias or {}).items():
            _check(isinstance(bias, (int, float)) and not isinstance(bias, bool) and -100 <= bias <= 100,
                   f"logit_bias[{token}]", bias, "must be a number in [-100, 100]")
        if self.allowed_token_ids is not None:
            _check(len(self.allowed_token_ids) > 0 and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                           for t in self.allowed_token_ids),
                   "allowed_token_ids", self.allowed_token_ids, "must be a non-empty list of non-negative integers")
        _check(self.output_kind in tuple(RequestOutputKind), "output_kind", self.output_kind,
               "must be a RequestOutputKind, or 'cumulative', 'delta' or 'final_only'")
        self.output_kind = RequestOutputKind(self.output_kind).value
        self._validate_unsupported()

    def _validate_structured(self) -> None:
        if self.structured_outputs is None:
            return
        _check(isinstance(self.structured_outputs, StructuredOutputsParams), "structured_outputs",
               self.structured_outputs, "must be a StructuredOutputsParams (or a dict of its fields)")
        # the grammar decides where the output ends: masking EOS before then could leave no token
        _check(self.min_tokens == 0, "min_tokens", self.min_tokens, "must be 0 with structured_outputs")

    def _validate_unsupported(self) -> None:
        """vLLM fields pagedllm cannot honour: only their no-op values are accepted."""
        _check(self.spaces_between_special_tokens is True, "spaces_between_special_tokens",
               self.spaces_between_special_tokens,
               "only True is supported (output text is what the tokenizer's decode() returns)")
        _check(not self.extra_args, "extra_args", self.extra_args,
               "must be None or empty: pagedllm has no custom sampler or plugin that reads them")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def num_sequences(self) -> int:
        """Sequences sampled for the request: best_of when set, else n."""
        return self.best_of or self.n

    def clone(self) -> SamplingParams:
        from copy import deepcopy
        return deepcopy(self)


@dataclass
class BeamSearchParams:
    """Beam search, as vLLM's ``LLM.beam_search``."""

    beam_width: int
    max_tokens: int | None  # None: as many as max_model_len leaves after the prompt
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    # Hugging Face semantics: False (heuristic stop), True (stop once beam_width beams finished)
    # or "never" (canonical beam search: stop only when no running beam can still win)
    early_stopping: bool | str = False

    def __post_init__(self):
        _check(isinstance(self.beam_width, int) and self.beam_width >= 1, "beam_width", self.beam_width,
               "must be an integer >= 1")
        _check(self.early_stopping in (True, False, "never"), "early_stopping", self.early_stopping,
               "must be True, False or 'never'")
        _check(self.temperature == 0, "temperature", self.temperature, "beam search is deterministic: use 0")
        _check(self.max_tokens is None or isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens",
               self.max_tokens, "must be an integer >= 1 or None")

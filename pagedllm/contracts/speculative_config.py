"""``speculative_config`` (vLLM's names), parsed and validated into a typed frozen config."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

METHODS = ("ngram", "draft_model")
FIELDS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")
_NGRAM_MODEL_NAMES = ("ngram", "[ngram]")  # vLLM's older spelling: model="[ngram]"
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's default when neither prompt_lookup_min nor _max is given


@dataclass(frozen=True)
class SpeculativeConfig:
    """How drafts are proposed and how many per step.

    ``method="ngram"``: the last ``prompt_lookup_max`` .. ``prompt_lookup_min`` tokens are looked
    up earlier in the sequence and the tokens that followed are proposed. ``method="draft_model"``:
    ``model`` (a directory or Hub id with the target's vocabulary) proposes them; ``draft`` is
    its resolved ModelConfig (set by ``EngineArgs.create_engine_config``).
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None
    draft: Any = field(default=None, compare=False, repr=False)  # pagedllm.config.ModelConfig

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method={self.method!r} is not supported; use one of {METHODS}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"speculative_config.num_speculative_tokens={k!r} must be an integer >= 1")
        if self.method == "ngram":
            self._check_ngram()
        elif self.prompt_lookup_max is not None or self.prompt_lookup_min is not None:
            raise ValueError("speculative_config.prompt_lookup_max/prompt_lookup_min apply only to method='ngram', "
                             f"not {self.method!r}")
        elif not self.model:
            raise ValueError("speculative_config.model (the draft model's directory or Hub id) is required for "
                             "method='draft_model'")

    def _check_ngram(self) -> None:
        if self.model is not None:
            raise ValueError(f"speculative_config.model={self.model!r} cannot be set with method='ngram' "
                             "(n-gram lookup uses no model)")
        for name in ("prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config.{name}={value!r} must be an integer >= 1")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min={self.prompt_lookup_min} must be <= "
                             f"prompt_lookup_max={self.prompt_lookup_max}")


def parse_speculative_config(raw: dict | str | None) -> SpeculativeConfig | None:
    """A dict (or its JSON text, as ``--speculative-config`` gives it) with vLLM's field names."""
    if raw is None:
        return None
    if isinstance(raw, str):
        raw = load_json_object(raw)
    if not isinstance(raw, dict):
        raise TypeError(f"speculative_config must be a dict or its JSON text, got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(FIELDS))
    if unknown:
        raise ValueError(f"speculative_config has unknown field(s) {unknown}; allowed: {list(FIELDS)}")
    values = dict(raw)
    if "num_speculative_tokens" not in values:
        raise ValueError("speculative_config.num_speculative_tokens is required (the drafts proposed per step)")
    values["method"] = _method(values)
    if values["method"] == "ngram":
        if values.get("model") in _NGRAM_MODEL_NAMES:
            values.pop("model")
        _default_lookup(values)
    return SpeculativeConfig(**values)


def _method(values: dict) -> str:
    method, model = values.get("method"), values.get("model")
    if method is not None:
        return method
    if model in _NGRAM_MODEL_NAMES:
        return "ngram"
    if model is not None:
        return "draft_model"
    raise ValueError(f"speculative_config needs a method (one of {METHODS}) or a draft model")


def _default_lookup(values: dict) -> None:
    """vLLM's rule: neither bound given -> both 5; one given -> the other equals it."""
    lo, hi = values.get("prompt_lookup_min"), values.get("prompt_lookup_max")
    if lo is None and hi is None:
        lo = hi = DEFAULT_PROMPT_LOOKUP
    values["prompt_lookup_min"] = hi if lo is None else lo
    values["prompt_lookup_max"] = lo if hi is None else hi


def load_json_object(text: str, name: str = "speculative_config") -> dict:
    """A JSON-object option's text (``--speculative-config``, ``--pooler-config``) -> dict
    (ValueError naming the option ``name`` when it is not a JSON object)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{name}={text!r} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name}={text!r} must be a JSON object")
    return value


def check_draft_vocab(draft_vocab: int, target_vocab: int, model: str) -> None:
    """The draft proposes token ids the target verifies: both must use the same vocabulary."""
    if draft_vocab != target_vocab:
        raise ValueError(f"speculative_config.model={model!r} has vocab_size={draft_vocab}, but the target model "
                         f"has {target_vocab}; the draft must share the target's vocabulary")

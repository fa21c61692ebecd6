"""Request fields the server does not honour are refused, never dropped.

vLLM accepts an unknown field with a warning; a client that sends ``guided_json`` to a server that
drops it believes its output is constrained when it is not. So every top-level field a request
model does not declare is a 400 naming it: a vLLM field this server does not implement (accepted
only at its no-op value, which clients often send explicitly), or a field vLLM does not know.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel

# vLLM's completion / chat request fields that pagedllm does not implement -> their no-op value
UNSUPPORTED_VLLM_FIELDS: dict[str, Any] = {
    "prompt_embeds": None,
    "logits_processors": None,
    "kv_transfer_params": None,
    "vllm_xargs": None,
    "mm_processor_kwargs": None,  # completions (chat requests declare it: their image / video parts)
    "media_io_kwargs": None,
    "reasoning_effort": None,
}


class RequestFieldError(ValueError):
    """A request field that cannot be honoured; ``param`` is the field the 400 names."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def check_request_fields(req: BaseModel) -> None:
    """Raises RequestFieldError for the first undeclared field that is not at its no-op value."""
    for name, value in (req.model_extra or {}).items():
        if name not in UNSUPPORTED_VLLM_FIELDS:
            raise RequestFieldError(f"unknown field {name!r}: this server refuses fields it does not implement "
                                    "rather than ignore them", name)
        neutral = UNSUPPORTED_VLLM_FIELDS[name]
        if not _is_no_op(value, neutral):
            raise RequestFieldError(f"{name}={value!r} is not supported by this server (only "
                                    f"{'null' if neutral is None else repr(neutral)} is accepted)", name)


def _is_no_op(value: Any, neutral: Any) -> bool:
    if value is None:
        return True
    if isinstance(neutral, bool) or isinstance(value, bool):
        return value is neutral
    return value == neutral

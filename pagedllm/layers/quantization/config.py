"""Reading ``quantization_config``: refusals that name the field, its value and what is allowed."""
from __future__ import annotations


def require(ok: bool, field: str, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"quantization_config.{field}={value!r} is not supported; allowed: {allowed}")


def require_choice(cfg: dict, field: str, choices: tuple) -> object:
    value = cfg.get(field)
    require(value in choices, field, value, f"one of {choices}")
    return value

"""Small shared helpers (no heavy imports: safe to use from CLI entry points)."""

from __future__ import annotations

import math
import re

__all__ = ["parse_size", "format_size", "human_bytes", "cdiv"]

# Decimal (SI) and binary (IEC) units. Bare single letters (K/M/G/T) are treated as
# binary, the way most memory flags (docker, JVM) read them.
_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_size(value: str | int | float, name: str | None = None) -> int:
    """Parse a memory size into a whole number of bytes.

    Accepts ints (bytes), and strings such as ``"80GiB"``, ``"4GB"``, ``"512MiB"``,
    ``"1.5 GiB"``, ``"1e9"`` or ``"4096"``. ``KB/MB/GB/TB`` are powers of 1000,
    ``KiB/MiB/GiB/TiB`` and bare ``K/M/G/T`` are powers of 1024; units are
    case-insensitive. Raises ``ValueError`` naming the offending value for anything
    unparsable, negative, non-finite or not a whole number of bytes (and the parameter,
    when ``name`` is given).
    """
    if name is not None:
        try:
            return parse_size(value)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
    if isinstance(value, bool):
        raise ValueError(f"invalid size {value!r}: expected a number of bytes or a string like '80GiB'")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"invalid size {value!r}: must not be negative")
        return value
    if isinstance(value, float):
        number, mult = value, 1
    elif isinstance(value, str):
        number, mult = _split_size_string(value)
    else:
        raise ValueError(f"invalid size {value!r}: expected int, float or str, got {type(value).__name__}")
    return _to_bytes(value, number, mult)


def _split_size_string(value: str) -> tuple[float, int]:
    """Split ``"1.5GiB"`` into ``(1.5, 2**30)``; raise ValueError naming ``value``."""
    match = _SIZE_RE.match(value)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"invalid size {value!r}: expected a number with an optional unit "
            "(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. '80GiB', '4GB', '1e9'"
        )
    return float(match.group(1)), _UNITS[unit]


def _to_bytes(original: object, number: float, mult: int) -> int:
    """Scale ``number`` by ``mult``; the result must be a finite, whole, non-negative byte count."""
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"invalid size {original!r}: must be a finite, non-negative number")
    total = number * mult
    rounded = round(total)
    if abs(total - rounded) > 1e-6 * max(1.0, total):
        raise ValueError(f"invalid size {original!r}: not a whole number of bytes")
    return int(rounded)


def format_size(num_bytes: int | float, precision: int = 2) -> str:
    """Render a byte count with binary units, e.g. ``524288 -> '512.00 KiB'``."""
    value = float(num_bytes)
    sign = "-" if value < 0 else ""
    value = abs(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            break
        value /= 1024
    if unit == "B":
        return f"{sign}{int(value)} B"
    return f"{sign}{value:.{precision}f} {unit}"


human_bytes = format_size


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(-a // b)


def check_int(name: str, value: object, low: int) -> None:
    """ValueError naming ``name`` unless ``value`` is an int (not a bool) >= ``low``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}={value!r} is invalid: must be an integer >= {low}")


def check_seconds(name: str, value: object) -> None:
    """ValueError naming ``name`` unless ``value`` is a finite number of seconds > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}={value!r} is invalid: must be a positive number of seconds")


class graph_break:  # noqa: N801 -- used as a decorator, like torch.compiler.disable
    """Decorates a method as a ``torch.compile`` graph break, applied when compiling starts
    (``apply_graph_breaks``) rather than at class definition.

    Why: ``@torch.compiler.disable`` on a class body imports ``torch._dynamo`` with the module,
    ~0.4-1.2 s of every start-up (a third of ``import pagedllm`` on a 2-core host), although only
    ``compile_model`` ever compiles."""

    registered: list[tuple[type, str, object]] = []

    def __init__(self, fn):
        self.fn = fn

    def __set_name__(self, owner: type, name: str) -> None:
        graph_break.registered.append((owner, name, self.fn))
        setattr(owner, name, self.fn)  # the plain method until something compiles

    @classmethod
    def apply_graph_breaks(cls) -> None:
        """Wraps every registered method in ``torch.compiler.disable`` (idempotent); call before
        ``torch.compile``."""
        import torch
        for owner, name, fn in cls.registered:
            if owner.__dict__.get(name) is fn:
                setattr(owner, name, torch.compiler.disable(fn))

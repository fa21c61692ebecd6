"""Small shared helpers."""
from __future__ import annotations

import re

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}


def parse_size(value: int | float | str, name: str = "size") -> int:
    """Bytes from an int/float or a string such as ``"4GiB"``, ``"512MiB"``, ``"2GB"``, ``"1e9"``."""
    if isinstance(value, bool):
        raise ValueError(f"{name}={value!r} is not a size; use bytes or a string like '4GiB'")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"{name}={value!r} must be >= 0 bytes")
        return int(value)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(value))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"{name}={value!r} is not a size; use bytes or a number with a unit "
            "(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. '4GiB'"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.2f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.2f} TiB"

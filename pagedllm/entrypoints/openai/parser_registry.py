"""What the tool-call and reasoning parsers share: a name -> class registry for a server flag, and
the held-back tail of a marker that is still being written."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

P = TypeVar("P")


class ParserRegistry(dict[str, type[P]], Generic[P]):
    """The parsers registered for ``option`` (the flag / field that names one)."""

    def __init__(self, option: str):
        super().__init__()
        self.option = option

    def register(self, name: str) -> Callable[[type[P]], type[P]]:
        def add(cls: type[P]) -> type[P]:
            self[name] = cls
            return cls
        return add

    def check(self, name: str) -> None:
        """ValueError naming the option and listing the registered names, unless ``name`` is one."""
        if name not in self:
            raise ValueError(f"{self.option}={name!r} is invalid: must be one of {sorted(self)}")

    def create(self, name: str, **request: Any) -> P:
        """A parser for one request; ``request`` is what that parser reads from it (tools, template kwargs)."""
        self.check(name)
        return self[name](**request)


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``marker`` (held back
    while streaming: it may still become the marker)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def held_tail(text: str, markers: tuple[str, ...], final: bool) -> int:
    """How much of ``text``'s tail to hold back while streaming: the longest that may still grow
    into one of ``markers`` (nothing once the text is final)."""
    return 0 if final else max(partial_suffix(text, m) for m in markers)

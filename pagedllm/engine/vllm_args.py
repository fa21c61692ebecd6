"""vLLM's engine argument names as data: ``vllm_engine_args.json`` (regenerated from a vLLM wheel by
``scripts/vllm_engine_args.py``) lists every ``EngineArgs`` / ``LLM(...)`` keyword of the vLLM it
records, with vLLM's default, its flags and pagedllm's decision:

- ``honoured``: an EngineArgs field of ours (the same name, or ``field``) does what vLLM's does;
- ``noop``: accepted at the values in ``accept`` (vLLM's defaults unless listed), which change
  nothing here; any other value is refused naming the argument, the value and ``reason``;
- ``deprecated``: deprecated or removed in vLLM; accepted like ``noop``, or mapped (``task``).

EngineArgs declares the honoured names itself and gets one field per noop / deprecated name from
here (arg_utils.py), so ``LLM(**kwargs)``, ``EngineArgs(...)`` and every CLI command accept them.
"""
from __future__ import annotations

import difflib
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TABLE_PATH = Path(__file__).with_name("vllm_engine_args.json")
STATUSES = ("honoured", "noop", "deprecated")


@dataclass(frozen=True)
class VllmArg:
    """One vLLM keyword: its default, how its flag parses (``type``) and what pagedllm does with it."""

    name: str
    status: str
    default: Any
    type: str  # bool, bool_or_str, int, float, str, json, list, list_int (see scripts/vllm_engine_args.py)
    flags: tuple[str, ...] = ()
    accept: tuple = ()  # noop / deprecated: the values that change nothing here
    reason: str = ""
    field: str | None = None  # the EngineArgs field it maps to, when not its own name
    cli: str | None = None  # why no flag is generated for it (another parser declares it), or None
    llm_only: bool = False  # a keyword of LLM(...) only (chat_template), not of EngineArgs

    def accepts(self, value: Any) -> bool:
        return any(_same(value, ok) for ok in self.accept)

    def refusal(self, value: Any) -> str:
        allowed = ", ".join(repr(v) for v in self.accept)
        return f"{self.name}={value!r} is not supported: {self.reason} (accepted: {allowed})"


def _same(value: Any, ok: Any) -> bool:
    """Equality that keeps True apart from 1 and treats sets / tuples as lists (JSON has only lists)."""
    if isinstance(value, bool) or isinstance(ok, bool):
        return value is ok
    if isinstance(value, (set, frozenset, tuple)):
        value = sorted(value) if isinstance(value, (set, frozenset)) else list(value)
    return type(value) is type(ok) and value == ok if isinstance(ok, (list, dict)) else value == ok


@functools.cache
def load_table() -> dict:
    return json.loads(TABLE_PATH.read_text())


def vllm_version() -> str:
    return load_table()["vllm_version"]


@functools.cache
def vllm_args() -> dict[str, VllmArg]:
    """Every name in the table, by name."""
    out = {}
    for name, e in load_table()["args"].items():
        if e["status"] not in STATUSES:
            raise ValueError(f"{TABLE_PATH.name}: {name} has status {e['status']!r}; decide one of {STATUSES}")
        accept = e.get("accept", [e.get("default"), *([e["llm_default"]] if "llm_default" in e else [])])
        out[name] = VllmArg(name, e["status"], e.get("default"), e["type"], tuple(e.get("flags", ())),
                            tuple(accept), e.get("reason", ""), e.get("field"), e.get("cli"), e["in"] == ["LLM"])
    return out


def unknown_keyword_error(name: str, valid: list[str], owner: str = "EngineArgs") -> TypeError:
    """The TypeError for a keyword neither vLLM nor pagedllm has, naming the closest valid one."""
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return TypeError(f"{owner} got an unexpected keyword argument {name!r}{hint} (pagedllm accepts every keyword "
                     f"of vLLM {vllm_version()}'s EngineArgs and LLM, see pagedllm/engine/{TABLE_PATH.name})")

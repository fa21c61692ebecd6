"""LoRA adapters on the server (vLLM's): ``--lora-modules name=path`` (or the JSON form with
``base_model_name``), each served as a model of its own (``model=name`` picks it, ``/v1/models``
lists it with its ``parent``); ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``
(this module's ``router``, in the app's ROUTERS) answer when ``PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING``
(or vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``) was set at start-up, and are a 404 saying so otherwise.

Every adapter gets a fresh ``lora_int_id``: one reloaded under the same name is another adapter
to the engine, so its slots and prefix-cache blocks never mix with the old weights.
"""
from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import dataclass

from fastapi import APIRouter, Request
from pydantic import BaseModel

from pagedllm.engine.async_engine import AsyncLLMEngine
from pagedllm.lora.request import LoRARequest

from .protocol import ModelCard
from .serving_base import ERROR_RESPONSES, ServingError, serving_of


@dataclass(frozen=True)
class LoRAModulePath:
    """One ``--lora-modules`` entry."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoRAModulePath:
    """``name=path`` or ``{"name": ..., "path": ..., "base_model_name": ...}`` (argparse type)."""
    if text.lstrip().startswith("{"):
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"--lora-modules {text!r}: invalid JSON ({e})") from None
        unknown = sorted(set(raw) - {"name", "path", "base_model_name"}) if isinstance(raw, dict) else None
        if unknown is None or unknown or not raw.get("name") or not raw.get("path"):
            raise argparse.ArgumentTypeError(f"--lora-modules {text!r}: a JSON entry needs \"name\" and \"path\" "
                                             "(and optionally \"base_model_name\"), nothing else")
        return LoRAModulePath(raw["name"], raw["path"], raw.get("base_model_name"))
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"--lora-modules {text!r}: expected name=path or a JSON object")
    return LoRAModulePath(name, path)


def add_lora_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("LoRA adapters")
    g.add_argument("--lora-modules", nargs="+", type=parse_lora_module, default=None,
                   help='adapters to serve (with --enable-lora), as name=path or {"name": ..., "path": ..., '
                        '"base_model_name": ...}; requests pick one with model=name')


def check_lora_modules(modules: list[LoRAModulePath] | None, enable_lora: bool) -> None:
    """Adapters to serve need an engine with LoRA slots (checked before the model loads)."""
    if modules and not enable_lora:
        raise ValueError(f"--lora-modules {' '.join(f'{m.name}={m.path}' for m in modules)} needs --enable-lora")


class LoRAModels:
    """The adapters this server serves, by name (a name is not also a base model name)."""

    def __init__(self, engine: AsyncLLMEngine, base_names: list[str], runtime_updates: bool = False):
        self.engine, self.base_names = engine, base_names
        self.runtime_updates = runtime_updates  # the (un)load routes answer
        self.adapters: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def get(self, name: str | None) -> LoRARequest | None:
        return self.adapters.get(name) if name is not None else None

    def new_request(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        if not name or not path:
            raise ServingError("lora_name and lora_path are required", 400, "lora_name" if not name else "lora_path")
        if name in self.adapters or name in self.base_names:
            raise ServingError(f"The lora adapter '{name}' has already been loaded", 400, "lora_name")
        if self.engine.engine.lora_registry is None:
            raise ServingError("LoRA adapters need a server started with --enable-lora", 400, "lora_name")
        return LoRARequest(name, next(self._ids), path, base_model_name)

    def add_static(self, modules: list[LoRAModulePath]) -> None:
        """``--lora-modules``, checked before the server starts (ValueError: the server does not start)."""
        for m in modules:
            try:
                lora = self.new_request(m.name, m.path, m.base_model_name)
            except ServingError as e:
                raise ValueError(f"--lora-modules {m.name}={m.path}: {e.message}") from None
            self.engine.engine.check_lora(lora)
            self.adapters[m.name] = lora

    async def load(self, name: str, path: str) -> LoRARequest:
        lora = self.new_request(name, path)
        try:
            await self.engine.check_lora(lora)
        except ValueError as e:
            raise ServingError(str(e), 400, "lora_path") from None
        self.adapters[name] = lora
        return lora

    def unload(self, name: str) -> None:
        """Requests in flight keep running with it; new ones can no longer name it."""
        if self.adapters.pop(name, None) is None:
            raise ServingError(f"The lora adapter '{name}' cannot be found", 404, "lora_name", "NotFoundError")

    def cards(self, max_model_len: int) -> list[ModelCard]:
        return [ModelCard(id=name, root=lora.lora_path, parent=lora.base_model_name or self.base_names[0],
                          max_model_len=max_model_len) for name, lora in self.adapters.items()]


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None


router = APIRouter()


def _models(raw: Request) -> LoRAModels:
    """The server's adapters, when runtime loading is on (else a 404 that says how to turn it on)."""
    models = serving_of(raw).lora_models
    if models is None or not models.runtime_updates:
        raise ServingError("loading LoRA adapters at run time is off: start the server with --enable-lora and "
                           "PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING=1 (or VLLM_ALLOW_RUNTIME_LORA_UPDATING=1)", 404,
                           code="NotFoundError")
    return models


@router.post("/v1/load_lora_adapter", responses=ERROR_RESPONSES)
async def load_lora_adapter(request: LoadLoRAAdapterRequest, raw: Request):
    await _models(raw).load(request.lora_name, request.lora_path)
    return f"Success: LoRA adapter '{request.lora_name}' added successfully."


@router.post("/v1/unload_lora_adapter", responses=ERROR_RESPONSES)
async def unload_lora_adapter(request: UnloadLoRAAdapterRequest, raw: Request):
    _models(raw).unload(request.lora_name)
    return f"Success: LoRA adapter '{request.lora_name}' removed successfully."

"""Sleep mode for one rank's weights (``ModelRunner.sleep`` / ``wake_up``; the KV pool is the runner's).

vLLM's levels, without its CUDA allocator hooks (each tensor is moved or dropped here by hand):

- level 1: the weights go to host memory (pinned, on CUDA) and come back on ``wake_up``; on the
  CPU they already live in host memory and stay where they are.
- level 2: the weights' storage is freed (on every device); ``wake_up`` allocates fresh,
  uninitialized storage of the same shapes, which the caller fills with a weight update
  (``collective_rpc("load_weights", ...)``) or a reload of the checkpoint
  (``collective_rpc("reload_weights")``). Buffers (rotary tables) are kept, as in vLLM.

The Parameter objects themselves stay (only their ``.data`` changes), so tied weights stay tied
and the weight loaders that hold them keep working.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

LEVELS = (1, 2)
TAGS = ("weights", "kv_cache")


def check_level(level: object) -> int:
    if isinstance(level, bool) or level not in LEVELS:
        raise ValueError(f"level={level!r} must be 1 (offload the weights to host memory) or 2 (discard them)")
    return level


def check_tags(tags: object) -> tuple[str, ...]:
    """``None`` means both; otherwise a list of "weights" / "kv_cache"."""
    if tags is None:
        return TAGS
    if isinstance(tags, str) or not all(t in TAGS for t in tags):
        raise ValueError(f"tags={tags!r} must be None (wake everything) or a list of {list(TAGS)}")
    return tuple(dict.fromkeys(tags))


@dataclass
class SleepingWeights:
    """What a sleeping rank keeps of its weights: host copies (level 1 on CUDA), or only each
    parameter's shape and dtype (level 2)."""

    device: torch.device
    discarded: bool  # level 2: the values are gone
    host: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> host copy (level 1 on CUDA)
    specs: dict[str, tuple[torch.Size, torch.dtype]] = field(default_factory=dict)  # name -> shape, dtype (level 2)


def _params(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Every distinct parameter (a tied one once), by name."""
    return list(model.named_parameters())


def put_to_sleep(model: nn.Module, level: int, device: torch.device,
                 asleep: SleepingWeights | None) -> SleepingWeights | None:
    """Frees the weights' device memory for ``level``; returns what ``wake`` needs (None: nothing
    was moved, the CPU at level 1). Called on weights already asleep at level 1, level 2 drops them."""
    if asleep is not None and (asleep.discarded or level == 1):
        return asleep
    if level == 1:
        return _offload(model, device) if device.type != "cpu" else None
    state = SleepingWeights(device, discarded=True)
    offloaded = asleep.host if asleep is not None else {}  # level 1 on CUDA first: the shapes are the copies'
    for name, t in _params(model):
        state.specs[name] = (offloaded.get(name, t).shape, t.dtype)
        t.data = torch.empty(0, dtype=t.dtype, device=device)
    if device.type != "cpu":  # buffers are kept, in host memory
        _move_buffers(model, torch.device("cpu"))
    return state


def _offload(model: nn.Module, device: torch.device) -> SleepingWeights:
    state = SleepingWeights(device, discarded=False)
    for name, t in _params(model):
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t.data)
        state.host[name] = host
        t.data = torch.empty(0, dtype=t.dtype, device=device)
    _move_buffers(model, torch.device("cpu"))
    return state


def _move_buffers(model: nn.Module, to: torch.device) -> None:
    buffers = [(module, attr, t) for module in model.modules() for attr, t in module.named_buffers(recurse=False)]
    for module, attr, t in buffers:
        setattr(module, attr, t.to(to))


def wake(model: nn.Module, state: SleepingWeights | None) -> None:
    """Gives the weights device storage again: their host copies (level 1), or fresh uninitialized
    storage of the same shapes (level 2; the caller loads values into it)."""
    if state is None:
        return
    with torch.no_grad():
        for name, t in _params(model):
            if state.discarded:
                shape, dtype = state.specs[name]
                t.data = torch.empty(shape, dtype=dtype, device=state.device)
            else:
                t.data = state.host.pop(name).to(state.device)
    if state.device.type != "cpu":
        _move_buffers(model, state.device)

"""Counts host synchronisations on the CPU, where CUDA cannot report them.

On a GPU every device->host read (``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()``, a tensor in
an ``if``, ``nonzero``, a boolean-mask index, whose result shape depends on the data) and every
host->device copy from pageable memory without ``non_blocking`` (``torch.tensor(..., device=)``,
``.to(device)``) makes the host wait for the stream. ``HostSyncs`` patches each of them to record
its call site, except inside the two sanctioned transfers: ``to_device`` (one pinned,
non-blocking upload) and ``to_host`` (the step's one fetch), which are counted by name instead,
with the reads they make themselves. A test then asserts "one fetch, no stray sync" for the code
it runs on CPU tensors exactly as it would run on CUDA ones.

``no_host_syncs`` is the strict mode for code that CUDA graphs capture: the first stray sync
(or a ``torch.cuda`` synchronize) raises ``HostSync`` at its call site, and only the Triton
interpreter's kernel launches may read tensors (a compiled launch reads none).
"""
from __future__ import annotations

import contextlib
import traceback

import torch

_READS = ("item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "__int__", "__float__", "__index__", "unique",
          "bincount", "equal", "allclose")
# torch functions that read a value on the host inside C++ (an output size, a Python bool): on
# CUDA ``bincount`` reads the input's maximum, ``equal`` / ``allclose`` their answer
_FUNCTIONS = ("nonzero", "masked_select", "unique", "argwhere", "bincount", "equal", "allclose")


class HostSync(AssertionError):
    """A host synchronisation where none may happen (``no_host_syncs``)."""


class HostSyncs:
    """``stray``: call sites of syncs outside the sanctioned transfers; ``fetches`` / ``uploads``
    / ``kernels``: calls of ``to_host`` / ``to_device`` / a Triton kernel launch (the
    interpreter reads its CPU tensors; a compiled launch does not); ``fetch_reads``: the reads
    ``to_host`` made. With ``armed`` False nothing is recorded outside ``arm_within``'s calls;
    with ``strict`` a stray sync raises ``HostSync`` instead of being recorded."""

    def __init__(self, armed: bool = True, strict: bool = False):
        self.stray: list[str] = []
        self.fetches = self.uploads = self.kernels = self.fetch_reads = self.armed_calls = 0
        self.armed, self.strict = armed, strict
        self._inside: str | None = None
        self._redispatch = 0  # depth of calls the index watch passes on (their records were made outside)

    def arm_within(self, monkeypatch, owner, name: str) -> None:
        """Records only during calls of ``owner.name`` (counted in ``armed_calls``)."""
        original = getattr(owner, name)

        def armed(*args, **kwargs):
            self.armed, self.armed_calls = True, self.armed_calls + 1
            try:
                return original(*args, **kwargs)
            finally:
                self.armed = False
        monkeypatch.setattr(owner, name, armed)

    def record(self, what: str) -> None:
        if not self.armed or self._redispatch:
            return
        if self._inside == "fetch":
            self.fetch_reads += 1
        elif self._inside is None:
            site = f"{what} at {traceback.format_stack(limit=3)[0].strip()}"
            if self.strict:
                raise HostSync(f"host synchronisation on a capturable path: {site}")
            self.stray.append(site)

    def sanctioned(self, kind: str, fn):
        def wrapper(*args, **kwargs):
            if self._inside is not None:  # nested: counted by the outer one
                return fn(*args, **kwargs)
            self._inside = kind
            counter = {"fetch": "fetches", "upload": "uploads", "kernel": "kernels"}[kind]
            setattr(self, counter, getattr(self, counter) + 1)
            try:
                return fn(*args, **kwargs)
            finally:
                self._inside = None
        return wrapper


def _is_mask(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def _repeats_read_on_host(input=None, repeats=None, *args, **kwargs) -> bool:
    if kwargs.get("output_size") is not None:
        return False
    return isinstance(input if repeats is None else repeats, torch.Tensor)  # (one argument: the repeats)


def _has_device(args, kwargs) -> bool:
    return "device" in kwargs or any(isinstance(a, (torch.device, str)) for a in args)


@contextlib.contextmanager
def count_host_syncs(monkeypatch, fetch_sites: list, upload_sites: list, kernel_sites: tuple = (),
                     armed: bool = True, strict: bool = False):
    """Patches the sync points; ``fetch_sites`` / ``upload_sites`` / ``kernel_sites``: ``(module,
    name)`` pairs bound to ``to_host`` / ``to_device`` / a kernel launcher in the code under test."""
    syncs = HostSyncs(armed, strict)

    def watch(owner, name, what, when=lambda *a, **k: True):
        original = getattr(owner, name)

        def patched(*args, **kwargs):
            if when(*args, **kwargs):
                syncs.record(what)
            return original(*args, **kwargs)
        monkeypatch.setattr(owner, name, patched)

    for name in _READS:
        watch(torch.Tensor, name, f"Tensor.{name}")
    for name in _FUNCTIONS:
        watch(torch, name, f"torch.{name}")
    # without output_size the result's length is the repeats' sum, read on the host
    for owner in (torch, torch.Tensor):
        watch(owner, "repeat_interleave", "repeat_interleave without output_size", _repeats_read_on_host)
    watch(torch, "where", "torch.where(condition) (a nonzero)", lambda *a, **k: len(a) + len(k) == 1)
    watch(torch.Tensor, "to", "Tensor.to(device)", lambda self, *a, **k: _has_device(a, k))
    watch(torch.Tensor, "cuda", "Tensor.cuda")
    watch(torch.cuda, "synchronize", "torch.cuda.synchronize")
    for owner in (torch.cuda.Stream, torch.cuda.Event):
        watch(owner, "synchronize", f"{owner.__name__}.synchronize")
    for name in ("tensor", "as_tensor"):
        watch(torch, name, f"torch.{name}(device=)", lambda *a, **k: "device" in k)
    for module, name in fetch_sites:
        monkeypatch.setattr(module, name, syncs.sanctioned("fetch", getattr(module, name)))
    for module, name in upload_sites:
        monkeypatch.setattr(module, name, syncs.sanctioned("upload", getattr(module, name)))
    for module, name in kernel_sites:
        monkeypatch.setattr(module, name, syncs.sanctioned("kernel", getattr(module, name)))
    with _MaskIndexWatch(syncs):
        yield syncs


class _MaskIndexWatch(torch.overrides.TorchFunctionMode):
    """Boolean-mask indexing and writes (their result's size is read on the host), seen as torch
    functions. Not by patching ``Tensor.__getitem__``: assigning that dunder on the class gives it
    a sequence slot that outlives the undo, after which ``torch.tensor([t0, t1])`` of 0-d tensors
    raises "len() of a 0-d tensor" in every later test of the process."""

    def __init__(self, syncs: HostSyncs):
        super().__init__()
        self.syncs = syncs

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__):
            if self.syncs._inside is None and len(args) > 1 and _is_mask(args[1]):
                self.syncs.record("boolean-mask index" if func is torch.Tensor.__getitem__ else "boolean-mask write")
            return func(*args, **(kwargs or {}))
        # a method the guard patched reaches here again as its patched self (already recorded)
        self.syncs._redispatch += 1
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.syncs._redispatch -= 1


def interpreted_launches() -> list:
    """The Triton interpreter's launch, as a ``kernel_sites`` entry: it copies every tensor
    argument to the host and back, which a compiled launch does not."""
    from triton.runtime.interpreter import InterpretedFunction
    return [(InterpretedFunction, "run")]


@contextlib.contextmanager
def no_host_syncs(monkeypatch, fetch_sites: list = (), upload_sites: list = (), armed: bool = True):
    """``count_host_syncs`` in strict mode with every interpreted kernel launch sanctioned: code
    run inside it (or, with ``armed`` False, inside ``arm_within``'s calls) raises ``HostSync``
    at the first device->host read, data-dependent shape or synchronize."""
    with count_host_syncs(monkeypatch, list(fetch_sites), list(upload_sites), interpreted_launches(), armed,
                          strict=True) as syncs:
        yield syncs

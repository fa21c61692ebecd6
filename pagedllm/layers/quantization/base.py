"""The interface every weight-only format implements, and what the formats share.

A format is one file in this package. Its :class:`QuantMethod` says, per linear layer:

* ``create_weights(layer)``: the parameters the checkpoint stores (named as in the checkpoint,
  each with a ``weight_loader`` that unpacks and shards the tensor); nothing for formats we
  quantize ourselves at load time (int8, int4);
* ``process_weights(layer)``: once everything is loaded, the runtime layout: int8 codes with a
  per-row scale (``int8.py``), or the group-wise 4/8-bit layout of ``grouped.py``;
* the runtime layout's own ``apply`` (``int8.int8_linear`` / ``grouped.grouped_linear``), which
  ``LinearBase.forward`` picks by the weight's dtype.
"""
from __future__ import annotations

import threading

import torch

from pagedllm.native import bindings


class QuantMethod:
    """One weight-only format: what a linear layer holds and how it gets there."""

    name: str = ""

    def create_weights(self, layer: torch.nn.Module) -> None:
        """Registers the checkpoint's tensors as parameters of ``layer`` (before loading)."""

    def process_weights(self, layer: torch.nn.Module) -> None:
        """Turns the loaded (or float) weights of ``layer`` into the runtime layout."""
        raise NotImplementedError


# one float32 buffer per thread, reused: no page faults per call; thread-local, so a finished
# thread's buffer (a whole layer's weight) is freed with it rather than kept under a dead id
_scratch = threading.local()


def scratch_buffer(numel: int) -> torch.Tensor:
    """A float32 CPU buffer of ``numel`` elements that the thread's next call overwrites."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < numel:
        buf = _scratch.buf = torch.empty(numel, dtype=torch.float32)
    return buf[:numel]


def unpack_int32(packed: torch.Tensor, bits: int, dim: int, order: list[int] | None = None) -> torch.Tensor:
    """Unpacks ``32 / bits`` codes per int32 along ``dim`` (code k at bits ``k*bits``, low first),
    returning int32 codes with that dimension ``32 / bits`` times longer. ``order[j]`` is the slot
    holding the j-th value of each word (AWQ interleaves); default: slot j."""
    per_word = 32 // bits
    if dim == 0:
        return unpack_int32(packed.t(), bits, 1, order).t()
    words = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(0, 32, bits, dtype=torch.int64)
    codes = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [rows, words, per_word]
    if order is not None:
        codes = codes[..., order]
    return codes.reshape(packed.shape[0], packed.shape[1] * per_word).to(torch.int32)


def pack_int32(codes: torch.Tensor, bits: int, dim: int, order: list[int] | None = None) -> torch.Tensor:
    """The inverse of :func:`unpack_int32` (for tests and our own fixtures): unsigned codes in,
    int32 words out."""
    per_word = 32 // bits
    if dim == 0:
        return pack_int32(codes.t(), bits, 1, order).t().contiguous()
    rows, cols = codes.shape
    c = codes.to(torch.int64).reshape(rows, cols // per_word, per_word)  # [rows, words, per_word]
    if order is not None:
        c = c[..., torch.argsort(torch.tensor(order))]
    words = (c << torch.arange(0, 32, bits, dtype=torch.int64)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def native_f32(x: torch.Tensor) -> bindings.NativeLibrary | None:
    """The C library when ``x`` is a float32 CPU input (and not under torch.compile), else None:
    the quantized projections' C kernels apply (without it they widen the weight in torch)."""
    cpu_f32 = x.device.type == "cpu" and x.dtype == torch.float32 and not torch.compiler.is_compiling()
    return bindings.library() if cpu_f32 and bindings.is_available() else None

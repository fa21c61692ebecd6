"""A step's inputs to the device in one host->device copy.

On CUDA each separate ``.to(device)`` of a small array is its own synchronous copy (~10 us of
launch and driver latency apiece). The runner (token ids, positions, sample rows,
query_start_loc, seq_lens, block tables, slot mapping) and the sampler (its floats, masks and
ids) instead pack every array of the step as raw bytes into one pinned buffer, copy it once
(non-blocking), and view each part back on the device as its array's dtype and shape, so
nothing is cast or rounded. On the CPU, ``torch.from_numpy`` shares memory, so nothing is
packed or copied.

A replayed CUDA graph (``worker/cuda_graphs.py``) reads its inputs from persistent tensors: given
as ``out``, those receive their arrays from the same single copy (copied, and cast to their own
dtype, on the device instead of becoming new tensors).
"""
from __future__ import annotations

import numpy as np
import torch

# The dtypes that cross between host and device (both directions: device_to_host.py refuses the
# others); bfloat16 and the fp8 types have no numpy dtype.
NUMPY_DTYPES = {torch.bool: np.bool_, torch.uint8: np.uint8, torch.int8: np.int8, torch.int16: np.int16,
                torch.int32: np.int32, torch.int64: np.int64, torch.float16: np.float16, torch.float32: np.float32,
                torch.float64: np.float64}
TORCH_DTYPES = {np.dtype(n): t for t, n in NUMPY_DTYPES.items()}


def to_device(arrays: dict[str, np.ndarray], device: torch.device | str, pack: bool | None = None,
              out: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Tensors on ``device`` with each array's shape and dtype (any dtype of ``NUMPY_DTYPES``).

    ``pack`` defaults to "not on the CPU"; tests force it to check the packed round trip.
    ``out``: tensors (of the arrays' shapes) to fill in place for some names; returned as given.
    """
    device = torch.device(device)
    out = out or {}
    if pack is None:
        pack = device.type != "cpu"
    if pack:
        tensors = _packed_copy(arrays, device)
    else:
        tensors = {k: torch.from_numpy(np.ascontiguousarray(a)).to(device) for k, a in arrays.items()}
    return {k: _into(out[k], tensors[k]) if k in out else tensors[k] for k in arrays}


def _packed_copy(arrays: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    """The arrays as raw bytes in one pinned buffer, one non-blocking copy, viewed back on the device.

    Parts go in by decreasing item size, so each starts at a multiple of its own item size and
    the device-side ``view(dtype)`` is legal.
    """
    for k, a in arrays.items():
        if a.dtype not in TORCH_DTYPES:
            raise TypeError(f"to_device: array {k!r} has dtype {a.dtype}; allowed: {sorted(map(str, TORCH_DTYPES))}")
    order = sorted(arrays, key=lambda k: -arrays[k].dtype.itemsize)
    sizes = [arrays[k].nbytes for k in order]
    host = torch.empty(sum(sizes), dtype=torch.uint8, pin_memory=device.type == "cuda")
    buf, offset = host.numpy(), 0
    for k, n in zip(order, sizes):
        buf[offset:offset + n] = np.ascontiguousarray(arrays[k]).reshape(-1).view(np.uint8)
        offset += n
    flat = host.to(device, non_blocking=True)
    return {k: part.view(TORCH_DTYPES[arrays[k].dtype]).view(arrays[k].shape)  # [bytes] -> the array's shape
            for k, part in zip(order, flat.split(sizes))}


def _into(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    if dst.shape != src.shape:
        raise ValueError(f"out tensor of shape {tuple(dst.shape)} cannot take an array of shape {tuple(src.shape)}")
    return dst.copy_(src)  # casts to dst's dtype on the device

"""A step's integer inputs to the device in one host->device copy.

On CUDA each separate ``.to(device)`` of a small array is its own synchronous copy (~10 us of
launch and driver latency apiece). The runner instead packs every int array of the step
(token ids, positions, sample rows, query_start_loc, seq_lens, block tables, slot mapping)
into one pinned int64 buffer, copies it once (non-blocking), and splits it on the device,
casting back to each array's dtype there. On the CPU, ``torch.from_numpy`` shares memory, so
nothing is packed or copied.

A replayed CUDA graph (``worker/cuda_graphs.py``) reads its inputs from persistent tensors: given
as ``out``, those receive their arrays from the same single copy (the device-side cast writes
into them instead of into new tensors).
"""
from __future__ import annotations

import numpy as np
import torch


def to_device(arrays: dict[str, np.ndarray], device: torch.device | str, pack: bool | None = None,
              out: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Tensors on ``device`` with each array's shape and dtype (integer arrays only).

    ``pack`` defaults to "not on the CPU"; tests force it to check the packed round trip.
    ``out``: tensors (of the arrays' shapes) to fill in place for some names; returned as given.
    """
    device = torch.device(device)
    out = out or {}
    if pack is None:
        pack = device.type != "cpu"
    if not pack:
        return {k: _into(out.get(k), torch.from_numpy(np.ascontiguousarray(a)).to(device)) for k, a in arrays.items()}
    sizes = [a.size for a in arrays.values()]
    host = torch.empty(sum(sizes), dtype=torch.int64, pin_memory=device.type == "cuda")
    np.concatenate([a.ravel() for a in arrays.values()], out=host.numpy(), casting="same_kind")
    flat = host.to(device, non_blocking=True)
    result = {}
    for (name, a), part in zip(arrays.items(), flat.split(sizes)):
        t = part.view(a.shape)  # [flat] -> the array's shape
        if name in out:
            result[name] = _into(out[name], t)
        else:
            result[name] = t if a.dtype == np.int64 else t.to(torch.from_numpy(a[:0]).dtype)
    return result


def _into(dst: torch.Tensor | None, src: torch.Tensor) -> torch.Tensor:
    if dst is None:
        return src
    if dst.shape != src.shape:
        raise ValueError(f"out tensor of shape {tuple(dst.shape)} cannot take an array of shape {tuple(src.shape)}")
    return dst.copy_(src)  # casts to dst's dtype on the device


def to_device_bytes(arrays: dict[str, np.ndarray], device: torch.device | str,
                    pack: bool | None = None) -> dict[str, torch.Tensor]:
    """``to_device`` for arrays of any numeric or bool dtype (the sampler's floats, masks and
    ids): packed as raw bytes into one pinned buffer, copied once (non-blocking), and viewed back
    on the device as each array's dtype and shape, so nothing is cast or rounded.

    Parts go in by decreasing item size, so each starts at a multiple of its own item size and
    the device-side ``view(dtype)`` is legal. ``pack`` as in ``to_device``.
    """
    device = torch.device(device)
    if pack is None:
        pack = device.type != "cpu"
    if not pack:
        return {k: torch.from_numpy(np.ascontiguousarray(a)).to(device) for k, a in arrays.items()}
    order = sorted(arrays, key=lambda k: -arrays[k].dtype.itemsize)
    sizes = [arrays[k].nbytes for k in order]
    host = torch.empty(sum(sizes), dtype=torch.uint8, pin_memory=device.type == "cuda")
    buf, offset = host.numpy(), 0
    for k, n in zip(order, sizes):
        buf[offset:offset + n] = np.ascontiguousarray(arrays[k]).reshape(-1).view(np.uint8)
        offset += n
    flat = host.to(device, non_blocking=True)
    return {k: part.view(torch.from_numpy(np.empty(0, arrays[k].dtype)).dtype).view(arrays[k].shape)
            for k, part in zip(order, flat.split(sizes))}

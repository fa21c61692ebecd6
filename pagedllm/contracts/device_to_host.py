"""A step's results to the host in one device->host transfer.

Every ``.item()``, ``.tolist()`` or ``.cpu()`` of a CUDA tensor waits for the stream to drain:
the sampler's old epilogue made about three such waits per step (sampled ids, their logprobs,
top-logprobs), and prompt logprobs added their own. Instead, every result of the step stays on
the device until ``to_host`` packs them as raw bytes into one flat tensor, copies it into pinned
memory (non-blocking) and waits once; the arrays it returns are numpy views of that one copy.

On the CPU the same packing runs, so the CPU tests count exactly the transfer a GPU makes.
"""
from __future__ import annotations

import numpy as np
import torch

from pagedllm.contracts.host_to_device import NUMPY_DTYPES


def to_host(tensors: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """Numpy arrays with each tensor's shape and dtype, after one device->host copy (none when
    ``tensors`` is empty). Tensors may live on one device; bfloat16 has no numpy dtype and is refused."""
    if not tensors:
        return {}
    for name, t in tensors.items():
        if t.dtype not in NUMPY_DTYPES:
            raise TypeError(f"to_host: tensor {name!r} has dtype {t.dtype}; allowed: {sorted(map(str, NUMPY_DTYPES))}")
    order = sorted(tensors, key=lambda k: -tensors[k].element_size())  # each part aligned to its item size
    parts = [tensors[k].detach().contiguous().view(-1).view(torch.uint8) for k in order]
    flat = parts[0] if len(parts) == 1 else torch.cat(parts)  # (a greedy step's one array: no packing copy)
    host, arrays, offset = _copy_to_host(flat), {}, 0
    for k in order:
        t = tensors[k]
        n = t.numel() * t.element_size()
        arrays[k] = host[offset:offset + n].view(NUMPY_DTYPES[t.dtype]).reshape(t.shape)
        offset += n
    return arrays


def _copy_to_host(flat: torch.Tensor) -> np.ndarray:
    """The step's one device->host transfer (``flat``: uint8) and its one wait."""
    if flat.device.type == "cpu":
        return flat.numpy()
    host = torch.empty(flat.shape, dtype=torch.uint8, pin_memory=True)
    host.copy_(flat, non_blocking=True)
    _wait(flat.device)
    return host.numpy()


def _wait(device: torch.device) -> None:
    """Blocks until the copy (and everything queued before it) is done: the step's only sync."""
    torch.cuda.current_stream(device).synchronize()

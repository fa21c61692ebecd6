"""Owns the KV tensors: one pool allocated once, plus block copies (CoW) and swaps."""
from __future__ import annotations

import torch

from pagedllm.kv_cache.spec import KVCacheSpec
from pagedllm.platform import huge_page_empty, huge_pages_enabled


class CacheEngine:
    """KV cache storage ``spec.pool_shape``: ``[num_layers, num_tensors, num_blocks, num_kv_heads,
    block_size, head_size]`` (kv_cache/spec.py).

    With K/V per head, layer ``l``'s key cache is ``kv[l, 0]`` and value cache ``kv[l, 1]``; with
    an MLA latent its one latent cache is ``kv[l, 0]``. ``layer_caches[l]`` is that tuple. A block
    id indexes dim 2 of every layer at once, so copying or swapping a block moves it in all layers
    together, whatever the spec.
    """

    def __init__(self, spec: KVCacheSpec, num_layers: int, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, num_cpu_blocks: int = 0):
        """``num_layers``: the layers this rank's pipeline stage holds."""
        shape = spec.pool_shape(num_layers, num_blocks, block_size)
        # on the CPU in 2 MiB pages, which attention streams 1.4-1.6x faster at batch 64
        # (platform.huge_page_empty), and written once here, as vLLM's torch.zeros does: left to
        # first touch, every run that reached never-written blocks faulted their pages in while
        # serving (the block pool hands out fresh blocks first), ~0.6 s of a 5 s batch-64 run of
        # the 34M model on this VM (first touch ~0.7 GB/s); zeroing the 1 GiB pool takes ~1.4 s
        # at start-up, and a pool that does not fit fails here rather than mid-request
        if device.type == "cpu":
            self.kv = huge_page_empty(shape, dtype) if huge_pages_enabled() else torch.empty(shape, dtype=dtype)
            self.kv.zero_()
        else:
            self.kv = torch.empty(shape, dtype=dtype, device=device)
        cpu_shape = shape[:2] + (num_cpu_blocks,) + shape[3:]
        pin = device.type == "cuda"
        self.cpu_kv = torch.empty(cpu_shape, dtype=dtype, pin_memory=pin) if num_cpu_blocks else None
        self.layer_caches = [tuple(self.kv[i, j] for j in range(shape[1])) for i in range(shape[0])]

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write plan: ``dst`` becomes a copy of ``src`` in every layer."""
        if not pairs:
            return
        src, dst = (torch.tensor(x, device=self.kv.device) for x in zip(*pairs))
        self.kv[:, :, dst] = self.kv[:, :, src]

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Device blocks -> CPU blocks, batched into one gather and one copy."""
        if not pairs:
            return
        src, dst = (torch.tensor(x) for x in zip(*pairs))
        self.cpu_kv[:, :, dst] = self.kv[:, :, src.to(self.kv.device)].to("cpu")

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """CPU blocks -> device blocks."""
        if not pairs:
            return
        src, dst = (torch.tensor(x) for x in zip(*pairs))
        self.kv[:, :, dst.to(self.kv.device)] = self.cpu_kv[:, :, src].to(self.kv.device, non_blocking=True)

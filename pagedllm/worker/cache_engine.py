"""Owns the KV tensors: one pool allocated once, plus block copies (CoW) and swaps."""
from __future__ import annotations

import atexit
import math
import os
import threading

import torch

from pagedllm import envs
from pagedllm.kv_cache.spec import KVCacheSpec
from pagedllm.platform import HUGE_PAGE, huge_page_empty, huge_pages_enabled, populate_range

# bytes of the pool populated before the engine starts (~0.2 s at this VM's 2 MiB first-touch
# rate): the blocks of the first requests; the rest follows in the background
PREFAULT_SYNC_BYTES = 64 * 1024**2


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
        self._prefault: PoolPrefault | None = None
        if device.type == "cpu":
            self.kv = self._cpu_pool(shape, dtype)
        else:
            self.kv = torch.empty(shape, dtype=dtype, device=device)
        cpu_shape = shape[:2] + (num_cpu_blocks,) + shape[3:]
        pin = device.type == "cuda"
        self.cpu_kv = torch.empty(cpu_shape, dtype=dtype, pin_memory=pin) if num_cpu_blocks else None
        self.layer_caches = [tuple(self.kv[i, j] for j in range(shape[1])) for i in range(shape[0])]

    def _cpu_pool(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The pool on the CPU, zero, in 2 MiB pages where the host gives them (attention streams
        them 1.4-1.6x faster at batch 64, platform.huge_page_empty), with its pages faulted in
        before the engine writes them: left to first touch, every run that reached never-written
        blocks faulted their pages in while serving (the block pool hands out fresh blocks first),
        ~0.6 s of a 5 s batch-64 run of the 34M model on this VM.

        Faulting in the whole 4 GiB default pool took 10-13 s of start-up on this VM (2 MiB first
        touch there runs at ~0.3 GB/s), so only the first blocks are populated here and the rest
        in block-id order by a background thread (``PoolPrefault``), ahead of the block pool's
        fresh-first hand-out; populating never changes contents, so it is safe beside the engine's
        writes. At nice 19 the thread only runs while the engine leaves a core idle: under load from
        the start, the engine's KV writes fault the pages in themselves, and a batch-64 run of the
        34M model took 7.2-7.9 s until the pool was all populated (24 s idle), 5.8-6.1 s after
        (benchmarks/probes/kv_prefault.py).
        ``PAGEDLLM_KV_PREFAULT=startup`` populates the whole pool here instead. A kernel without
        ``MADV_POPULATE_WRITE`` (before 5.14) zeroes the pool here, as
        vLLM's ``torch.zeros`` does."""
        mode = prefault_mode()  # a bad PAGEDLLM_KV_PREFAULT is refused on every host
        if not huge_pages_enabled():
            return torch.zeros(shape, dtype=dtype)
        kv = huge_page_empty(shape, dtype)  # a fresh anonymous mapping: reads zero
        self._prefault = PoolPrefault.start(kv, everything=mode == "startup")
        if self._prefault is None:
            kv.zero_()
        return kv

    def close(self) -> None:
        """Stops the background prefault (the pool may be dropped at once after)."""
        if self._prefault is not None:
            self._prefault.stop()

    def wait_prefaulted(self, timeout: float | None = None) -> bool:
        """Blocks until every page of the CPU pool is faulted in; False on timeout."""
        return self._prefault is None or self._prefault.wait(timeout)

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


PREFAULT_MODES = ("background", "startup")


def prefault_mode() -> str:
    """``PAGEDLLM_KV_PREFAULT``, checked against ``PREFAULT_MODES``."""
    mode = envs.PAGEDLLM_KV_PREFAULT
    if mode not in PREFAULT_MODES:
        raise ValueError(f"PAGEDLLM_KV_PREFAULT={mode!r} must be one of {', '.join(PREFAULT_MODES)}")
    return mode


class PoolPrefault:
    """Faults in a CPU KV pool's pages in block-id order: the first ``PREFAULT_SYNC_BYTES`` at
    once, the rest on a background thread at the lowest CPU priority (nice 19), so it runs on
    cycles the engine leaves idle and start-up does not wait for a pool of gigabytes.

    The pool ``[layers, tensors, blocks, ...]`` holds block ``b`` in every ``(layer, tensor)``
    slab, so each chunk of blocks is populated in all slabs together. The thread works on the
    slabs' addresses only (``platform.populate_range``), and is stopped at interpreter exit."""

    def __init__(self, kv: torch.Tensor):
        self._kv = kv  # held while the thread runs: the addresses below stay this pool's
        slabs = kv.flatten(0, 1)  # [layers * tensors, blocks, ...]
        self._bases = [slab.data_ptr() for slab in slabs]
        self._block_bytes = slabs[0, 0].numel() * kv.element_size()  # one block of one slab
        self._num_blocks = slabs.shape[1]
        self._chunk = max(1, math.ceil(HUGE_PAGE / self._block_bytes))  # blocks per chunk: >= 2 MiB per slab
        self._stopped = threading.Event()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def start(cls, kv: torch.Tensor, everything: bool = False) -> PoolPrefault | None:
        """Populates the first blocks (``everything``: all of them) and starts the thread for the
        rest; None where the kernel cannot populate (nothing was done)."""
        self = cls(kv)
        per_block = self._block_bytes * len(self._bases)  # one block in every slab
        sync_blocks = self._num_blocks if everything else \
            min(self._num_blocks, max(1, PREFAULT_SYNC_BYTES // per_block))
        if not self._populate(0, sync_blocks):
            return None
        if sync_blocks == self._num_blocks:
            self._finish()
        else:
            _RUNNING.add(self)
            self._thread = threading.Thread(target=self._run, args=(sync_blocks,), daemon=True,
                                            name="pagedllm-kv-prefault")
            self._thread.start()
        return self

    def _populate(self, lo: int, hi: int) -> bool:
        offset, length = lo * self._block_bytes, (hi - lo) * self._block_bytes
        return all([populate_range(base + offset, length) for base in self._bases])

    def _run(self, first: int) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # this thread only (Linux)
        except (OSError, AttributeError):
            pass
        for lo in range(first, self._num_blocks, self._chunk):
            if self._stopped.is_set():
                break
            self._populate(lo, min(self._num_blocks, lo + self._chunk))
        self._finish()

    def _finish(self) -> None:
        self._kv = None  # let the pool go with its engine
        _RUNNING.discard(self)
        self._done.set()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)


_RUNNING: set[PoolPrefault] = set()


@atexit.register
def _stop_prefaults() -> None:
    """Joins the running prefault threads before the interpreter tears down (a chunk takes
    milliseconds)."""
    for prefault in list(_RUNNING):
        prefault.stop()

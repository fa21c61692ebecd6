"""Facts about the machine this process runs on: memory and cores (Linux /proc, with fallbacks),
CPU tensors in 2 MiB pages, and how glibc's malloc keeps freed memory."""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import mmap
import os
import resource

import torch

from pagedllm import envs

_FALLBACK_RAM = 8 * 1024**3  # no /proc/meminfo (not Linux): assume a small machine


def available_ram() -> int:
    """Bytes of RAM the kernel could hand out now without swapping (``MemAvailable``)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return _FALLBACK_RAM


def physical_cores() -> int:
    """Distinct physical cores (hyper-threads counted once); the logical CPU count if unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            return count_physical_cores(f) or os.cpu_count() or 1
    except OSError:
        return os.cpu_count() or 1


def cpu_vendor() -> str:
    """/proc/cpuinfo's ``vendor_id`` ("GenuineIntel", "AuthenticAMD", ...); "" where unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def count_physical_cores(cpuinfo_lines) -> int:
    """Distinct (physical id, core id) pairs in /proc/cpuinfo's lines: "core id" restarts at 0 on
    each socket, so the pair, not the core id, names a core."""
    cores, socket = set(), ""
    for line in cpuinfo_lines:
        if line.startswith("physical id"):
            socket = line.split(":")[1].strip()
        elif line.startswith("core id"):
            cores.add((socket, line.split(":")[1].strip()))
    return len(cores)


def peak_rss() -> int:
    """This process's peak resident set size so far, in bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ---------------------------------------------------------------------------------- 2 MiB pages
HUGE_PAGE = 2 * 1024**2


def huge_pages_supported() -> bool:
    """Transparent huge pages can be asked for (Linux: ``madvise(MADV_HUGEPAGE)``), and the
    kernel's THP mode is not ``never``."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def huge_pages_enabled() -> bool:
    """The engine keeps CPU weights and the CPU KV pool in 2 MiB pages: ``PAGEDLLM_HUGE_PAGES``
    is on and the host can give them (``huge_pages_supported``)."""
    return envs.PAGEDLLM_HUGE_PAGES and huge_pages_supported()


def huge_page_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor in an anonymous mapping of its own, aligned to 2 MiB and
    advised ``MADV_HUGEPAGE``, so the kernel backs it with 2 MiB pages as it is touched.

    Why: streaming reads (a decode step's weights, the KV blocks attention reads) run up to ~1.4x
    faster from 2 MiB pages on this project's CPU hosts (benchmarks/RESULTS.md, "2 MiB pages"):
    with 4 KiB pages every 4 KiB of a stream costs a TLB miss, and under a hypervisor each miss
    is a two-level page walk. torch's allocator advises huge pages only under
    ``THP_MEM_ALLOC_ENABLE=1``, for every allocation, which also makes each step's temporary
    buffers fault in 2 MiB at a time (measured slower end to end). The mapping lives as long as
    the tensor (the storage holds it); pages are committed only as they are first written, as
    with ``torch.empty``.
    """
    if any(d < 0 for d in shape):  # as torch.empty refuses it: a negative size would map a wrong-sized area
        raise ValueError(f"huge_page_empty: shape {tuple(shape)} has a negative dimension")
    nbytes = math.prod(shape) * dtype.itemsize
    area = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    area.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(area, dtype=torch.uint8)  # keeps ``area`` alive
    start = -raw.data_ptr() % HUGE_PAGE  # the mapping is only 4 KiB-aligned
    return raw[start:start + nbytes].view(dtype).view(shape)


_MADV_POPULATE_WRITE = 23  # linux/mman.h, Linux 5.14+


def populate_range(address: int, length: int) -> bool:
    """Faults in the pages under the bytes ``[address, address + length)`` of this process as
    written, without changing what they hold (``madvise(MADV_POPULATE_WRITE)``), so later writes
    do not fault; False where the kernel has no such advice (then nothing happened).

    Why not ``zero_()``: that writes, so it may only run before anyone uses the memory; populating
    leaves the contents alone and is safe beside the engine writing into the same pages (the KV
    pool is populated in the background while the engine serves). Plain integers and one libc
    call (no torch): a background thread can run it up to interpreter exit, where a thread inside
    torch's C++ is ended by an unwind that aborts the process."""
    page = mmap.PAGESIZE
    start = address // page * page  # madvise wants a page boundary: the page holding the first byte
    return _libc().madvise(ctypes.c_void_p(start), ctypes.c_size_t(address + length - start),
                           _MADV_POPULATE_WRITE) == 0


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def huge_page_views(specs: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
    """Uninitialised contiguous CPU tensors of the given (shape, dtype)s, side by side in one
    mapping in 2 MiB pages (``huge_page_empty``), each at a 4 KiB boundary: one mapping wastes at
    most one page, where one per tensor would commit a whole 2 MiB page for each small one."""
    sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in specs]
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + -(-n // 4096) * 4096)
    arena = huge_page_empty((starts[-1],), torch.uint8)
    return [arena[start:start + n].view(dtype).view(shape)  # the arena's storage, the spec's shape
            for (shape, dtype), start, n in zip(specs, starts, sizes)]


def huge_page_copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Contiguous copies of the CPU ``tensors`` in one mapping in 2 MiB pages (``huge_page_views``)."""
    views = huge_page_views([(tuple(t.shape), t.dtype) for t in tensors])
    return [view.copy_(t) for view, t in zip(views, tensors)]


def module_to_huge_pages(module: torch.nn.Module, min_bytes: int = 64 * 1024) -> int:
    """Moves every CPU parameter and buffer of ``module`` of at least ``min_bytes`` into 2 MiB
    pages, all in one mapping (``huge_page_views``); returns the bytes moved. A tensor shared
    between modules (tied embeddings) stays shared: each distinct view is copied once. Tensors
    move one at a time and the original is let go at once, so loading peaks at the model plus
    one tensor, not twice the model (the mapping commits pages only as they are written)."""
    slots: dict[tuple, list[tuple[torch.nn.Module, str, bool]]] = {}  # view -> (module, name, is a Parameter)
    for sub in module.modules():
        for name, t in [*sub.named_parameters(recurse=False), *sub.named_buffers(recurse=False)]:
            if t.device.type == "cpu" and t.numel() * t.element_size() >= min_bytes:
                key = (t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
                slots.setdefault(key, []).append((sub, name, isinstance(t, torch.nn.Parameter)))
    views = huge_page_views([(shape, dtype) for _, dtype, shape, _ in slots])
    for held, view in zip(slots.values(), views):
        first, name, _ = held[0]
        view.copy_(getattr(first, name).detach())
        for sub, name, is_param in held:
            if is_param:
                getattr(sub, name).data = view  # the same Parameter object: ties and outside references hold
            else:
                setattr(sub, name, view)
    return sum(v.numel() * v.element_size() for v in views)


# ------------------------------------------------------------------------------------ malloc
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)
HEAP_TRIM_THRESHOLD = 1 << 30


def keep_freed_memory() -> bool:
    """Makes glibc's malloc serve every allocation from its heaps and keep up to
    ``HEAP_TRIM_THRESHOLD`` of freed memory there (``mallopt``: no ``mmap`` for big blocks, trim
    threshold 1 GiB); True if applied (glibc, ``PAGEDLLM_HEAP_MALLOC`` on).

    Why: glibc maps every block above its mmap threshold (at most 32 MiB) afresh and unmaps it on
    free, and trims the heap top past twice that, so each prefill step's big activations (a
    2048-token chunk: 16-46 MiB per GEMM output) are faulted in and zeroed by the kernel page by
    page, every layer, every step. Kept in the heap they are reused (after a few steps' growth:
    an aligned request does not always fit the chunk just freed): 2048-token prefill steps ran
    1.35x faster on the 34M model and 1.19x on the 200M one (benchmarks/RESULTS.md); vLLM's CPU
    docs recommend preloading TCMalloc for its allocations. Call it once the weights are
    loaded (their load-time copies are gone by then); the process then keeps up to the peak of
    its activations' memory, not more than the trim threshold above what is in use at the top.
    """
    if not envs.PAGEDLLM_HEAP_MALLOC:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return False
    if not hasattr(libc, "gnu_get_libc_version"):  # not glibc (musl's mallopt does nothing)
        return False
    return bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, HEAP_TRIM_THRESHOLD))

"""Machine facts the engine sizes itself from, and the process's malloc settings."""
import resource

import pytest
import torch

from pagedllm import platform
from pagedllm.platform import count_physical_cores, physical_cores


def _cpuinfo(sockets: int, cores: int, threads: int) -> list[str]:
    lines = []
    for s in range(sockets):
        for c in range(cores):
            for _ in range(threads):
                lines += [f"processor\t: {len(lines)}\n", f"physical id\t: {s}\n", f"core id\t\t: {c}\n", "\n"]
    return lines


def test_cores_are_counted_per_socket_and_hyperthreads_once():
    assert count_physical_cores(_cpuinfo(sockets=1, cores=2, threads=2)) == 2
    assert count_physical_cores(_cpuinfo(sockets=2, cores=2, threads=2)) == 4  # core ids restart per socket
    assert count_physical_cores([]) == 0


def test_this_machine_has_at_least_one_core():
    assert physical_cores() >= 1


def _faults_to_fill(nbytes: int) -> int:
    """Minor page faults taken to allocate and write ``nbytes`` of CPU tensor (then freed)."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(nbytes // 4, dtype=torch.float32).fill_(1.0)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_freed_activations_stay_in_the_heap(monkeypatch):
    """After keep_freed_memory, 40 MiB blocks (above glibc's largest mmap threshold, 32 MiB)
    allocated and freed in turn stop faulting once the heap holds enough free space for them
    (a few rounds: torch's aligned allocations do not always fit the chunk just freed); by
    default glibc unmaps each one and every round takes a fault per 4 KiB page. (Below 64 MiB:
    a thread moved off the main arena, as a worker that ran engine threads may be, allocates
    from 64 MiB heaps and maps anything larger.)"""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            if "[always]" in f.read():
                pytest.skip("THP [always]: malloc's own mappings fault 2 MiB at a time, nothing to tell apart")
    except OSError:
        pass
    monkeypatch.setenv("PAGEDLLM_HEAP_MALLOC", "0")
    assert platform.keep_freed_memory() is False
    monkeypatch.setenv("PAGEDLLM_HEAP_MALLOC", "1")
    if not platform.keep_freed_memory():
        pytest.skip("not glibc")
    nbytes, few = 40 * 2**20, 40 * 2**20 // 4096 // 8
    rounds = [_faults_to_fill(nbytes) for _ in range(16)]  # the heap grows until the sizes fit
    assert all(f < few for f in rounds[-3:]), rounds

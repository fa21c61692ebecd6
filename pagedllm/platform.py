"""Facts about the machine this process runs on: memory and cores (Linux /proc, with fallbacks)."""
from __future__ import annotations

import os
import resource

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

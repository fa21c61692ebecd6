"""How the CPU engine's OpenMP threads share the machine: how many, on which CPUs, how they wait.

Imports nothing that loads torch, so ``pagedllm/__init__.py`` can call :func:`configure_openmp`
before torch (and with it libgomp) is loaded: libgomp reads ``OMP_WAIT_POLICY`` once, when it
is loaded, and never again.

Why it matters: a CPU engine runs every step as a series of OpenMP parallel regions, each ending
in a barrier. With the cores to itself that is fast; beside another busy process a barrier waits
for the thread the kernel has just preempted, while its partner spins for it (libgomp spins up to
300,000 pause loops, milliseconds on current CPUs, before sleeping). On a 2-core host beside one
busy loop, batch-1 decode fell to 0.3x of its alone speed (the fair share is 0.5x), and on a host
loaded by several processes two spinning threads ran 10x slower than one (benchmarks/RESULTS.md,
"Beside a noisy neighbour"). Three things here answer it:

* :func:`configure_openmp`: ``OMP_WAIT_POLICY=PASSIVE`` (sleep at once at a barrier) when the
  machine is already oversubscribed at start-up (:func:`oversubscribed`); an explicit setting is
  never overridden.
* :class:`ThreadsBind`: ``PAGEDLLM_CPU_OMP_THREADS_BIND`` (vLLM's ``VLLM_CPU_OMP_THREADS_BIND``
  is honoured the same way): ``auto`` (default), ``nobind``, or CPU lists (``0-3``, ``0,2,4-5``;
  ``|`` between the ranks of one host) that pin one thread per listed CPU.
* :class:`AdaptiveThreads`: under ``auto`` with no fixed thread count, the engine re-checks every
  0.4 s how many of its CPUs other processes keep busy (:class:`CpuUsage`, from
  ``/proc/stat``) and runs as many threads as there are CPUs left, at least one: one thread has
  no barrier to wait at, so beside a busy neighbour it keeps a whole core.
"""
from __future__ import annotations

import os
import re
import sys
import time
from dataclasses import dataclass

from pagedllm import envs

BIND_AUTO, BIND_NONE = "auto", "nobind"
_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


# ---------------------------------------------------------------------------------- CPU lists
def parse_cpu_list(text: str, name: str = "cpu list") -> tuple[int, ...]:
    """``"0-3,8"`` -> ``(0, 1, 2, 3, 8)`` (Linux's cpu-list syntax, as ``taskset -c``); ValueError
    naming ``name`` for anything else, a descending range or a CPU given twice."""
    cpus: list[int] = []
    for part in text.split(","):
        m = _RANGE.match(part.strip())
        if not m:
            raise ValueError(f"{name}={text!r}: {part.strip()!r} is not a CPU number or range like 0-3")
        lo, hi = int(m[1]), int(m[2] if m[2] is not None else m[1])
        if hi < lo:
            raise ValueError(f"{name}={text!r}: the range {part.strip()!r} runs backwards")
        cpus.extend(range(lo, hi + 1))
    if len(set(cpus)) != len(cpus):
        raise ValueError(f"{name}={text!r} names a CPU more than once")
    return tuple(cpus)


@dataclass(frozen=True)
class ThreadsBind:
    """Where the CPU engine's threads run (``PAGEDLLM_CPU_OMP_THREADS_BIND``).

    ``mode``: ``auto`` (the thread count follows the free cores when not fixed; no pinning),
    ``nobind`` (the thread count stays as set; no pinning) or ``cpus`` (``cpus[rank]``: one thread
    pinned to each CPU of the rank's list, as many threads as CPUs)."""

    mode: str = BIND_AUTO
    cpus: tuple[tuple[int, ...], ...] = ()

    @classmethod
    def parse(cls, text: str, name: str = "PAGEDLLM_CPU_OMP_THREADS_BIND") -> ThreadsBind:
        """``auto``, ``nobind``, or CPU lists separated by ``|`` (one per rank of this host,
        e.g. ``0-3|4-7``); ValueError naming ``name`` otherwise, or when ranks share a CPU."""
        text = text.strip()
        if text in (BIND_AUTO, BIND_NONE):
            return cls(text)
        lists = tuple(parse_cpu_list(part, name) for part in text.split("|"))
        flat = [c for cpus in lists for c in cpus]
        if len(set(flat)) != len(flat):
            raise ValueError(f"{name}={text!r}: two ranks' CPU lists share a CPU")
        return cls("cpus", lists)

    def rank_cpus(self, local_rank: int, ranks_on_host: int) -> tuple[int, ...] | None:
        """The CPUs this rank's threads are pinned to (None unless ``mode == "cpus"``); ValueError
        when there is not one list per rank of this host."""
        if self.mode != "cpus":
            return None
        if len(self.cpus) != ranks_on_host:
            raise ValueError(f"PAGEDLLM_CPU_OMP_THREADS_BIND gives {len(self.cpus)} CPU list(s) for "
                             f"{ranks_on_host} rank(s) on this host: give one list per rank, separated by '|'")
        return self.cpus[local_rank]


def threads_bind() -> ThreadsBind:
    """The binding in force: ``PAGEDLLM_CPU_OMP_THREADS_BIND``, else vLLM's ``VLLM_CPU_OMP_THREADS_BIND``."""
    ours = envs.PAGEDLLM_CPU_OMP_THREADS_BIND
    if ours is not None:
        return ThreadsBind.parse(ours)
    theirs = envs.VLLM_CPU_OMP_THREADS_BIND
    return ThreadsBind() if theirs is None else ThreadsBind.parse(theirs, "VLLM_CPU_OMP_THREADS_BIND")


def check_cpus_allowed(cpus: tuple[int, ...], allowed: set[int]) -> None:
    """ValueError when a pinned CPU is outside this process's affinity mask."""
    outside = sorted(set(cpus) - allowed)
    if outside:
        raise ValueError(f"PAGEDLLM_CPU_OMP_THREADS_BIND pins threads to CPU(s) {outside}, outside the CPUs this "
                         f"process may run on ({format_cpu_list(sorted(allowed))})")


def format_cpu_list(cpus: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    parts, start = [], None
    for i, c in enumerate(cpus):
        start = c if start is None else start
        if i + 1 == len(cpus) or cpus[i + 1] != c + 1:
            parts.append(str(c) if c == start else f"{start}-{c}")
            start = None
    return ",".join(parts)


def allowed_cpus() -> set[int]:
    """The CPUs this process may run on (its affinity mask; every CPU where that is unknown)."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


# ---------------------------------------------------------------------------------- wait policy
def oversubscribed(load: float, cpus: int, threads: int | None = None) -> bool:
    """More runnable work than CPUs: the 1-minute load average reaches the CPU count, or the
    OpenMP threads asked for (``OMP_NUM_THREADS``) outnumber the CPUs this process may use."""
    return load >= cpus or (threads is not None and threads > cpus)


def _omp_runtime_loaded() -> bool:
    """An OpenMP runtime is already in this process (torch imported, or its maps show one):
    then setting ``OMP_WAIT_POLICY`` changes nothing."""
    if "torch" in sys.modules:
        return True
    return bool(openmp_runtimes())


@dataclass(frozen=True)
class OpenMPSetup:
    """What :func:`configure_openmp` found and did (logged at engine start)."""

    wait_policy: str | None  # the OMP_WAIT_POLICY in force (None: libgomp's default, spin then sleep)
    chosen: bool  # pagedllm set it (else it came from the environment, or was left unset)
    why: str


_SETUP: OpenMPSetup | None = None


def configure_openmp() -> OpenMPSetup:
    """Chooses libgomp's wait policy before the runtime loads (once per process; later calls
    return the first answer): an ``OMP_WAIT_POLICY`` already set is kept; else ``PASSIVE`` when
    the machine is :func:`oversubscribed` now, else libgomp's default. Too late once torch is
    imported (the runtime read its environment then): say so, and change nothing. Worker
    processes the engine spawns inherit the choice through the environment."""
    global _SETUP
    if _SETUP is None:
        _SETUP = _choose_wait_policy()
    return _SETUP


def _choose_wait_policy() -> OpenMPSetup:
    given = envs.OMP_WAIT_POLICY
    if given is not None:
        return OpenMPSetup(given, False, "OMP_WAIT_POLICY from the environment")
    if _omp_runtime_loaded():
        return OpenMPSetup(None, False, "the OpenMP runtime was loaded before pagedllm (torch imported first), "
                                        "so its wait policy is libgomp's default; set OMP_WAIT_POLICY=PASSIVE "
                                        "before starting Python to choose")
    cpus = len(allowed_cpus())
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if oversubscribed(load, cpus, envs.OMP_NUM_THREADS):
        envs.set_default("OMP_WAIT_POLICY", "PASSIVE")
        return OpenMPSetup("PASSIVE", True, f"oversubscribed at start-up: load {load:.1f} on {cpus} CPU(s)")
    return OpenMPSetup(None, False, f"not oversubscribed at start-up (load {load:.1f} on {cpus} CPU(s)): "
                                    "libgomp's default (spin, then sleep)")


def openmp_runtimes() -> list[str]:
    """The OpenMP runtime libraries mapped into this process (one expected: torch's libgomp,
    which the C library shares; two runtimes would each keep a thread pool spinning)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if re.search(r"/lib(gomp|iomp5|omp)[-.][^/]*$", line.strip())}
    except OSError:
        return []
    return sorted(paths)


# ---------------------------------------------------------------------------------- adaptive threads
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # /proc/stat: user nice system [idle iowait] irq softirq steal
FIRST_WINDOW = 0.25  # after an idle gap, the first reading comes after this share of the interval


@dataclass(frozen=True)
class CpuSample:
    """One reading: ticks the allowed CPUs spent busy and in all, and this process's own ticks."""

    busy: int
    total: int
    own: int


def parse_proc_stat(lines, cpus: set[int]) -> tuple[int, int]:
    """(busy, total) ticks summed over the ``cpuN`` lines of /proc/stat for N in ``cpus``."""
    busy = total = 0
    for line in lines:
        if not line.startswith("cpu") or line.startswith("cpu "):
            continue
        name, *fields = line.split()
        if int(name[3:]) in cpus:
            ticks = [int(x) for x in fields[:8]]
            busy += sum(ticks[i] for i in _BUSY_FIELDS if i < len(ticks))
            total += sum(ticks)
    return busy, total


def own_ticks(stat_line: str) -> int:
    """utime + stime of /proc/self/stat's line (every thread of this process), in clock ticks."""
    fields = stat_line.rsplit(")", 1)[1].split()  # after "pid (comm)": comm may hold spaces
    return int(fields[11]) + int(fields[12])


class CpuUsage:
    """How many of ``cpus`` other processes kept busy since the last reading (``/proc/stat``
    minus this process's own ticks); None where /proc cannot be read (not Linux)."""

    def __init__(self, cpus: set[int]):
        self.cpus = cpus
        self._last = self._read()

    def _read(self) -> CpuSample | None:
        try:
            with open("/proc/stat") as f:
                busy, total = parse_proc_stat(f, self.cpus)
            with open("/proc/self/stat") as f:
                own = own_ticks(f.read())
        except (OSError, ValueError, IndexError):
            return None
        return CpuSample(busy, total, own)

    def others_busy(self) -> float | None:
        """CPUs' worth of time other processes used since the last call (0..len(cpus))."""
        now = self._read()
        last, self._last = self._last, now
        if now is None or last is None or now.total <= last.total:
            return None
        return others_busy(last, now, len(self.cpus))


def others_busy(a: CpuSample, b: CpuSample, ncpus: int) -> float:
    """CPUs' worth of busy time between two readings that was not this process's."""
    per_cpu = (b.total - a.total) / ncpus  # ticks one CPU had in the window
    others = (b.busy - a.busy) - (b.own - a.own)
    return min(float(ncpus), max(0.0, others / per_cpu))


def threads_for(free_cpus: float, most: int) -> int:
    """Threads to run beside what others use: the free CPUs rounded to the nearest whole one
    (a neighbour using 2/3 of a core takes it), at least 1 and at most ``most``."""
    return max(1, min(most, int(free_cpus + 0.5)))


class AdaptiveThreads:
    """The thread count of a CPU engine that shares its cores: ``check()``, called once per step,
    re-reads the CPUs' use every ``interval_s`` and returns a new thread count when it changed
    (else None). Between re-reads a check costs one clock read. A reading over a window longer
    than twice the interval (the engine sat idle) only starts a new, shorter window
    (``FIRST_WINDOW`` of the interval): what others did while the engine waited says little about
    now, and a request should not run long on a count measured before it came."""

    def __init__(self, most: int, cpus: set[int], interval_s: float = 0.4, usage: CpuUsage | None = None,
                 clock=time.monotonic):
        self.most, self.interval_s, self.clock = most, interval_s, clock
        self.usage = usage if usage is not None else CpuUsage(cpus)
        self.ncpus = len(cpus)
        self.threads = most
        self._next = clock() + interval_s

    def check(self) -> int | None:
        now = self.clock()
        if now < self._next:
            return None
        stale = now - self._next > self.interval_s  # the window ran > 2 intervals
        others = self.usage.others_busy()
        if stale:  # the engine sat idle: measure a short fresh window before acting
            self._next = now + self.interval_s * FIRST_WINDOW
            return None
        self._next = now + self.interval_s
        if others is None:
            return None
        # free CPUs in units of our threads: with 2 hyper-threads per core, 2 free CPUs are one core
        threads = threads_for((self.ncpus - others) * self.most / self.ncpus, self.most)
        if threads == self.threads:
            return None
        self.threads = threads
        return threads

"""How the CPU engine's threads share the machine (pagedllm/cpu_threads.py): CPU lists, the
binding variable, the wait policy chosen before torch loads, and the thread count that follows
the CPUs other processes leave free."""
import os
import subprocess
import sys

import pytest

from pagedllm import cpu_threads
from pagedllm.cpu_threads import AdaptiveThreads, CpuSample, ThreadsBind, parse_cpu_list

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def test_cpu_lists_parse_as_taskset_reads_them():
    assert parse_cpu_list("0-3,8") == (0, 1, 2, 3, 8)
    assert parse_cpu_list("5") == (5,)
    assert cpu_threads.format_cpu_list([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    for bad, why in [("a", "not a CPU number"), ("3-1", "backwards"), ("0,0", "more than once"), ("", "not a CPU")]:
        with pytest.raises(ValueError, match=why):
            parse_cpu_list(bad, "X")


def test_bind_modes_and_one_list_per_rank():
    assert ThreadsBind.parse("auto") == ThreadsBind("auto")
    assert ThreadsBind.parse(" nobind ").mode == "nobind"
    two = ThreadsBind.parse("0-1|2-3")
    assert two.rank_cpus(1, 2) == (2, 3)
    assert ThreadsBind("auto").rank_cpus(0, 1) is None
    with pytest.raises(ValueError, match="1 CPU list.*for 2 rank"):
        ThreadsBind.parse("0-1").rank_cpus(0, 2)
    with pytest.raises(ValueError, match="share a CPU"):
        ThreadsBind.parse("0-1|1-2")
    with pytest.raises(ValueError, match="PAGEDLLM_CPU_OMP_THREADS_BIND='all'"):
        ThreadsBind.parse("all")


def test_vllm_variable_is_honoured_and_ours_wins(monkeypatch):
    monkeypatch.delenv("PAGEDLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    assert cpu_threads.threads_bind() == ThreadsBind("auto")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    assert cpu_threads.threads_bind() == ThreadsBind("cpus", ((0, 1),))
    monkeypatch.setenv("PAGEDLLM_CPU_OMP_THREADS_BIND", "nobind")
    assert cpu_threads.threads_bind().mode == "nobind"
    monkeypatch.delenv("PAGEDLLM_CPU_OMP_THREADS_BIND")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "x")
    with pytest.raises(ValueError, match="VLLM_CPU_OMP_THREADS_BIND='x'"):
        cpu_threads.threads_bind()


def test_pinned_cpus_must_be_allowed():
    cpu_threads.check_cpus_allowed((0, 1), {0, 1, 2})
    with pytest.raises(ValueError, match=r"CPU\(s\) \[7\].*\(0-1\)"):
        cpu_threads.check_cpus_allowed((1, 7), {0, 1})


def test_oversubscribed_by_load_or_by_thread_count():
    assert not cpu_threads.oversubscribed(0.4, 2)
    assert cpu_threads.oversubscribed(2.0, 2)
    assert cpu_threads.oversubscribed(0.0, 2, threads=4)
    assert not cpu_threads.oversubscribed(0.0, 2, threads=2)


def _choose(monkeypatch, load: float, loaded: bool = False):
    monkeypatch.setattr(cpu_threads.os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(cpu_threads, "allowed_cpus", lambda: {0, 1})
    monkeypatch.setattr(cpu_threads, "_omp_runtime_loaded", lambda: loaded)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    return cpu_threads._choose_wait_policy()


def test_wait_policy_passive_only_when_oversubscribed_and_never_over_the_users(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    quiet = _choose(monkeypatch, 0.3)
    assert (quiet.wait_policy, quiet.chosen) == (None, False) and "OMP_WAIT_POLICY" not in os.environ
    late = _choose(monkeypatch, 5.0, loaded=True)  # torch came first: libgomp has read its environment
    assert late.wait_policy is None and "loaded before pagedllm" in late.why and "OMP_WAIT_POLICY" not in os.environ
    busy = _choose(monkeypatch, 5.0)
    assert (busy.wait_policy, busy.chosen) == ("PASSIVE", True) and os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    kept = _choose(monkeypatch, 5.0)
    assert (kept.wait_policy, kept.chosen) == ("ACTIVE", False) and os.environ["OMP_WAIT_POLICY"] == "ACTIVE"


@linux_only
def test_importing_pagedllm_sets_the_policy_before_torch_loads():
    """A fresh interpreter on a machine made to look busy (OMP_NUM_THREADS above its CPUs):
    importing pagedllm sets PASSIVE in the environment libgomp reads, before torch is loaded."""
    code = ("import sys; import pagedllm.cpu_threads as c; s = c.configure_openmp(); "
            "print(s.wait_policy, s.chosen, 'torch' in sys.modules and c.openmp_runtimes() != [])")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env.update(OMP_NUM_THREADS=str(len(cpu_threads.allowed_cpus()) + 1), PYTHONPATH=os.getcwd())
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["PASSIVE", "True", "True"]  # chosen, and torch (imported by pagedllm) came after


@linux_only
def test_torch_and_the_c_library_share_one_openmp_runtime():
    from pagedllm.native import bindings
    if not bindings.is_available():
        pytest.skip("no C compiler")
    bindings.library()
    runtimes = cpu_threads.openmp_runtimes()
    assert len(runtimes) == 1 and "libgomp" in runtimes[0], runtimes


STAT = ["cpu  90 0 30 200 0 0 0 0 0 0", "cpu0 50 0 10 100 5 0 0 0 0 0", "cpu1 40 0 20 100 0 1 2 3 0 0",
        "cpu2 999 0 0 0 0 0 0 0 0 0", "intr 1 2 3"]


def test_proc_stat_sums_busy_and_total_ticks_of_the_allowed_cpus():
    assert cpu_threads.parse_proc_stat(STAT, {0, 1}) == (50 + 10 + 40 + 20 + 1 + 2 + 3, 165 + 166)
    assert cpu_threads.own_ticks("12 (a b) c) R 1 2 3 4 5 6 7 8 9 10 17 4 0") == 21  # utime + stime


def test_others_busy_subtracts_this_process():
    a, b = CpuSample(busy=0, total=0, own=0), CpuSample(busy=150, total=200, own=50)  # 2 CPUs x 100 ticks
    assert cpu_threads.others_busy(a, b, 2) == 1.0
    assert cpu_threads.others_busy(a, CpuSample(50, 200, 60), 2) == 0.0  # never negative


class FakeUsage:
    def __init__(self, readings):
        self.readings = list(readings)

    def others_busy(self):
        return self.readings.pop(0)


def test_threads_follow_the_cpus_a_neighbour_leaves_free():
    now = [0.0]
    usage = FakeUsage([0.0, 0.7, 1.0, None, 0.1])
    gov = AdaptiveThreads(2, {0, 1}, interval_s=0.5, usage=usage, clock=lambda: now[0])
    assert gov.check() is None  # within the first interval: no reading
    now[0] = 0.6
    assert gov.check() is None and usage.readings == [0.7, 1.0, None, 0.1]  # alone: stays at 2
    now[0] = 0.7
    assert gov.check() is None  # 0.1 s later: not read again
    now[0] = 1.2
    assert gov.check() == 1  # a neighbour took 2/3 of a CPU: one thread, no barrier to wait at
    now[0] = 1.8
    assert gov.check() is None  # still busy: stays at 1
    now[0] = 2.4
    assert gov.check() is None  # no reading (e.g. /proc unreadable): unchanged
    now[0] = 3.0
    assert gov.check() == 2  # the neighbour left


def test_a_reading_across_an_idle_gap_only_starts_a_new_window():
    now = [0.0]
    usage = FakeUsage([2.0, 2.0])
    gov = AdaptiveThreads(2, {0, 1}, interval_s=0.5, usage=usage, clock=lambda: now[0])
    now[0] = 5.0  # idle for seconds (another program ran meanwhile): read, but not acted on
    assert gov.check() is None and usage.readings == [2.0]
    now[0] = 5.1
    assert gov.check() is None  # the fresh window is a quarter interval long
    now[0] = 5.13
    assert gov.check() == 1


def test_hyperthreads_count_as_half_a_core():
    assert cpu_threads.threads_for((4 - 1) * 2 / 4, 2) == 2  # 1 of 4 CPUs busy: 1.5 cores free -> 2
    assert cpu_threads.threads_for((4 - 2) * 2 / 4, 2) == 1
    assert cpu_threads.threads_for(0.0, 2) == 1  # at least one


@linux_only
def test_cpu_usage_reads_this_machine():
    usage = cpu_threads.CpuUsage(cpu_threads.allowed_cpus())
    sum(i * i for i in range(300_000))  # let some ticks pass
    busy = usage.others_busy()
    assert busy is None or 0.0 <= busy <= len(usage.cpus)

"""Machine facts the engine sizes itself from."""
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

"""Runs independent subprocesses side by side: the ahead-of-time Triton compiles take minutes per
target, single-threaded each (the frontend, LLVM and ptxas in turn), so one process per CUDA
arch halves their wall time on two cores and costs nothing in coverage."""
from __future__ import annotations

import subprocess
from dataclasses import dataclass


@dataclass(frozen=True)
class Finished:
    """What ``run_side_by_side`` hands back: the joined stdout of every process, in argument
    order, and each one's (returncode, stderr)."""

    stdout: str
    results: tuple[tuple[int, str], ...]

    @property
    def failures(self) -> list[str]:
        """Each failed process's stderr tail (empty: every process exited 0)."""
        return [f"exit {code}: {err[-3000:]}" for code, err in self.results if code != 0]


def run_side_by_side(commands: list[list[str]], envs: list[dict[str, str]], timeout: float) -> Finished:
    """Starts every command at once (``envs[i]`` for ``commands[i]``) and waits for them all;
    a process still running after ``timeout`` seconds is killed and raises TimeoutExpired."""
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for cmd, env in zip(commands, envs)]
    try:
        outputs = [proc.communicate(timeout=timeout) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()  # no-op on the ones that exited
            proc.wait()
    stdout = "".join(out if out.endswith("\n") or not out else out + "\n" for out, _ in outputs)
    return Finished(stdout, tuple((proc.returncode, err) for proc, (_, err) in zip(procs, outputs)))

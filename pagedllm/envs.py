"""The one reader of environment variables (like vLLM's ``envs.py``).

Every variable pagedllm honours is declared here, with its default and what it does; other
modules read ``envs.NAME``, which looks the variable up at that moment (lazily), so a test's
``monkeypatch.setenv`` or a user's ``os.environ[...] = ...`` before building an engine takes
effect. No other module under ``pagedllm/`` touches ``os.environ`` (a test enforces it).
"""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def _parsed(name: str, default: Any, parse: Callable[[str], Any], what: str) -> Callable[[], Any]:
    """A getter: ``default`` when the variable is unset or empty, else ``parse(value)``; a value
    that does not parse raises ValueError naming the variable and ``what`` it must be."""
    def read() -> Any:
        raw = os.environ.get(name)
        if raw is None or raw == "":
            return default
        try:
            return parse(raw)
        except ValueError:
            raise ValueError(f"environment variable {name}={raw!r} must be {what}") from None
    return read


def _switch(raw: str) -> bool:
    """"0" (or "false"/"no"/"off") turns a switch off, anything else on."""
    return raw.strip().lower() not in ("0", "false", "no", "off")


def _flag(name: str, default: bool) -> Callable[[], bool]:
    return _parsed(name, default, _switch, "a switch")


def _float(name: str, default: float) -> Callable[[], float]:
    return _parsed(name, default, float, "a number")


def _int(name: str, default: int) -> Callable[[], int]:
    return _parsed(name, default, int, "an integer")


def _flag_or_vllm(name: str, vllm_name: str, default: bool) -> Callable[[], bool]:
    """Our switch when set, else vLLM's spelling of it (so a vLLM deployment's environment works)."""
    ours, theirs = _flag(name, default), _flag(vllm_name, default)
    return lambda: ours() if os.environ.get(name) else theirs()


def _str(name: str, default: str | None = None) -> Callable[[], str | None]:
    return lambda: os.environ.get(name) or default


def _cache_dir() -> Path:
    raw = os.environ.get("PAGEDLLM_CACHE_DIR")
    return Path(raw) if raw else Path.home() / ".cache" / "pagedllm"


@dataclass(frozen=True)
class EnvVar:
    read: Callable[[], Any]
    doc: str


VARIABLES: dict[str, EnvVar] = {
    "PAGEDLLM_CACHE_DIR": EnvVar(_cache_dir, "where compiled C kernels are cached (default ~/.cache/pagedllm)"),
    "CC": EnvVar(_str("CC"), "C compiler for the CPU kernels (default: gcc, then cc)"),
    "PAGEDLLM_DEVICE": EnvVar(_str("PAGEDLLM_DEVICE"), "force the device (cpu, cuda, cuda:N) instead of auto"),
    "PAGEDLLM_ALLOW_LONG_MAX_MODEL_LEN": EnvVar(
        _flag("PAGEDLLM_ALLOW_LONG_MAX_MODEL_LEN", False),
        "1 allows max_model_len above the model's max_position_embeddings"),
    "PAGEDLLM_CPU_KVCACHE_SPACE": EnvVar(
        _float("PAGEDLLM_CPU_KVCACHE_SPACE", 4.0), "cap (GiB) on the KV pool sized from RAM on CPU"),
    "PAGEDLLM_FUSED_CPU_OPS": EnvVar(
        _flag("PAGEDLLM_FUSED_CPU_OPS", True), "0 turns off the fused C norm/rotary/activation ops on CPU"),
    "PAGEDLLM_PACKED_LINEAR": EnvVar(
        _flag("PAGEDLLM_PACKED_LINEAR", True),
        "0 turns off packed float32 linear weights on CPU (oneDNN-packed and panel copies)"),
    "PAGEDLLM_KERNEL_TUNING": EnvVar(
        _str("PAGEDLLM_KERNEL_TUNING", "fast"),
        "off|fast|full: time the CPU float32 GEMM kernels per layer shape and the C attention kernel's work "
        "split at start-up and keep the fastest (cached under PAGEDLLM_CACHE_DIR/kernels); off keeps the fixed "
        "row thresholds and split"),
    "PAGEDLLM_HUGE_PAGES": EnvVar(
        _flag("PAGEDLLM_HUGE_PAGES", True),
        "0 keeps CPU weights and the CPU KV pool in ordinary 4 KiB pages (default: 2 MiB transparent huge pages)"),
    "PAGEDLLM_KV_PREFAULT": EnvVar(
        _str("PAGEDLLM_KV_PREFAULT", "background"),
        "background|startup: fault the CPU KV pool's pages in on a background thread after its first 64 MiB "
        "(default: quick start-up, but under load from the first second the engine faults pages in itself, "
        "~20% slower until every block was used once), or all at start-up as vLLM's zeroed pool"),
    "PAGEDLLM_HEAP_MALLOC": EnvVar(
        _flag("PAGEDLLM_HEAP_MALLOC", True),
        "0 leaves glibc malloc's settings alone in a CPU engine (default: freed memory stays in the heap)"),
    "PAGEDLLM_FUSED_DECODE": EnvVar(
        _flag("PAGEDLLM_FUSED_DECODE", True), "0 turns off the one-call C decoder for small CPU batches"),
    "PAGEDLLM_API_KEY": EnvVar(_str("PAGEDLLM_API_KEY"), "API key the server requires when --api-key is not given"),
    "PAGEDLLM_MAX_COMPLETION_PROMPTS": EnvVar(
        _int("PAGEDLLM_MAX_COMPLETION_PROMPTS", 1024),
        "most prompts one /v1/completions request may list (vLLM's VLLM_MAX_COMPLETION_PROMPTS); more is a 400"),
    "PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING": EnvVar(
        _flag_or_vllm("PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_ALLOW_RUNTIME_LORA_UPDATING", False),
        "1 turns on the server's POST /v1/load_lora_adapter and /v1/unload_lora_adapter (else a 404; vLLM's "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING is read when this is unset)"),
    "PAGEDLLM_MEDIA_FETCH_TIMEOUT": EnvVar(
        _float("PAGEDLLM_MEDIA_FETCH_TIMEOUT", 5.0),
        "seconds an --allowed-media-domains image URL may take to download (vLLM's VLLM_IMAGE_FETCH_TIMEOUT)"),
    "PAGEDLLM_MAX_MEDIA_BYTES": EnvVar(
        _int("PAGEDLLM_MAX_MEDIA_BYTES", 20 * 2**20),
        "largest image (encoded bytes) a request may send or point to; larger is a 400"),
    "PAGEDLLM_PORT": EnvVar(
        _int("PAGEDLLM_PORT", 0),
        "first port tried for a tensor-parallel group's store (the next free one is taken; default: any free port)"),
    "PAGEDLLM_TP_TIMEOUT": EnvVar(
        _float("PAGEDLLM_TP_TIMEOUT", 120.0),
        "seconds a tensor-parallel collective waits for the other ranks before the engine fails"),
    "PAGEDLLM_TP_STARTUP_TIMEOUT": EnvVar(
        _float("PAGEDLLM_TP_STARTUP_TIMEOUT", 600.0),
        "seconds tensor-parallel workers may take to start and load weights (a worker that exits fails at once)"),
    "PAGEDLLM_TP_CUDA_GRAPHS": EnvVar(
        _flag("PAGEDLLM_TP_CUDA_GRAPHS", False),
        "1 captures CUDA graphs for decode under tensor parallelism too (off: not yet verified on GPUs)"),
    "PAGEDLLM_TORCH_PROFILER_DIR": EnvVar(
        _str("PAGEDLLM_TORCH_PROFILER_DIR"),
        "directory for the torch profiler traces of LLM.start_profile()/stop_profile() and the server's "
        "/start_profile, /stop_profile (unset: profiling is refused)"),
    "VLLM_TORCH_PROFILER_DIR": EnvVar(
        _str("VLLM_TORCH_PROFILER_DIR"),
        "vLLM's name for PAGEDLLM_TORCH_PROFILER_DIR (that one wins when both are set)"),
    "PAGEDLLM_CPU_OMP_THREADS_BIND": EnvVar(
        _str("PAGEDLLM_CPU_OMP_THREADS_BIND"),
        "auto (default): on CPU the thread count follows the cores other processes leave free (unless num_threads "
        "fixes it); nobind: the thread count stays as set; a CPU list (0-3, 0,2,4-5; '|' between the ranks of one "
        "host, e.g. 0-3|4-7): one thread pinned to each listed CPU (vLLM's VLLM_CPU_OMP_THREADS_BIND)"),
    "VLLM_CPU_OMP_THREADS_BIND": EnvVar(
        _str("VLLM_CPU_OMP_THREADS_BIND"), "vLLM's name for PAGEDLLM_CPU_OMP_THREADS_BIND (that one wins when both "
                                           "are set)"),
    "OMP_WAIT_POLICY": EnvVar(
        _str("OMP_WAIT_POLICY"),
        "OpenMP's: PASSIVE threads sleep at once at a barrier, ACTIVE spin; unset, pagedllm sets PASSIVE when the "
        "machine is oversubscribed as it is imported (read by libgomp once, when torch loads it)"),
    "OMP_NUM_THREADS": EnvVar(_parsed("OMP_NUM_THREADS", None, int, "an integer"),
                              "OpenMP's thread count; more than the CPUs this process may use counts as "
                              "oversubscribed (a PASSIVE wait policy)"),
    # torch.distributed's standard launch variables (torchrun sets them): a multi-node launch
    "MASTER_ADDR": EnvVar(_str("MASTER_ADDR"), "rank 0's host for a multi-node launch when --master-addr is not given"),
    "MASTER_PORT": EnvVar(_parsed("MASTER_PORT", None, int, "a port number"),
                          "rank 0's rendezvous port for a multi-node launch when --master-port is not given"),
    "WORLD_SIZE": EnvVar(_parsed("WORLD_SIZE", None, int, "an integer"),
                         "torchrun: the number of processes, each one rank (must equal TP x PP)"),
    "RANK": EnvVar(_parsed("RANK", None, int, "an integer"),
                   "torchrun: this process's rank (0 hosts the engine and the API, the others run headless)"),
    "TORCHELASTIC_USE_AGENT_STORE": EnvVar(
        _flag("TORCHELASTIC_USE_AGENT_STORE", False),
        "torchrun: its agent already hosts the store on MASTER_PORT, so rank 0 joins it instead of creating one"),
    "LOCAL_WORLD_SIZE": EnvVar(_parsed("LOCAL_WORLD_SIZE", None, int, "an integer"),
                               "torchrun: the processes on this host (they share its cores)"),
    "LOCAL_RANK": EnvVar(_parsed("LOCAL_RANK", None, int, "an integer"),
                         "torchrun: this process's index on its host (its CUDA device)"),
}


def set_default(name: str, value: str) -> bool:
    """Sets a declared variable in this process's environment (so child processes inherit it)
    unless it is already set; True if it was set here."""
    if name not in VARIABLES:
        raise KeyError(f"{name} is not a variable envs.py declares")
    if os.environ.get(name):
        return False
    os.environ[name] = value
    return True


def __getattr__(name: str) -> Any:
    var = VARIABLES.get(name)
    if var is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return var.read()


def __dir__() -> list[str]:
    return sorted(VARIABLES)

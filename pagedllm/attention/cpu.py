"""Fast CPU paged attention: a plain C kernel (``csrc/paged_attention.c``) bound with ctypes.

KV cache layout, per layer: ``key_cache`` and ``value_cache`` each
``[num_blocks, num_kv_heads, block_size, head_dim]``, contiguous. Why this order:

* The kernel's unit of work is one (request, kv head [, tile of query tokens]). For such an
  item, one (block, kv head) pair is a single contiguous ``block_size x head_dim`` tile, so it
  walks its block table reading whole tiles with unit stride (hardware-prefetch friendly) and
  never touches the other heads' data (a ``[..., block_size, num_kv_heads, head_dim]`` layout
  would interleave heads and waste cache lines / bandwidth per item).
* Keys and values are separate tensors with the same layout, so one offset addresses both.
* ``head_dim`` innermost: the q.k dot products and the p*v accumulation vectorize over it.

A step is two C calls: ``pa_write_kv`` scatters the new K/V into their slots (a row memcpy
per token and kv head), then ``pa_attention`` attends. Writing first is what lets a prefill
chunk's tokens see each other. The attention reads K/V in place through the block tables (no
gather copy), processes the query heads of a GQA group together so each K/V tile is loaded once
for the whole group (and, for prefill chunks, once for a tile of query tokens), folds 64 keys
at a time into each row's online softmax, and runs items in parallel with OpenMP. Decode tokens
and prefill chunks (causal inside the chunk, possibly starting mid-context) go in the same
call. Hot loops are AVX2/FMA intrinsics with scalar fallbacks; metadata that would index
outside the tensors is rejected (ValueError) rather than crashing the process.

Dtypes: the cache may be float32, float16 or bfloat16 (converted to float32 per tile, in a
per-thread scratch buffer, when read); the math and the accumulation are float32. Queries are
computed in float32 and the output is cast back to ``query.dtype``.

Build: on first use the C file is compiled with the system C compiler (``$CC`` or ``gcc``)
with ``-O3 -march=native -fopenmp`` into
``$PAGEDLLM_CACHE_DIR/kernels/`` (default ``~/.cache/pagedllm/kernels/``), named by a hash of
source, flags, compiler version and host CPU, so a stale or foreign build is never loaded.
The compiler writes a temporary file that is atomically renamed into place, so concurrent
processes may build at once safely. If there is no compiler or the build fails,
``get_cpu_backend()`` logs a warning and returns the torch reference backend; the engine's
selector (``attention/selector.py``) falls back to the faster SDPA backend instead.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from pagedllm import envs
from pagedllm.attention.backend import AttentionBackend, check_soft_cap
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.torch_ref import TorchReferenceBackend

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "csrc" / "paged_attention.c"
# fused model-body ops (RMSNorm, rotary, the small-batch decoder) share the library: one build, one cache entry
_PKG = Path(__file__).resolve().parent.parent
SOURCES = (SOURCE, _PKG / "layers" / "csrc" / "cpu_ops.c", _PKG / "models" / "csrc" / "llama_decode.c")
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
LDLIBS = ("-lm",)
ABI_VERSION = 5  # must match pa_abi_version() in the C file
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


# ---------------------------------------------------------------------------------------------
# build + load
# ---------------------------------------------------------------------------------------------


def kernel_cache_dir() -> Path:
    return envs.PAGEDLLM_CACHE_DIR / "kernels"


def find_compiler() -> str | None:
    for cc in (envs.CC, "gcc", "cc"):
        if cc and shutil.which(cc):
            return cc
    return None


def _host_cpu_id() -> str:
    """CPU model + feature flags: -march=native output is only valid on a matching CPU."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine() + platform.processor()
    keep = [ln for ln in lines if ln.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(keep)))


def _build_key(source: bytes, cc: str, cflags: tuple[str, ...]) -> str:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    h = hashlib.sha256()
    flags = " ".join(cflags + LDLIBS)
    for part in (source, flags.encode(), version.encode(), _host_cpu_id().encode()):
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:20]


def _compile(cc: str, cflags: tuple[str, ...], out_path: Path) -> None:
    """Compiles to a temp file in the same directory, then renames it into place, so readers
    (other processes building or loading at the same time) never see a partial .so."""
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_path.parent, prefix=out_path.stem + ".", suffix=".tmp")
    os.close(fd)
    try:
        cmd = [cc, *cflags, *map(str, SOURCES), "-o", tmp, *LDLIBS]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr.strip()}")
        os.replace(tmp, out_path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    vp, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.pa_abi_version.restype = i32
    lib.pa_has_avx2.restype = i32
    lib.pa_write_kv.restype = i32
    lib.pa_write_kv.argtypes = [
        vp, vp, vp, vp, vp,  # key, value, key/value cache, slot_mapping
        i64, i64, i32, i32, i32,  # num_tokens, num_blocks, kv heads, head_dim, block_size
        i64, i64, i64, i64,  # key / value strides (token, head), in elements
        i32, i32,  # cache dtype, threads
    ]
    lib.pa_attention.restype = i32
    lib.pa_attention.argtypes = [
        vp, vp, vp, vp, vp, vp, vp,  # query, out, key/value cache, block_tables, qsl, seq_lens
        i32, i64, i64, i32, i64,  # num_reqs, num_tokens, num_blocks, max_blocks, bt_stride
        i32, i32, i32, i32,  # heads, kv heads, head_dim, block_size
        i64, i64, i64, i64,  # query / out strides (token, head), in elements
        ctypes.c_float, i32, i32, i32, i64,  # scale, sliding window (0: none), cache dtype, threads, parallel_work
    ]
    lib.pl_add_rms_norm.restype = i32
    lib.pl_add_rms_norm.argtypes = [vp, vp, vp, vp, i64, i64, i64, ctypes.c_float, i32]
    lib.pl_rotary_neox.restype = i32
    lib.pl_rotary_neox.argtypes = [vp, vp, vp, vp, i64, i32, i32, i64, i64, i64, i32]
    lib.ld_linear.restype = i32  # small-batch float32 / int8 matmul (models/csrc/llama_decode.c)
    lib.ld_linear.argtypes = [vp, i64, vp, vp, vp, i64, i64, vp, i32]
    lib.ld_dequant_i8.restype = i32
    lib.ld_dequant_i8.argtypes = [vp, vp, vp, i64, i64, i32]
    return lib


def build_and_load(
    cc: str | None = None, cache_dir: Path | None = None, cflags: tuple[str, ...] = CFLAGS
) -> ctypes.CDLL:
    """Compiles (unless a matching build is cached) and loads the kernel library; raises on
    failure. ``cflags`` other than the default are for tests (e.g. the portable scalar path)."""
    cc = cc or find_compiler()
    if cc is None or shutil.which(cc) is None:
        raise RuntimeError(f"no C compiler found (tried $CC, gcc, cc; got {cc!r})")
    source = b"\0".join(src.read_bytes() for src in SOURCES)
    name = f"paged_attention-{_build_key(source, cc, cflags)}.so"
    out_path = (cache_dir or kernel_cache_dir()) / name
    if not out_path.exists():
        logger.info("compiling CPU paged-attention kernel -> %s", out_path)
        _compile(cc, cflags, out_path)
    lib = _bind(ctypes.CDLL(str(out_path)))
    if lib.pa_abi_version() != ABI_VERSION:
        raise RuntimeError(f"{out_path}: ABI {lib.pa_abi_version()}, expected {ABI_VERSION}")
    return lib


@functools.cache
def load_library() -> ctypes.CDLL | None:
    """The process-wide kernel library, or None (with one warning) if it cannot be built."""
    try:
        return build_and_load()
    except Exception as exc:  # noqa: BLE001 - any build/load failure means "use the fallback"
        logger.warning("CPU paged-attention kernel unavailable (%s); falling back to a torch backend", exc)
        return None


# ---------------------------------------------------------------------------------------------
# backend
# ---------------------------------------------------------------------------------------------


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def _rows_contiguous(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[tokens, heads, head_dim] in ``dtype`` with a unit-stride last dim (other strides are
    passed to C, so views of a fused QKV projection need no copy)."""
    t = t.to(dtype)
    return t if t.stride(-1) == 1 else t.contiguous()


def _meta_arrays(meta: AttentionMetadata):
    """Metadata tensors in the exact dtypes/contiguity the C signature assumes (no-ops normally)."""
    as_i32 = lambda t: t.to(device="cpu", dtype=torch.int32).contiguous()  # noqa: E731
    slots = meta.slot_mapping.to(device="cpu", dtype=torch.int64).contiguous()
    return as_i32(meta.query_start_loc), as_i32(meta.seq_lens), as_i32(meta.block_tables), slots


class CpuAttentionBackend(AttentionBackend):
    """Paged attention with the compiled C kernel.

    ``num_threads`` defaults, per call, to ``torch.get_num_threads()``. Steps with less work
    than ``parallel_work`` multiply-adds (query rows x visible keys x head_dim; the default is
    ~50 us of work, e.g. a decode batch of a few short sequences) run on the calling thread,
    because waking the thread team would cost more than it saves.
    """

    name = "cpu"
    DEFAULT_PARALLEL_WORK = 1 << 19

    def __init__(self, num_threads: int | None = None, parallel_work: int = DEFAULT_PARALLEL_WORK):
        lib = load_library()
        if lib is None:
            raise RuntimeError("CPU paged-attention kernel unavailable; use get_cpu_backend()")
        self._lib = lib
        self.num_threads = num_threads
        self.parallel_work = parallel_work

    @staticmethod
    def is_available() -> bool:
        return load_library() is not None

    def _threads(self) -> int:
        return max(1, self.num_threads or torch.get_num_threads())

    @torch.compiler.disable  # a ctypes call: under torch.compile, a clean graph break
    def forward(self, query, key, value, key_cache, value_cache, meta: AttentionMetadata, scale,
                sliding_window: int | None = None, logits_soft_cap: float | None = None):
        check_soft_cap(logits_soft_cap, self.name)
        _check_shapes(query, key, value, key_cache, value_cache, meta)
        qsl, seq_lens, block_tables, slots = _meta_arrays(meta)
        self.write_kv(key, value, key_cache, value_cache, slots)

        q = _rows_contiguous(query, torch.float32)
        num_tokens, num_heads, head_dim = q.shape
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=torch.float32)
        if num_tokens == 0:
            return out.to(query.dtype)
        num_blocks, num_kv_heads, block_size, _ = key_cache.shape
        rc = self._lib.pa_attention(
            _ptr(q), _ptr(out), _ptr(key_cache), _ptr(value_cache),
            _ptr(block_tables), _ptr(qsl), _ptr(seq_lens),
            meta.num_reqs, num_tokens, num_blocks, block_tables.shape[1], block_tables.stride(0),
            num_heads, num_kv_heads, head_dim, block_size,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            float(scale), sliding_window or 0, DTYPE_CODES[key_cache.dtype], self._threads(), self.parallel_work,
        )  # fmt: skip
        _raise_on_error(rc, "pa_attention")
        return out if query.dtype == torch.float32 else out.to(query.dtype)

    def write_kv(self, key, value, key_cache, value_cache, slot_mapping: torch.Tensor) -> None:
        """Scatters [num_tokens, num_kv_heads, head_dim] K/V into their slots (negative = skip)."""
        k = _rows_contiguous(key, key_cache.dtype)
        v = _rows_contiguous(value, value_cache.dtype)
        slots = slot_mapping.to(torch.int64).contiguous()
        num_blocks, num_kv_heads, block_size, head_dim = key_cache.shape
        rc = self._lib.pa_write_kv(
            _ptr(k), _ptr(v), _ptr(key_cache), _ptr(value_cache), _ptr(slots),
            k.shape[0], num_blocks, num_kv_heads, head_dim, block_size,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            DTYPE_CODES[key_cache.dtype], self._threads(),
        )  # fmt: skip
        _raise_on_error(rc, "pa_write_kv")


_ERRORS = {
    -1: (ValueError, "bad dimensions or dtype"),
    -2: (MemoryError, "scratch allocation failed"),
    -3: (ValueError, "metadata out of range (block id, slot, or lengths past the tensors)"),
}


def _raise_on_error(rc: int, fn: str) -> None:
    if rc != 0:
        exc, msg = _ERRORS.get(rc, (RuntimeError, "unknown error"))
        raise exc(f"{fn}: {msg} (code {rc})")


def _check_shapes(query, key, value, key_cache, value_cache, meta: AttentionMetadata) -> None:
    """The C kernel trusts its arguments, so everything it relies on is checked here."""
    for name, t in (("query", query), ("key", key), ("value", value),
                    ("key_cache", key_cache), ("value_cache", value_cache)):  # fmt: skip
        if t.device.type != "cpu":
            raise ValueError(f"{name} must be on the CPU, got {t.device}")
    if key_cache.shape != value_cache.shape or key_cache.dtype != value_cache.dtype:
        raise ValueError("key_cache and value_cache must have the same shape and dtype")
    if key_cache.dtype not in DTYPE_CODES:
        raise ValueError(f"unsupported cache dtype {key_cache.dtype}")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("the KV cache must be contiguous (it is written in place)")
    _, num_kv_heads, block_size, head_dim = key_cache.shape
    num_tokens, num_heads, q_dim = query.shape
    if block_size != meta.block_size:
        raise ValueError(f"cache block size {block_size} != metadata block size {meta.block_size}")
    if q_dim != head_dim or num_heads % num_kv_heads != 0:
        raise ValueError(f"query {tuple(query.shape)} does not fit cache {tuple(key_cache.shape)}")
    if key.shape != (num_tokens, num_kv_heads, head_dim) or value.shape != key.shape:
        raise ValueError(f"key/value must be [{num_tokens}, {num_kv_heads}, {head_dim}]")
    if meta.num_tokens != num_tokens:
        raise ValueError(f"metadata has {meta.num_tokens} tokens, query has {num_tokens}")


def get_cpu_backend(num_threads: int | None = None) -> AttentionBackend:
    """The compiled CPU backend if it builds, else the torch reference (after a warning)."""
    if load_library() is None:
        return TorchReferenceBackend()
    return CpuAttentionBackend(num_threads=num_threads)

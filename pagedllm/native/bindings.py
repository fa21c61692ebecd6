"""The CPU kernel library (``csrc/``), loaded once per process and bound with ctypes.

Attention (``attention/cpu.py``), the fused model-body ops (``layers/cpu_ops.py``), int8
and 4/8-bit matmuls (``layers/quantization/``) and the one-call decoder (``models/cpu_decode.py``) all go
through this module: :func:`is_available` says whether the library built, :func:`library`
returns it (or raises :class:`NativeLibraryError`), and :class:`NativeLibrary` has one typed
method per C function, taking tensors and raising ``ValueError`` / ``MemoryError`` on a C error
code. Loading checks the bindings against the C side (``abi.py``): argtypes against the header's
prototypes, the ctypes struct mirrors below against ``sizeof`` / ``offsetof``, and the constants
are read back from the library rather than retyped.

The kernels trust their arguments' shapes and dtypes (they only range-check metadata): callers
validate tensors before calling.
"""
from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

from pagedllm.native import abi
from pagedllm.native.abi import NativeLibraryError
from pagedllm.native.build import CFLAGS, HEADER, build_library

__all__ = ["LdBatch", "LdModel", "NativeLibrary", "NativeLibraryError", "is_available", "library", "load_default"]

logger = logging.getLogger(__name__)

_VP, _I32, _I64, _F32 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_float
_P64 = ctypes.POINTER(ctypes.c_int64)

# ---------------------------------------------------------------------------------------------
# struct mirrors (field order and types as in csrc/pagedllm_native.h; checked at load)
# ---------------------------------------------------------------------------------------------

_PROJECTIONS = ("qkv", "o", "gate_up", "down")
# LdModel's per-layer parameter arrays (one pointer per layer), in the C field order
LAYER_ARRAY_FIELDS = ("input_norm", "post_norm",
                      *(f"{p}_{kind}" for kind in ("w", "s", "b", "z", "p", "ps", "pz", "la", "lb")
                        for p in _PROJECTIONS),
                      "q_norm", "k_norm")  # fmt: skip
CACHE_ARRAY_FIELDS = ("key_cache", "value_cache")


class LdModel(ctypes.Structure):
    _fields_ = [
        *[(n, _I32) for n in ("num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim", "intermediate",
                              "block_size", "cache_dtype", "quant_bits", "fp8_act", "bf16", "panel_min")],
        *[(n, _I64) for n in ("num_blocks", "vocab_size", "max_position")],
        *[(f"{p}_group", _I64) for p in _PROJECTIONS],
        ("lora_slots", _I64), *[(f"{p}_lora_rank", _I64) for p in _PROJECTIONS],
        ("eps", _F32), ("scale", _F32),
        *[(n, _VP) for n in ("embed", "final_norm", "cos", "sin")],
        *[(n, ctypes.POINTER(_VP)) for n in (*LAYER_ARRAY_FIELDS, *CACHE_ARRAY_FIELDS)],
        ("window", ctypes.POINTER(_I32)),
    ]  # fmt: skip


class LdBatch(ctypes.Structure):
    _fields_ = [
        *[(n, _VP) for n in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping", "positions",
                             "input_ids")],
        ("num_reqs", _I32), ("max_blocks", _I32),
        *[(n, _I64) for n in ("bt_stride", "num_tokens", "parallel_work")],
        *[(n, _VP) for n in ("lora_rows", "lora_seg_slot", "lora_seg_start")], ("lora_num_segs", _I64),
    ]  # fmt: skip


STRUCTS: tuple[type[ctypes.Structure], ...] = (LdModel, LdBatch)

# every PN_EXPORT function of the header: (restype, argtypes), checked against the prototypes
SIGNATURES: dict[str, tuple[type | None, list[type]]] = {
    "pa_write_kv": (_I32, [
        _VP, _VP, _VP, _VP, _VP,  # key, value, key/value cache, slot_mapping
        _I64, _I64, _I32, _I32, _I32,  # num_tokens, num_blocks, kv heads, head_dim, block_size
        _I64, _I64, _I64, _I64,  # key / value strides (token, head), in elements
        _I32, _I32,  # cache dtype, threads
    ]),
    "pa_attention": (_I32, [
        _VP, _VP, _VP, _VP, _VP, _VP, _VP,  # query, out, key/value cache, block_tables, qsl, seq_lens
        _I32, _I64, _I64, _I32, _I64,  # num_reqs, num_tokens, num_blocks, max_blocks, bt_stride
        _I32, _I32, _I32, _I32,  # heads, kv heads, head_dim, block_size
        _I64, _I64, _I64, _I64,  # query / out strides (token, head), in elements
        _F32, _I32, _I32,  # scale, sliding window (0: none), attention chunk (0: none)
        _I32, _I32, _I64,  # cache dtype, threads, parallel_work
        _VP,  # attention sinks [num_heads] float32, or NULL
        _VP,  # attend_ends [num_tokens] int32 (bidirectional spans), or NULL
    ]),
    "mla_latent_attention": (_I32, [
        _VP, _VP, _VP, _VP, _VP, _VP,  # query, out, latent cache, block_tables, qsl, seq_lens
        _I32, _I64, _I64, _I32, _I64,  # num_reqs, num_tokens, num_blocks, max_blocks, bt_stride
        _I32, _I32, _I32, _I32,  # heads, kv_lora_rank, rope dims, block_size
        _I64, _I64, _I64, _I64,  # query / out strides (token, head), in elements
        _F32, _I32, _I32,  # scale, cache dtype, threads
    ]),
    "pa_set_split": (_I32, [_I32, _I32]),  # prefill tile rows, decode items per thread (0: the defaults)
    "pl_add_rms_norm": (_I32, [_VP, _VP, _VP, _VP, _I64, _I64, _I64, _F32, _I32]),
    "pl_argmax_rows": (_I32, [_VP, _I64, _I64, _I64, _VP]),
    "pl_rotary_neox": (_I32, [_VP, _VP, _VP, _VP, _I64, _I32, _I32, _I64, _I64, _I64, _I32]),
    "ld_dequant_i8": (_I32, [_VP, _VP, _VP, _I64, _I64, _I32]),
    "ld_linear": (_I32, [_VP, _I64, _VP, _VP, _VP, _I64, _I64, _VP, _I32]),
    "ld_silu_and_mul": (_I32, [_VP, _I64, _I64, _VP, _I32]),
    "ld_forward": (_I32, [ctypes.POINTER(LdModel), ctypes.POINTER(LdBatch), _VP, _I32]),
    "qg_linear": (_I32, [
        _VP, _I64, _VP, _VP, _VP, _VP,  # x, T, codes, scale, scaled zero, bias
        _I64, _I64, _I64, _I32, _VP, _I32,  # in, out, group, bits, y, threads
    ]),
    "qg_dequant": (_I32, [_VP, _VP, _VP, _VP, _I64, _I64, _I64, _I32, _I32]),
    "qg_gemm": (_I32, [
        _VP, _I64, _VP, _VP, _VP, _VP,  # x, T, panel codes, panel scale, panel scaled zero, bias
        _I64, _I64, _I64, _I32, _VP, _I32,  # in, out, group, bits, y, threads
    ]),
    "fp8_linear": (_I32, [
        _VP, _I64, _VP, _VP, _VP,  # x, T, fp8 weight bytes, scale, bias
        _I64, _I64, _I64, _VP, _I32,  # in, out, group, y, threads
    ]),
    "bf16_linear": (_I32, [_VP, _I64, _VP, _VP, _I64, _I64, _VP, _I32]),  # x, T, weight, bias, in, out, y, threads
    "fp8_dequant": (_I32, [_VP, _VP, _VP, _I64, _I64, _I64, _I32]),
    "fp8_act_quant": (_I32, [_VP, _I64, _I64, _I64, _F32, _VP, _I32]),
    "moe_experts": (_I32, [
        _VP, _I64, _VP, _VP, _I64,  # x, T, ids, top-k weights, top_k
        _VP, _VP, _I64, _I64, _I64, _VP, _I32,  # packed w13 / w2, experts, hidden, inter, y, threads
    ]),
    "dg_gemm": (_I32, [_VP, _I64, _VP, _VP, _I64, _I64, _VP, _I32]),  # x, T, panels, bias, in, out, y, threads
    # x, T, blocks, scales, bias, in, out, y, threads
    "mx_linear": (_I32, [_VP, _I64, _VP, _VP, _VP, _I64, _I64, _VP, _I32]),
    "lora_sgmv": (_I32, [
        _VP, _I64, _I64, _VP, _VP, _VP, _I32,  # x, T, in, rows (or NULL), segments' slots and starts, segments
        _VP, _VP, _I64, _I64, _I64, _VP, _I32,  # a, b, slots, R, out, y, threads
    ]),
    "pn_pin_threads": (_I32, [_VP, _I32]),  # cpus (int32), count
    "pn_constant": (_I32, [ctypes.c_char_p, _P64]),
    "pn_struct_layout": (_I32, [ctypes.c_char_p, _P64, _P64]),
    "pn_field_layout": (_I32, [ctypes.c_char_p, ctypes.c_char_p, _P64, _P64]),
}  # fmt: skip

_DTYPE_CONSTANTS = {torch.float32: "DTYPE_F32", torch.float16: "DTYPE_F16", torch.bfloat16: "DTYPE_BF16",
                    torch.float8_e4m3fn: "DTYPE_FP8_E4M3", torch.float8_e5m2: "DTYPE_FP8_E5M2"}
_ERROR_CONSTANTS = {
    "ERR_ARG": (ValueError, "bad dimensions or dtype"),
    "ERR_NOMEM": (MemoryError, "scratch allocation failed"),
    "ERR_META": (ValueError, "metadata out of range (a block id, slot, position, token id or length past its "
                             "tensor)"),
}  # fmt: skip


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


# ---------------------------------------------------------------------------------------------
# the library
# ---------------------------------------------------------------------------------------------


class NativeLibrary:
    """One loaded build of the C library, with a typed method per kernel.

    Loading binds every exported function and checks the bindings against the C side; any
    mismatch raises :class:`NativeLibraryError` naming the function, constant or struct field.
    Attributes read back from the library: ``abi_version``, ``max_decode_tokens`` (most tokens
    of one ``decoder_forward`` / ``linear`` call), ``max_panel_decode_tokens`` (most tokens of a
    ``decoder_forward`` whose projections all have panel copies, float32 or 4/8-bit codes),
    ``has_avx2`` (built with AVX2/FMA paths) and
    ``moe_panels`` (the column panels of ``moe_experts``' packed weights: gate/up, down) and
    ``qg_panel`` (the output columns per panel of ``grouped_gemm``'s packed weights), ``dg_panel``
    and ``dg_rows`` (``dense_gemm``'s panel width and register-tile rows: 8 in AVX-512 builds).
    """

    def __init__(self, path: Path, header: Path = HEADER):
        self.path = Path(path)
        header_text = header.read_text()
        abi.check_signatures(SIGNATURES, header_text)  # before calling anything through them
        self._lib = ctypes.CDLL(str(self.path))
        for name, (restype, argtypes) in SIGNATURES.items():
            self._bind(name, restype, argtypes)
        self.abi_version = self.constant("ABI_VERSION")
        declared = abi.header_constant(header_text, "PN_ABI_VERSION")
        if self.abi_version != declared:
            raise NativeLibraryError(f"{self.path}: ABI {self.abi_version}, but {header} declares {declared} "
                                     "(stale or foreign build)")
        for mirror in STRUCTS:
            self.check_struct(mirror)
        self.max_decode_tokens = self.constant("MAX_DECODE_TOKENS")
        self.max_panel_decode_tokens = self.constant("MAX_PANEL_DECODE_TOKENS")
        self.has_avx2 = bool(self.constant("HAS_AVX2"))
        self.moe_panels = (self.constant("MOE_GATE_PANEL"), self.constant("MOE_DOWN_PANEL"))
        self.qg_panel = self.constant("QG_PANEL")
        self.dg_panel, self.dg_rows = self.constant("DG_PANEL"), self.constant("DG_ROWS")
        self._dtype_codes = {dt: self.constant(c) for dt, c in _DTYPE_CONSTANTS.items()}
        self._errors = {self.constant(c): err for c, err in _ERROR_CONSTANTS.items()}

    @classmethod
    def build(cls, cc: str | None = None, cache_dir: Path | None = None,
              cflags: tuple[str, ...] = CFLAGS) -> NativeLibrary:
        """Compiles (unless cached) and loads the library; raises on any failure."""
        return cls(build_library(cc, cache_dir, cflags))

    def _bind(self, name: str, restype: type | None, argtypes: list[type]) -> None:
        try:
            fn = getattr(self._lib, name)
        except AttributeError:
            raise NativeLibraryError(f"{self.path} does not export {name}") from None
        fn.restype, fn.argtypes = restype, argtypes

    def constant(self, name: str) -> int:
        """A constant of the header, read back from the library by name (e.g. ``"ERR_META"``)."""
        return abi.read_constant(self._lib, name)

    def check_struct(self, mirror: type[ctypes.Structure]) -> None:
        """Raises :class:`NativeLibraryError` naming the first field where the ctypes ``mirror``
        differs from the C struct of the same name (done at load for every mirror here)."""
        abi.check_struct(self._lib, mirror)

    def _raise(self, rc: int, fn: str, detail: str = "") -> None:
        """Raises for a C error code. Callers test ``rc`` first so that the detail string is only
        formatted on error: these calls are on the per-layer hot path."""
        exc, msg = self._errors.get(rc, (RuntimeError, "unknown error"))
        raise exc(f"{fn}: {msg} (code {rc}){detail}")

    def supports_cache_dtype(self, dtype: torch.dtype) -> bool:
        return dtype in self._dtype_codes

    def dtype_code(self, dtype: torch.dtype) -> int:
        try:
            return self._dtype_codes[dtype]
        except KeyError:
            raise ValueError(f"cache dtype {dtype} is not supported; allowed: {list(self._dtype_codes)}") from None

    # --- paged attention (strides passed in elements, so strided views need no copy) ---------

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, num_threads: int) -> None:
        """Scatters key/value ``[num_tokens, num_kv_heads, head_dim]`` (cache dtype, unit inner
        stride) into the caches ``[num_blocks, num_kv_heads, block_size, head_dim]`` at
        ``slot_mapping`` (int64, contiguous; negative = skip)."""
        num_blocks, num_kv_heads, block_size, head_dim = key_cache.shape
        rc = self._lib.pa_write_kv(
            key.data_ptr(), value.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), slot_mapping.data_ptr(),
            key.shape[0], num_blocks, num_kv_heads, head_dim, block_size,
            key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            self.dtype_code(key_cache.dtype), num_threads,
        )  # fmt: skip
        if rc != 0:
            self._raise(rc, "pa_write_kv")

    def attention(self, query: torch.Tensor, out: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                  block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                  window: int, num_threads: int, parallel_work: int, attn_chunk: int = 0,
                  sinks: torch.Tensor | None = None, attend_ends: torch.Tensor | None = None) -> None:
        """Paged attention into ``out``; query/out ``[num_tokens, num_heads, head_dim]`` float32
        with unit inner stride; metadata int32 and contiguous; ``window`` 0 = full attention;
        ``attn_chunk`` C > 0: chunked local attention (a token sees only its own C-token chunk);
        ``sinks`` float32 ``[num_heads]`` contiguous (GPT-OSS attention sinks) or None;
        ``attend_ends`` int32 ``[num_tokens]`` contiguous: each token's visible end (bidirectional
        image spans, attention/metadata.py), or None for causal."""
        num_tokens, num_heads, head_dim = query.shape
        num_blocks, num_kv_heads, block_size, _ = key_cache.shape
        rc = self._lib.pa_attention(
            query.data_ptr(), out.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
            block_tables.data_ptr(), query_start_loc.data_ptr(), seq_lens.data_ptr(),
            seq_lens.shape[0], num_tokens, num_blocks, block_tables.shape[1], block_tables.stride(0),
            num_heads, num_kv_heads, head_dim, block_size,
            query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            scale, window, attn_chunk, self.dtype_code(key_cache.dtype), num_threads, parallel_work, _ptr(sinks),
            _ptr(attend_ends),
        )  # fmt: skip
        if rc != 0:
            self._raise(rc, "pa_attention")

    def set_attention_split(self, tile_rows: int, decode_items_per_thread: int) -> None:
        """``attention``'s work split from the next call on, process-wide: query rows per prefill
        item (``tile_rows / head_dim`` tokens) and decode items per thread (0: the built-in defaults)."""
        rc = self._lib.pa_set_split(tile_rows, decode_items_per_thread)
        if rc != 0:
            self._raise(rc, "pa_set_split", f": tile_rows={tile_rows}, "
                        f"decode_items_per_thread={decode_items_per_thread}")

    def mla_latent_attention(self, query: torch.Tensor, out: torch.Tensor, latent_cache: torch.Tensor,
                             block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                             kv_lora_rank: int, scale: float, num_threads: int) -> None:
        """MLA's absorbed form (csrc/mla_decode.c) into ``out`` ``[num_tokens, num_heads,
        kv_lora_rank]``; query ``[num_tokens, num_heads, kv_lora_rank + rope]`` = ``[W_UK^T q_nope |
        q_pe]``, both float32 with unit inner stride; latent_cache ``[num_blocks, 1, block_size,
        kv_lora_rank + rope]``; metadata int32 and contiguous."""
        num_tokens, num_heads, width = query.shape
        num_blocks, _, block_size, _ = latent_cache.shape
        rc = self._lib.mla_latent_attention(
            query.data_ptr(), out.data_ptr(), latent_cache.data_ptr(),
            block_tables.data_ptr(), query_start_loc.data_ptr(), seq_lens.data_ptr(),
            seq_lens.shape[0], num_tokens, num_blocks, block_tables.shape[1], block_tables.stride(0),
            num_heads, kv_lora_rank, width - kv_lora_rank, block_size,
            query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            scale, self.dtype_code(latent_cache.dtype), num_threads,
        )  # fmt: skip
        if rc != 0:
            self._raise(rc, "mla_latent_attention")

    # --- fused model-body ops (float32) ---------------------------------------------------------

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, out: torch.Tensor,
                     eps: float, num_threads: int) -> None:
        """``residual += x`` (if given), then ``out`` = RMSNorm of the result; x ``[rows, dim]``
        with unit inner stride, residual and out contiguous."""
        rows, dim = x.shape
        rc = self._lib.pl_add_rms_norm(_ptr(x), _ptr(residual), _ptr(weight), _ptr(out), rows, dim, x.stride(0),
                                       eps, num_threads)
        if rc != 0:
            self._raise(rc, "pl_add_rms_norm", f": x {tuple(x.shape)}")

    def argmax_rows(self, x: torch.Tensor) -> torch.Tensor:
        """``[rows]`` int64: each row of float32 ``x`` ``[rows, cols]`` (unit inner stride)'s first
        maximum, a NaN first (torch's ``max(dim).indices``)."""
        out = torch.empty(x.shape[0], dtype=torch.int64)
        rc = self._lib.pl_argmax_rows(_ptr(x), x.shape[0], x.shape[1], x.stride(0), _ptr(out))
        if rc != 0:
            self._raise(rc, "pl_argmax_rows", f": x {tuple(x.shape)} strides {x.stride()}")
        return out

    def rotary_neox_(self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     num_threads: int) -> None:
        """Rotates x ``[tokens, heads, head_dim]`` (unit inner stride) in place; positions int64
        contiguous, cos/sin ``[max_position, head_dim / 2]``."""
        tokens, heads, head_dim = x.shape
        rc = self._lib.pl_rotary_neox(_ptr(x), _ptr(positions), _ptr(cos), _ptr(sin), tokens, heads, head_dim,
                                      x.stride(0), x.stride(1), cos.shape[0], num_threads)
        if rc != 0:
            self._raise(rc, "pl_rotary_neox", f": positions must be in [0, {cos.shape[0]})")

    # --- small-batch matmuls and the one-call decoder (llama_decode.c) -------------------------

    def linear(self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None,
               out: torch.Tensor, num_threads: int) -> None:
        """``out [T, out] = x [T, in] . weight^T (+ bias)``, all contiguous, T at most
        ``max_decode_tokens``; weight float32 (scale None) or int8 with float32 per-row scales."""
        rows, in_features = x.shape
        rc = self._lib.ld_linear(_ptr(x), rows, _ptr(weight), _ptr(scale), _ptr(bias), in_features,
                                 weight.shape[0], _ptr(out), num_threads)
        if rc != 0:
            self._raise(rc, "ld_linear", f": x {tuple(x.shape)}, weight {tuple(weight.shape)}")

    def lora_sgmv(self, x: torch.Tensor, y: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                  rows: torch.Tensor | None, seg_slot: torch.Tensor, seg_start: torch.Tensor, num_threads: int) -> None:
        """``y[rows[i]] += (x[rows[i]] . a[s]^T) . b[s]^T`` for the tokens of each segment (``csrc/lora_sgmv.c``):
        ``x [T, in]``, ``y [T, out]``, ``a [slots, R, in]``, ``b [slots, out, R]`` contiguous float32;
        ``rows`` (None: token i is row i), ``seg_slot [G]`` and ``seg_start [G + 1]`` int64."""
        rc = self._lib.lora_sgmv(_ptr(x), x.shape[0], x.shape[1], _ptr(rows), _ptr(seg_slot), _ptr(seg_start),
                                 seg_slot.shape[0], _ptr(a), _ptr(b), a.shape[0], a.shape[1], b.shape[1], _ptr(y),
                                 num_threads)
        if rc != 0:
            self._raise(rc, "lora_sgmv", f": x {tuple(x.shape)}, a {tuple(a.shape)}, {seg_slot.shape[0]} segments")

    def pin_threads(self, cpus: tuple[int, ...]) -> None:
        """Pins OpenMP thread i (of a team of ``len(cpus)``) to ``cpus[i]`` (``csrc/threads.c``);
        ValueError when the kernel refuses a CPU."""
        ids = torch.tensor(cpus, dtype=torch.int32)
        rc = self._lib.pn_pin_threads(_ptr(ids), len(cpus))
        if rc != 0:
            self._raise(rc, "pn_pin_threads", f": CPUs {list(cpus)}")

    def silu_and_mul(self, gate_up: torch.Tensor, out: torch.Tensor, num_threads: int) -> None:
        """``out [T, I] = silu(gate_up[:, :I]) * gate_up[:, I:]``, both contiguous float32."""
        rows, inter = out.shape
        rc = self._lib.ld_silu_and_mul(_ptr(gate_up), rows, inter, _ptr(out), num_threads)
        if rc != 0:
            self._raise(rc, "ld_silu_and_mul", f": gate_up {tuple(gate_up.shape)}")

    def dequantize_int8(self, q: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, num_threads: int) -> None:
        """``out [rows, in] = q [rows, in] (int8) * scale[row]``, all contiguous."""
        rc = self._lib.ld_dequant_i8(_ptr(q), _ptr(scale), _ptr(out), q.shape[0], q.shape[1], num_threads)
        if rc != 0:
            self._raise(rc, "ld_dequant_i8", f": weight {tuple(q.shape)}")

    def grouped_linear(self, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, szero: torch.Tensor,
                       bias: torch.Tensor | None, group: int, bits: int, out: torch.Tensor, num_threads: int) -> None:
        """``out [T, out] = x [T, in] . W^T (+ bias)`` with W group-quantized (``csrc/quant_linear.c``):
        q uint8 codes, scale / szero float32 ``[out, in / group]``; all contiguous, T at most
        ``max_decode_tokens``."""
        rows, in_features = x.shape
        rc = self._lib.qg_linear(_ptr(x), rows, _ptr(q), _ptr(scale), _ptr(szero), _ptr(bias), in_features,
                                 q.shape[0], group, bits, _ptr(out), num_threads)
        if rc != 0:
            self._raise(rc, "qg_linear", f": x {tuple(x.shape)}, codes {tuple(q.shape)}, group {group}, bits {bits}")

    def dequantize_grouped(self, q: torch.Tensor, scale: torch.Tensor, szero: torch.Tensor, out: torch.Tensor,
                           group: int, bits: int, num_threads: int) -> None:
        """``out [rows, in]`` float32 = the group-quantized matrix, all contiguous."""
        rows, in_features = out.shape
        rc = self._lib.qg_dequant(_ptr(q), _ptr(scale), _ptr(szero), _ptr(out), rows, in_features, group, bits,
                                  num_threads)
        if rc != 0:
            self._raise(rc, "qg_dequant", f": out {tuple(out.shape)}, group {group}, bits {bits}")

    def grouped_gemm(self, x: torch.Tensor, qp: torch.Tensor, sp: torch.Tensor, zp: torch.Tensor,
                     bias: torch.Tensor | None, group: int, bits: int, out: torch.Tensor, num_threads: int) -> None:
        """``out [T, out] = x [T, in] . W^T (+ bias)`` for any T, with W group-quantized in the panel
        layout of ``csrc/quant_gemm.c`` (``grouped.pack_panels``): qp uint8, sp / zp float32
        ``[panels, in / group, qg_panel]``; all contiguous."""
        rows, in_features = x.shape
        rc = self._lib.qg_gemm(_ptr(x), rows, _ptr(qp), _ptr(sp), _ptr(zp), _ptr(bias), in_features, out.shape[1],
                               group, bits, _ptr(out), num_threads)
        if rc != 0:
            self._raise(rc, "qg_gemm", f": x {tuple(x.shape)}, panels {tuple(qp.shape)}, group {group}, bits {bits}")

    def dense_gemm(self, x: torch.Tensor, wp: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
                   num_threads: int) -> None:
        """``out [T, out] = x [T, in] . W^T (+ bias)`` for float32 W in the panel layout of
        ``csrc/dense_gemm.c`` (``cpu_ops.pack_panels``): wp ``[out / dg_panel, in, dg_panel]``; all
        contiguous float32."""
        rows, in_features = x.shape
        rc = self._lib.dg_gemm(_ptr(x), rows, _ptr(wp), _ptr(bias), in_features, out.shape[1], _ptr(out),
                               num_threads)
        if rc != 0:
            self._raise(rc, "dg_gemm", f": x {tuple(x.shape)}, panels {tuple(wp.shape)}, out {tuple(out.shape)}")

    def fp8_linear(self, x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                   group: int, out: torch.Tensor, num_threads: int) -> None:
        """``out [T, out] = x [T, in] . W^T (+ bias)`` with W float8_e4m3fn bytes times a float32
        scale per row and group of ``group`` inputs (``csrc/fp8_linear.c``); all contiguous, T at
        most ``max_decode_tokens``."""
        rows, in_features = x.shape
        rc = self._lib.fp8_linear(_ptr(x), rows, _ptr(w), _ptr(scale), _ptr(bias), in_features, w.shape[0], group,
                                  _ptr(out), num_threads)
        if rc != 0:
            self._raise(rc, "fp8_linear", f": x {tuple(x.shape)}, weight {tuple(w.shape)}, group {group}")

    def bf16_linear(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
                    num_threads: int) -> None:
        """``out [T, out] = x [T, in] . W^T (+ bias)`` with W bfloat16 ``[out, in]`` widened in registers
        (``csrc/bf16_linear.c``); x, bias and out float32; all contiguous, T at most ``max_decode_tokens``."""
        rows, in_features = x.shape
        rc = self._lib.bf16_linear(_ptr(x), rows, _ptr(w), _ptr(bias), in_features, w.shape[0], _ptr(out),
                                   num_threads)
        if rc != 0:
            self._raise(rc, "bf16_linear", f": x {tuple(x.shape)}, weight {tuple(w.shape)}")

    def dequantize_fp8(self, w: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, group: int,
                       num_threads: int) -> None:
        """``out [rows, in]`` float32 = the FP8 matrix times its group scales, all contiguous."""
        rows, in_features = out.shape
        rc = self._lib.fp8_dequant(_ptr(w), _ptr(scale), _ptr(out), rows, in_features, group, num_threads)
        if rc != 0:
            self._raise(rc, "fp8_dequant", f": out {tuple(out.shape)}, group {group}")

    def fp8_quantize_activations(self, x: torch.Tensor, group: int, static_scale: float, out: torch.Tensor,
                                 num_threads: int) -> None:
        """``out [T, in]`` = ``x`` (float32, contiguous) rounded to e4m3 per row and group of
        ``group`` inputs with scale amax / 448, or with ``static_scale`` if > 0, and scaled back."""
        rows, in_features = x.shape
        rc = self._lib.fp8_act_quant(_ptr(x), rows, in_features, group, static_scale, _ptr(out), num_threads)
        if rc != 0:
            self._raise(rc, "fp8_act_quant", f": x {tuple(x.shape)}, group {group}")

    def moe_experts(self, x: torch.Tensor, ids: torch.Tensor, topk_weights: torch.Tensor, w13p: torch.Tensor,
                    w2p: torch.Tensor, out: torch.Tensor, num_threads: int) -> None:
        """``out [T, hidden]`` = the routed experts of a SiLU MoE layer (``csrc/moe_experts.c``):
        x float32 ``[T, hidden]``, ids int64 and topk_weights float32 ``[T, top_k]``, w13p / w2p
        in the packed layout of that file; all contiguous."""
        rows, hidden = x.shape
        experts, inter = w13p.shape[0], w13p.shape[1] * self.moe_panels[0]
        rc = self._lib.moe_experts(_ptr(x), rows, _ptr(ids), _ptr(topk_weights), ids.shape[1], _ptr(w13p),
                                   _ptr(w2p), experts, hidden, inter, _ptr(out), num_threads)
        if rc != 0:
            self._raise(rc, "moe_experts", f": x {tuple(x.shape)}, experts {experts}, inter {inter}")

    def mx_linear(self, x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                  out: torch.Tensor, num_threads: int) -> None:
        """``out [T, out]`` = x ``[T, in]`` float32 times the MXFP4 weight (``csrc/mxfp4.c``):
        blocks uint8 ``[out, in / 32, 16]``, scales uint8 ``[out, in / 32]``, bias float32 or
        None; all contiguous."""
        rows, in_features = x.shape
        rc = self._lib.mx_linear(_ptr(x), rows, _ptr(blocks), _ptr(scales), _ptr(bias), in_features, blocks.shape[0],
                                 _ptr(out), num_threads)
        if rc != 0:
            self._raise(rc, "mx_linear", f": x {tuple(x.shape)}, blocks {tuple(blocks.shape)}")

    def decoder_forward(self, model: LdModel, batch: LdBatch, out: torch.Tensor, num_threads: int) -> None:
        """The whole decoder stack on ``batch``: final-normed hidden states into ``out``
        ``[num_tokens, hidden]``; the KV cache is written in place."""
        rc = self._lib.ld_forward(ctypes.byref(model), ctypes.byref(batch), _ptr(out), num_threads)
        if rc != 0:
            self._raise(rc, "ld_forward")


# ---------------------------------------------------------------------------------------------
# the process-wide instance
# ---------------------------------------------------------------------------------------------


@functools.cache
def load_default() -> NativeLibrary | None:
    """The process-wide library, built on first use; None (after one warning) if it cannot be
    built or loaded, in which case callers take their torch fallbacks."""
    try:
        return NativeLibrary.build()
    except Exception as exc:  # any build/load failure (no compiler, compile error, mismatch) means "fall back"
        logger.warning("CPU kernel library unavailable (%s); falling back to torch code paths", exc)
        return None


def is_available() -> bool:
    return load_default() is not None


def library() -> NativeLibrary:
    """The process-wide library; :class:`NativeLibraryError` if it is unavailable."""
    lib = load_default()
    if lib is None:
        raise NativeLibraryError("the CPU kernel library could not be built or loaded (see the warning logged "
                                 "at first use)")
    return lib

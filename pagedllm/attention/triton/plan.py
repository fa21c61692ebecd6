"""Host-side choices for the Triton attention kernels: what is supported, the tile shapes, and
when to split the keys (flash-decoding). Pure Python: no triton import, no device access."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from importlib import metadata

import torch

SUPPORTED_HEAD_DIMS = (64, 80, 96, 128, 256)
SUPPORTED_BLOCK_SIZES = (8, 16, 32, 64, 128)  # the engine's block sizes; the kernel reads any
# (query dtype, KV cache dtype): the model's dtype throughout, a float32 model over a half cache,
# or any model over an fp8 cache (widened to the query dtype on read; scales folded in by the model,
# attention/kv_quant.py)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
E4M3_MIN_CAPABILITY = (8, 9)  # Triton has no float8_e4m3fn (fp8e4nv) before sm_89
# Triton before 3.7 also converts float8_e5m2 with sm_89's `cvt.e5m2x2` (ptxas refuses it for sm_80;
# seen with 3.6.0, the H200 device's version); 3.7 and later emulate it there (3.7, 3.8, 3.9 compile)
E5M2_BEFORE_SM89_TRITON = (3, 7)
SUPPORTED_DTYPES = (
    (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
    (torch.float32, torch.float16), (torch.float32, torch.bfloat16),
    *((q, c) for q in (torch.float32, torch.float16, torch.bfloat16) for c in FP8_DTYPES),
)

MAX_HEADS_PER_PROGRAM = 16  # query heads of one GQA group a program serves (bigger groups: several programs)
DECODE_MAX_QUERY_LEN = 16  # steps whose chunks are all this short count as decode steps
# rows per program, decode and prefill alike (as vLLM's unified Triton kernel): the smallest
# tl.dot M, and one compiled variant for mixed batches. A larger prefill tile would cut K/V
# re-reads for long prompts; it is one line here once a GPU measurement says it pays.
BLOCK_M = 16
MAX_KV_SPLITS = 32
MIN_KEYS_PER_SPLIT = 256  # a split must have this many keys to pay for its share of the merge


def device_lacks_dtype(kv_cache_dtype: torch.dtype, capability: tuple[int, int],
                       triton_version: tuple[int, int] | None = None) -> bool:
    """True for a cache dtype Triton (``triton_version``, default: the installed one) cannot
    compile for a GPU of ``capability``."""
    if capability >= E4M3_MIN_CAPABILITY or kv_cache_dtype not in FP8_DTYPES:
        return False
    if kv_cache_dtype == torch.float8_e4m3fn:
        return True
    return (triton_version or installed_triton_version()) < E5M2_BEFORE_SM89_TRITON


@functools.cache
def installed_triton_version() -> tuple[int, int]:
    """(major, minor) of the installed triton, read from its metadata (no import of triton)."""
    try:
        text = metadata.version("triton")
    except metadata.PackageNotFoundError:  # torch nightlies ship it as pytorch-triton
        import triton
        text = triton.__version__
    major, minor = text.split(".")[:2]
    return int(major), int(minor)


def next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


@dataclass(frozen=True)
class AttentionTiles:
    """Constexprs and launch options of ``paged_attention_kernel`` for one step.

    ``heads_per_prog`` query heads of a GQA group times ``block_q`` query tokens fill the
    ``block_m`` rows of one program; a group bigger than MAX_HEADS_PER_PROGRAM is served by
    ``subgroups`` programs per KV head."""

    block_m: int
    tile_n: int  # keys per step of the online softmax (independent of the cache block size)
    head_dim_pad: int  # head_dim rounded up to a power of two (arange needs one); the rest is masked
    heads_per_prog: int
    subgroups: int
    num_warps: int
    num_stages: int = 2  # K and V tiles per stage: <= 64 KiB even in float32, fits sm_80's shared memory

    @property
    def block_q(self) -> int:
        return self.block_m // self.heads_per_prog


def attention_tiles(head_dim: int, group: int) -> AttentionTiles:
    head_dim_pad = next_pow2(head_dim)
    heads_per_prog = min(group, MAX_HEADS_PER_PROGRAM)
    # 32 keys at head_dim 256 keep the K/V tiles and the score tile as small as 64 keys at 128
    return AttentionTiles(block_m=BLOCK_M, tile_n=32 if head_dim_pad > 128 else 64, head_dim_pad=head_dim_pad,
                          heads_per_prog=heads_per_prog, subgroups=-(-group // heads_per_prog), num_warps=4)


def num_query_tiles(num_tokens: int, num_reqs: int, block_q: int) -> int:
    """Request r owns tiles ``qsl[r] // block_q + r .. qsl[r+1] // block_q + r`` (kernels.py), so
    this bounds the grid without reading the device's query_start_loc."""
    return num_tokens // block_q + num_reqs


def choose_num_kv_splits(num_programs: int, max_query_len: int, max_seq_len: int, num_sms: int) -> int:
    """How many key ranges each query tile is split into (1: no split).

    Split only a decode step (every chunk at most DECODE_MAX_QUERY_LEN tokens) whose unsplit grid
    (``num_programs`` = query tiles x KV heads x subgroups) is smaller than the GPU (``num_sms``
    streaming multiprocessors): then most SMs idle while each program walks a long context.
    Splitting aims for ~2 programs per SM, keeps MIN_KEYS_PER_SPLIT keys per split and at most
    MAX_KV_SPLITS. Long prefills, big batches and short contexts never split."""
    if max_query_len > DECODE_MAX_QUERY_LEN or num_programs >= num_sms:
        return 1
    by_occupancy = -(-2 * num_sms // num_programs)
    by_length = max_seq_len // MIN_KEYS_PER_SPLIT
    return max(1, min(MAX_KV_SPLITS, by_occupancy, by_length))

"""Ahead-of-time compilation of every kernel configuration the backend can launch, for real GPU
targets, on any machine (the triton wheel carries ptxas): catches what the interpreter lets
through (``tl.dot`` shape limits, types, shared memory).

The launches are built by the same ``launch.py`` functions the backend uses, over meta-device
tensors, so the compiled signatures are the launched ones.

    python -m pagedllm.attention.triton.aot [--arch 80 90]

Needs the compiled kernels: run it without ``TRITON_INTERPRET=1``.
"""
from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterator

import torch

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.triton.launch import (
    AttentionCall,
    Launch,
    SplitBuffers,
    attention_launch,
    reduce_launch,
    write_kv_launch,
)
from pagedllm.attention.triton.plan import (
    FP8_DTYPES,
    SUPPORTED_BLOCK_SIZES,
    SUPPORTED_DTYPES,
    SUPPORTED_HEAD_DIMS,
    attention_tiles,
    device_lacks_dtype,
    next_pow2,
)

ARCHS = (80, 90)
MAX_SHARED_MEMORY = {80: 166912, 90: 232448}  # bytes a block may opt into (A100, H100)
_TYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.int32: "i32",
               torch.int64: "i64", torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5"}


def signature(args: dict[str, object]) -> dict[str, str]:
    """Triton signature types of runtime arguments, as the JIT types them at launch (an int equal
    to 1 becomes a constexpr there: ``specialized_constants`` gives its value)."""
    def type_of(value) -> str:
        if isinstance(value, torch.Tensor):
            return "*" + _TYPE_NAMES[value.dtype]
        if isinstance(value, bool):
            return "i1"
        if isinstance(value, int):
            if value == 1:
                return "constexpr"
            return "i32" if -(2**31) <= value < 2**31 else "i64"
        if isinstance(value, float):
            return "fp32"
        raise TypeError(f"no Triton type for {type(value).__name__}")
    return {name: type_of(value) for name, value in args.items()}


def specialized_constants(args: dict[str, object]) -> dict[str, int]:
    """The runtime ints the JIT compiles in as constants (those equal to 1: a batch of one
    request, one split, a GQA group of one), so a kernel that breaks when one becomes a
    constexpr (e.g. reassigned in a loop) fails here, not on the GPU."""
    return {name: 1 for name, value in args.items() if type(value) is int and value == 1}


def _meta(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def _metadata(num_tokens: int, num_reqs: int, max_query_len: int) -> AttentionMetadata:
    return AttentionMetadata(
        query_start_loc=_meta(num_reqs + 1, dtype=torch.int32), seq_lens=_meta(num_reqs, dtype=torch.int32),
        block_tables=_meta(num_reqs, 8, dtype=torch.int32), slot_mapping=_meta(num_tokens, dtype=torch.int64),
        max_query_len=max_query_len, max_seq_len=4096, block_size=SUPPORTED_BLOCK_SIZES[0],
    )  # fmt: skip


def shipped_launches() -> Iterator[Launch]:
    """One launch per distinct (kernel, argument types, constexprs, options) the backend issues:
    every (query, cache) dtype pair and every padded head dim."""
    # K/V reach the write kernel in the model's dtype, or already rounded for an fp8 cache (the
    # backend rounds them in torch): one launch per distinct (K/V dtype, cache dtype)
    for key_dtype, cache_dtype in dict.fromkeys((c if c in FP8_DTYPES else q, c) for q, c in SUPPORTED_DTYPES):
        key = _meta(4, 2, 64, dtype=key_dtype)
        cache = _meta(16, 2, SUPPORTED_BLOCK_SIZES[0], 64, dtype=cache_dtype)
        yield write_kv_launch(key, key, cache, cache, _meta(4, dtype=torch.int64))
    for q_dtype, cache_dtype in SUPPORTED_DTYPES:
        for head_dim in {next_pow2(d): d for d in SUPPORTED_HEAD_DIMS}.values():  # one per padded width
            yield from _attention_launches(q_dtype, cache_dtype, head_dim)
        yield _batch1_decode_launch(q_dtype, cache_dtype)
    for q_dtype in dict.fromkeys(q for q, _ in SUPPORTED_DTYPES):  # the merge reads float32 partials
        out = _meta(4, 8, 64, dtype=q_dtype)
        yield reduce_launch(out, SplitBuffers.empty(3, out))


def _attention_launches(q_dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int) -> Iterator[Launch]:
    """The attention kernel for one dtype pair and head size (split or not, it is one kernel)."""
    tokens, heads, kv_heads = 4, 8, 2
    query = _meta(tokens, heads, head_dim, dtype=q_dtype)
    cache = _meta(16, kv_heads, SUPPORTED_BLOCK_SIZES[0], head_dim, dtype=cache_dtype)
    call = AttentionCall(query, cache, cache, _metadata(tokens, 2, 1), 0.1, 0, 0.0)
    yield attention_launch(call, attention_tiles(head_dim, call.group), torch.empty_like(query),
                           SplitBuffers.empty(3, query))


def _batch1_decode_launch(q_dtype: torch.dtype, cache_dtype: torch.dtype) -> Launch:
    """One request, one query head per KV head, no split: num_reqs, group, heads_per_prog and
    num_splits all equal 1, which the JIT turns into constants."""
    query = _meta(1, 2, 128, dtype=q_dtype)
    cache = _meta(16, 2, SUPPORTED_BLOCK_SIZES[0], 128, dtype=cache_dtype)
    call = AttentionCall(query, cache, cache, _metadata(1, 1, 1), 0.1, 0, 0.0)
    return attention_launch(call, attention_tiles(128, call.group), torch.empty_like(query),
                            SplitBuffers.empty(1, query))


def compile_launch(launch: Launch, arch: int):
    """Compiles one launch for ``sm_<arch>``; returns triton's CompiledKernel."""
    import triton
    from triton.backends.compiler import GPUTarget

    from pagedllm.attention.triton import load_kernels
    sig = signature(launch.args) | {name: "constexpr" for name in launch.constexprs}
    src = triton.compiler.ASTSource(fn=getattr(load_kernels(), launch.kernel), signature=sig,
                                    constexprs=specialized_constants(launch.args) | launch.constexprs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=launch.options)


def describe(launch: Launch) -> str:
    """The kernel, the dtypes of its data pointers, constexprs and options, on one line."""
    data = ("query_ptr", "key_ptr", "acc_ptr", "key_cache_ptr", "out_ptr")
    dtypes = " ".join(f"{name[:-4]}={t[1:]}" for name, t in signature(launch.args).items() if name in data)
    return f"{launch.kernel} {dtypes} {specialized_constants(launch.args) | launch.constexprs} {launch.options}"


def dot_instructions(kernel) -> str:
    """The tensor-core instructions in a compiled kernel's PTX (``mma.sync`` / ``wgmma`` with their
    shapes and operand types), comma-separated; ``fma`` where there is none (float32 dots)."""
    found = set(re.findall(r"\b(?:wgmma\.mma_async|mma\.sync)\.aligned\.[\w.]+", kernel.asm["ptx"]))
    return ",".join(sorted(found)) or "fma"


def _needs_newer_arch(launch: Launch, arch: int) -> bool:
    """An e4m3 cache kernel on a pre-sm_89 target (the backend refuses that cache there)."""
    capability = divmod(arch, 10)
    return any(isinstance(v, torch.Tensor) and device_lacks_dtype(v.dtype, capability) for v in launch.args.values())


def compile_all(archs: tuple[int, ...] = ARCHS) -> list[str]:
    """Compiles every shipped launch for every arch (e4m3-cache kernels from sm_89 on); returns
    one line per kernel (ending in ``dot=``, its ``dot_instructions``) and raises on a failure or
    a kernel needing more shared memory than the target has."""
    lines = []
    for launch in shipped_launches():
        for arch in [a for a in archs if not _needs_newer_arch(launch, a)]:
            kernel = compile_launch(launch, arch)
            shared = kernel.metadata.shared
            if shared > MAX_SHARED_MEMORY[arch]:
                raise RuntimeError(f"sm_{arch} {describe(launch)}: {shared} bytes of shared memory")
            lines.append(f"sm_{arch} shared={shared} {describe(launch)} dot={dot_instructions(kernel)}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, nargs="+", default=list(ARCHS), choices=ARCHS)
    args = parser.parse_args(argv)
    from pagedllm.attention.triton import interpreting
    if interpreting():
        print("the kernels were built for Triton's interpreter: unset TRITON_INTERPRET", file=sys.stderr)
        return 2
    for line in compile_all(tuple(args.arch)):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())

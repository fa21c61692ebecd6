"""Compiles every Triton kernel ahead of time for the given CUDA architectures (no GPU needed:
triton's wheel ships ptxas). Run without TRITON_INTERPRET: interpreted kernels cannot be compiled.

    python tests/layers/triton_ops/aot_compile.py 80 90
"""
from __future__ import annotations

import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource

from pagedllm.attention.triton.aot import MAX_SHARED_MEMORY
from pagedllm.layers.triton_ops import (
    activation,
    fused_moe,
    grouped_gemm,
    int8_gemm,
    lora,
    mxfp4,
    norm,
    rotary,
    sampling,
)


def _specs(dt: str):
    """(kernel, signature, constexprs, num_warps) per kernel, for activation dtype ``dt``."""
    return [
        (norm._add_rms_norm_kernel,
         dict(x_ptr=f"*{dt}", residual_ptr=f"*{dt}", weight_ptr=f"*{dt}", out_ptr=f"*{dt}", x_stride="i32",
              residual_stride="i32", out_stride="i32", dim="i32", eps="fp32"),
         dict(HAS_RESIDUAL=True, BLOCK=2048), 8),
        (rotary._rotary_neox_kernel,
         dict(x_ptr=f"*{dt}", positions_ptr="*i64", cos_ptr="*fp32", sin_ptr="*fp32", token_stride="i32",
              head_stride="i32", num_heads="i32", half="i32", cache_stride="i32"),
         dict(BLOCK_H=32, BLOCK_D=64), 4),
        (activation._silu_and_mul_kernel,
         dict(x_ptr=f"*{dt}", out_ptr=f"*{dt}", x_stride="i32", out_stride="i32", d="i32"),
         dict(BLOCK=1024), 4),
        *[(sampling._top_k_top_p_min_p_kernel,
           dict(logits_ptr="*fp32", cand_ptr="*fp32", top_k_ptr="*i32", top_p_ptr="*fp32", min_p_ptr="*fp32",
                passes_ptr="*i32", stride="i32", cand_stride="i32", vocab="i32", num_cand="i32"),
           dict(BLOCK=1024, CAND_BLOCK=sampling.CANDIDATES, KEY_STEPS=sampling._KEY_STEPS, COUNT_PASSES=count), 8)
          for count in (False, True)],
        *[(int8_gemm._int8_gemm_kernel,
           dict(x_ptr=f"*{dt}", q_ptr="*i8", scale_ptr="*fp32", bias_ptr=f"*{dt}", y_ptr=f"*{dt}", M="i32",
                N="i32", K="i32", x_stride="i32", q_stride="i32", y_stride="i32"),
           dict(HAS_BIAS=True, DOT_PRECISION="ieee" if dt == "fp32" else "tf32", BLOCK_M=bm, BLOCK_N=bn,
                BLOCK_K=bk), 4)
          for bm, bn, bk in (int8_gemm._tiles(1), int8_gemm._tiles(4096))],  # decode and prefill tiles
        *_grouped_gemm_specs(dt),
        *_fused_moe_specs(dt),
        *[(mxfp4._mxfp4_gemm_kernel,
           dict(x_ptr=f"*{dt}", blocks_ptr="*u8", scales_ptr="*u8", bias_ptr=f"*{dt}", y_ptr=f"*{dt}", M="i32",
                N="i32", K="i32", x_stride="i32", y_stride="i32"),
           dict(HAS_BIAS=True, DOT_PRECISION="ieee" if dt == "fp32" else "tf32", BLOCK_M=bm, BLOCK_N=bn,
                BLOCK_K=bk), 4)
          for bm, bn, bk in (mxfp4.tiles(1), mxfp4.tiles(4096))],  # MXFP4 (gpt-oss experts): decode and prefill tiles
        *_lora_specs(dt),
    ]


def _lora_specs(dt: str):
    """The batched LoRA shrink and expand as lora_sgmv launches them (rank 16: BLOCK_R 16)."""
    meta = dict(perm_ptr="*i64", seg_slot_ptr="*i64", seg_start_ptr="*i64")
    precision = "ieee" if dt == "fp32" else "tf32"
    return [(lora._lora_shrink_kernel, dict(x_ptr=f"*{dt}", a_ptr=f"*{dt}", t_ptr="*fp32", **meta, K="i32", R="i32",
                                            x_stride="i32"),
             dict(DOT_PRECISION=precision, BLOCK_M=lora.BLOCK_M, BLOCK_R=16, BLOCK_K=64), 4),
            (lora._lora_expand_kernel, dict(t_ptr="*fp32", b_ptr=f"*{dt}", y_ptr=f"*{dt}", **meta, N="i32", R="i32",
                                            y_stride="i32"),
             dict(DOT_PRECISION=precision, BLOCK_M=lora.BLOCK_M, BLOCK_N=64, BLOCK_R=16), 4)]


def _fused_moe_specs(dt: str):
    """The MoE GEMM as the layer launches it: gate_up (A rows per token, top-2) and down (A rows
    per slot, routing weights applied), at the decode and prefill tiles."""
    def signature(per_row: int, bias: bool, mx: bool = False) -> dict[str, str]:
        weight = "*fp32" if per_row == 1 else "*i32"  # (unread without routing weights: num_padded)
        return dict(a_ptr=f"*{dt}", w_ptr="*u8" if mx else f"*{dt}", w_scales_ptr="*u8" if mx else "*i32",
                    c_ptr=f"*{dt}", weight_ptr=weight,
                    bias_ptr=f"*{dt}" if bias else weight, slots_ptr="*i32", block_expert_ptr="*i32",
                    num_padded_ptr="*i32", N="i32", K="i32", num_slots="i32", a_stride="i32", w_expert_stride="i32",
                    w_stride="i32", c_stride="i32")
    # with and without the experts' biases, and GPT-OSS's MXFP4 experts (biased)
    return [(fused_moe._moe_gemm_kernel, signature(per_row, bias, mx),
             dict(SLOTS_PER_ROW=per_row, MUL_WEIGHT=per_row == 1, HAS_BIAS=bias, MXFP4=mx,
                  DOT_PRECISION="ieee" if dt == "fp32" else "tf32", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk), warps)
            for per_row in (2, 1) for bm, bn, bk, warps in (fused_moe.tiles(1, 8), fused_moe.tiles(4096, 8))
            for bias, mx in ((False, False), (True, False), (True, True))]


def _grouped_gemm_specs(dt: str):
    """The 4/8-bit GEMM: both code widths, decode and prefill tiles, one group per K tile (group
    >= tile, channel-wise) and several (group 32 under the 64-wide prefill tile)."""
    signature = dict(x_ptr=f"*{dt}", q_ptr="*u8", scale_ptr="*fp32", szero_ptr="*fp32", bias_ptr=f"*{dt}",
                     y_ptr=f"*{dt}", M="i32", N="i32", K="i32", G="i32", group="i32", x_stride="i32",
                     q_stride="i32", y_stride="i32")
    specs = [(grouped_gemm._grouped_gemm_kernel, signature,
              dict(BITS=bits, ONE_GROUP=one_group, HAS_BIAS=True, DOT_PRECISION="ieee" if dt == "fp32" else "tf32",
                   BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk), warps)
             for bits in (4, 8) for bm, bn, bk, warps in (grouped_gemm.tiles(1), grouped_gemm.tiles(4096))
             for one_group in (True, False)]
    # batch-1 decode of a channel-wise layer: the JIT compiles runtime ints equal to 1 (M, G) in
    # as constants, a variant of its own
    kernel, _, constexprs, warps = specs[0]
    return [*specs, (kernel, signature, {**constexprs, "M": 1, "G": 1}, warps)]


def compile_all(arch: int) -> list[str]:
    """bfloat16 (the GPU dtype) for every kernel and GEMM tile shape, and on sm_90 also the
    float32 GEMMs' prefill tiles (IEEE dot); float16 compiles like bfloat16, left out to keep the
    test short."""
    done = []
    fp32 = [spec for spec in _specs("fp32") if spec[2].get("BLOCK_M") == 64] if arch >= 90 else []
    for dt, specs in (("bf16", _specs("bf16")), ("fp32", fp32)):
        for kernel, signature, constexprs, num_warps in specs:
            signature = {**signature, **{name: "constexpr" for name in constexprs}}
            src = ASTSource(kernel, signature=signature, constexprs=constexprs)
            compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})
            assert compiled.asm["cubin"], f"{kernel.__name__} produced no cubin"
            shared = compiled.metadata.shared  # (a launch over the limit fails only on the GPU)
            assert shared <= MAX_SHARED_MEMORY[arch], f"{kernel.__name__} {constexprs}: {shared} bytes shared"
            done.append(f"sm_{arch} {dt} {kernel.__name__}")
    return done


if __name__ == "__main__":
    for arch in sys.argv[1:]:
        print("\n".join(compile_all(int(arch))))

/* pagedllm_native.h: everything the CPU library shares with Python, declared once.
 *
 * The library is the kernel files (paged_attention.c, cpu_ops.c, llama_decode.c,
 * quant_linear.c, quant_gemm.c, fp8_linear.c, bf16_linear.c, moe_experts.c, dense_gemm.c, mxfp4.c,
 * mla_decode.c, threads.c) plus
 * native.c, compiled together by pagedllm/native/build.py; each includes this header, so no
 * prototype is written twice. Python (pagedllm/native/bindings.py) never retypes what is here:
 *   - constants are read back through pn_constant() by name;
 *   - the ctypes mirrors of the structs are checked at load against pn_struct_layout() and
 *     pn_field_layout() (size and field count of each struct, offset and size of each field);
 *   - the argtypes / restype of every PN_EXPORT function are checked against the prototypes
 *     below, parsed from this file (so keep each one a plain `PN_EXPORT type name(args);`).
 * This header is part of the build hash: editing it rebuilds the library.
 */
#ifndef PAGEDLLM_NATIVE_H
#define PAGEDLLM_NATIVE_H

#include <stdint.h>

/* Bump when an exported signature or struct changes meaning, not only its layout (layout and
 * argument types are checked automatically). */
#define PN_ABI_VERSION 15

/* Marks the functions Python binds; the bindings' argtypes are checked against them. */
#define PN_EXPORT

/* 16 float / int32 lanes for the register-tile GEMMs (moe_experts.c, quant_gemm.c): one zmm with
 * AVX-512, two ymm with AVX2, scalar code elsewhere. aligned(4): loads from any float address. */
typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef int32_t v16i __attribute__((vector_size(64), aligned(4)));
static inline v16 load16(const float *p) { return *(const v16 *)p; }
static inline void store16(float *p, v16 v) { *(v16 *)p = v; }

/* The register tile of those GEMMs: acc[r][0:2] += sum over k < K of a[r][k] * b[k][0:32] for M
 * rows, b one 32-column panel (32 floats per k). M is a literal at every call site, so the row
 * loops unroll and acc lives in registers (2 M accumulators: M = 8 with AVX-512's 32 zmm, 2 with
 * AVX2's 16 ymm). prefetch > 0 (a literal too): b streams from memory, fetch that many floats
 * ahead; 0: b is already in cache. */
static inline __attribute__((always_inline)) void pn_tile32(const int M, const float *const *a, const float *b,
                                                            int64_t K, v16 (*acc)[2], const int prefetch) {
#pragma GCC unroll 2
    for (int64_t k = 0; k < K; k++) {
        if (prefetch) {
            __builtin_prefetch(b + 32 * k + prefetch, 0, 3);
            __builtin_prefetch(b + 32 * k + prefetch + 16, 0, 3);
        }
        const v16 b0 = load16(b + 32 * k), b1 = load16(b + 32 * k + 16);
        for (int r = 0; r < M; r++) {
            acc[r][0] += a[r][k] * b0;
            acc[r][1] += a[r][k] * b1;
        }
    }
}

/* Most tokens one call of the small-batch kernels (ld_linear, qg_linear, fp8_linear,
 * bf16_linear) and of ld_forward takes (the Python side sends batches up to its own, smaller,
 * limits). Sizes stack arrays. ld_forward takes up to LD_PANEL_MAX_TOKENS when every projection
 * is float32 with a panel copy (LdModel.qkv_p ...), which dg_gemm runs. */
#define LD_MAX_TOKENS 64
#define LD_PANEL_MAX_TOKENS 96

/* Largest finite float8_e4m3fn: FP8 scales are amax / PN_FP8_E4M3_MAX (Python reads it from here). */
#define PN_FP8_E4M3_MAX 448

/* KV cache dtypes (the math is float32 whatever the cache holds; fp8 caches' scales are folded
 * into the softmax scale and the output by the caller). */
enum { PN_DTYPE_F32 = 0, PN_DTYPE_F16 = 1, PN_DTYPE_BF16 = 2, PN_DTYPE_FP8_E4M3 = 3, PN_DTYPE_FP8_E5M2 = 4 };

/* Return codes of every exported function. */
enum {
    PN_OK = 0,
    PN_ERR_ARG = -1,   /* bad dimension / dtype argument */
    PN_ERR_NOMEM = -2, /* scratch allocation failed */
    PN_ERR_META = -3,  /* metadata out of range (would read or write outside the tensors) */
};

/* The hot loops use AVX2/FMA intrinsics when the build flags allow, with scalar fallbacks. */
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PN_AVX2 1
/* the sum of the 8 lanes of v */
static inline float pn_hsum256(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

/* 8 bfloat16 values at p as float32 lanes (exact): zero-extend to 32 bits, shift into the high half */
static inline __m256 pn_load_bf16x8(const uint16_t *p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

/* exp's constants, one set for both widths: log2(e), ln2 in two parts, the polynomial */
#define PN_EXP_LOG2E 1.44269504088896341f
#define PN_EXP_LN2_HI 0.693359375f
#define PN_EXP_LN2_LO (-2.12194440e-4f)
#define PN_EXP_P0 1.9875691500e-4f
#define PN_EXP_P1 1.3981999507e-3f
#define PN_EXP_P2 8.3334519073e-3f
#define PN_EXP_P3 4.1665795894e-2f
#define PN_EXP_P4 1.6666665459e-1f
#define PN_EXP_P5 5.0000001201e-1f

/* e^x lane-wise for x <= 88 (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, degree-6 polynomial,
 * ~2 ulp). Inputs below -87 give ~1e-38 (2^n stays a normal float), i.e. 0 next to a softmax
 * row max whose weight is exactly 1; callers whose x may exceed 88 clamp it (2^n overflows). */
static inline __m256 pn_exp256(__m256 x) {
    const __m256 log2e = _mm256_set1_ps(PN_EXP_LOG2E);
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, log2e, _mm256_set1_ps(0.5f)));
    /* x - fx * ln2 with ln2 split in two for accuracy */
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(PN_EXP_LN2_HI), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(PN_EXP_LN2_LO), x);
    __m256 y = _mm256_set1_ps(PN_EXP_P0);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(PN_EXP_P1));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(PN_EXP_P2));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(PN_EXP_P3));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(PN_EXP_P4));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(PN_EXP_P5));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i biased = _mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127));
    const __m256i e = _mm256_slli_epi32(biased, 23); /* 2^fx as float bits */
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

#if defined(__AVX512F__)
/* pn_exp256 on 16 lanes: the same operations, so the same bits lane for lane */
static inline __m512 pn_exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 fx = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(PN_EXP_LOG2E),
                                                           _mm512_set1_ps(0.5f)), _MM_FROUND_TO_NEG_INF);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(PN_EXP_LN2_HI), x);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(PN_EXP_LN2_LO), x);
    __m512 y = _mm512_set1_ps(PN_EXP_P0);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(PN_EXP_P1));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(PN_EXP_P2));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(PN_EXP_P3));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(PN_EXP_P4));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(PN_EXP_P5));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}
#endif
#else
#define PN_AVX2 0
#endif

/* ------------------------------------------------------------------------------------------ */
/* structs passed from Python (mirrored with ctypes in bindings.py)                           */
/* ------------------------------------------------------------------------------------------ */

/* The model of the one-call decoder. Per-layer pointers: one array entry per layer; bias /
 * q_norm / k_norm entries may be NULL. Projection weights are all float32 (scales NULL), all
 * int8 with per-row scales (quant_bits 0), all group-wise 4/8-bit codes (quant_bits 4 or 8;
 * scales and scaled zeros [out, in / group], the layout of quant_linear.c), or all FP8 e4m3
 * bytes (fp8_act != 0; scales [out, in / group], fp8_linear.c's layout) whose activations stay
 * float32 (fp8_act 1) or are rounded to e4m3 per token (2) or per token and group (3), or all
 * bfloat16 (bf16 1: the embedding is bfloat16 too; norm weights, biases and cos / sin stay
 * float32, and activations are float32 throughout). The KV cache is float32 or bfloat16. */
typedef struct {
    int32_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate;
    int32_t block_size, cache_dtype, quant_bits, fp8_act, bf16, panel_min;
    int64_t num_blocks, vocab_size, max_position;
    int64_t qkv_group, o_group, gate_up_group, down_group; /* group sizes when quant_bits or fp8_act != 0 */
    /* LoRA adapter slots (see _la / _lb below): slots per projection, and each projection's rank
     * R (its sub-projections' ranks stacked: qkv 3 x max_lora_rank); 0 where none */
    int64_t lora_slots, qkv_lora_rank, o_lora_rank, gate_up_lora_rank, down_lora_rank;
    float eps, scale;
    const void *embed;       /* [vocab, hidden], float32 or (bf16) bfloat16 */
    const float *final_norm; /* [hidden] */
    const float *cos, *sin;  /* [max_position, head_dim / 2] */
    const float *const *input_norm, *const *post_norm;
    const void *const *qkv_w, *const *o_w, *const *gate_up_w, *const *down_w; /* f32, int8, uint8 codes, e4m3, bf16 */
    const float *const *qkv_s, *const *o_s, *const *gate_up_s, *const *down_s; /* scales or NULL */
    const float *const *qkv_b, *const *o_b, *const *gate_up_b, *const *down_b;
    const float *const *qkv_z, *const *o_z, *const *gate_up_z, *const *down_z; /* scaled zeros or NULL */
    /* panel copies, or NULL: float32 weights in dense_gemm.c's layout (dg_gemm), or 4/8-bit
     * codes in quant_gemm.c's with their panel scales (_ps) and scaled zeros (_pz) (qg_gemm).
     * A projection with its copy runs on that GEMM from panel_min tokens: the Python side picks
     * the switch (models/cpu_decode.py: float32 per host CPU, codes where the module path
     * switches, grouped.SMALL_MAX_ROWS + 1). Past LD_MAX_TOKENS tokens every projection needs
     * its panel copy. */
    const void *const *qkv_p, *const *o_p, *const *gate_up_p, *const *down_p;
    const float *const *qkv_ps, *const *o_ps, *const *gate_up_ps, *const *down_ps;
    const float *const *qkv_pz, *const *o_pz, *const *gate_up_pz, *const *down_pz;
    /* LoRA (layers/lora.py's LoRASlots), or NULL entries where a projection takes no adapter:
     * A [lora_slots, R, in] and B [lora_slots, out, R] float32, the adapter's scale folded into B.
     * The step's tokens of slot s get y += (x . A[s]^T) . B[s]^T right after the base projection
     * (lora_sgmv.c), when LdBatch names LoRA segments; base-model tokens are in none. */
    const float *const *qkv_la, *const *o_la, *const *gate_up_la, *const *down_la;
    const float *const *qkv_lb, *const *o_lb, *const *gate_up_lb, *const *down_lb;
    const float *const *q_norm, *const *k_norm;
    void *const *key_cache, *const *value_cache; /* [num_blocks, kv_heads, block, head_dim] */
    const int32_t *window; /* per layer: sliding attention window, 0 = full attention */
} LdModel;

/* Attention metadata of the step (same arrays as the paged-attention kernel takes). */
typedef struct {
    const int32_t *query_start_loc, *seq_lens, *block_tables;
    const int64_t *slot_mapping, *positions, *input_ids;
    int32_t num_reqs, max_blocks;
    int64_t bt_stride, num_tokens, parallel_work;
    /* the step's LoRA tokens grouped by adapter slot, as lora_sgmv takes them (lora_rows NULL: one
     * segment covers every token in order); lora_num_segs 0: no adapter token, nothing runs */
    const int64_t *lora_rows, *lora_seg_slot, *lora_seg_start;
    int64_t lora_num_segs;
} LdBatch;

/* ------------------------------------------------------------------------------------------ */
/* paged attention (paged_attention.c); strides are in elements                               */
/* ------------------------------------------------------------------------------------------ */

PN_EXPORT int pa_write_kv(const void *key, const void *value, void *key_cache, void *value_cache,
                          const int64_t *slot_mapping, int64_t num_tokens, int64_t num_blocks,
                          int num_kv_heads, int head_dim, int block_size, int64_t k_stride_tok,
                          int64_t k_stride_head, int64_t v_stride_tok, int64_t v_stride_head, int dtype,
                          int num_threads);
PN_EXPORT int pa_attention(const float *query, float *out, const void *key_cache, const void *value_cache,
                           const int32_t *block_tables, const int32_t *query_start_loc,
                           const int32_t *seq_lens, int num_reqs, int64_t num_tokens, int64_t num_blocks,
                           int max_blocks, int64_t bt_stride, int num_heads, int num_kv_heads, int head_dim,
                           int block_size, int64_t q_stride_tok, int64_t q_stride_head, int64_t o_stride_tok,
                           int64_t o_stride_head, float scale, int window, int attn_chunk, int dtype, int num_threads,
                           int64_t parallel_work, const float *sinks, const int32_t *attend_ends);
/* pa_attention's work split, process-wide (kernel_tuning.py measures them at start-up): query
 * rows per prefill item (tile_rows / head_dim tokens, at least a GQA group's row; 0: 4096), and
 * the decode items per thread under which a decode token's kv heads are split over more items
 * (0: 1). PN_ERR_ARG for negative values. */
PN_EXPORT int pa_set_split(int tile_rows, int decode_items_per_thread);

/* ------------------------------------------------------------------------------------------ */
/* fused model-body ops (cpu_ops.c)                                                           */
/* ------------------------------------------------------------------------------------------ */

PN_EXPORT int pl_add_rms_norm(const float *x, float *residual, const float *weight, float *out, int64_t rows,
                              int64_t dim, int64_t x_stride, float eps, int threads);
PN_EXPORT int pl_rotary_neox(float *x, const int64_t *pos, const float *cos_cache, const float *sin_cache,
                             int64_t tokens, int heads, int head_dim, int64_t ts, int64_t hs, int64_t max_pos,
                             int threads);
PN_EXPORT int pl_argmax_rows(const float *x, int64_t rows, int64_t cols, int64_t stride, int64_t *out);

/* ------------------------------------------------------------------------------------------ */
/* float32 panel GEMM for decode-sized batches (dense_gemm.c)                                 */
/* ------------------------------------------------------------------------------------------ */

/* Output columns per packed panel: wp [out / DG_PANEL, in, DG_PANEL]. */
#define DG_PANEL 32
/* Rows of its register tile: 8 with AVX-512 (where it beats oneDNN's packed GEMM), 2 elsewhere. */
#if defined(__AVX512F__)
#define DG_ROWS 8
#else
#define DG_ROWS 2
#endif

/* y [T, out] = x [T, in] . W^T (+ bias [out] unless NULL), W packed as above; out % DG_PANEL == 0. */
PN_EXPORT int dg_gemm(const float *x, int64_t T, const float *wp, const float *bias, int64_t in, int64_t out,
                      float *y, int threads);

/* ------------------------------------------------------------------------------------------ */
/* batched LoRA over a mixed batch (lora_sgmv.c)                                              */
/* ------------------------------------------------------------------------------------------ */

/* y[rows[i]] += (x[rows[i]] . a[s]^T) . b[s]^T for the tokens i of each segment g (tokens
 * seg_start[g] .. seg_start[g + 1] - 1, slot s = seg_slot[g]); rows NULL: token i is row i and the
 * segments cover all T rows. x [T, in], y [T, out], a [num_slots, R, in], b [num_slots, out, R],
 * all float32 and contiguous; PN_ERR_META for a segment, slot or row out of range. */
/* Internal (llama_decode.c checks a step's segments once, before it writes the KV cache):
 * lora_sgmv's own check, PN_ERR_META where it would refuse them. */
int lora_check_segments(const int64_t *rows, const int64_t *seg_slot, const int64_t *seg_start, int num_segs,
                        int64_t num_slots, int64_t T);
PN_EXPORT int lora_sgmv(const float *x, int64_t T, int64_t in, const int64_t *rows, const int64_t *seg_slot,
                        const int64_t *seg_start, int num_segs, const float *a, const float *b, int64_t num_slots,
                        int64_t R, int64_t out, float *y, int threads);

/* ------------------------------------------------------------------------------------------ */
/* small-batch decoder and matmuls (llama_decode.c)                                           */
/* ------------------------------------------------------------------------------------------ */

PN_EXPORT int ld_dequant_i8(const int8_t *q, const float *scale, float *out, int64_t rows, int64_t in,
                            int threads);
PN_EXPORT int ld_linear(const float *x, int64_t T, const void *w, const float *scale, const float *bias,
                        int64_t in, int64_t out, float *y, int threads);
PN_EXPORT int ld_forward(const LdModel *m, const LdBatch *b, float *out, int threads);
/* act [T, inter] = silu(gate) * up of gate_up [T, 2 * inter] (gate first), both contiguous. */
PN_EXPORT int ld_silu_and_mul(const float *gate_up, int64_t T, int64_t inter, float *act, int threads);

/* ------------------------------------------------------------------------------------------ */
/* group-wise 4/8-bit weight-only matmuls (quant_linear.c; layout in that file's comment)     */
/* ------------------------------------------------------------------------------------------ */

PN_EXPORT int qg_linear(const float *x, int64_t T, const uint8_t *q, const float *scale, const float *szero,
                        const float *bias, int64_t in, int64_t out, int64_t group, int bits, float *y,
                        int threads);
/* Internal (llama_decode.c): signed int8 codes with one scale per row on quant_linear.c's VNNI
 * path; PN_ERR_ARG where that path does not apply (the caller keeps its own kernel). */
int qg_linear_i8(const float *x, int64_t T, const int8_t *q, const float *scale, const float *bias, int64_t in,
                 int64_t out, float *y, int threads);
PN_EXPORT int qg_dequant(const uint8_t *q, const float *scale, const float *szero, float *out, int64_t rows,
                         int64_t in, int64_t group, int bits, int threads);

/* Output columns per panel of qg_gemm's packed layout (quant_gemm.c; grouped.py builds it). */
#define QG_PANEL 32

/* y [T, out] = x [T, in] . W^T (+ bias) for any T, W in the panel layout of quant_gemm.c. */
PN_EXPORT int qg_gemm(const float *x, int64_t T, const uint8_t *qp, const float *sp, const float *zp,
                      const float *bias, int64_t in, int64_t out, int64_t group, int bits, float *y, int threads);

/* ------------------------------------------------------------------------------------------ */
/* FP8 (e4m3fn) weight matmuls (fp8_linear.c; layout in that file's comment)                  */
/* ------------------------------------------------------------------------------------------ */

/* pn_fp8_e4m3_lut[b] = the float8_e4m3fn byte b as float32 (filled when the library loads). */
extern float pn_fp8_e4m3_lut[256];

PN_EXPORT int fp8_linear(const float *x, int64_t T, const uint8_t *w, const float *scale, const float *bias,
                         int64_t in, int64_t out, int64_t group, float *y, int threads);
PN_EXPORT int fp8_dequant(const uint8_t *w, const float *scale, float *out, int64_t rows, int64_t in,
                          int64_t group, int threads);
PN_EXPORT int fp8_act_quant(const float *x, int64_t T, int64_t in, int64_t group, float static_scale, float *out,
                            int threads);

/* ------------------------------------------------------------------------------------------ */
/* bfloat16 weight matmuls (bf16_linear.c)                                                    */
/* ------------------------------------------------------------------------------------------ */

/* y [T, out] = x [T, in] . W^T (+ bias) with W bfloat16 [out, in]; x, y, bias float32; T at most
 * LD_MAX_TOKENS. */
PN_EXPORT int bf16_linear(const float *x, int64_t T, const uint16_t *w, const float *bias, int64_t in, int64_t out,
                          float *y, int threads);
/* Internal: one bfloat16 as float32 (exact), and float32 rounded to bfloat16 as torch casts it
 * (nearest, ties to even). */
float pn_bf16_to_f32(uint16_t h);
uint16_t pn_f32_to_bf16(float f);

/* ------------------------------------------------------------------------------------------ */
/* the routed experts of a float32 MoE layer (moe_experts.c; packed layout in that file)     */
/* ------------------------------------------------------------------------------------------ */

/* Columns per packed weight panel: gate/up panels hold this many gate and as many up rows,
 * down panels this many hidden rows; inter and hidden must be multiples of them. */
#define MOE_GATE_PANEL 16
#define MOE_DOWN_PANEL 32

/* y [T, hidden] = sum over k of topk_w[t, k] * expert ids[t, k] (x[t]); ids int64 [T, top_k]. */
PN_EXPORT int moe_experts(const float *x, int64_t T, const int64_t *ids, const float *topk_w, int64_t top_k,
                          const float *w13p, const float *w2p, int64_t E, int64_t hidden, int64_t inter,
                          float *y, int threads);

/* ------------------------------------------------------------------------------------------ */
/* MXFP4 weights as gpt-oss ships them (mxfp4.c; layout in that file)                        */
/* ------------------------------------------------------------------------------------------ */

/* y [rows, out] = x [rows, in] W^T + bias (NULL: none); W as blocks [out, in/32, 16] e2m1 pairs
 * and scales [out, in/32] e8m0; in a multiple of 32; all contiguous. */
PN_EXPORT int mx_linear(const float *x, int64_t rows, const uint8_t *blocks, const uint8_t *scales,
                        const float *bias, int64_t in_features, int64_t out_features, float *y, int threads);

/* ------------------------------------------------------------------------------------------ */
/* multi-head latent attention, absorbed form (mla_decode.c; layouts there)                   */
/* ------------------------------------------------------------------------------------------ */

/* out [T, heads, rank] = softmax(scale * query . latents^T) . c_kv over each token's causal context,
 * query [T, heads, rank + rope] = [W_UK^T q_nope | q_pe], latent_cache [blocks, 1, block_size, rank + rope]. */
PN_EXPORT int mla_latent_attention(const float *query, float *out, const void *latent_cache,
                                   const int32_t *block_tables, const int32_t *query_start_loc,
                                   const int32_t *seq_lens, int num_reqs, int64_t num_tokens, int64_t num_blocks,
                                   int max_blocks, int64_t bt_stride, int num_heads, int kv_lora_rank, int rope_dim,
                                   int block_size, int64_t q_stride_tok, int64_t q_stride_head,
                                   int64_t o_stride_tok, int64_t o_stride_head, float scale, int dtype,
                                   int num_threads);

/* ------------------------------------------------------------------------------------------ */
/* OpenMP threads (threads.c)                                                                 */
/* ------------------------------------------------------------------------------------------ */

/* Runs one parallel region of n threads in which thread i pins itself to cpus[i] (the pool's
 * threads keep it); PN_ERR_ARG for a CPU out of range or one the kernel refused. */
PN_EXPORT int pn_pin_threads(const int32_t *cpus, int n);

/* ------------------------------------------------------------------------------------------ */
/* what Python reads back at load (native.c)                                                  */
/* ------------------------------------------------------------------------------------------ */

/* *value = the constant called `name` (e.g. "ABI_VERSION", "ERR_META"); PN_ERR_ARG if unknown. */
PN_EXPORT int pn_constant(const char *name, int64_t *value);
/* sizeof the struct called `type` and its number of fields; PN_ERR_ARG if unknown. */
PN_EXPORT int pn_struct_layout(const char *type, int64_t *size, int64_t *num_fields);
/* offsetof / sizeof the field `field` of the struct `type`; PN_ERR_ARG if unknown. */
PN_EXPORT int pn_field_layout(const char *type, const char *field, int64_t *offset, int64_t *size);

#endif /* PAGEDLLM_NATIVE_H */

/* Group-wise weight-only 4-bit and 8-bit matmuls (layers/quantization/grouped.py).
 *
 * Weight layout (one format for our own int4 and every checkpoint format, converted at load):
 *   q      uint8, row-major [out, in / 2] for 4 bits (column 2j in the low nibble of byte j,
 *          column 2j+1 in the high nibble) or [out, in] for 8 bits; unsigned codes;
 *   scale  float32 [out, in / group]: the group's step;
 *   szero  float32 [out, in / group]: zero point * scale of the group;
 * so W[o, i] = q[o, i] * scale[o, g] - szero[o, g] with g = i / group. group is a multiple of
 * 8 and divides in (checked by the Python side at load and here per call).
 *
 * Why: decoding small batches streams every weight once per step, at memory bandwidth on a
 * CPU; 4-bit codes are an eighth of float32's bytes. The codes are widened to float32 in
 * registers and multiplied into fp32 accumulators; the group's scale and zero are applied once
 * per group. With AVX-512 (qtile4_512) a step is 16 lanes from one 128-bit load per row, and a
 * software prefetch keeps the next work units' codes streaming in while this one computes:
 * without it the kernel ran at ~ (compute time + read time), ~2.4x the read time at batch 1;
 * with it ~1.2x (benchmarks/RESULTS.md, "4-bit, 8-bit and FP8 weights"). With AVX2 only
 * (qtile4) a step is 8 lanes (4 bytes of nibbles: broadcast, per-lane shift, mask), with the
 * same prefetch (~1.6x the read time for 4 bits). 4-bit codes in groups of whole 128-column
 * blocks (the usual group 128) take qtile4_lut instead: each code looked up in a table of its
 * group's 16 weight values, fewer vector ops per weight than widening it; on AVX512-VNNI CPUs
 * they take qv_tile4: integer dot products of the codes with x's int8 levels. Threads
 * split the output rows; each work unit reads 4 weight rows once and applies them to up to 3
 * tokens per pass (2 for 4 bits), as the float32/int8 kernel in llama_decode.c does. Larger
 * batches widen the weight into a float32 buffer (qg_dequant) for one MKL GEMM.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pagedllm_native.h"

#if PN_AVX2
/* Codes of columns i..i+7 of one row as float32 lanes (i a multiple of 8). BITS is a literal. */
static inline __attribute__((always_inline)) __m256 load_codes8(const uint8_t *row, int64_t i, const int BITS) {
    if (BITS == 4) {
        uint32_t v;
        memcpy(&v, row + i / 2, sizeof v); /* lane k = nibble k = bits 4k..4k+3 (little endian) */
        const __m256i shifts = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
        const __m256i codes = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)v), shifts),
                                               _mm256_set1_epi32(15));
        return _mm256_cvtepi32_ps(codes);
    }
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(row + i))));
}
#endif

static inline __attribute__((always_inline)) float load_code1(const uint8_t *row, int64_t i, const int BITS) {
    return BITS == 4 ? (float)((row[i >> 1] >> ((i & 1) * 4)) & 15) : (float)row[i];
}

/* The rows of a quantized matrix that one work unit reads: codes, scales and scaled zeros. */
typedef struct {
    const uint8_t *q[4];
    const float *s[4], *z[4];
    const char *prefetch; /* codes of a later work unit, fetched a line per step (qtile4_512) */
} Rows4;

/* dots[t][k] = W_k . x_t for 4 rows and NT <= 3 tokens, each weight chunk widened once in
 * registers for all NT tokens. The group's scale and zero are applied per group, not per
 * weight:  W_k . x_t = sum_g s[k][g] * (codes . x_t over g) - sum_g sz[k][g] * xsum[t][g]
 * with xsum[t][g] the sum of x_t over group g (computed once per call by the caller), so the
 * inner loop is unpack, convert and one FMA per token. NT and BITS are literals at every call
 * site. */
static inline __attribute__((always_inline)) void qtile4(const Rows4 *r, const float *x, const float *xsum,
                                                         int64_t n, int64_t group, const int NT, const int BITS,
                                                         float dots[3][4]) {
    const int64_t groups = n / group;
    for (int t = 0; t < NT; t++)
        for (int k = 0; k < 4; k++) dots[t][k] = 0.0f;
    for (int64_t g = 0; g < groups; g++) {
        float part[3][4];
#if PN_AVX2
        __m256 acc[3][4];
        for (int t = 0; t < NT; t++)
            for (int k = 0; k < 4; k++) acc[t][k] = _mm256_setzero_ps();
        for (int64_t i = g * group; i < (g + 1) * group; i += 8) {
            /* a step reads 4 x BITS bytes: fetch as many of a later unit (see qtile4_512) */
            _mm_prefetch(r->prefetch + i / 8 * 4 * BITS, _MM_HINT_T0);
            __m256 xv[3];
            for (int t = 0; t < NT; t++) xv[t] = _mm256_loadu_ps(x + t * n + i);
            for (int k = 0; k < 4; k++) {
                const __m256 codes = load_codes8(r->q[k], i, BITS);
                for (int t = 0; t < NT; t++) acc[t][k] = _mm256_fmadd_ps(codes, xv[t], acc[t][k]);
            }
        }
        for (int t = 0; t < NT; t++)
            for (int k = 0; k < 4; k++) part[t][k] = pn_hsum256(acc[t][k]);
#else
        for (int t = 0; t < NT; t++)
            for (int k = 0; k < 4; k++) part[t][k] = 0.0f;
        for (int64_t i = g * group; i < (g + 1) * group; i++)
            for (int k = 0; k < 4; k++)
                for (int t = 0; t < NT; t++) part[t][k] += load_code1(r->q[k], i, BITS) * x[t * n + i];
#endif
        for (int t = 0; t < NT; t++)
            for (int k = 0; k < 4; k++)
                dots[t][k] += r->s[k][g] * part[t][k] - r->z[k][g] * xsum[t * groups + g];
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define QG_AVX512 1
/* The AVX-512 path: 16 lanes, one 128-bit load of codes per row and step (32 columns of
 * 4-bit codes, 16 of 8-bit ones), zero-extended to 16 dword lanes in one instruction. A 4-bit
 * step's 16 bytes hold columns 2j (low nibble) and 2j+1 (high nibble): a mask gives the even
 * columns, a shift the odd ones, so no shuffle is needed if x comes de-interleaved
 * (deinterleave_x: per 32 columns, the 16 even ones then the 16 odd ones, once per call).
 * Each group's codes . x accumulates in vector registers and is folded into the row's total
 * with one FMA by the group's scale; the zero term (szero * group sum of x) is scalar, once
 * per group; one horizontal sum per row and token at the end. */
#define QG_STEP(BITS) ((BITS) == 4 ? 32 : 16)
static inline __attribute__((always_inline)) void qtile4_512(const Rows4 *r, const float *x, const float *xsum,
                                                             int64_t n, int64_t group, const int NT, const int BITS,
                                                             float dots[3][4]) {
    const int64_t groups = n / group;
    __m512 tot[3][4];
    float zsum[3][4];
    for (int t = 0; t < NT; t++)
        for (int k = 0; k < 4; k++) tot[t][k] = _mm512_setzero_ps(), zsum[t][k] = 0.0f;
    for (int64_t g = 0; g < groups; g++) {
        __m512 acc[3][4];
        for (int t = 0; t < NT; t++)
            for (int k = 0; k < 4; k++) acc[t][k] = _mm512_setzero_ps();
        for (int64_t i = g * group; i < (g + 1) * group; i += QG_STEP(BITS)) {
            /* a step reads 4 x 16 bytes, one cache line's worth: fetch the same amount of a
             * later unit, so memory streams while this one computes (the hardware prefetcher
             * alone left the loads and the math serialised: ~ the sum of both times) */
            _mm_prefetch(r->prefetch + i / QG_STEP(BITS) * 64, _MM_HINT_T0);
            if (BITS == 4) {
                __m512 xe[3], xo[3]; /* x of the even / odd columns of i..i+31 */
                for (int t = 0; t < NT; t++) xe[t] = _mm512_loadu_ps(x + t * n + i), xo[t] = _mm512_loadu_ps(x + t * n + i + 16);
                for (int k = 0; k < 4; k++) {
                    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(r->q[k] + i / 2)));
                    const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
                    const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
                    for (int t = 0; t < NT; t++)
                        acc[t][k] = _mm512_fmadd_ps(hi, xo[t], _mm512_fmadd_ps(lo, xe[t], acc[t][k]));
                }
            } else {
                __m512 xv[3];
                for (int t = 0; t < NT; t++) xv[t] = _mm512_loadu_ps(x + t * n + i);
                for (int k = 0; k < 4; k++) {
                    const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(r->q[k] + i))));
                    for (int t = 0; t < NT; t++) acc[t][k] = _mm512_fmadd_ps(w, xv[t], acc[t][k]);
                }
            }
        }
        for (int k = 0; k < 4; k++) {
            const __m512 s = _mm512_set1_ps(r->s[k][g]);
            for (int t = 0; t < NT; t++) {
                tot[t][k] = _mm512_fmadd_ps(acc[t][k], s, tot[t][k]);
                zsum[t][k] += r->z[k][g] * xsum[t * groups + g];
            }
        }
    }
    for (int t = 0; t < NT; t++)
        for (int k = 0; k < 4; k++) dots[t][k] = _mm512_reduce_add_ps(tot[t][k]) - zsum[t][k];
}

/* Whether qtile4_512 takes this group size: whole steps per group. */
static inline int qg_wide(int64_t group, int bits) { return group % QG_STEP(bits) == 0; }

/* xd = x with each run of 32 columns reordered as its 16 even columns then its 16 odd ones
 * (the order of a 4-bit step's lanes, see above); [T, in], in a multiple of 32. */
static void deinterleave_x(const float *x, int64_t T, int64_t in, float *xd) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t i = 0; i < in; i += 32)
            for (int j = 0; j < 16; j++) {
                xd[t * in + i + j] = x[t * in + i + 2 * j];
                xd[t * in + i + 16 + j] = x[t * in + i + 2 * j + 1];
            }
}

/* The 4-bit path for groups of whole 128-column blocks (own int4, GPTQ / AWQ / compressed-
 * tensors at group 128): one 64-byte load per row holds a block, dword d of it columns
 * 8d..8d+7 (nibble j = column 8d + j). Shifting the dwords right by 4j puts nibble j in each
 * lane's low 4 bits, and vpermps, which reads only those bits of its indices, looks the 16
 * lanes up in a table of the group's 16 weight values (code * scale - szero, built once per row
 * and group), so a lane is one shift (none for j = 0), one permute and one FMA per token:
 * ~24 vector ops per row and 128 columns, against ~30 for qtile4_512's unpack-and-convert
 * with a scale FMA and zero term per group, which kept the kernel compute-bound at batch 1
 * (benchmarks/RESULTS.md, "The batch-1 int4 step: ..."). The table also makes the dot product
 * one of the dequantized weights (as qg_dequant writes them) with x, with no scale / zero
 * terms to fold in. x comes transposed per block (transpose_x8: lanes of step j are columns
 * 8d + j). */
#define QG_BLOCK 128
static inline int qg_lut(int64_t group, int bits) { return bits == 4 && group % QG_BLOCK == 0; }

/* xt [T, in] = x with each 128-column block read as a 16 x 8 matrix and stored transposed:
 * xt[b + 16 j + d] = x[b + 8 d + j] (in a multiple of 128). */
static void transpose_x8(const float *x, int64_t T, int64_t in, float *xt) {
    const __m512i idx = _mm512_setr_epi32(0, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104, 112, 120);
    for (int64_t t = 0; t < T; t++)
        for (int64_t b = t * in; b < (t + 1) * in; b += QG_BLOCK)
            for (int j = 0; j < 8; j++) _mm512_storeu_ps(xt + b + 16 * j, _mm512_i32gather_ps(idx, x + b + j, 4));
}

/* Step j of row k's block: the 16 weights of columns 8d + j, FMA'd into acc for NT tokens. */
#define QG_LUT_STEP(J)                                                                               \
    do {                                                                                             \
        const __m512 w = _mm512_permutexvar_ps((J) ? _mm512_srli_epi32(v, 4 * (J)) : v, table[k]);   \
        for (int t = 0; t < NT; t++)                                                                 \
            acc[t][k][(J) & (ACC - 1)] =                                                             \
                _mm512_fmadd_ps(w, _mm512_loadu_ps(x + t * n + b + 16 * (J)), acc[t][k][(J) & (ACC - 1)]); \
    } while (0)

/* dots[t][k] = W_k . x_t for 4 rows and NT <= 3 tokens through the group's value table (see
 * above); x transposed by transpose_x8. One accumulator per row and token, two at NT = 1 so
 * that 8 FMA chains are in flight. NT is a literal at every call site. */
static inline __attribute__((always_inline)) void qtile4_lut(const Rows4 *r, const float *x, int64_t n,
                                                             int64_t group, const int NT, float dots[3][4]) {
    const int ACC = NT == 1 ? 2 : 1; /* accumulators per row and token */
    const __m512 codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 acc[3][4][2];
    for (int t = 0; t < NT; t++)
        for (int k = 0; k < 4; k++)
            for (int a = 0; a < ACC; a++) acc[t][k][a] = _mm512_setzero_ps();
    for (int64_t g = 0; g < n / group; g++) {
        __m512 table[4];
        for (int k = 0; k < 4; k++)
            table[k] = _mm512_fmsub_ps(codes, _mm512_set1_ps(r->s[k][g]), _mm512_set1_ps(r->z[k][g]));
        for (int64_t b = g * group; b < (g + 1) * group; b += QG_BLOCK) {
            /* each row's 64 bytes of the block: one line of a later unit (see qtile4_512), fetched
             * between the row's steps (the four fetched at the start of the block, back to back,
             * measured ~8% slower from memory: benchmarks/RESULTS.md) */
            const char *ahead = r->prefetch + b / QG_BLOCK * 256;
            for (int k = 0; k < 4; k++) {
                const __m512i v = _mm512_loadu_si512((const void *)(r->q[k] + b / 2));
                QG_LUT_STEP(0); QG_LUT_STEP(1); QG_LUT_STEP(2); QG_LUT_STEP(3);
                _mm_prefetch(ahead + 64 * k, _MM_HINT_T0);
                QG_LUT_STEP(4); QG_LUT_STEP(5); QG_LUT_STEP(6); QG_LUT_STEP(7);
            }
        }
    }
    for (int t = 0; t < NT; t++)
        for (int k = 0; k < 4; k++)
            dots[t][k] = _mm512_reduce_add_ps(ACC == 2 ? _mm512_add_ps(acc[t][k][0], acc[t][k][1]) : acc[t][k][0]);
}
#undef QG_LUT_STEP
#else
#define QG_AVX512 0
static inline int qg_wide(int64_t group, int bits) { return (void)group, (void)bits, 0; }
static inline int qg_lut(int64_t group, int bits) { return (void)group, (void)bits, 0; }
#endif

/* dots[t][k] for all T tokens, three at a time. */
static void qdot_rows(const Rows4 *r, int bits, const float *x, const float *xsum, int64_t T, int64_t n,
                      int64_t group, float (*dots)[4]) {
    const int64_t groups = n / group;
    int64_t t = 0;
#if QG_AVX512
    if (qg_lut(group, bits)) { /* x is transposed per block (qg_linear) */
#define QTILE_LUT(NT) qtile4_lut(r, x + t * n, n, group, NT, dots + t)
        for (; t + 3 <= T; t += 3) QTILE_LUT(3);
        if (T - t == 2) QTILE_LUT(2);
        if (T - t == 1) QTILE_LUT(1);
#undef QTILE_LUT
        return;
    }
    if (qg_wide(group, bits)) { /* x is de-interleaved for 4 bits (qg_linear) */
#define QTILE512(NT, BITS) qtile4_512(r, x + t * n, xsum + t * groups, n, group, NT, BITS, dots + t)
        if (bits == 4) {
            for (; t + 2 <= T; t += 2) QTILE512(2, 4);
            if (T - t == 1) QTILE512(1, 4);
        } else {
            for (; t + 3 <= T; t += 3) QTILE512(3, 8);
            if (T - t == 2) QTILE512(2, 8);
            if (T - t == 1) QTILE512(1, 8);
        }
#undef QTILE512
        return;
    }
#endif
#define QTILE(NT, BITS) qtile4(r, x + t * n, xsum + t * groups, n, group, NT, BITS, dots + t)
    if (bits == 4) { /* two tokens a pass: the nibble unpacking needs registers of its own */
        for (; t + 2 <= T; t += 2) QTILE(2, 4);
        if (T - t == 1) QTILE(1, 4);
    } else {
        for (; t + 3 <= T; t += 3) QTILE(3, 8);
        if (T - t == 2) QTILE(2, 8);
        if (T - t == 1) QTILE(1, 8);
    }
#undef QTILE
}

#if QG_AVX512 && defined(__AVX512VNNI__)
#define QV_VNNI 1
/* The VNNI path (AVX512-VNNI CPUs) of our own int8 (quantization="int8": signed codes, one
 * scale per row; qg_linear_i8): integer dot products with vpdpbusd (64 u8 x s8 products summed
 * into 16 int32 lanes per instruction), the codes on its unsigned side as c + 128 (one xor per
 * 64 columns; zero point 128), the activations quantized once per call into QV_LEVELS int8 levels:
 *     x ~= sx * (q1 + q2 / 254 + q3 / 254^2),  sx = max|x| / 127,  each level the rounded
 *     residual of the ones before (|residual| <= 1/2, so 254 * residual fits in [-127, 127]),
 * so the dot product keeps float32 accuracy: |x - x~| <= sx / 2 / 254^(L - 1) per element
 * (L = 2: max|x| * 1.55e-5, L = 3: max|x| * 6.1e-8), plus float32 rounding of x * 127 / max|x|
 * (relative 2^-24). Two levels failed the kernels' float64 checks (benchmarks/RESULTS.md, "The
 * batch-1 int4 step: VNNI"). Why: llama_decode.c's int8 tile widens 8 codes per 256-bit step with
 * no prefetch and ran the 200M model's int8 step at 2.2-2.4x the read time; here 3 vpdpbusd per
 * 64 columns and token, with the prefetch of qtile4_lut. The zero term uses the levels' exact
 * sums, so the result is the dequantized weight times x~ with no cancellation against a
 * differently rounded sum:  W_k . x~ = s[k] * (sx * (c + 128) . levels - 128 * xsum~).
 * (The same path for group-wise 8-bit codes measured +17% slower on the Xeon and is not built.
 * For 4-bit groups of whole 128-column blocks it is qv_tile4 below: on the Xeon the projections
 * alone were 13% faster but the engine step did not move; on AMD Zen 5, where qtile4_lut is
 * compute-bound, the int4 engine step went from 7.10 to 5.97 ms.) */
#define QV_LEVELS 3
#define QV_STEP_F 254.0f
#define QV_COLS 64 /* columns of one 64-byte load of codes */

/* The int8 levels of 16 floats r (x already times 127 / max|x|) to lv[l * in], l < QV_LEVELS;
 * adds each level to sums[l]. */
static inline void qv_levels16(__m512 r, int8_t *lv, int64_t in, __m512i *sums) {
    for (int l = 0; l < QV_LEVELS; l++) {
        const __m512 q = _mm512_roundscale_ps(r, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512i qi = _mm512_cvtps_epi32(q);
        _mm_storeu_si128((__m128i *)(lv + l * in), _mm512_cvtepi32_epi8(qi));
        sums[l] = _mm512_add_epi32(sums[l], qi);
        r = _mm512_mul_ps(_mm512_sub_ps(r, q), _mm512_set1_ps(QV_STEP_F)); /* r - q exact (|r - q| <= 1/2) */
    }
}

/* One token: lv [QV_LEVELS][in] bytes, returns sx and sets *xsum = sx * the sum of the levels
 * (q1 + q2 / 254 + ...) over the row. in is a multiple of 16. */
static float qv_quantize(const float *x, int64_t in, int8_t *lv, float *xsum) {
    __m512 m = _mm512_setzero_ps();
    for (int64_t i = 0; i < in; i += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
    const float amax = _mm512_reduce_max_ps(m), sx = amax > 0.0f ? amax / 127.0f : 0.0f;
    const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    __m512i sums[QV_LEVELS];
    for (int l = 0; l < QV_LEVELS; l++) sums[l] = _mm512_setzero_si512();
    for (int64_t i = 0; i < in; i += 16) qv_levels16(_mm512_mul_ps(_mm512_loadu_ps(x + i), inv), lv + i, in, sums);
    double s = 0.0, unit = 1.0;
    for (int l = 0; l < QV_LEVELS; l++, unit /= QV_STEP_F) s += unit * _mm512_reduce_add_epi32(sums[l]);
    *xsum = (float)(sx * s);
    return sx;
}

/* dots[t][k] = W_k . x~_t for 4 rows of signed int8 codes and NT <= 2 tokens (see above); lv the
 * levels of token 0 ([T][QV_LEVELS][n] bytes), xsum and sx its level sum and scale. */
static inline __attribute__((always_inline)) void qv_tile(const Rows4 *r, const int8_t *lv, const float *xsum,
                                                          const float *sx, int64_t n, const int NT, float dots[3][4]) {
    __m512i acc[2][4][QV_LEVELS];
    for (int t = 0; t < NT; t++)
        for (int k = 0; k < 4; k++)
            for (int l = 0; l < QV_LEVELS; l++) acc[t][k][l] = _mm512_setzero_si512();
    for (int64_t b = 0; b < n; b += QV_COLS) {
        const char *ahead = r->prefetch + b / QV_COLS * 256; /* a later unit's line per row (qtile4_lut) */
        for (int k = 0; k < 4; k++) {
            const __m512i v = _mm512_xor_si512(_mm512_loadu_si512((const void *)(r->q[k] + b)),
                                               _mm512_set1_epi8((char)0x80)); /* c + 128 */
            _mm_prefetch(ahead + 64 * k, _MM_HINT_T0);
            for (int t = 0; t < NT; t++)
                for (int l = 0; l < QV_LEVELS; l++)
                    acc[t][k][l] = _mm512_dpbusd_epi32(
                        acc[t][k][l], v, _mm512_loadu_si512((const void *)(lv + (t * QV_LEVELS + l) * n + b)));
        }
    }
    for (int t = 0; t < NT; t++)
        for (int k = 0; k < 4; k++) {
            __m512 f = _mm512_cvtepi32_ps(acc[t][k][QV_LEVELS - 1]);
            for (int l = QV_LEVELS - 2; l >= 0; l--) /* Horner: q1 + (q2 + q3 / 254) / 254 */
                f = _mm512_fmadd_ps(f, _mm512_set1_ps(1.0f / QV_STEP_F), _mm512_cvtepi32_ps(acc[t][k][l]));
            dots[t][k] = r->s[k][0] * (sx[t] * _mm512_reduce_add_ps(f) - 128.0f * xsum[t]);
        }
}

/* dots[t][k] for all T tokens, two at a time (three would not fit the 32 registers). */
static void qv_dot_rows(const Rows4 *r, const int8_t *lv, const float *xsum, const float *sx, int64_t T, int64_t n,
                        float (*dots)[4]) {
    int64_t t = 0;
    for (; t + 2 <= T; t += 2) qv_tile(r, lv + t * QV_LEVELS * n, xsum + t, sx + t, n, 2, dots + t);
    if (T - t == 1) qv_tile(r, lv + t * QV_LEVELS * n, xsum + t, sx + t, n, 1, dots + t);
}

/* 4-bit codes in groups of whole 128-column blocks on the VNNI path. qtile4_lut spends a shift, a
 * 512-bit permute and an FMA per 16 weights and token; on AMD Zen 5 it ran compute-bound at ~6
 * weights per cycle and core, ~1.8x the codes' read time at batch 1 (benchmarks/RESULTS.md).
 * Here a block's 64 bytes of codes split into its even columns (low nibbles) and odd ones (high
 * nibbles, one shift) as unsigned bytes, and vpdpbusd multiplies 64 of them by x's int8 levels at
 * a time, 3 levels as qv_tile (x~ = sx * (q1 + q2 / 254 + q3 / 254^2)), the levels laid out per
 * block as the block's 64 even columns then its 64 odd ones (qv_levels4). Per group the three
 * integer sums fold into floats with the group's scale; the zero term uses the levels' exact
 * group sums (lsum, in units of sx):  W_k . x~ = sx * sum_g (s[k][g] * codes . levels_g -
 * sz[k][g] * lsum[g]). One token per pass: 12 integer accumulators, 6 level vectors and 4
 * float totals fill the registers; the unit's 4 rows stay in L1 for the next token. */
static inline __attribute__((always_inline)) void qv_tile4(const Rows4 *r, const int8_t *lv, const float *lsum,
                                                           float sx, int64_t n, int64_t group, float dots[4]) {
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    __m512 tot[4];
    float zs[4];
    for (int k = 0; k < 4; k++) tot[k] = _mm512_setzero_ps(), zs[k] = 0.0f;
    for (int64_t g = 0; g < n / group; g++) {
        __m512i acc[4][QV_LEVELS];
        for (int k = 0; k < 4; k++)
            for (int l = 0; l < QV_LEVELS; l++) acc[k][l] = _mm512_setzero_si512();
        for (int64_t b = g * group; b < (g + 1) * group; b += QG_BLOCK) {
            const char *ahead = r->prefetch + b / QG_BLOCK * 256; /* a later unit's line per row (qtile4_lut) */
            __m512i xe[QV_LEVELS], xo[QV_LEVELS];
            for (int l = 0; l < QV_LEVELS; l++)
                xe[l] = _mm512_loadu_si512((const void *)(lv + l * n + b)),
                xo[l] = _mm512_loadu_si512((const void *)(lv + l * n + b + 64));
            for (int k = 0; k < 4; k++) {
                const __m512i v = _mm512_loadu_si512((const void *)(r->q[k] + b / 2));
                const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
                _mm_prefetch(ahead + 64 * k, _MM_HINT_T0);
                for (int l = 0; l < QV_LEVELS; l++)
                    acc[k][l] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc[k][l], lo, xe[l]), hi, xo[l]);
            }
        }
        for (int k = 0; k < 4; k++) {
            __m512 f = _mm512_cvtepi32_ps(acc[k][QV_LEVELS - 1]);
            for (int l = QV_LEVELS - 2; l >= 0; l--)
                f = _mm512_fmadd_ps(f, _mm512_set1_ps(1.0f / QV_STEP_F), _mm512_cvtepi32_ps(acc[k][l]));
            tot[k] = _mm512_fmadd_ps(f, _mm512_set1_ps(r->s[k][g]), tot[k]);
            zs[k] += r->z[k][g] * lsum[g];
        }
    }
    for (int k = 0; k < 4; k++) dots[k] = sx * (_mm512_reduce_add_ps(tot[k]) - zs[k]);
}

/* One token's levels for qv_tile4: out [QV_LEVELS][in] in its per-block order (each 128-column
 * block's even columns, then its odd ones), lsum[g] = the levels' sum over group g in units of
 * sx; returns sx. lv: scratch of QV_LEVELS * in bytes. */
static float qv_levels4(const float *x, int64_t in, int64_t group, int8_t *lv, int8_t *out, float *lsum) {
    float unused;
    const float sx = qv_quantize(x, in, lv, &unused);
    for (int l = 0; l < QV_LEVELS; l++)
        for (int64_t b = 0; b < in; b += QG_BLOCK)
            for (int j = 0; j < 64; j++) {
                out[l * in + b + j] = lv[l * in + b + 2 * j];
                out[l * in + b + 64 + j] = lv[l * in + b + 2 * j + 1];
            }
    for (int64_t g = 0; g < in / group; g++) {
        double s = 0.0, unit = 1.0;
        for (int l = 0; l < QV_LEVELS; l++, unit /= QV_STEP_F) {
            int64_t sum = 0;
            for (int64_t i = g * group; i < (g + 1) * group; i++) sum += lv[l * in + i];
            s += unit * (double)sum;
        }
        lsum[g] = (float)s;
    }
    return sx;
}
#else
#define QV_VNNI 0
#endif

/* xsum[t, g] = sum of x[t] over input group g. */
static void group_sums(const float *x, int64_t T, int64_t in, int64_t group, float *xsum) {
    const int64_t groups = in / group;
    for (int64_t t = 0; t < T; t++)
        for (int64_t g = 0; g < groups; g++) {
            float s = 0.0f;
            for (int64_t i = g * group; i < (g + 1) * group; i++) s += x[t * in + i];
            xsum[t * groups + g] = s;
        }
}

/* how many work units ahead qtile4 and qtile4_512 fetch codes, and qtile4_lut (the 200M model's
 * 4-bit projections with qtile4_lut: 2, 3 and 4 within noise of each other, 1 ~7% slower) */
#define QG_PREFETCH_UNITS 4
#define QG_LUT_PREFETCH_UNITS 2

static int bad_args(int64_t in, int64_t out, int64_t group, int bits, int threads) {
    return in <= 0 || out <= 0 || threads <= 0 || (bits != 4 && bits != 8) || group <= 0 || group % 8 != 0 ||
           in % group != 0;
}

/* The 4 rows of the work unit from output row o (missing rows repeat a valid one), and the
 * codes of the unit `units_ahead` later to prefetch (its own when there is none). */
static Rows4 unit_rows(const uint8_t *q, const float *scale, const float *szero, int64_t o, int64_t out,
                       int64_t row_bytes, int64_t groups, int units_ahead) {
    Rows4 r;
    const int64_t later = o + 4 * units_ahead;
    r.prefetch = (const char *)(q + (later < out - 3 ? later : o) * row_bytes);
    for (int k = 0; k < 4; k++) {
        const int64_t row = o + (k < out - o ? k : 0);
        r.q[k] = q + row * row_bytes, r.s[k] = scale + row * groups, r.z[k] = szero ? szero + row * groups : NULL;
    }
    return r;
}

/* y[t, o + k] = dots[t][k] (+ bias) for the unit's valid rows. */
static void store_unit(float (*dots)[4], const float *bias, int64_t T, int64_t o, int64_t out, float *y) {
    const int nr = out - o < 4 ? (int)(out - o) : 4;
    for (int64_t t = 0; t < T; t++)
        for (int k = 0; k < nr; k++) y[t * out + o + k] = dots[t][k] + (bias ? bias[o + k] : 0.0f);
}

#if QV_VNNI
/* qg_linear for 4-bit codes in groups of whole 128-column blocks on the VNNI path (qv_tile4). */
static int qv_linear4(const float *x, int64_t T, const uint8_t *q, const float *scale, const float *szero,
                      const float *bias, int64_t in, int64_t out, int64_t group, float *y, int threads) {
    const int64_t groups = in / group, units = (out + 3) / 4;
    int8_t *lv = malloc((size_t)((T + 1) * QV_LEVELS * in));
    float *lsum = malloc(sizeof(float) * (size_t)(T * groups)), sx[LD_MAX_TOKENS];
    if (!lv || !lsum) {
        free(lv), free(lsum);
        return PN_ERR_NOMEM;
    }
    int8_t *scratch = lv + T * QV_LEVELS * in;
    for (int64_t t = 0; t < T; t++)
        sx[t] = qv_levels4(x + t * in, in, group, scratch, lv + t * QV_LEVELS * in, lsum + t * groups);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t u = 0; u < units; u++) {
        const Rows4 r = unit_rows(q, scale, szero, u * 4, out, in / 2, groups, QG_LUT_PREFETCH_UNITS);
        float dots[LD_MAX_TOKENS][4];
        for (int64_t t = 0; t < T; t++)
            qv_tile4(&r, lv + t * QV_LEVELS * in, lsum + t * groups, sx[t], in, group, dots[t]);
        store_unit(dots, bias, T, u * 4, out, y);
    }
    free(lv);
    free(lsum);
    return PN_OK;
}

/* qg_linear_i8 on the VNNI path (above): x quantized into levels once, then the row units. */
static int qv_linear_i8(const float *x, int64_t T, const int8_t *q, const float *scale, const float *bias,
                        int64_t in, int64_t out, float *y, int threads) {
    const int64_t units = (out + 3) / 4;
    int8_t *lv = malloc((size_t)(T * QV_LEVELS * in));
    float xsum[LD_MAX_TOKENS], sx[LD_MAX_TOKENS];
    if (!lv) return PN_ERR_NOMEM;
    for (int64_t t = 0; t < T; t++) sx[t] = qv_quantize(x + t * in, in, lv + t * QV_LEVELS * in, xsum + t);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t u = 0; u < units; u++) {
        const Rows4 r = unit_rows((const uint8_t *)q, scale, NULL, u * 4, out, in, 1, QG_LUT_PREFETCH_UNITS);
        float dots[LD_MAX_TOKENS][4];
        qv_dot_rows(&r, lv, xsum, sx, T, in, dots);
        store_unit(dots, bias, T, u * 4, out, y);
    }
    free(lv);
    return PN_OK;
}
#endif

/* Own int8 (quantization="int8": signed codes, one scale per row) on the VNNI path (above).
 * PN_ERR_ARG where this path does not apply (no AVX512-VNNI, in not a multiple of 64): the
 * caller then keeps its own kernel. */
int qg_linear_i8(const float *x, int64_t T, const int8_t *q, const float *scale, const float *bias, int64_t in,
                 int64_t out, float *y, int threads) {
#if QV_VNNI
    if (T > 0 && T <= LD_MAX_TOKENS && !bad_args(in, out, in, 8, threads) && in % QV_COLS == 0)
        return qv_linear_i8(x, T, q, scale, bias, in, out, y, threads);
#endif
    (void)x, (void)T, (void)q, (void)scale, (void)bias, (void)in, (void)out, (void)y, (void)threads;
    return PN_ERR_ARG;
}

/* y [T, out] = x [T, in] . W^T (+ bias) with W the group-quantized matrix described above. */
int qg_linear(const float *x, int64_t T, const uint8_t *q, const float *scale, const float *szero,
              const float *bias, int64_t in, int64_t out, int64_t group, int bits, float *y, int threads) {
    if (T <= 0 || T > LD_MAX_TOKENS || bad_args(in, out, group, bits, threads)) return PN_ERR_ARG;
#if QV_VNNI
    if (qg_lut(group, bits)) return qv_linear4(x, T, q, scale, szero, bias, in, out, group, y, threads);
#endif
    const int64_t row_bytes = bits == 4 ? in / 2 : in, groups = in / group, units = (out + 3) / 4;
    const int lut = qg_lut(group, bits), shuffled = !lut && bits == 4 && qg_wide(group, bits);
    float *xsum = malloc(sizeof(float) * T * (groups + (shuffled || lut ? in : 0)));
    if (!xsum) return PN_ERR_NOMEM;
    if (!lut) group_sums(x, T, in, group, xsum); /* the value tables hold the zero term */
#if QG_AVX512
    if (lut || shuffled) { /* the kernel reads x in the lane order of the nibbles */
        (lut ? transpose_x8 : deinterleave_x)(x, T, in, xsum + T * groups);
        x = xsum + T * groups;
    }
#endif
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t u = 0; u < units; u++) {
        const Rows4 r = unit_rows(q, scale, szero, u * 4, out, row_bytes, groups,
                                  lut ? QG_LUT_PREFETCH_UNITS : QG_PREFETCH_UNITS);
        float dots[LD_MAX_TOKENS][4];
        qdot_rows(&r, bits, x, xsum, T, in, group, dots);
        store_unit(dots, bias, T, u * 4, out, y);
    }
    free(xsum);
    return PN_OK;
}

#if QG_AVX512
/* dst[i .. i + group) = the codes of one group times s minus z, 16 lanes at a time. (Streaming
 * stores measured slower: the GEMM right after reads a layer's widened matrix back from cache.) */
static inline void dequant_group512(const uint8_t *src, float *dst, int64_t i, int64_t group, float s, float z,
                                    int bits) {
    const __m512 sv = _mm512_set1_ps(s), zv = _mm512_set1_ps(z);
    __m512 w[2];
    /* the 4-bit lanes (even columns, odd columns) back in column order */
    const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i second = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    for (int64_t end = i + group; i < end; i += QG_STEP(bits)) {
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(src + (bits == 4 ? i / 2 : i))));
        int nw = 1;
        if (bits == 4) {
            const __m512i lo = _mm512_and_si512(v, _mm512_set1_epi32(15)), hi = _mm512_srli_epi32(v, 4);
            w[0] = _mm512_cvtepi32_ps(_mm512_permutex2var_epi32(lo, first, hi));
            w[1] = _mm512_cvtepi32_ps(_mm512_permutex2var_epi32(lo, second, hi));
            nw = 2;
        } else {
            w[0] = _mm512_cvtepi32_ps(v);
        }
        for (int j = 0; j < nw; j++) _mm512_storeu_ps(dst + i + 16 * j, _mm512_fmsub_ps(w[j], sv, zv));
    }
}
#endif

/* out [rows, in] float32 = the dequantized matrix, for batches where one MKL GEMM on it wins. */
int qg_dequant(const uint8_t *q, const float *scale, const float *szero, float *out, int64_t rows, int64_t in,
               int64_t group, int bits, int threads) {
    if (bad_args(in, rows, group, bits, threads)) return PN_ERR_ARG;
    const int64_t row_bytes = bits == 4 ? in / 2 : in, groups = in / group;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *src = q + r * row_bytes;
        float *dst = out + r * in;
        for (int64_t g = 0; g < groups; g++) {
            const float s = scale[r * groups + g], z = szero[r * groups + g];
            int64_t i = g * group;
#if QG_AVX512
            if (qg_wide(group, bits)) {
                dequant_group512(src, dst, i, group, s, z, bits);
                continue;
            }
#endif
#if PN_AVX2
            const __m256 sv = _mm256_set1_ps(s), zv = _mm256_set1_ps(z);
            for (; i < (g + 1) * group; i += 8)
                _mm256_storeu_ps(dst + i, _mm256_fmsub_ps(bits == 4 ? load_codes8(src, i, 4) : load_codes8(src, i, 8),
                                                          sv, zv));
#endif
            for (; i < (g + 1) * group; i++)
                dst[i] = (bits == 4 ? load_code1(src, i, 4) : load_code1(src, i, 8)) * s - z;
        }
    }
    return PN_OK;
}

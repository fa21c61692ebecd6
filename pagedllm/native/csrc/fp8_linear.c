/* FP8 (e4m3fn) weight matmuls (layers/quantization/fp8.py) and the fp8 -> float32 table that
 * the paged-attention kernel also reads for fp8 KV caches.
 *
 * Weight layout (every FP8 checkpoint format, converted at load):
 *   w      uint8, row-major [out, in]: float8_e4m3fn bytes (sign, 4 exponent bits with bias 7,
 *          3 mantissa bits; exponent 0 is subnormal; 0x7f / 0xff are NaN, there is no inf);
 *   scale  float32 [out, in / group]: the scale of each row's group of `group` input columns
 *          (per-tensor and per-channel scales are one group per row; DeepSeek/Qwen block-wise
 *          scales are expanded over the rows of their block at load);
 * so W[o, i] = e4m3(w[o, i]) * scale[o, i / group]; group divides in (checked here per call).
 *
 * Why: decoding small batches streams every weight once per step, at memory bandwidth on a
 * CPU; FP8 weights are a quarter of float32's bytes. Each byte is widened in registers: 8 bytes
 * zero-extended to int32 lanes index a 256-entry float table (one AVX2 gather, the table stays
 * in L1), so every value is exact (subnormals and NaN included, which a shift-based conversion
 * would have to special-case). The group's scale is applied once per group. Threads split the
 * output rows; a work unit reads 4 weight rows once for up to 3 tokens per pass, like
 * quant_linear.c. Larger batches widen the weight into a float32 buffer (fp8_dequant) for one
 * MKL GEMM.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pagedllm_native.h"

float pn_fp8_e4m3_lut[256];

static float e4m3_value(int b) {
    const int e = (b >> 3) & 15, m = b & 7;
    const float sign = (b & 0x80) ? -1.0f : 1.0f;
    if (e == 15 && m == 7) return NAN;
    if (e == 0) return sign * ldexpf((float)m / 8.0f, -6); /* subnormal */
    return sign * ldexpf(1.0f + (float)m / 8.0f, e - 7);
}

/* filled when the library is loaded, before any kernel can run */
__attribute__((constructor)) static void fill_e4m3_lut(void) {
    for (int b = 0; b < 256; b++) pn_fp8_e4m3_lut[b] = e4m3_value(b);
}

#if PN_AVX2
/* W[row, i..i+7] unscaled, as float32 lanes. */
static inline __attribute__((always_inline)) __m256 load_fp8x8(const uint8_t *row, int64_t i) {
    const __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(row + i)));
    return _mm256_i32gather_ps(pn_fp8_e4m3_lut, idx, 4);
}
#endif

/* The 4 weight rows and their scale rows that one work unit reads. */
typedef struct {
    const uint8_t *w[4];
    const float *s[4];
} Fp8Rows4;

/* Partial dot products of 4 rows with NT tokens over columns [lo, hi): part[t][k]. */
static inline __attribute__((always_inline)) void fp8_group_dots(const Fp8Rows4 *r, const float *x, int64_t n,
                                                                 int64_t lo, int64_t hi, const int NT,
                                                                 float part[3][4]) {
    int64_t i = lo;
    for (int t = 0; t < NT; t++)
        for (int k = 0; k < 4; k++) part[t][k] = 0.0f;
#if PN_AVX2
    __m256 acc[3][4];
    for (int t = 0; t < NT; t++)
        for (int k = 0; k < 4; k++) acc[t][k] = _mm256_setzero_ps();
    for (; i + 8 <= hi; i += 8) {
        __m256 xv[3];
        for (int t = 0; t < NT; t++) xv[t] = _mm256_loadu_ps(x + t * n + i);
        for (int k = 0; k < 4; k++) {
            const __m256 wv = load_fp8x8(r->w[k], i);
            for (int t = 0; t < NT; t++) acc[t][k] = _mm256_fmadd_ps(wv, xv[t], acc[t][k]);
        }
    }
    for (int t = 0; t < NT; t++)
        for (int k = 0; k < 4; k++) part[t][k] = pn_hsum256(acc[t][k]);
#endif
    for (; i < hi; i++) /* the tail (and the whole group without AVX2) */
        for (int k = 0; k < 4; k++)
            for (int t = 0; t < NT; t++) part[t][k] += pn_fp8_e4m3_lut[r->w[k][i]] * x[t * n + i];
}

/* dots[t][k] = W_k . x_t for 4 rows and NT <= 3 tokens (NT a literal at every call site). */
static inline __attribute__((always_inline)) void fp8_tile4(const Fp8Rows4 *r, const float *x, int64_t n,
                                                            int64_t group, const int NT, float dots[3][4]) {
    for (int t = 0; t < NT; t++)
        for (int k = 0; k < 4; k++) dots[t][k] = 0.0f;
    for (int64_t g = 0; g < n / group; g++) {
        float part[3][4];
        fp8_group_dots(r, x, n, g * group, (g + 1) * group, NT, part);
        for (int t = 0; t < NT; t++)
            for (int k = 0; k < 4; k++) dots[t][k] += r->s[k][g] * part[t][k];
    }
}

/* dots[t][k] for all T tokens, three at a time. */
static void fp8_dot_rows(const Fp8Rows4 *r, const float *x, int64_t T, int64_t n, int64_t group,
                         float (*dots)[4]) {
    int64_t t = 0;
    for (; t + 3 <= T; t += 3) fp8_tile4(r, x + t * n, n, group, 3, dots + t);
    if (T - t == 2) fp8_tile4(r, x + t * n, n, group, 2, dots + t);
    if (T - t == 1) fp8_tile4(r, x + t * n, n, group, 1, dots + t);
}

static int fp8_bad_args(int64_t in, int64_t out, int64_t group, int threads) {
    return in <= 0 || out <= 0 || threads <= 0 || group <= 0 || in % group != 0;
}

/* y [T, out] = x [T, in] . W^T (+ bias) with W the FP8 matrix described above. */
int fp8_linear(const float *x, int64_t T, const uint8_t *w, const float *scale, const float *bias, int64_t in,
               int64_t out, int64_t group, float *y, int threads) {
    if (T <= 0 || T > LD_MAX_TOKENS || fp8_bad_args(in, out, group, threads)) return PN_ERR_ARG;
    const int64_t groups = in / group, units = (out + 3) / 4;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t u = 0; u < units; u++) {
        const int64_t o = u * 4;
        const int nr = out - o < 4 ? (int)(out - o) : 4;
        Fp8Rows4 r;
        for (int k = 0; k < 4; k++) {
            const int64_t row = o + (k < nr ? k : 0); /* missing rows repeat a valid one */
            r.w[k] = w + row * in, r.s[k] = scale + row * groups;
        }
        float dots[LD_MAX_TOKENS][4];
        fp8_dot_rows(&r, x, T, in, group, dots);
        for (int64_t t = 0; t < T; t++)
            for (int k = 0; k < nr; k++) y[t * out + o + k] = dots[t][k] + (bias ? bias[o + k] : 0.0f);
    }
    return PN_OK;
}

/* out [rows, in] float32 = the dequantized matrix, for batches where one MKL GEMM on it wins. */
int fp8_dequant(const uint8_t *w, const float *scale, float *out, int64_t rows, int64_t in, int64_t group,
                int threads) {
    if (fp8_bad_args(in, rows, group, threads)) return PN_ERR_ARG;
    const int64_t groups = in / group;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *src = w + r * in;
        float *dst = out + r * in;
        for (int64_t g = 0; g < groups; g++) {
            const float s = scale[r * groups + g];
            int64_t i = g * group;
#if PN_AVX2
            const __m256 sv = _mm256_set1_ps(s);
            for (; i + 8 <= (g + 1) * group; i += 8) _mm256_storeu_ps(dst + i, _mm256_mul_ps(load_fp8x8(src, i), sv));
#endif
            for (; i < (g + 1) * group; i++) dst[i] = pn_fp8_e4m3_lut[src[i]] * s;
        }
    }
    return PN_OK;
}

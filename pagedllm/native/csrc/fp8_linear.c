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
 * CPU; FP8 weights are a quarter of float32's bytes. Each byte is widened in registers by moving
 * its bits into a float16: sign to bit 15, the 4 exponent and 3 mantissa bits to bits 7..13, so
 * the float16 reads e4m3's value times 2^-8 (float16's exponent bias is 8 more), subnormals
 * included, and F16C widens 8 of them to float32 in one instruction; the 2^8 is applied with the
 * group's scale. Measured per decoder layer of the 34M benchmark model at batch 1 (2 threads):
 * int8's kernel 84 us, this one 170 us, a 256-entry table gather 308 us (16 bytes per step
 * instead of 8 gained nothing). With AVX-512 (load_fp8x16: sign extension saves two of the
 * steps) and a software prefetch of later rows, FP8 runs at int8's speed: 9.7 vs 9.4 ms for the
 * ~200M model's projections at batch 1, ~1.2x the time reading them takes (RESULTS.md). The NaN bytes 0x7f / 0xff would read as +-480 this way: the loader refuses weights
 * holding them (layers/quantization/fp8.py), and the scalar paths read the exact table.
 * Threads split the output rows; a work unit reads 4 weight rows once for up to 3 tokens per
 * pass, like quant_linear.c. Larger batches widen the weight into a float32 buffer
 * (fp8_dequant) for one MKL GEMM.
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

#if PN_AVX2 && defined(__F16C__)
#define FP8_VECTOR 1
#define FP8_F16_BIAS 256.0f /* load_fp8x8 returns the value / 2^8 */
/* W[row, i..i+7] unscaled, divided by 2^8, as float32 lanes (no NaN bytes: see the top). */
static inline __attribute__((always_inline)) __m256 load_fp8x8(const uint8_t *row, int64_t i) {
    const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(row + i))); /* 8 x u16 */
    const __m128i h = _mm_or_si128(_mm_and_si128(_mm_slli_epi16(b, 8), _mm_set1_epi16((short)0x8000)),
                                   _mm_and_si128(_mm_slli_epi16(b, 7), _mm_set1_epi16(0x3f80)));
    return _mm256_cvtph_ps(h);
}
#else
#define FP8_VECTOR 0
#endif

#if FP8_VECTOR && defined(__AVX512F__) && defined(__AVX512BW__)
#define FP8_AVX512 1
/* W[row, i..i+15] unscaled, divided by 2^8: the same float16 as load_fp8x8 in fewer steps.
 * Sign-extending a byte to 16 bits puts its sign in bits 7..15; shifted left by 7, the 7
 * exponent and mantissa bits land on bits 7..13 and the sign on 14 and 15, and clearing bit 14
 * leaves the float16. */
static inline __attribute__((always_inline)) __m512 load_fp8x16(const uint8_t *row, int64_t i) {
    const __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(row + i))); /* 16 x i16 */
    return _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(b, 7), _mm256_set1_epi16((short)0xbfff)));
}
#else
#define FP8_AVX512 0
#endif

/* how many work units ahead the vector loops fetch weight bytes (quant_linear.c: why) */
#define FP8_PREFETCH_UNITS 4

/* The 4 weight rows and their scale rows that one work unit reads. */
typedef struct {
    const uint8_t *w[4];
    const float *s[4];
    const char *prefetch; /* bytes of a later work unit, fetched as fast as this one's are read */
} Fp8Rows4;

/* Partial dot products of 4 rows with NT tokens over columns [lo, hi): part[t][k]. */
static inline __attribute__((always_inline)) void fp8_group_dots(const Fp8Rows4 *r, const float *x, int64_t n,
                                                                 int64_t lo, int64_t hi, const int NT,
                                                                 float part[3][4]) {
    int64_t i = lo;
    for (int t = 0; t < NT; t++)
        for (int k = 0; k < 4; k++) part[t][k] = 0.0f;
#if FP8_AVX512
    /* 16 columns a step: 4 x 16 bytes, one cache line's worth, and one line of a later unit
     * fetched (without it the loads and the math serialise; quant_linear.c) */
    __m512 acc[3][4];
    for (int t = 0; t < NT; t++)
        for (int k = 0; k < 4; k++) acc[t][k] = _mm512_setzero_ps();
    for (; i + 16 <= hi; i += 16) {
        _mm_prefetch(r->prefetch + i / 16 * 64, _MM_HINT_T0);
        __m512 xv[3];
        for (int t = 0; t < NT; t++) xv[t] = _mm512_loadu_ps(x + t * n + i);
        for (int k = 0; k < 4; k++) {
            const __m512 wv = load_fp8x16(r->w[k], i);
            for (int t = 0; t < NT; t++) acc[t][k] = _mm512_fmadd_ps(wv, xv[t], acc[t][k]);
        }
    }
    for (int t = 0; t < NT; t++)
        for (int k = 0; k < 4; k++) part[t][k] = _mm512_reduce_add_ps(acc[t][k]) * FP8_F16_BIAS;
#endif
#if FP8_VECTOR /* (the 8-column tail of the AVX-512 loop) */
    __m256 acc8[3][4];
    for (int t = 0; t < NT; t++)
        for (int k = 0; k < 4; k++) acc8[t][k] = _mm256_setzero_ps();
    for (; i + 8 <= hi; i += 8) {
        _mm_prefetch(r->prefetch + i / 8 * 32, _MM_HINT_T0); /* 4 x 8 bytes a step */
        __m256 xv[3];
        for (int t = 0; t < NT; t++) xv[t] = _mm256_loadu_ps(x + t * n + i);
        for (int k = 0; k < 4; k++) {
            const __m256 wv = load_fp8x8(r->w[k], i);
            for (int t = 0; t < NT; t++) acc8[t][k] = _mm256_fmadd_ps(wv, xv[t], acc8[t][k]);
        }
    }
    for (int t = 0; t < NT; t++)
        for (int k = 0; k < 4; k++) part[t][k] += pn_hsum256(acc8[t][k]) * FP8_F16_BIAS;
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

#if FP8_AVX512
/* fp8_tile4 for groups of whole 16-column steps (per-channel scales and 128-wide blocks alike):
 * each group's dot products stay in vector registers and are folded into the row's total with
 * one FMA by the group's scale, with one horizontal sum per row and token at the end, as
 * quant_linear.c's qtile4_512 does. (fp8_tile4 sums 12 vectors horizontally per group: with
 * 128-wide blocks that was ~1.3x the per-channel time for the same bytes; RESULTS.md.) */
static inline __attribute__((always_inline)) void fp8_tile4_512(const Fp8Rows4 *r, const float *x, int64_t n,
                                                                int64_t group, const int NT, float dots[3][4]) {
    __m512 tot[3][4];
    for (int t = 0; t < NT; t++)
        for (int k = 0; k < 4; k++) tot[t][k] = _mm512_setzero_ps();
    for (int64_t g = 0; g < n / group; g++) {
        __m512 acc[3][4];
        for (int t = 0; t < NT; t++)
            for (int k = 0; k < 4; k++) acc[t][k] = _mm512_setzero_ps();
        for (int64_t i = g * group; i < (g + 1) * group; i += 16) {
            _mm_prefetch(r->prefetch + i / 16 * 64, _MM_HINT_T0); /* as in fp8_group_dots */
            __m512 xv[3];
            for (int t = 0; t < NT; t++) xv[t] = _mm512_loadu_ps(x + t * n + i);
            for (int k = 0; k < 4; k++) {
                const __m512 wv = load_fp8x16(r->w[k], i);
                for (int t = 0; t < NT; t++) acc[t][k] = _mm512_fmadd_ps(wv, xv[t], acc[t][k]);
            }
        }
        for (int k = 0; k < 4; k++) {
            const __m512 s = _mm512_set1_ps(r->s[k][g] * FP8_F16_BIAS);
            for (int t = 0; t < NT; t++) tot[t][k] = _mm512_fmadd_ps(acc[t][k], s, tot[t][k]);
        }
    }
    for (int t = 0; t < NT; t++)
        for (int k = 0; k < 4; k++) dots[t][k] = _mm512_reduce_add_ps(tot[t][k]);
}
#define FP8_TILE(NT) (group % 16 == 0 ? fp8_tile4_512(r, x + t * n, n, group, NT, dots + t) \
                                      : fp8_tile4(r, x + t * n, n, group, NT, dots + t))
#else
#define FP8_TILE(NT) fp8_tile4(r, x + t * n, n, group, NT, dots + t)
#endif

/* dots[t][k] for all T tokens, three at a time. */
static void fp8_dot_rows(const Fp8Rows4 *r, const float *x, int64_t T, int64_t n, int64_t group,
                         float (*dots)[4]) {
    int64_t t = 0;
    for (; t + 3 <= T; t += 3) FP8_TILE(3);
    if (T - t == 2) FP8_TILE(2);
    if (T - t == 1) FP8_TILE(1);
}
#undef FP8_TILE

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
        const int64_t ahead = o + 4 * FP8_PREFETCH_UNITS < out - 3 ? o + 4 * FP8_PREFETCH_UNITS : o;
        r.prefetch = (const char *)(w + ahead * in);
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
#if FP8_AVX512
            const __m512 sv16 = _mm512_set1_ps(s * FP8_F16_BIAS);
            for (; i + 16 <= (g + 1) * group; i += 16) _mm512_storeu_ps(dst + i, _mm512_mul_ps(load_fp8x16(src, i), sv16));
#endif
#if FP8_VECTOR
            const __m256 sv = _mm256_set1_ps(s * FP8_F16_BIAS);
            for (; i + 8 <= (g + 1) * group; i += 8) _mm256_storeu_ps(dst + i, _mm256_mul_ps(load_fp8x8(src, i), sv));
#endif
            for (; i < (g + 1) * group; i++) dst[i] = pn_fp8_e4m3_lut[src[i]] * s;
        }
    }
    return PN_OK;
}

/* ------------------------------------------------------------------------------------------ */
/* FP8 activations (W8A8 formats): x rounded to e4m3 with its scale and scaled back            */
/* ------------------------------------------------------------------------------------------ */

#define E4M3_MAX ((float)PN_FP8_E4M3_MAX)

/* v (|v| <= 448) rounded to the nearest e4m3 value, ties to even, as torch's cast does: the
 * step is 2^-9 below 2^-6 (subnormals), else 2^(e - 4) for v in [2^(e-1), 2^e); v / step is
 * exact (a power of two) and nearbyintf rounds to nearest even. */
static float round_e4m3(float v) {
    const float a = fabsf(v);
    float step = 0.001953125f;
    if (a >= 0.015625f) {
        int e;
        frexpf(a, &e);
        step = ldexpf(1.0f, e - 4);
    }
    return copysignf(nearbyintf(a / step) * step, v);
}

/* out [T, in] = x rounded to e4m3 per (row, group of `group` inputs) with scale amax / 448 (0:
 * float32's eps, as compressed-tensors), or with `static_scale` when it is > 0; then scaled back.
 * The same float32 operations as layers/quantization/fp8.quantize_activations, so the same bits. */
int fp8_act_quant(const float *x, int64_t T, int64_t in, int64_t group, float static_scale, float *out,
                  int threads) {
    if (T < 0 || in <= 0 || group <= 0 || in % group != 0 || threads <= 0) return PN_ERR_ARG;
    const int64_t groups = in / group;
#pragma omp parallel for schedule(static) num_threads(threads) if (T * in >= (1 << 16))
    for (int64_t u = 0; u < T * groups; u++) {
        const float *src = x + u * group;
        float *dst = out + u * group, s = static_scale;
        if (s <= 0.0f) {
            float amax = 0.0f;
            for (int64_t i = 0; i < group; i++) amax = fmaxf(amax, fabsf(src[i]));
            s = amax / E4M3_MAX;
            if (s == 0.0f) s = 1.1920928955078125e-07f; /* FLT_EPSILON */
        }
        for (int64_t i = 0; i < group; i++)
            dst[i] = round_e4m3(fminf(fmaxf(src[i] / s, -E4M3_MAX), E4M3_MAX)) * s;
    }
    return PN_OK;
}

/* bfloat16 weight matmuls for small batches: y = x . W^T (+ bias) with x and y float32 and W
 * bfloat16 [out, in] row-major (torch's Linear layout, the parameter read in place).
 *
 * Why: decoding a few tokens streams every weight once per step, at memory bandwidth on a CPU;
 * bfloat16 weights are half of float32's bytes. oneDNN's bf16 GEMM (AMX) wins for big batches,
 * but at a few rows it first rounds x to bfloat16 and pays a per-call setup. Here each weight is
 * widened to float32 in registers -- a bfloat16 is the high half of a float32, so a 16-bit shift
 * is exact -- and multiplied into float32 accumulators with x kept in float32: the products and
 * sums are those of float32 math on the bf16-rounded weights (no activation rounding).
 *
 * Threads split the output rows; a work unit reads 4 weight rows once for up to 3 tokens per
 * pass (fp8_linear.c's tile, 12 independent FMA chains), and fetches a later unit's rows as it
 * streams its own (without that, loads and math serialise; quant_linear.c). AVX-512: 16 lanes
 * from one 256-bit load per row and step; AVX2: 8 lanes; scalar code elsewhere and for tails.
 */
#include <stdint.h>
#include <string.h>

#include "pagedllm_native.h"

/* how many work units ahead the vector loops fetch weight rows (as fp8_linear.c) */
#define BF16_PREFETCH_UNITS 4

float pn_bf16_to_f32(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Round to nearest even, as torch's float32 -> bfloat16 cast does; NaN stays a (quiet) NaN. */
uint16_t pn_f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

#if defined(__AVX512F__)
#define BF16_AVX512 1
static inline __attribute__((always_inline)) __m512 load_bf16x16(const uint16_t *row, int64_t i) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(row + i)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
#else
#define BF16_AVX512 0
#endif

/* The 4 weight rows one work unit reads, and the bytes of a later unit it fetches meanwhile. */
typedef struct {
    const uint16_t *w[4];
    const char *prefetch;
} Bf16Rows4;

/* dots[t][k] = W_k . x_t for 4 rows and NT <= 3 tokens (NT a literal at every call site, so
 * the loops unroll and the accumulators live in registers); x rows n apart. */
static inline __attribute__((always_inline)) void bf16_tile4(const Bf16Rows4 *r, const float *x, int64_t n,
                                                             const int NT, float dots[3][4]) {
    int64_t i = 0;
    for (int t = 0; t < NT; t++)
        for (int k = 0; k < 4; k++) dots[t][k] = 0.0f;
#if BF16_AVX512
    __m512 acc[3][4];
    for (int t = 0; t < NT; t++)
        for (int k = 0; k < 4; k++) acc[t][k] = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        /* a step reads 4 x 32 bytes: fetch as many of a later unit (two lines) */
        _mm_prefetch(r->prefetch + i * 8, _MM_HINT_T0);
        _mm_prefetch(r->prefetch + i * 8 + 64, _MM_HINT_T0);
        __m512 xv[3];
        for (int t = 0; t < NT; t++) xv[t] = _mm512_loadu_ps(x + t * n + i);
        for (int k = 0; k < 4; k++) {
            const __m512 wv = load_bf16x16(r->w[k], i);
            for (int t = 0; t < NT; t++) acc[t][k] = _mm512_fmadd_ps(wv, xv[t], acc[t][k]);
        }
    }
    for (int t = 0; t < NT; t++)
        for (int k = 0; k < 4; k++) dots[t][k] = _mm512_reduce_add_ps(acc[t][k]);
#endif
#if PN_AVX2 /* (the 8-column tail of the AVX-512 loop) */
    __m256 acc8[3][4];
    for (int t = 0; t < NT; t++)
        for (int k = 0; k < 4; k++) acc8[t][k] = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        _mm_prefetch(r->prefetch + i * 8, _MM_HINT_T0); /* 4 x 16 bytes a step: one line */
        __m256 xv[3];
        for (int t = 0; t < NT; t++) xv[t] = _mm256_loadu_ps(x + t * n + i);
        for (int k = 0; k < 4; k++) {
            const __m256 wv = pn_load_bf16x8(r->w[k] + i);
            for (int t = 0; t < NT; t++) acc8[t][k] = _mm256_fmadd_ps(wv, xv[t], acc8[t][k]);
        }
    }
    for (int t = 0; t < NT; t++)
        for (int k = 0; k < 4; k++) dots[t][k] += pn_hsum256(acc8[t][k]);
#endif
    for (; i < n; i++) /* the tail (and everything without AVX2) */
        for (int k = 0; k < 4; k++)
            for (int t = 0; t < NT; t++) dots[t][k] += pn_bf16_to_f32(r->w[k][i]) * x[t * n + i];
}

/* dots[t][k] for all T tokens, three at a time. */
static void bf16_dot_rows(const Bf16Rows4 *r, const float *x, int64_t T, int64_t n, float (*dots)[4]) {
    int64_t t = 0;
    for (; t + 3 <= T; t += 3) bf16_tile4(r, x + t * n, n, 3, dots + t);
    if (T - t == 2) bf16_tile4(r, x + t * n, n, 2, dots + t);
    if (T - t == 1) bf16_tile4(r, x + t * n, n, 1, dots + t);
}

int bf16_linear(const float *x, int64_t T, const uint16_t *w, const float *bias, int64_t in, int64_t out, float *y,
                int threads) {
    if (T <= 0 || T > LD_MAX_TOKENS || in <= 0 || out <= 0 || threads <= 0) return PN_ERR_ARG;
    const int64_t units = (out + 3) / 4;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t u = 0; u < units; u++) {
        const int64_t o = u * 4;
        const int nr = out - o < 4 ? (int)(out - o) : 4;
        Bf16Rows4 r;
        const int64_t ahead = o + 4 * BF16_PREFETCH_UNITS < out - 3 ? o + 4 * BF16_PREFETCH_UNITS : o;
        r.prefetch = (const char *)(w + ahead * in);
        for (int k = 0; k < 4; k++) r.w[k] = w + (o + (k < nr ? k : 0)) * in; /* missing rows repeat a valid one */
        float dots[LD_MAX_TOKENS][4];
        bf16_dot_rows(&r, x, T, in, dots);
        for (int64_t t = 0; t < T; t++)
            for (int k = 0; k < nr; k++) y[t * out + o + k] = dots[t][k] + (bias ? bias[o + k] : 0.0f);
    }
    return PN_OK;
}

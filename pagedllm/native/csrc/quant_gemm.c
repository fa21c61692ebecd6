/* Group-wise 4/8-bit weight-only GEMM for batches past the small-batch kernel of quant_linear.c
 * (layers/quantization/grouped.py routes by row count).
 *
 * Why: the small-batch kernel widens every code once per pair (4 bits) or triple (8 bits) of
 * tokens, so past a few rows the widening dominates; widening the whole matrix into a float32
 * buffer for MKL's GEMM instead costs the buffer (a 200M model writes ~750 MB per step and the
 * GEMM reads it back). Here the weight is widened one column panel and one k-block at a time
 * into a small float32 scratch that stays in L1, and a register tile (QG_ROWS rows x 32 columns
 * of accumulators: the header's pn_tile32, shared with moe_experts.c) runs every row of x against
 * it: the codes are read from memory once per call and each is widened once per QG_MC rows.
 *
 * Panel layout (built at load by grouped.py: pack_panels), P = ceil(out / QG_PANEL):
 *   qp  uint8 [P, in, 16] for 4 bits: byte j of (p, k) = code of row p*32+j at input k in the
 *       low nibble, of row p*32+16+j in the high nibble (so one 16-byte load widens to the
 *       panel's 32 columns: mask -> columns 0..15, shift -> 16..31);
 *       uint8 [P, in, 32] for 8 bits: byte j of (p, k) = code of row p*32+j at input k;
 *   sp  float32 [P, in / group, 32]: the scale of row p*32+j in group g;
 *   zp  float32 [P, in / group, 32]: its zero point * scale;
 * rows past `out` (the last panel's tail) hold code 0, scale 0 and zero 0. Panels are stored
 * one after the other, so the codes a thread reads are one sequential stream.
 *
 * Threads split the panels: no two write the same output column.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "pagedllm_native.h"


#ifndef QG_ROWS
#if defined(__AVX512F__)
#define QG_ROWS 8 /* 16 zmm accumulators of the 32 registers */
#else
#define QG_ROWS 2 /* 8 ymm accumulators of the 16 registers */
#endif
#endif
_Static_assert(QG_PANEL == 32, "pn_tile32 runs 32-column panels");
/* the leftover-row switch in tile_all_rows covers 1 .. QG_ROWS - 1 rows up to 7 */
_Static_assert(QG_ROWS == 2 || QG_ROWS == 8, "tile_all_rows' tail cases cover QG_ROWS 2 or 8");

/* inputs per k-block: the scratch (QG_KC x 32 floats, 32 KiB) stays in a 48 KiB L1 */
#ifndef QG_KC
#define QG_KC 256
#endif

/* rows of x per pass over the panels: x[rows, in] stays in a 2 MiB L2 while every panel of the
 * thread runs against it (the codes are widened once per pass) */
#ifndef QG_MC
#define QG_MC 128
#endif


/* 16 bytes zero-extended to 16 int32 lanes. GCC's __builtin_convertvector compiles this to 16
 * scalar loads and inserts, which made the whole GEMM ~30% slower at 64 rows: intrinsics where
 * the ISA has the instruction. */
static inline v16i widen16(const uint8_t *src) {
#if defined(__AVX512F__) && PN_AVX2
    return (v16i)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)src));
#elif PN_AVX2
    union {
        v16i v;
        __m256i h[2];
    } u;
    u.h[0] = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)src));
    u.h[1] = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(src + 8)));
    return u.v;
#else
    v16i v;
    for (int i = 0; i < 16; i++) v[i] = src[i];
    return v;
#endif
}

/* bytes of one panel per input index */
static inline int64_t panel_bytes(int bits) { return bits == 4 ? QG_PANEL / 2 : QG_PANEL; }

/* b[k - k0][0:32] = the float32 weights of one panel's 32 columns at inputs k0 .. k1 - 1. The
 * codes of the next k-block (the next panel's first one at the end: panels are contiguous) are
 * prefetched meanwhile, a cache line per 64 bytes read. */
static void widen_block(const uint8_t *qp, const float *sp, const float *zp, int64_t k0, int64_t k1, int64_t group,
                        int bits, float *b) {
    const int64_t kb = panel_bytes(bits);
    for (int64_t k = k0; k < k1;) {
        const int64_t g = k / group, end = (g + 1) * group < k1 ? (g + 1) * group : k1;
        const v16 s0 = load16(sp + g * QG_PANEL), s1 = load16(sp + g * QG_PANEL + 16);
        const v16 z0 = load16(zp + g * QG_PANEL), z1 = load16(zp + g * QG_PANEL + 16);
        for (; k < end; k++) {
            const uint8_t *src = qp + k * kb;
            __builtin_prefetch(src + (k1 - k0) * kb, 0, 3);
            v16 c0, c1;
            if (bits == 4) {
                const v16i v = widen16(src);
                c0 = __builtin_convertvector(v & 15, v16), c1 = __builtin_convertvector(v >> 4, v16);
            } else {
                c0 = __builtin_convertvector(widen16(src), v16);
                c1 = __builtin_convertvector(widen16(src + 16), v16);
            }
            store16(b + (k - k0) * QG_PANEL, c0 * s0 - z0);
            store16(b + (k - k0) * QG_PANEL + 16, c1 * s1 - z1);
        }
    }
}

/* c[r][0:32] (+)= sum_k a[r * lda + k] * b[k][0:32] for M rows (the header's pn_tile32; M a
 * literal at every call site); `first` starts from zero. b is the L1 scratch: no prefetch. */
static inline __attribute__((always_inline)) void tile(const int M, const float *a, int64_t lda, const float *b,
                                                       int64_t kc, float *c, int first) {
    v16 acc[QG_ROWS][2];
    const float *rows[QG_ROWS];
    for (int r = 0; r < M; r++) {
        rows[r] = a + r * lda;
        acc[r][0] = first ? (v16){0} : load16(c + r * QG_PANEL);
        acc[r][1] = first ? (v16){0} : load16(c + r * QG_PANEL + 16);
    }
    pn_tile32(M, rows, b, kc, acc, 0);
    for (int r = 0; r < M; r++) {
        store16(c + r * QG_PANEL, acc[r][0]);
        store16(c + r * QG_PANEL + 16, acc[r][1]);
    }
}

/* tile() over all T rows of x, QG_ROWS at a time, the tail with its row count as a literal. */
static void tile_all_rows(const float *x, int64_t T, int64_t in, int64_t k0, const float *b, int64_t kc, float *c,
                          int first) {
    int64_t t = 0;
    for (; t + QG_ROWS <= T; t += QG_ROWS) tile(QG_ROWS, x + t * in + k0, in, b, kc, c + t * QG_PANEL, first);
    const float *a = x + t * in + k0;
    float *ct = c + t * QG_PANEL;
    switch (T - t) {
#define CASE(M) case M: tile(M, a, in, b, kc, ct, first); break;
        CASE(1)
#if QG_ROWS > 2
        CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7)
#endif
#undef CASE
    }
}

/* Shapes of one call. */
typedef struct {
    int64_t T, in, out, group;
    int bits;
} QgDims;

/* y[:, p*32 ..] = x . panel p^T (+ bias) for d->T <= QG_MC rows, with b (QG_KC x 32) and c
 * (QG_MC x 32) the thread's scratch. */
static void panel_gemm(const float *x, const uint8_t *qp, const float *sp, const float *zp, const float *bias,
                       const QgDims *d, int64_t p, float *y, float *b, float *c) {
    const int64_t groups = d->in / d->group;
    const uint8_t *q = qp + p * d->in * panel_bytes(d->bits);
    const float *s = sp + p * groups * QG_PANEL, *z = zp + p * groups * QG_PANEL;
    for (int64_t k0 = 0; k0 < d->in; k0 += QG_KC) {
        const int64_t kc = d->in - k0 < QG_KC ? d->in - k0 : QG_KC;
        widen_block(q, s, z, k0, k0 + kc, d->group, d->bits, b);
        tile_all_rows(x, d->T, d->in, k0, b, kc, c, k0 == 0);
    }
    const int64_t col = p * QG_PANEL, n = d->out - col < QG_PANEL ? d->out - col : QG_PANEL;
    for (int64_t t = 0; t < d->T; t++)
        for (int64_t j = 0; j < n; j++) y[t * d->out + col + j] = c[t * QG_PANEL + j] + (bias ? bias[col + j] : 0.0f);
}

int qg_gemm(const float *x, int64_t T, const uint8_t *qp, const float *sp, const float *zp, const float *bias,
            int64_t in, int64_t out, int64_t group, int bits, float *y, int threads) {
    if (T <= 0 || in <= 0 || out <= 0 || threads <= 0 || (bits != 4 && bits != 8) || group <= 0 || in % group)
        return PN_ERR_ARG;
    const int64_t panels = (out + QG_PANEL - 1) / QG_PANEL, per_thread = (QG_KC + QG_MC) * QG_PANEL;
    float *scratch = aligned_alloc(64, sizeof(float) * (size_t)(per_thread * threads));
    if (!scratch) return PN_ERR_NOMEM;
#pragma omp parallel num_threads(threads)
    {
        float *b = scratch + (int64_t)omp_get_thread_num() * per_thread;
        for (int64_t m0 = 0; m0 < T; m0 += QG_MC) {
            const QgDims d = {T - m0 < QG_MC ? T - m0 : QG_MC, in, out, group, bits};
#pragma omp for schedule(static)
            for (int64_t p = 0; p < panels; p++)
                panel_gemm(x + m0 * in, qp, sp, zp, bias, &d, p, y + m0 * out, b, b + QG_KC * QG_PANEL);
        }
    }
    free(scratch);
    return PN_OK;
}

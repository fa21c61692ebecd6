/*
 * Paged attention for CPUs: one call handles a flat batch that mixes decode tokens (q_len 1)
 * and prefill chunks (q_len > 1, causal inside the chunk, possibly starting mid-context).
 *
 * Layouts (see pagedllm/attention/cpu.py for the why):
 *   query / out      [num_tokens, num_heads, head_dim]            float32, last dim contiguous
 *   key / value      [num_tokens, num_kv_heads, head_dim]         cache dtype, last dim contiguous
 *   key/value_cache  [num_blocks, num_kv_heads, block_size, head_dim]  contiguous, f32/f16/bf16/fp8
 *   block_tables     [num_reqs, max_blocks] int32, query_start_loc [num_reqs + 1] int32,
 *   seq_lens         [num_reqs] int32 (context length including this step's tokens),
 *   slot_mapping     [num_tokens] int64 (negative = padding token, not written).
 *
 * Work is split into items (request, kv head, tile of query tokens). An item keeps, for every
 * (token, query head of the GQA group) row, the online-softmax state (running max m, running
 * sum l, accumulator acc[head_dim]) and walks the request's block table once, so each K/V tile
 * is read from the pool in place (no gather) and reused by all rows of the item while it is
 * in L1. Items run in parallel with OpenMP, largest first.
 *
 * Causality needs no mask: positions inside the context are contiguous, so a row at position
 * p sees exactly the first min(n, end - block_start) keys of a block (a prefix), where end is
 * p + 1, or attend_ends[t] for a token of a bidirectional image span (Gemma 3): the end of its
 * image's placeholder run, so the span's tokens see each other both ways. A request's ends never
 * decrease from token to token (a run's end is before the next token's position + 1), which the
 * row-pair and wide paths rely on (a later row sees at least the keys of an earlier one).
 *
 * Built with -O3 -march=native; the hot loops use AVX2/FMA intrinsics when available, AVX-512
 * for q.k and p.v where the build targets it (the dot products are reductions gcc will not
 * vectorize without -ffast-math), with scalar fallbacks. Items with many rows (prefill tiles)
 * take a key-major path under AVX-512 ("wide items" below) that needs no horizontal sums.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "pagedllm_native.h"

static size_t dtype_size(int dtype) { return dtype == PN_DTYPE_F32 ? 4 : dtype >= PN_DTYPE_FP8_E4M3 ? 1 : 2; }

/* ------------------------------------------------------------------------------------------ */
/* dtype conversion (cache -> float32), used only for f16 / bf16 / fp8 caches                 */
/* ------------------------------------------------------------------------------------------ */

static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t mant = h & 0x3ffu;
    uint32_t bits;
    float f;
    if (exp == 0) {
        /* zero or subnormal: mant * 2^-24 is exact in float32 */
        f = (float)mant * 5.9604644775390625e-8f;
        memcpy(&bits, &f, 4);
        bits |= sign;
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 112u) << 23) | (mant << 13);
    }
    memcpy(&f, &bits, 4);
    return f;
}

/* Converts n 16-bit values to float32. */
static void convert_to_f32(const uint16_t *src, float *dst, int64_t n, int dtype) {
    int64_t i = 0;
#if PN_AVX2
    if (dtype == PN_DTYPE_BF16) {
        for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, pn_load_bf16x8(src + i));
    }
#if defined(__F16C__)
    if (dtype == PN_DTYPE_F16) {
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
    }
#endif
#endif
    for (; i < n; i++) dst[i] = dtype == PN_DTYPE_BF16 ? pn_bf16_to_f32(src[i]) : half_to_float(src[i]); /* bf16_linear.c */
}

/* Converts n fp8 values to float32 (their per-tensor scales are folded in by the caller,
 * attention/kv_quant.py): e4m3 through the table of fp8_linear.c; e5m2 is the high byte of a
 * float16 with the same exponent bias, so it widens as one. */
static void convert_fp8_to_f32(const uint8_t *src, float *dst, int64_t n, int dtype) {
    int64_t i = 0;
    if (dtype == PN_DTYPE_FP8_E4M3) {
#if PN_AVX2
        for (; i + 8 <= n; i += 8) {
            const __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(src + i)));
            _mm256_storeu_ps(dst + i, _mm256_i32gather_ps(pn_fp8_e4m3_lut, idx, 4));
        }
#endif
        for (; i < n; i++) dst[i] = pn_fp8_e4m3_lut[src[i]];
        return;
    }
#if PN_AVX2 && defined(__F16C__)
    for (; i + 8 <= n; i += 8) {
        const __m128i h = _mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(src + i))), 8);
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
    }
#endif
    for (; i < n; i++) dst[i] = half_to_float((uint16_t)(src[i] << 8));
}

/* Returns a float32 view of n cache elements: the cache itself for f32, else scratch. */
static const float *load_f32(const void *src, int64_t n, int dtype, float *scratch) {
    if (dtype == PN_DTYPE_F32) return (const float *)src;
    if (dtype >= PN_DTYPE_FP8_E4M3) {
        convert_fp8_to_f32((const uint8_t *)src, scratch, n, dtype);
        return scratch;
    }
    convert_to_f32((const uint16_t *)src, scratch, n, dtype);
    return scratch;
}

/* ------------------------------------------------------------------------------------------ */
/* vector helpers                                                                             */
/* ------------------------------------------------------------------------------------------ */

#if PN_AVX2
static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* [sum(a0), sum(a1), sum(a2), sum(a3)] */
static inline __m128 hsum4x256(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}
#endif

/* AVX-512 (where the build targets it): a 64-float head row is four zmm registers instead of
 * eight ymm, which halves the FMA and load instructions of the q.k and p.v loops. */
#if PN_AVX2 && defined(__AVX512F__)
#define PA_AVX512 1
static inline __m256 fold512(__m512 v) {
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    return _mm256_add_ps(_mm512_castps512_ps256(v), hi);
}

/* [sum(a0), sum(a1), sum(a2), sum(a3)] */
static inline __m128 hsum4x512(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    return hsum4x256(fold512(a0), fold512(a1), fold512(a2), fold512(a3));
}
#else
#define PA_AVX512 0
#endif

static inline float dot(const float *a, const float *b, int D) {
    int d = 0;
    float s = 0.0f;
#if PN_AVX2
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (; d + 16 <= D; d += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), _mm256_loadu_ps(b + d + 8), acc1);
    }
    for (; d + 8 <= D; d += 8)
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc0);
    s = hsum256(_mm256_add_ps(acc0, acc1));
#endif
    for (; d < D; d++) s += a[d] * b[d];
    return s;
}

/* A later tile of the pool, fetched while one is used (p NULL: none); its key rows are
 * key_bytes apart. The loops over the current tile's keys fetch the same keys of it as they go,
 * so the reads overlap the math: asked for a whole tile (64 lines) at a time, a decode batch of
 * 64 at context 192 read 24 GB/s, spread this way 29-32 (AMD Zen 5, benchmarks/RESULTS.md). */
typedef struct {
    const char *p;
    int key_bytes;
} Ahead;

/* Into L2 (prefetcht1), not L1: an Intel core has ~16 L1 fill buffers but ~48 L2 misses in
 * flight, and these tiles stream from memory. On a Xeon with AMX (2 cores) decode batches of 64 x
 * 192, 16 x 512 and 1 x 2048 ran 1.14x, 1.16x and 1.10x faster than with prefetcht0
 * (benchmarks/attention_ab.py; RESULTS.md). */
#define PA_FETCH_LOCALITY 2

static inline __attribute__((always_inline)) void fetch_keys(Ahead a, int j, int n) {
    if (a.p)
        for (int i = 0; i < n * a.key_bytes; i += 64)
            __builtin_prefetch(a.p + (int64_t)j * a.key_bytes + i, 0, PA_FETCH_LOCALITY);
}

/* s[j] = q . k[j] for j < n (k rows are D apart). */
static void qk_scores(const float *q, const float *k, int n, int D, float *s, Ahead ahead) {
    int j = 0;
    if (!PN_AVX2 || D % 8) fetch_keys(ahead, 0, n); /* no vector loop below to spread it over */
#if PA_AVX512
    if (D % 16 == 0) {
        for (; j + 4 <= n; j += 4) {
            const float *k0 = k + (int64_t)j * D;
            fetch_keys(ahead, j, 4);
            __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
            __m512 a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
            for (int d = 0; d < D; d += 16) {
                const __m512 qv = _mm512_loadu_ps(q + d);
                a0 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k0 + d), a0);
                a1 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k0 + D + d), a1);
                a2 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k0 + 2 * D + d), a2);
                a3 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k0 + 3 * D + d), a3);
            }
            _mm_storeu_ps(s + j, hsum4x512(a0, a1, a2, a3));
        }
    }
#endif
#if PN_AVX2
    if (D % 8 == 0) {
        /* four keys at a time: one q load feeds four independent FMA chains */
        for (; j + 4 <= n; j += 4) {
            const float *k0 = k + (int64_t)j * D;
            fetch_keys(ahead, j, 4);
            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
            __m256 a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
            for (int d = 0; d < D; d += 8) {
                __m256 qv = _mm256_loadu_ps(q + d);
                a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + d), a0);
                a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + D + d), a1);
                a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 2 * D + d), a2);
                a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 3 * D + d), a3);
            }
            _mm_storeu_ps(s + j, hsum4x256(a0, a1, a2, a3));
        }
    }
#endif
    for (; j < n; j++) s[j] = dot(q, k + (int64_t)j * D, D);
}

/* Two rows at once: s0[j] = q0 . k[j], s1[j] = q1 . k[j] for j < n. */
static void qk_scores2(const float *q0, const float *q1, const float *k, int n, int D, float *s0,
                       float *s1, Ahead ahead) {
    int j = 0;
    if (!PN_AVX2 || D % 8) fetch_keys(ahead, 0, n);
#if PA_AVX512
    if (D % 16 == 0) {
        for (; j + 4 <= n; j += 4) {
            const float *k0 = k + (int64_t)j * D;
            fetch_keys(ahead, j, 4);
            __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
            __m512 a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
            __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
            __m512 b2 = _mm512_setzero_ps(), b3 = _mm512_setzero_ps();
            for (int d = 0; d < D; d += 16) {
                const __m512 x = _mm512_loadu_ps(q0 + d), y = _mm512_loadu_ps(q1 + d);
                __m512 kv = _mm512_loadu_ps(k0 + d);
                a0 = _mm512_fmadd_ps(x, kv, a0);
                b0 = _mm512_fmadd_ps(y, kv, b0);
                kv = _mm512_loadu_ps(k0 + D + d);
                a1 = _mm512_fmadd_ps(x, kv, a1);
                b1 = _mm512_fmadd_ps(y, kv, b1);
                kv = _mm512_loadu_ps(k0 + 2 * D + d);
                a2 = _mm512_fmadd_ps(x, kv, a2);
                b2 = _mm512_fmadd_ps(y, kv, b2);
                kv = _mm512_loadu_ps(k0 + 3 * D + d);
                a3 = _mm512_fmadd_ps(x, kv, a3);
                b3 = _mm512_fmadd_ps(y, kv, b3);
            }
            _mm_storeu_ps(s0 + j, hsum4x512(a0, a1, a2, a3));
            _mm_storeu_ps(s1 + j, hsum4x512(b0, b1, b2, b3));
        }
    }
#endif
#if PN_AVX2
    if (D % 8 == 0) {
        for (; j + 4 <= n; j += 4) {
            const float *k0 = k + (int64_t)j * D;
            fetch_keys(ahead, j, 4);
            __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
            __m256 a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
            __m256 b0 = _mm256_setzero_ps(), b1 = _mm256_setzero_ps();
            __m256 b2 = _mm256_setzero_ps(), b3 = _mm256_setzero_ps();
            for (int d = 0; d < D; d += 8) {
                const __m256 x = _mm256_loadu_ps(q0 + d), y = _mm256_loadu_ps(q1 + d);
                __m256 kv = _mm256_loadu_ps(k0 + d);
                a0 = _mm256_fmadd_ps(x, kv, a0);
                b0 = _mm256_fmadd_ps(y, kv, b0);
                kv = _mm256_loadu_ps(k0 + D + d);
                a1 = _mm256_fmadd_ps(x, kv, a1);
                b1 = _mm256_fmadd_ps(y, kv, b1);
                kv = _mm256_loadu_ps(k0 + 2 * D + d);
                a2 = _mm256_fmadd_ps(x, kv, a2);
                b2 = _mm256_fmadd_ps(y, kv, b2);
                kv = _mm256_loadu_ps(k0 + 3 * D + d);
                a3 = _mm256_fmadd_ps(x, kv, a3);
                b3 = _mm256_fmadd_ps(y, kv, b3);
            }
            _mm_storeu_ps(s0 + j, hsum4x256(a0, a1, a2, a3));
            _mm_storeu_ps(s1 + j, hsum4x256(b0, b1, b2, b3));
        }
    }
#endif
    for (; j < n; j++) {
        s0[j] = dot(q0, k + (int64_t)j * D, D);
        s1[j] = dot(q1, k + (int64_t)j * D, D);
    }
}

/* max(init, s[0..n)) */
static float max_with(const float *s, int n, float init) {
    int j = 0;
    float m = init;
#if PN_AVX2
    if (n >= 8) {
        __m256 vm = _mm256_loadu_ps(s);
        for (j = 8; j + 8 <= n; j += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(s + j));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(vm), _mm256_extractf128_ps(vm, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        const float hm = _mm_cvtss_f32(h);
        m = hm > m ? hm : m;
    }
#endif
    for (; j < n; j++) m = s[j] > m ? s[j] : m;
    return m;
}

/* s[j] = exp(s[j] - m) for j < n; returns the sum. */
static float exp_shift_sum(float *s, int n, float m) {
    int j = 0;
    float sum = 0.0f;
#if PN_AVX2
    __m256 vm = _mm256_set1_ps(m), vsum = _mm256_setzero_ps();
    for (; j + 8 <= n; j += 8) {
        __m256 p = pn_exp256(_mm256_sub_ps(_mm256_loadu_ps(s + j), vm));
        _mm256_storeu_ps(s + j, p);
        vsum = _mm256_add_ps(vsum, p);
    }
    sum = hsum256(vsum);
#endif
    for (; j < n; j++) {
        s[j] = expf(s[j] - m);
        sum += s[j];
    }
    return sum;
}

/* acc[0..D) *= f */
static void scale_row(float *acc, float f, int D) {
    for (int d = 0; d < D; d++) acc[d] *= f;
}

/* acc += sum_j p[j] * v[j] over j < n (v rows are D apart), one row. FMA latency is several
 * cycles and two units issue per cycle, so the vector loops keep eight independent
 * accumulator chains: even and odd keys go to separate sets, summed at the end. */
static void pv_row(float *acc, const float *p, const float *v, int n, int D, Ahead ahead) {
    int d = 0;
    if (!PN_AVX2 || D < 64) fetch_keys(ahead, 0, n); /* the loops below that fetch as they go need 64 columns */
#if PA_AVX512
    for (; d + 64 <= D; d += 64) {
        __m512 a[4], b[4];
        for (int u = 0; u < 4; u++) a[u] = _mm512_loadu_ps(acc + d + 16 * u), b[u] = _mm512_setzero_ps();
        int j = 0;
        for (; j + 2 <= n; j += 2) {
            if (d == 0) fetch_keys(ahead, j, 2);
            const __m512 p0 = _mm512_set1_ps(p[j]), p1 = _mm512_set1_ps(p[j + 1]);
            const float *v0 = v + (int64_t)j * D + d, *v1 = v0 + D;
            for (int u = 0; u < 4; u++) {
                a[u] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(v0 + 16 * u), a[u]);
                b[u] = _mm512_fmadd_ps(p1, _mm512_loadu_ps(v1 + 16 * u), b[u]);
            }
        }
        if (j < n) {
            const __m512 p0 = _mm512_set1_ps(p[j]);
            for (int u = 0; u < 4; u++)
                a[u] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(v + (int64_t)j * D + d + 16 * u), a[u]);
        }
        for (int u = 0; u < 4; u++) _mm512_storeu_ps(acc + d + 16 * u, _mm512_add_ps(a[u], b[u]));
    }
#endif
#if PN_AVX2
    /* 64 columns at a time: eight accumulators stay in registers across all n keys */
    for (; d + 64 <= D; d += 64) {
        __m256 a[8];
        for (int u = 0; u < 8; u++) a[u] = _mm256_loadu_ps(acc + d + 8 * u);
        for (int j = 0; j < n; j++) {
            if (d == 0) fetch_keys(ahead, j, 1);
            const __m256 pj = _mm256_set1_ps(p[j]);
            const float *vj = v + (int64_t)j * D + d;
            for (int u = 0; u < 8; u++)
                a[u] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 8 * u), a[u]);
        }
        for (int u = 0; u < 8; u++) _mm256_storeu_ps(acc + d + 8 * u, a[u]);
    }
    for (; d + 8 <= D; d += 8) {
        __m256 a = _mm256_loadu_ps(acc + d);
        for (int j = 0; j < n; j++)
            a = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), _mm256_loadu_ps(v + (int64_t)j * D + d), a);
        _mm256_storeu_ps(acc + d, a);
    }
#endif
    for (; d < D; d++) {
        float a = acc[d];
        for (int j = 0; j < n; j++) a += p[j] * v[(int64_t)j * D + d];
        acc[d] = a;
    }
}

/* pv_row for two rows over the same n keys: each V row is loaded once for both, and the two
 * rows' accumulators are the independent FMA chains. */
static void pv_rows2(float *acc0, const float *p0, float *acc1, const float *p1, const float *v, int n,
                     int D, Ahead ahead) {
    int d = 0;
#if PA_AVX512
    if (D < 64) fetch_keys(ahead, 0, n);
    for (; d + 64 <= D; d += 64) {
        __m512 a[4], b[4];
        for (int u = 0; u < 4; u++) a[u] = _mm512_loadu_ps(acc0 + d + 16 * u), b[u] = _mm512_loadu_ps(acc1 + d + 16 * u);
        for (int j = 0; j < n; j++) {
            if (d == 0) fetch_keys(ahead, j, 1);
            const __m512 x = _mm512_set1_ps(p0[j]), y = _mm512_set1_ps(p1[j]);
            const float *vj = v + (int64_t)j * D + d;
            for (int u = 0; u < 4; u++) {
                const __m512 vv = _mm512_loadu_ps(vj + 16 * u);
                a[u] = _mm512_fmadd_ps(x, vv, a[u]);
                b[u] = _mm512_fmadd_ps(y, vv, b[u]);
            }
        }
        for (int u = 0; u < 4; u++) _mm512_storeu_ps(acc0 + d + 16 * u, a[u]), _mm512_storeu_ps(acc1 + d + 16 * u, b[u]);
    }
#elif PN_AVX2
    if (D < 32) fetch_keys(ahead, 0, n);
    /* 32 columns: eight accumulators, within the 16 ymm registers plain AVX2 has */
    for (; d + 32 <= D; d += 32) {
        __m256 a[4], b[4];
        for (int u = 0; u < 4; u++) a[u] = _mm256_loadu_ps(acc0 + d + 8 * u), b[u] = _mm256_loadu_ps(acc1 + d + 8 * u);
        for (int j = 0; j < n; j++) {
            if (d == 0) fetch_keys(ahead, j, 1);
            const __m256 x = _mm256_set1_ps(p0[j]), y = _mm256_set1_ps(p1[j]);
            const float *vj = v + (int64_t)j * D + d;
            for (int u = 0; u < 4; u++) {
                const __m256 vv = _mm256_loadu_ps(vj + 8 * u);
                a[u] = _mm256_fmadd_ps(x, vv, a[u]);
                b[u] = _mm256_fmadd_ps(y, vv, b[u]);
            }
        }
        for (int u = 0; u < 4; u++) _mm256_storeu_ps(acc0 + d + 8 * u, a[u]), _mm256_storeu_ps(acc1 + d + 8 * u, b[u]);
    }
#endif
#if !PN_AVX2
    fetch_keys(ahead, 0, n);
#endif
#if PN_AVX2
    for (; d + 8 <= D; d += 8) {
        __m256 a = _mm256_loadu_ps(acc0 + d), b = _mm256_loadu_ps(acc1 + d);
        for (int j = 0; j < n; j++) {
            const __m256 vv = _mm256_loadu_ps(v + (int64_t)j * D + d);
            a = _mm256_fmadd_ps(_mm256_set1_ps(p0[j]), vv, a);
            b = _mm256_fmadd_ps(_mm256_set1_ps(p1[j]), vv, b);
        }
        _mm256_storeu_ps(acc0 + d, a);
        _mm256_storeu_ps(acc1 + d, b);
    }
#endif
    for (; d < D; d++) {
        float a = acc0[d], b = acc1[d];
        for (int j = 0; j < n; j++) {
            const float vv = v[(int64_t)j * D + d];
            a += p0[j] * vv;
            b += p1[j] * vv;
        }
        acc0[d] = a;
        acc1[d] = b;
    }
}

/* ------------------------------------------------------------------------------------------ */
/* KV write                                                                                   */
/* ------------------------------------------------------------------------------------------ */

/* Scatters new K/V rows (already in the cache dtype) into their slots: a plain byte copy of
 * head_dim elements per (token, kv head). Strides are in elements. */
int pa_write_kv(const void *key, const void *value, void *key_cache, void *value_cache,
                const int64_t *slot_mapping, int64_t num_tokens, int64_t num_blocks,
                int num_kv_heads, int head_dim, int block_size, int64_t k_stride_tok,
                int64_t k_stride_head, int64_t v_stride_tok, int64_t v_stride_head, int dtype,
                int num_threads) {
    if (num_kv_heads <= 0 || head_dim <= 0 || block_size <= 0 || dtype < 0 || dtype > PN_DTYPE_FP8_E5M2)
        return PN_ERR_ARG;
    for (int64_t t = 0; t < num_tokens; t++) /* validate first: fail without a partial write */
        if (slot_mapping[t] >= num_blocks * block_size) return PN_ERR_META;
    const size_t es = dtype_size(dtype), row_bytes = es * (size_t)head_dim;
    const char *kb = (const char *)key, *vb = (const char *)value;
    char *kc = (char *)key_cache, *vc = (char *)value_cache;
    /* threads only pay off for big prefills; a decode step writes a few KB */
    const int big = num_tokens * num_kv_heads * head_dim >= (1 << 16);
    (void)num_threads; /* unused when built without OpenMP */
#pragma omp parallel for schedule(static) num_threads(num_threads) if (big)
    for (int64_t t = 0; t < num_tokens; t++) {
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        const int64_t blk = slot / block_size, off = slot % block_size;
        for (int h = 0; h < num_kv_heads; h++) {
            const int64_t dst = ((blk * num_kv_heads + h) * block_size + off) * head_dim;
            memcpy(kc + dst * es, kb + (t * k_stride_tok + h * k_stride_head) * es, row_bytes);
            memcpy(vc + dst * es, vb + (t * v_stride_tok + h * v_stride_head) * es, row_bytes);
        }
    }
    return PN_OK;
}

/* ------------------------------------------------------------------------------------------ */
/* attention                                                                                  */
/* ------------------------------------------------------------------------------------------ */

typedef struct {
    int req, kv_head, nheads, t0, t1; /* kv heads [kv_head, kv_head + nheads), query tokens [t0, t1) */
    int64_t cost;                     /* ~ rows * keys visited, for largest-first ordering */
} WorkItem;

typedef struct {
    const float *query;
    float *out;
    const void *key_cache, *value_cache;
    const int32_t *block_tables, *query_start_loc, *seq_lens;
    int64_t bt_stride, q_stride_tok, q_stride_head, o_stride_tok, o_stride_head;
    int num_heads, num_kv_heads, head_dim, block_size, dtype;
    float scale;
    int window; /* sliding window: a row at position p sees keys p - window + 1 .. p; 0 = all */
    int attn_chunk; /* chunked local attention (Llama 4): a row at position p sees keys
                     * p / attn_chunk * attn_chunk .. p (its own chunk); 0 = none */
    const float *sinks; /* [num_heads] attention-sink logits (GPT-OSS), or NULL */
    const int32_t *attend_ends; /* [num_tokens] each token's visible end, exclusive; NULL = position + 1 */
} Problem;

typedef struct {
    float *q, *acc, *m, *l, *s, *kbuf, *vbuf; /* per-thread scratch */
    float *qt, *st;              /* wide items: q^T [head_dim][rows_pad], scores [keys][rows_pad] */
    const float **kp, **vp;      /* wide items: the chunk's key / value rows */
} Scratch;

static inline int imin(int a, int b) { return a < b ? a : b; }
static inline int imax(int a, int b) { return a > b ? a : b; }

/* The first visible key of the row at position p, relative to position `base`: the later of its
 * sliding window's start and its attention chunk's start; <= 0 when it sees from base on. Rows
 * later in a request never start earlier, so the first row's value bounds the blocks read. */
static inline int row_first_key(const Problem *P, int base, int p) {
    int lo = P->window ? p - P->window + 1 : 0;
    if (P->attn_chunk) lo = imax(lo, p / P->attn_chunk * P->attn_chunk);
    return lo - base;
}

/* The first block a request's rows from position pos on read: blocks wholly before the first
 * row's first visible key (sliding window / attention chunk) are never read. */
static inline int first_visible_block(const Problem *P, int pos) {
    const int lowest_key = row_first_key(P, 0, pos);
    return lowest_key > 0 ? lowest_key / P->block_size : 0;
}

/* The visible end (exclusive) of query token t (flat index) at position p: p + 1, or its
 * bidirectional span's end. */
static inline int token_end(const Problem *P, int64_t t, int p) { return P->attend_ends ? P->attend_ends[t] : p + 1; }

/* ends[i] = the visible end of the item's token t0 + i (i < t1 - t0). */
static void item_ends(const Problem *P, const WorkItem *it, int ctx_start, int *ends) {
    const int q_begin = P->query_start_loc[it->req];
    for (int t = it->t0; t < it->t1; t++) ends[t - it->t0] = token_end(P, q_begin + t, ctx_start + t);
}

static int cmp_cost_desc(const void *a, const void *b) {
    int64_t ca = ((const WorkItem *)a)->cost, cb = ((const WorkItem *)b)->cost;
    return (ca < cb) - (ca > cb);
}

/* Query tokens per item: enough rows (tokens x group heads) to amortize each K/V tile load,
 * few enough that the rows' q and acc (2 x rows x head_dim floats) stay cache resident. */
#define DEFAULT_TILE_ROWS 4096 /* x head_dim floats: 16 KiB of q per item in float32 */
static int g_tile_rows = DEFAULT_TILE_ROWS;
static int tile_tokens(int group, int head_dim) {
    int rows = g_tile_rows / head_dim;
    if (rows < group) rows = group;
    int t = rows / group;
    return t < 1 ? 1 : t;
}

/* The kernel indexes raw memory with these values, so bad metadata must fail, not crash. */
static int check_metadata(const Problem *P, int num_reqs, int64_t num_tokens, int64_t num_blocks,
                          int max_blocks) {
    if (P->query_start_loc[0] != 0 || P->query_start_loc[num_reqs] != num_tokens)
        return PN_ERR_META;
    for (int r = 0; r < num_reqs; r++) {
        const int q_len = P->query_start_loc[r + 1] - P->query_start_loc[r];
        const int seq_len = P->seq_lens[r];
        if (q_len < 0 || seq_len < q_len) return PN_ERR_META;
        if (q_len == 0) continue; /* its block table is never read */
        const int nb = (seq_len + P->block_size - 1) / P->block_size;
        if (nb > max_blocks) return PN_ERR_META;
        const int32_t *btab = P->block_tables + (int64_t)r * P->bt_stride;
        for (int b = 0; b < nb; b++)
            if (btab[b] < 0 || btab[b] >= num_blocks) return PN_ERR_META;
        if (!P->attend_ends) continue;
        /* a token sees at least itself and at most the context; ends never decrease */
        const int32_t *ends = P->attend_ends + P->query_start_loc[r];
        for (int t = 0; t < q_len; t++)
            if (ends[t] < seq_len - q_len + t + 1 || ends[t] > seq_len || (t > 0 && ends[t] < ends[t - 1]))
                return PN_ERR_META;
    }
    return PN_OK;
}

/* kv heads per item of a decode token (a request with one query token). An item with several
 * heads walks each chunk of blocks head after head (run_item), and while it works on head h it
 * prefetches head h + 1's tiles of the same blocks: the next 4 KiB of the pool for float32, 64
 * floats x 16 keys (a block's heads are adjacent). Reads then come in head-interleaved runs over
 * a few blocks, which this memory serves far better than 4 KiB pieces at random (28-33 against
 * 40-46 GB/s in a read probe on AMD Zen 5); with the fetch spread over the key loops (Ahead), a
 * decode batch of 64 at context 192 ran 1.73x faster than with one item per (request, head)
 * (benchmarks/attention_ab.py; benchmarks/RESULTS.md). Halved while that leaves fewer than
 * DECODE_ITEMS_PER_THREAD items per thread, so a few long decodes still spread over the cores:
 * each item's first tiles come cold (nothing before them fetched them), so the fewer items the
 * better once every thread has one. On a Xeon with AMX, one item per thread rather than 8 ran
 * decode batches of 1 x 192 .. 1 x 2048 and 4 x 256 .. 4 x 1024 1.03-1.10x faster in two
 * attention_ab.py runs (2 per thread: 0.93-1.10x, within that host's noise at one request);
 * from 16 decodes (2 threads) nothing changes. */
#define DECODE_ITEMS_PER_THREAD 1
static int g_decode_items_per_thread = DECODE_ITEMS_PER_THREAD;
static int decode_heads_per_item(const Problem *P, int num_reqs, int num_threads) {
    int decodes = 0;
    for (int r = 0; r < num_reqs; r++) decodes += P->query_start_loc[r + 1] - P->query_start_loc[r] == 1;
    int h = P->num_kv_heads;
    while (h > 1 && (int64_t)decodes * ((P->num_kv_heads + h - 1) / h) < g_decode_items_per_thread * (int64_t)num_threads)
        h = (h + 1) / 2;
    return h;
}

static WorkItem *build_items(const Problem *P, int num_reqs, int tile, int decode_heads, int64_t *count) {
    int64_t n = 0;
    const int decode_items = (P->num_kv_heads + decode_heads - 1) / decode_heads;
    for (int r = 0; r < num_reqs; r++) {
        int q_len = P->query_start_loc[r + 1] - P->query_start_loc[r];
        if (q_len > 0) n += q_len == 1 ? decode_items : (int64_t)((q_len + tile - 1) / tile) * P->num_kv_heads;
    }
    WorkItem *items = (WorkItem *)malloc((size_t)(n > 0 ? n : 1) * sizeof(WorkItem));
    if (!items) return NULL;
    const int group = P->num_heads / P->num_kv_heads;
    int64_t i = 0;
    for (int r = 0; r < num_reqs; r++) {
        const int q_len = P->query_start_loc[r + 1] - P->query_start_loc[r];
        const int ctx_start = P->seq_lens[r] - q_len;
        for (int t0 = 0; t0 < q_len; t0 += tile) {
            const int t1 = t0 + tile < q_len ? t0 + tile : q_len;
            const int hs = q_len == 1 ? decode_heads : 1;
            for (int g = 0; g < P->num_kv_heads; g += hs) {
                const int nh = imin(hs, P->num_kv_heads - g);
                items[i++] = (WorkItem){r, g, nh, t0, t1, (int64_t)(t1 - t0) * group * nh * (ctx_start + t1)};
            }
        }
    }
    qsort(items, (size_t)n, sizeof(WorkItem), cmp_cost_desc);
    *count = n;
    return items;
}

/* Keys folded into a row's softmax state at once: several blocks per update amortize the
 * per-update work (max, rescale, horizontal sums) that dominates with small blocks. */
#define CHUNK_KEYS 64

/* A run of consecutive logical blocks of one request and kv head, as float32 tiles. */
typedef struct {
    const float *k[CHUNK_KEYS], *v[CHUNK_KEYS]; /* [n[b], head_dim] each */
    int n[CHUNK_KEYS];                          /* valid keys per block */
    int nblocks, nkeys, start;                  /* start = position of the first key */
    const char *pk[CHUNK_KEYS], *pv[CHUNK_KEYS]; /* tiles to prefetch while block b's are used (NULL: none) */
    int key_bytes;                               /* bytes per key row of those tiles */
} Chunk;

static int chunk_blocks(int B) { return B >= CHUNK_KEYS ? 1 : (CHUNK_KEYS + B - 1) / B; }

/* Bytes from the start of the pool to kv head kv_head's tile of logical block b (in the cache
 * dtype: block_size x head_dim elements, the same offset in the K and the V pool). */
static inline int64_t tile_offset(const Problem *P, const int32_t *btab, int b, int kv_head) {
    return ((int64_t)btab[b] * P->num_kv_heads + kv_head) * P->block_size * P->head_dim *
           (int64_t)dtype_size(P->dtype);
}

static void load_chunk(const Problem *P, Scratch *S, const int32_t *btab, int kv_head, int b0,
                       int b1, int seq_len, Chunk *c) {
    const int B = P->block_size, D = P->head_dim;
    c->nblocks = b1 - b0;
    c->start = b0 * B;
    for (int i = 0; i < c->nblocks; i++) c->pk[i] = c->pv[i] = NULL;
    c->nkeys = 0;
    for (int b = b0; b < b1; b++) {
        const int i = b - b0, n = imin(B, seq_len - b * B);
        const int64_t off = tile_offset(P, btab, b, kv_head);
        c->k[i] = load_f32((const char *)P->key_cache + off, (int64_t)n * D, P->dtype, S->kbuf + (int64_t)i * B * D);
        c->v[i] = load_f32((const char *)P->value_cache + off, (int64_t)n * D, P->dtype, S->vbuf + (int64_t)i * B * D);
        c->n[i] = n;
        c->nkeys += n;
    }
}

/* Pages are scattered, so the hardware prefetcher can't guess the next tiles: ask for them.
 * Must be inlined: gcc deems a function that only prefetches pure, and drops calls to it. */
static inline __attribute__((always_inline)) void prefetch_blocks(const Problem *P,
                                                                  const int32_t *btab,
                                                                  int kv_head, int b0, int b1) {
    const size_t bytes = dtype_size(P->dtype) * (size_t)P->block_size * P->head_dim;
    for (int b = b0; b < b1; b++) {
        const int64_t off = tile_offset(P, btab, b, kv_head);
        const char *k = (const char *)P->key_cache + off, *v = (const char *)P->value_cache + off;
        for (size_t i = 0; i < bytes; i += 64) {
            __builtin_prefetch(k + i);
            __builtin_prefetch(v + i);
        }
    }
}

/* While the chunk's block i is used, kv head kv_head's tiles of block b0 + i (up to b1) are
 * prefetched (Ahead): spread over the chunk's work, where a burst of a whole chunk's prefetches
 * at its start measured no better than none. */
static void plan_prefetch(const Problem *P, const int32_t *btab, int kv_head, int b0, int b1, Chunk *c) {
    c->key_bytes = (int)(dtype_size(P->dtype) * P->head_dim);
    for (int i = 0; i < c->nblocks && b0 + i < b1; i++) { /* load_chunk left the rest NULL */
        const int64_t off = tile_offset(P, btab, b0 + i, kv_head);
        c->pk[i] = (const char *)P->key_cache + off;
        c->pv[i] = (const char *)P->value_cache + off;
    }
}

/* The blocks [*b0, *b1) of item `it`'s first chunk (for its first kv head), as run_item reads them:
 * from the first row's first visible key, at most chunk_blocks, within the request's blocks. */
static void first_chunk(const Problem *P, const WorkItem *it, int *b0, int *b1) {
    const int B = P->block_size, seq_len = P->seq_lens[it->req];
    const int q_len = P->query_start_loc[it->req + 1] - P->query_start_loc[it->req];
    *b0 = first_visible_block(P, seq_len - q_len + it->t0);
    *b1 = imin(*b0 + chunk_blocks(B), (seq_len + B - 1) / B);
}

/* s0[j] = q0 . key j (and s1[j] = q1 . key j unless q1 is NULL) for the chunk's first nv keys. */
static void chunk_scores(const Chunk *c, const float *q0, const float *q1, int nv, int D,
                         float *s0, float *s1) {
    for (int b = 0, off = 0; b < c->nblocks && off < nv; off += c->n[b], b++) {
        const int m = imin(c->n[b], nv - off);
        const Ahead ahead = {c->pk[b], c->key_bytes};
        if (q1)
            qk_scores2(q0, q1, c->k[b], m, D, s0 + off, s1 + off, ahead);
        else
            qk_scores(q0, c->k[b], m, D, s0 + off, ahead);
    }
}

/* s[0..lo) = -inf (lo <= 0: nothing); returns s. */
static float *mask_before(float *s, int lo) {
    for (int j = 0; j < lo; j++) s[j] = -INFINITY;
    return s;
}

/* Folds scores s[0..nv) of the chunk's keys into row r's online-softmax state: new max, the
 * old sum and accumulator rescaled by exp(m_old - m_new); s becomes p_j = exp(s_j - m_new),
 * which the caller then adds into the row's accumulator (chunk_pv). */
static void softmax_update(Scratch *S, int r, float *s, int nv, int D) {
    const float m_old = S->m[r], m_new = max_with(s, nv, m_old);
    /* skip the exp when the max did not move; on the first chunk (m = -inf) acc is still 0 */
    const float corr = m_new == m_old ? 1.0f : expf(m_old - m_new);
    S->l[r] = S->l[r] * corr + exp_shift_sum(s, nv, m_new);
    S->m[r] = m_new;
    if (corr != 1.0f && m_old != -INFINITY) scale_row(S->acc + (int64_t)r * D, corr, D);
}

/* acc0 += sum_j p0[j] v_j over the chunk's keys j in [from, to) (p indexed by key within the
 * chunk), and the same for acc1 / p1 in the same pass unless acc1 is NULL. */
static void chunk_pv(const Chunk *c, float *acc0, const float *p0, float *acc1, const float *p1, int from,
                     int to, int D) {
    for (int b = 0, off = 0; b < c->nblocks && off < to; off += c->n[b], b++) {
        const int lo = from > off ? from : off, hi = imin(off + c->n[b], to);
        if (lo >= hi) continue;
        const float *v = c->v[b] + (int64_t)(lo - off) * D;
        /* the tile ahead once per block: on its first pass (the rows' shared keys) */
        const Ahead ahead = {from == 0 ? c->pv[b] : NULL, c->key_bytes};
        if (acc1)
            pv_rows2(acc0, p0 + lo, acc1, p1 + lo, v, hi - lo, D, ahead);
        else
            pv_row(acc0, p0 + lo, v, hi - lo, D, ahead);
    }
}

/* Rows r and r + 1 (if pair) after their scores are in s0 / s1: softmax state updates, then
 * p.v with V read once for the keys both rows see (row r + 1 sees at least row r's keys). */
static void pair_softmax_pv(Scratch *S, const Chunk *c, int r, float *s0, int nv0, int lo0, float *s1,
                            int nv1, int lo1, int D) {
    const int do0 = nv0 > 0 && lo0 < nv0, do1 = nv1 > 0 && lo1 < nv1;
    float *acc0 = S->acc + (int64_t)r * D, *acc1 = acc0 + D;
    if (do0) softmax_update(S, r, mask_before(s0, lo0), nv0, D);
    if (do1) softmax_update(S, r + 1, mask_before(s1, lo1), nv1, D);
    if (do0 && do1) {
        chunk_pv(c, acc0, s0, acc1, s1, 0, nv0, D);
        chunk_pv(c, acc1, s1, NULL, NULL, nv0, nv1, D);
    } else if (do0) {
        chunk_pv(c, acc0, s0, NULL, NULL, 0, nv0, D);
    } else if (do1) {
        chunk_pv(c, acc1, s1, NULL, NULL, 0, nv1, D);
    }
}

/* Rows of the wide path are padded to whole vectors; the per-row state is sized for that. */
static int rows_pad(int rows) { return (rows + 15) & ~15; }

/* The item's rows' q (scaled) into S->q, and a fresh softmax state for rows_padded rows. */
static void load_rows(const Problem *P, const WorkItem *it, Scratch *S, int rows_padded) {
    const int D = P->head_dim, group = P->num_heads / P->num_kv_heads, ntok = it->t1 - it->t0;
    const int q_begin = P->query_start_loc[it->req];
    for (int i = 0; i < ntok; i++) {
        const float *qt = P->query + (int64_t)(q_begin + it->t0 + i) * P->q_stride_tok;
        for (int h = 0; h < group; h++) {
            const float *src = qt + (int64_t)(it->kv_head * group + h) * P->q_stride_head;
            float *dst = S->q + (int64_t)(i * group + h) * D;
            for (int d = 0; d < D; d++) dst[d] = src[d] * P->scale; /* fold scale into q once */
        }
    }
    memset(S->acc, 0, sizeof(float) * (size_t)rows_padded * D);
    for (int r = 0; r < rows_padded; r++) {
        S->m[r] = -INFINITY;
        S->l[r] = 0.0f;
    }
}

/* out rows = acc / l; a head's sink logit adds exp(sink - m) to l: exp(sink) in the units of
 * the running sum, which is scaled by exp(-m) (every stored row saw its own key, so m is finite) */
static void store_rows(const Problem *P, const WorkItem *it, const Scratch *S) {
    const int D = P->head_dim, group = P->num_heads / P->num_kv_heads, ntok = it->t1 - it->t0;
    const int q_begin = P->query_start_loc[it->req];
    for (int i = 0; i < ntok; i++) {
        float *ot = P->out + (int64_t)(q_begin + it->t0 + i) * P->o_stride_tok;
        for (int h = 0; h < group; h++) {
            const int r = i * group + h;
            const int head = it->kv_head * group + h;
            float *dst = ot + (int64_t)head * P->o_stride_head;
            const float sink = P->sinks ? expf(P->sinks[head] - S->m[r]) : 0.0f;
            const float inv = 1.0f / (S->l[r] + sink);
            for (int d = 0; d < D; d++) dst[d] = S->acc[(int64_t)r * D + d] * inv;
        }
    }
}

#if PA_AVX512
/* ------------------------------------------------------------------------------------------ */
/* wide items (prefill tiles, >= 16 rows; AVX-512): scores key-major, no horizontal sums      */
/* ------------------------------------------------------------------------------------------ */

/* The row-pair path above computes each score as a dot product ending in a horizontal sum,
 * which for head_dim 64 costs more shuffle than FMA work. With many rows per item, the scores
 * are instead formed as s^T[key][rows] = sum_d k[key][d] * q^T[d][rows]: a broadcast key
 * element times 16 rows' q at once (q is transposed once per item). The online softmax then
 * runs down the key axis, 16 rows per vector, and p.v broadcasts p[key][row] against V rows. */

#define WIDE_MIN_ROWS 16

static int wide_ok(const Problem *P, int rows) { return rows >= WIDE_MIN_ROWS && P->head_dim % 64 == 0; }

/* q^T [D][rp] from the item's row-major scaled q; padding rows are 0 */
static void transpose_q(Scratch *S, int rows, int rp, int D) {
    for (int d = 0; d < D; d++) {
        float *dst = S->qt + (int64_t)d * rp;
        for (int r = 0; r < rows; r++) dst[r] = S->q[(int64_t)r * D + d];
        for (int r = rows; r < rp; r++) dst[r] = 0.0f;
    }
}

/* The chunk's key / value row pointers, one per key. */
static void chunk_rows(const Chunk *c, Scratch *S, int D) {
    for (int b = 0, j = 0; b < c->nblocks; b++)
        for (int t = 0; t < c->n[b]; t++, j++) {
            S->kp[j] = c->k[b] + (int64_t)t * D;
            S->vp[j] = c->v[b] + (int64_t)t * D;
        }
}

/* st[j][16 * v0 .. 16 * (v0 + NV)) for keys j0 .. j0 + 3 (key pointers clamped to the last valid
 * key: the extra scores are never read). NV row vectors x 4 keys accumulators. */
static inline __attribute__((always_inline)) void scores_block(const Scratch *S, int j0, int nv, int v0, int NV,
                                                               int rp, int D) {
    const float *k[4];
    for (int t = 0; t < 4; t++) k[t] = S->kp[imin(j0 + t, nv - 1)];
    __m512 a[4][4];
    for (int t = 0; t < 4; t++)
        for (int v = 0; v < NV; v++) a[t][v] = _mm512_setzero_ps();
    for (int d = 0; d < D; d++) {
        const float *q = S->qt + (int64_t)d * rp + 16 * v0;
        __m512 qv[4];
        for (int v = 0; v < NV; v++) {
            qv[v] = _mm512_loadu_ps(q + 16 * v);
            /* keep q in a register: gcc otherwise folds the load into each of the 4 keys' FMAs,
             * 4x the loads, which holds the loop at the load ports where a zmm load takes both
             * (AMD Zen 4: 16 loads per 16 FMAs) */
            __asm__("" : "+v"(qv[v]));
        }
        for (int t = 0; t < 4; t++) {
            const __m512 kb = _mm512_set1_ps(k[t][d]);
            for (int v = 0; v < NV; v++) a[t][v] = _mm512_fmadd_ps(kb, qv[v], a[t][v]);
        }
    }
    for (int t = 0; t < 4; t++)
        for (int v = 0; v < NV; v++) _mm512_storeu_ps(S->st + (int64_t)(j0 + t) * rp + 16 * (v0 + v), a[t][v]);
}

static void wide_scores(const Scratch *S, int nv, int rp, int D) {
    for (int j0 = 0; j0 < nv; j0 += 4) {
        int v0 = 0;
        for (; v0 + 4 <= rp / 16; v0 += 4) scores_block(S, j0, nv, v0, 4, rp, D);
        for (; v0 + 2 <= rp / 16; v0 += 2) scores_block(S, j0, nv, v0, 2, rp, D);
        for (; v0 < rp / 16; v0++) scores_block(S, j0, nv, v0, 1, rp, D);
    }
}

/* Online-softmax update of 16 rows (vector v) over keys [0, nv): keys outside a row's
 * [lo, hi) are masked; st becomes p (0 where masked); rescales the rows' acc where the max
 * moved. */
static void wide_softmax(Scratch *S, int v, const int *lo, const int *hi, int nv, int rp, int D) {
    const __m512i lov = _mm512_loadu_si512(lo + 16 * v), hiv = _mm512_loadu_si512(hi + 16 * v);
    const __m512 ninf = _mm512_set1_ps(-INFINITY);
    float *st = S->st + 16 * v;
    __m512 mx = ninf;
    for (int j = 0; j < nv; j++) {
        const __m512i jv = _mm512_set1_epi32(j);
        const __mmask16 in = _mm512_cmpgt_epi32_mask(hiv, jv) & _mm512_cmple_epi32_mask(lov, jv);
        const __m512 x = _mm512_mask_blend_ps(in, ninf, _mm512_loadu_ps(st + (int64_t)j * rp));
        _mm512_storeu_ps(st + (int64_t)j * rp, x);
        mx = _mm512_max_ps(mx, x);
    }
    const __m512 m_old = _mm512_loadu_ps(S->m + 16 * v), m_new = _mm512_max_ps(m_old, mx);
    const __mmask16 seen = _mm512_cmp_ps_mask(m_new, ninf, _CMP_NEQ_OQ);
    const __m512 m_use = _mm512_maskz_mov_ps(seen, m_new); /* rows with nothing yet: 0, p = 0 */
    __m512 sum = _mm512_setzero_ps();
    for (int j = 0; j < nv; j++) {
        const __m512 x = _mm512_loadu_ps(st + (int64_t)j * rp);
        const __mmask16 real = _mm512_cmp_ps_mask(x, ninf, _CMP_NEQ_OQ);
        const __m512 p = _mm512_maskz_mov_ps(real, pn_exp512(_mm512_sub_ps(x, m_use)));
        _mm512_storeu_ps(st + (int64_t)j * rp, p);
        sum = _mm512_add_ps(sum, p);
    }
    const __mmask16 moved = _mm512_cmp_ps_mask(m_new, m_old, _CMP_NEQ_OQ);
    const __m512 corr = _mm512_mask_blend_ps(moved, _mm512_set1_ps(1.0f), pn_exp512(_mm512_sub_ps(m_old, m_use)));
    _mm512_storeu_ps(S->l + 16 * v, _mm512_fmadd_ps(_mm512_loadu_ps(S->l + 16 * v), corr, sum));
    _mm512_storeu_ps(S->m + 16 * v, m_new);
    float c[16];
    _mm512_storeu_ps(c, corr);
    for (int i = 0; i < 16; i++)
        if (c[i] != 1.0f) scale_row(S->acc + (int64_t)(16 * v + i) * D, c[i], D);
}

/* acc[r0 .. r0 + 4) += sum_{j < nv} p[j][r] v_j, 64 columns at a time (16 accumulators). */
static void wide_pv4(Scratch *S, int r0, int nv, int rp, int D) {
    for (int d = 0; d < D; d += 64) {
        __m512 a[4][4];
        for (int i = 0; i < 4; i++)
            for (int u = 0; u < 4; u++) a[i][u] = _mm512_loadu_ps(S->acc + (int64_t)(r0 + i) * D + d + 16 * u);
        for (int j = 0; j < nv; j++) {
            const float *vj = S->vp[j] + d, *p = S->st + (int64_t)j * rp + r0;
            __m512 vv[4];
            for (int u = 0; u < 4; u++) vv[u] = _mm512_loadu_ps(vj + 16 * u);
            for (int i = 0; i < 4; i++) {
                const __m512 pb = _mm512_set1_ps(p[i]);
                for (int u = 0; u < 4; u++) a[i][u] = _mm512_fmadd_ps(pb, vv[u], a[i][u]);
            }
        }
        for (int i = 0; i < 4; i++)
            for (int u = 0; u < 4; u++) _mm512_storeu_ps(S->acc + (int64_t)(r0 + i) * D + d + 16 * u, a[i][u]);
    }
}

/* The chunk loop of run_item for a wide item (state already loaded by load_rows). */
static void run_item_wide(const Problem *P, const WorkItem *it, Scratch *S) {
    const int D = P->head_dim, B = P->block_size, group = P->num_heads / P->num_kv_heads;
    const int q_len = P->query_start_loc[it->req + 1] - P->query_start_loc[it->req];
    const int seq_len = P->seq_lens[it->req], ctx_start = seq_len - q_len;
    const int rows = (it->t1 - it->t0) * group, rp = rows_pad(rows);
    const int32_t *btab = P->block_tables + (int64_t)it->req * P->bt_stride;
    const int ntok = it->t1 - it->t0, pos0 = ctx_start + it->t0; /* pos0: the item's first token's position */
    int lo[rp], hi[rp], ends[ntok]; /* a row's visible keys in the current chunk: [lo, hi) */
    item_ends(P, it, ctx_start, ends);
    transpose_q(S, rows, rp, D);
    const int num_blocks = (ends[ntok - 1] - 1) / B + 1, cb = chunk_blocks(B); /* up to the last row's end */
    Chunk c;
    for (int b0 = first_visible_block(P, pos0); b0 < num_blocks; b0 += cb) {
        const int b1 = imin(b0 + cb, num_blocks);
        load_chunk(P, S, btab, it->kv_head, b0, b1, seq_len, &c);
        prefetch_blocks(P, btab, it->kv_head, b1, imin(b1 + cb, num_blocks));
        for (int r = 0; r < rp; r++) { /* padding rows (r >= rows) see nothing */
            const int i = imin(r / group, ntok - 1);
            hi[r] = r < rows ? imin(ends[i] - c.start, c.nkeys) : 0;
            lo[r] = row_first_key(P, c.start, pos0 + i);
        }
        const int nv = hi[rows - 1]; /* rows are token-major: the last row sees the most keys */
        if (nv <= 0) continue;
        chunk_rows(&c, S, D);
        wide_scores(S, nv, rp, D);
        for (int v = 0; v < rp / 16; v++) wide_softmax(S, v, lo, hi, nv, rp, D);
        for (int r0 = 0; r0 < rows; r0 += 4) wide_pv4(S, r0, imax(hi[imin(r0 + 3, rows - 1)], 0), rp, D);
    }
}
#endif

/* Scratch for the rows of the item's i-th kv head (rows_h rows each, padded). */
/* The item's i-th kv head as an item of its own (what load_rows / store_rows / run_item_wide take). */
static WorkItem head_item(const WorkItem *it, int i) {
    WorkItem one = *it;
    one.kv_head += i;
    one.nheads = 1;
    return one;
}

static Scratch head_view(const Scratch *S, int i, int rows_h, int D) {
    Scratch V = *S;
    const int64_t base = (int64_t)i * rows_pad(rows_h);
    V.q += base * D;
    V.acc += base * D;
    V.m += base;
    V.l += base;
    return V;
}

/* Rows [0, rows) of one kv head against a loaded chunk: scores, softmax update, p.v. Rows in
 * pairs: two rows x four keys give eight independent FMA chains. Rows are token-major, so the
 * second row sees at least as many keys as the first; scores past a row's own limit are computed
 * on real keys and then ignored. ends: the visible end of each of the item's tokens, the first
 * at position pos0. */
static void chunk_pairs(const Problem *P, Scratch *S, const Chunk *c, int rows, const int *ends, int pos0,
                        int smax) {
    const int D = P->head_dim, group = P->num_heads / P->num_kv_heads;
    for (int r = 0; r < rows; r += 2) {
        const int pair = r + 1 < rows;
        const int nv0 = imin(ends[r / group] - c->start, c->nkeys);
        const int nv1 = pair ? imin(ends[(r + 1) / group] - c->start, c->nkeys) : 0;
        if (nv0 <= 0 && nv1 <= 0) continue;
        const float *q0 = S->q + (int64_t)r * D;
        chunk_scores(c, q0, pair ? q0 + D : NULL, pair ? nv1 : nv0, D, S->s, S->s + smax);
        /* sliding window / attention chunk: keys before a row's first visible key drop out of its softmax */
        const int lo0 = row_first_key(P, c->start, pos0 + r / group);
        const int lo1 = pair ? row_first_key(P, c->start, pos0 + (r + 1) / group) : 0;
        pair_softmax_pv(S, c, r, S->s, nv0, lo0, S->s + smax, nv1, lo1, D);
    }
}

/* One item: for each of its kv heads, rows = (token i in [t0, t1)) x (query head h of the kv
 * head's group), row-major in that order; all rows of a token share one causal limit. The
 * chunk loop is outside the head loop, so one chunk's blocks are read for every head in turn. */
static void run_item(const Problem *P, const WorkItem *it, const WorkItem *next, Scratch *S) {
    const int D = P->head_dim, B = P->block_size, group = P->num_heads / P->num_kv_heads;
    const int q_begin = P->query_start_loc[it->req];
    const int q_len = P->query_start_loc[it->req + 1] - q_begin;
    const int seq_len = P->seq_lens[it->req];
    const int ctx_start = seq_len - q_len; /* position of the chunk's first token */
    const int ntok = it->t1 - it->t0, rows = ntok * group, nh = it->nheads;
    const int32_t *btab = P->block_tables + (int64_t)it->req * P->bt_stride;
#if PA_AVX512
    if (wide_ok(P, rows)) { /* each head's rows walk the blocks on their own (run_item_wide) */
        for (int i = 0; i < nh; i++) {
            const WorkItem one = head_item(it, i);
            load_rows(P, &one, S, rows_pad(rows));
            run_item_wide(P, &one, S);
            store_rows(P, &one, S);
        }
        return;
    }
#endif
    Scratch V[nh];
    for (int i = 0; i < nh; i++) {
        const WorkItem one = head_item(it, i);
        V[i] = head_view(S, i, rows, D);
        load_rows(P, &one, &V[i], rows_pad(rows));
    }

    int ends[ntok];
    item_ends(P, it, ctx_start, ends);
    const int num_blocks = (ends[ntok - 1] - 1) / B + 1; /* up to the last row's end */
    const int cb = chunk_blocks(B), smax = cb * B;
    Chunk c;
    for (int b0 = first_visible_block(P, ctx_start + it->t0); b0 < num_blocks; b0 += cb) {
        const int b1 = imin(b0 + cb, num_blocks);
        for (int i = 0; i < nh; i++) {
            load_chunk(P, S, btab, it->kv_head + i, b0, b1, seq_len, &c);
            if (i + 1 < nh) /* the next head's tiles of these blocks, else the first head's of the next chunk */
                plan_prefetch(P, btab, it->kv_head + i + 1, b0, b1, &c);
            else if (b1 < num_blocks)
                plan_prefetch(P, btab, it->kv_head, b1, imin(b1 + cb, num_blocks), &c);
            else if (next) { /* the last chunk: the thread's next item's first one, else it starts cold */
                int n0, n1;
                first_chunk(P, next, &n0, &n1);
                plan_prefetch(P, P->block_tables + (int64_t)next->req * P->bt_stride, next->kv_head, n0, n1, &c);
            }
            chunk_pairs(P, &V[i], &c, rows, ends, ctx_start + it->t0, smax);
        }
    }

    for (int i = 0; i < nh; i++) {
        const WorkItem one = head_item(it, i);
        store_rows(P, &one, &V[i]);
    }
}

static int scratch_alloc(Scratch *S, int rows, int D, int B) {
    const size_t fl = sizeof(float), chunk = (size_t)chunk_blocks(B) * B;
    S->q = (float *)malloc(fl * (size_t)rows_pad(rows) * D);
    S->acc = (float *)malloc(fl * (size_t)rows_pad(rows) * D);
    S->m = (float *)malloc(fl * (size_t)rows_pad(rows));
    S->l = (float *)malloc(fl * (size_t)rows_pad(rows));
    S->s = (float *)malloc(fl * chunk * 2); /* one score row per row of a pair */
    S->kbuf = (float *)malloc(fl * chunk * D);
    S->vbuf = (float *)malloc(fl * chunk * D);
    const size_t rp = (size_t)rows_pad(rows);
    S->qt = (float *)malloc(fl * rp * D);
    S->st = (float *)malloc(fl * (chunk + 3) * rp); /* keys in fours: up to 3 rows past the chunk */
    S->kp = (const float **)malloc(sizeof(float *) * chunk);
    S->vp = (const float **)malloc(sizeof(float *) * chunk);
    return S->q && S->acc && S->m && S->l && S->s && S->kbuf && S->vbuf && S->qt && S->st && S->kp && S->vp;
}

static void scratch_free(Scratch *S) {
    free(S->q);
    free(S->acc);
    free(S->m);
    free(S->l);
    free(S->s);
    free(S->kbuf);
    free(S->vbuf);
    free(S->qt);
    free(S->st);
    free(S->kp);
    free(S->vp);
}

/* From this many work items per thread, each thread claims its next item before running the
 * current one (pa_attention), so the current item's last chunk prefetches the next one's first:
 * before, every item's first tiles came cold. benchmarks/probes/attention_ab.py (8 heads / 4 kv
 * heads, head_dim 64, 8 layers' pools, 2 threads, AMD Zen 4): decode batches 64 x 192 1.07x,
 * 64 x 128 1.07-1.08x, 16 x 512 1.04x faster. Below it (4 x 1024, 1 x 2048: a few items) each is
 * claimed as a thread gets free: claiming one ahead there left a thread idle (1 x 2048: 0.63x). */
#define LOOKAHEAD_ITEMS_PER_THREAD 8

/* The next item index for this thread (items are taken in order; past n_items: none left). */
static int64_t claim(int64_t *next_item) {
    int64_t i;
#pragma omp atomic capture
    i = (*next_item)++;
    return i;
}

/* Set between calls (start-up), never during one: plain stores, read by every later call. */
int pa_set_split(int tile_rows, int decode_items_per_thread) {
    if (tile_rows < 0 || decode_items_per_thread < 0) return PN_ERR_ARG;
    g_tile_rows = tile_rows ? tile_rows : DEFAULT_TILE_ROWS;
    g_decode_items_per_thread = decode_items_per_thread ? decode_items_per_thread : DECODE_ITEMS_PER_THREAD;
    return PN_OK;
}

/* Paged attention over the flat batch; the new K/V must already be in the cache. Returns
 * PN_OK or a negative error code. Strides are in elements. attend_ends: NULL (causal), or each
 * token's visible end (bidirectional image spans; checked by check_metadata). */
int pa_attention(const float *query, float *out, const void *key_cache, const void *value_cache,
                 const int32_t *block_tables, const int32_t *query_start_loc,
                 const int32_t *seq_lens, int num_reqs, int64_t num_tokens, int64_t num_blocks,
                 int max_blocks, int64_t bt_stride, int num_heads,
                 int num_kv_heads, int head_dim, int block_size, int64_t q_stride_tok,
                 int64_t q_stride_head, int64_t o_stride_tok, int64_t o_stride_head, float scale,
                 int window, int attn_chunk, int dtype, int num_threads, int64_t parallel_work, const float *sinks,
                 const int32_t *attend_ends) {
    if (num_heads <= 0 || num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || head_dim <= 0 ||
        block_size <= 0 || dtype < 0 || dtype > PN_DTYPE_FP8_E5M2 || num_threads <= 0 || window < 0 ||
        attn_chunk < 0)
        return PN_ERR_ARG;
    const Problem P = {
        .query = query, .out = out, .key_cache = key_cache, .value_cache = value_cache,
        .block_tables = block_tables, .query_start_loc = query_start_loc, .seq_lens = seq_lens,
        .bt_stride = bt_stride, .q_stride_tok = q_stride_tok, .q_stride_head = q_stride_head,
        .o_stride_tok = o_stride_tok, .o_stride_head = o_stride_head, .num_heads = num_heads,
        .num_kv_heads = num_kv_heads, .head_dim = head_dim, .block_size = block_size,
        .dtype = dtype, .scale = scale, .window = window,
        .attn_chunk = attn_chunk, .sinks = sinks, .attend_ends = attend_ends};
    const int group = num_heads / num_kv_heads, tile = tile_tokens(group, head_dim);
    int64_t n_items = 0;
    const int meta_status = check_metadata(&P, num_reqs, num_tokens, num_blocks, max_blocks);
    if (meta_status != PN_OK) return meta_status;
    const int decode_heads = decode_heads_per_item(&P, num_reqs, num_threads);
    WorkItem *items = build_items(&P, num_reqs, tile, decode_heads, &n_items);
    if (!items) return PN_ERR_NOMEM;
    int nt = num_threads < n_items ? num_threads : (int)n_items;
    /* waking a thread team costs microseconds (far more when cores are oversubscribed), so
     * steps under parallel_work (rows x keys x head_dim) run on the calling thread */
    int64_t work = 0;
    for (int64_t i = 0; i < n_items; i++) work += items[i].cost;
    if (nt < 1 || work * head_dim < parallel_work) nt = 1;
    int status = PN_OK;
    int64_t next_item = 0; /* the first item no thread has claimed */
    const int lookahead = n_items >= LOOKAHEAD_ITEMS_PER_THREAD * nt;

#pragma omp parallel num_threads(nt)
    {
        Scratch S;
        /* rows: a tile of one head's rows, or a decode item's heads' rows (each padded) */
        const int ok = scratch_alloc(&S, imax(tile * group, decode_heads * rows_pad(group)), head_dim, block_size);
        if (!ok) {
#pragma omp atomic write
            status = PN_ERR_NOMEM;
        }
        /* dynamic scheduling by hand: with many items per thread each is claimed one ahead, so
         * that its last chunk prefetches the thread's next item's first one (a few items are
         * claimed one at a time: a thread holding the next would leave another idle); a failed
         * thread claims nothing */
        int64_t i = ok ? claim(&next_item) : n_items;
        while (i < n_items) {
            const int64_t after = lookahead ? claim(&next_item) : n_items;
            run_item(&P, &items[i], after < n_items ? &items[after] : NULL, &S);
            i = lookahead ? after : claim(&next_item);
        }
        scratch_free(&S);
    }
    free(items);
    return status;
}

/*
 * Multi-head latent attention (MLA, DeepSeek V2/V3) in the weight-absorbed form, over the paged
 * latent cache: what attention/mla.py runs for decode tokens and short chunks on the CPU.
 *
 * The caller folds q_nope into W_UK (q_lat = W_UK^T q_nope per head) and maps the result through
 * W_UV afterwards (both batched GEMMs over the step's tokens); this kernel is the part that reads
 * the context, and it reads only latents:
 *
 *   latent(t) = [ c_kv(t) (rank) | k_pe(t) (rope) ]          one row per token, shared by every head
 *   s_h(t)    = scale * [q_lat_h | q_pe_h] . latent(t)        (one dot of width rank + rope)
 *   o_h       = sum_t softmax_t(s_h(t)) c_kv(t)               (rank wide: the rope part is no value)
 *
 * Layouts:
 *   query        [num_tokens, num_heads, rank + rope]  float32 ([q_lat | q_pe]), last dim contiguous
 *   out          [num_tokens, num_heads, rank]         float32, the latent-space output
 *   latent_cache [num_blocks, 1, block_size, rank + rope]  contiguous, f32/f16/bf16/fp8 (unscaled)
 *   block_tables [num_reqs, max_blocks] int32, query_start_loc [num_reqs + 1] int32, seq_lens
 *   [num_reqs] int32 (context length including this step's tokens). A chunk is causal: its token i
 *   sits at position seq_len - q_len + i and sees the keys up to it.
 *
 * Against running the generic paged-attention kernel with the latent as one KV head for both K
 * and V (what mla.py did before): each latent row is read and widened to float32 once, not twice,
 * and p.v covers rank channels, not rank + rope. Work items are (query token, group of heads); a
 * decode step with fewer tokens than threads splits the heads so every thread has work, each
 * group then reading the context on its own.
 *
 * Two paths per item. With 16 heads or more on an AVX-512 build ("wide items" below) the heads are
 * the vector lanes: scores and p.v are small GEMMs over chunks of 64 keys with no horizontal sums
 * and one softmax update per chunk. Otherwise (fewer heads, or AVX2 only) eight heads share each
 * latent load of a dot product, over slices of 8 keys. Measured with benchmarks/probes/mla_ab.py on
 * 2 heavily shared Zen 4 cores (one thread, DeepSeek-V2-Lite's 16 heads, decode of 1 and 8 requests
 * at context 2048, medians of the interleaved rounds' ratios): the wide path ran 1.02-1.14x the
 * generic kernel's speed over a float32 latent cache, 1.15-1.43x over bfloat16 and 1.5-2.3x over
 * fp8, where the 8-head path it replaced for such items ran 0.66-0.92x, 0.78-1.18x and 1.2x.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "pagedllm_native.h"

static inline int mla_imin(int a, int b) { return a < b ? a : b; }

static float mla_half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    uint32_t bits;
    float f;
    if (exp == 0) { /* zero or subnormal: mant * 2^-24 is exact in float32 */
        f = (float)mant * 5.9604644775390625e-8f;
        memcpy(&bits, &f, 4);
        bits |= sign;
    } else {
        bits = sign | (exp == 31 ? 0x7f800000u | (mant << 13) : ((exp + 112u) << 23) | (mant << 13));
    }
    memcpy(&f, &bits, 4);
    return f;
}

/* dst[0..n) = the n stored elements at src as float32 (exact for every cache dtype; fp8 unscaled:
 * the caller folds the scales into the query and the output, attention/kv_quant.py) */
static void mla_widen(const void *src, float *dst, int64_t n, int dtype) {
    const uint16_t *h = (const uint16_t *)src;
    const uint8_t *b = (const uint8_t *)src;
    int64_t i = 0;
#if PN_AVX2
    if (dtype == PN_DTYPE_BF16)
        for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, pn_load_bf16x8(h + i));
    if (dtype == PN_DTYPE_FP8_E4M3)
        for (; i + 8 <= n; i += 8) {
            const __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(b + i)));
            _mm256_storeu_ps(dst + i, _mm256_i32gather_ps(pn_fp8_e4m3_lut, idx, 4));
        }
#if defined(__F16C__)
    if (dtype == PN_DTYPE_F16)
        for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
    if (dtype == PN_DTYPE_FP8_E5M2)
        for (; i + 8 <= n; i += 8) {
            const __m128i x = _mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(b + i))), 8);
            _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(x));
        }
#endif
#endif
    switch (dtype) { /* the tail, or everything without the vector paths */
    case PN_DTYPE_BF16:
        for (; i < n; i++) dst[i] = pn_bf16_to_f32(h[i]);
        break;
    case PN_DTYPE_F16:
        for (; i < n; i++) dst[i] = mla_half_to_float(h[i]);
        break;
    case PN_DTYPE_FP8_E4M3:
        for (; i < n; i++) dst[i] = pn_fp8_e4m3_lut[b[i]];
        break;
    default: /* e5m2: the high byte of a float16 with the same exponent bias */
        for (; i < n; i++) dst[i] = mla_half_to_float((uint16_t)(b[i] << 8));
    }
}

static inline float mla_hsum(v16 v) {
#if PN_AVX2
    __m256 lo, hi; /* the two halves of the 16 lanes (one zmm, or two ymm), then a shuffle tree */
    memcpy(&lo, &v, sizeof lo);
    memcpy(&hi, (const char *)&v + sizeof lo, sizeof hi);
    return pn_hsum256(_mm256_add_ps(lo, hi));
#else
    float t[16], s = 0.0f;
    memcpy(t, &v, sizeof t);
    for (int i = 0; i < 16; i++) s += t[i];
    return s;
#endif
}

/* s[j] = exp(s[j] - m) for j < n (every s[j] <= m); returns their sum */
static float mla_exp_shift(float *s, int n, float m) {
    int j = 0;
    float sum = 0.0f;
#if PN_AVX2
    __m256 acc = _mm256_setzero_ps();
    for (; j + 8 <= n; j += 8) {
        const __m256 p = pn_exp256(_mm256_sub_ps(_mm256_loadu_ps(s + j), _mm256_set1_ps(m)));
        _mm256_storeu_ps(s + j, p);
        acc = _mm256_add_ps(acc, p);
    }
    sum = pn_hsum256(acc);
#endif
    for (; j < n; j++) {
        s[j] = expf(s[j] - m);
        sum += s[j];
    }
    return sum;
}

/* s[j] = scale * q . k[j] for j < n, k rows D apart: four keys at a time share each q load and
 * keep four independent FMA chains (16 lanes each), summed across lanes once per key. */
static void mla_scores(const float *q, const float *k, int n, int D, float scale, float *s) {
    const int D16 = D & ~15;
    int j = 0;
    for (; j + 4 <= n; j += 4) {
        const float *k0 = k + (int64_t)j * D, *k1 = k0 + D, *k2 = k1 + D, *k3 = k2 + D;
        v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        for (int d = 0; d < D16; d += 16) {
            const v16 qv = load16(q + d);
            a0 += qv * load16(k0 + d);
            a1 += qv * load16(k1 + d);
            a2 += qv * load16(k2 + d);
            a3 += qv * load16(k3 + d);
        }
        float t0 = mla_hsum(a0), t1 = mla_hsum(a1), t2 = mla_hsum(a2), t3 = mla_hsum(a3);
        for (int d = D16; d < D; d++) {
            t0 += q[d] * k0[d];
            t1 += q[d] * k1[d];
            t2 += q[d] * k2[d];
            t3 += q[d] * k3[d];
        }
        s[j] = scale * t0, s[j + 1] = scale * t1, s[j + 2] = scale * t2, s[j + 3] = scale * t3;
    }
    for (; j < n; j++) {
        const float *kj = k + (int64_t)j * D;
        v16 a = {0};
        for (int d = 0; d < D16; d += 16) a += load16(q + d) * load16(kj + d);
        float t = mla_hsum(a);
        for (int d = D16; d < D; d++) t += q[d] * kj[d];
        s[j] = scale * t;
    }
}

/* o[0..R) = o * corr + sum_j p[j] v[j][0..R) for j < n, v rows D apart: 64 columns at a time stay
 * in registers across the keys, so o is read and written once per block, not once per key. */
static void mla_pv(float *o, float corr, const float *p, const float *v, int n, int D, int R) {
    int d = 0;
    for (; d + 64 <= R; d += 64) {
        v16 a0 = load16(o + d) * corr, a1 = load16(o + d + 16) * corr;
        v16 a2 = load16(o + d + 32) * corr, a3 = load16(o + d + 48) * corr;
        for (int j = 0; j < n; j++) {
            const float *vj = v + (int64_t)j * D + d;
            const float pj = p[j];
            a0 += pj * load16(vj);
            a1 += pj * load16(vj + 16);
            a2 += pj * load16(vj + 32);
            a3 += pj * load16(vj + 48);
        }
        store16(o + d, a0), store16(o + d + 16, a1), store16(o + d + 32, a2), store16(o + d + 48, a3);
    }
    for (; d + 16 <= R; d += 16) {
        v16 a = load16(o + d) * corr;
        for (int j = 0; j < n; j++) a += p[j] * load16(v + (int64_t)j * D + d);
        store16(o + d, a);
    }
    for (; d < R; d++) {
        float a = o[d] * corr;
        for (int j = 0; j < n; j++) a += p[j] * v[(int64_t)j * D + d];
        o[d] = a;
    }
}

/* Eight heads at once (a register tile: each latent load feeds eight heads' FMA chains, sixteen
 * independent chains in all, enough to hide the FMA latency; measured 1.2x over four on Zen 4). */
#define MLA_HB 8
/* keys per slice: 8 latents of DeepSeek (18 KiB in float32) stay in L1 next to the heads' queries */
#define MLA_SUB 8

/* s[h][j] = scale * q[h] . k[j] for the MLA_HB heads h and j < n (s rows `stride` apart), two keys at a time */
static void mla_scores4(const float *const *q, const float *k, int n, int D, float scale, float *s, int stride) {
    const int D16 = D & ~15;
    for (int j = 0; j < n; j += 2) {
        const float *k0 = k + (int64_t)j * D, *k1 = j + 1 < n ? k0 + D : k0; /* odd n: key j twice, stored once */
        v16 a[MLA_HB][2] = {{{0}}};
        for (int d = 0; d < D16; d += 16) {
            const v16 x0 = load16(k0 + d), x1 = load16(k1 + d);
            for (int h = 0; h < MLA_HB; h++) {
                const v16 qv = load16(q[h] + d);
                a[h][0] += qv * x0;
                a[h][1] += qv * x1;
            }
        }
        for (int h = 0; h < MLA_HB; h++) {
            float t0 = mla_hsum(a[h][0]), t1 = mla_hsum(a[h][1]);
            for (int d = D16; d < D; d++) {
                t0 += q[h][d] * k0[d];
                t1 += q[h][d] * k1[d];
            }
            s[h * stride + j] = scale * t0;
            if (j + 1 < n) s[h * stride + j + 1] = scale * t1;
        }
    }
}

/* o[h] = o[h] * corr[h] + sum_j p[h][j] v[j] for the MLA_HB heads (p rows `stride` apart), over the
 * first R columns of the v rows (D apart), 32 columns of the MLA_HB heads in registers at a time */
static void mla_pv4(float *const *o, const float *corr, const float *p, int stride, const float *v, int n, int D,
                    int R) {
    int d = 0;
    for (; d + 32 <= R; d += 32) {
        v16 a[MLA_HB][2];
        for (int h = 0; h < MLA_HB; h++) {
            a[h][0] = load16(o[h] + d) * corr[h];
            a[h][1] = load16(o[h] + d + 16) * corr[h];
        }
        for (int j = 0; j < n; j++) {
            const v16 x0 = load16(v + (int64_t)j * D + d), x1 = load16(v + (int64_t)j * D + d + 16);
            for (int h = 0; h < MLA_HB; h++) {
                const float pj = p[h * stride + j];
                a[h][0] += pj * x0;
                a[h][1] += pj * x1;
            }
        }
        for (int h = 0; h < MLA_HB; h++) {
            store16(o[h] + d, a[h][0]);
            store16(o[h] + d + 16, a[h][1]);
        }
    }
    if (d < R)
        for (int h = 0; h < MLA_HB; h++) mla_pv(o[h] + d, corr[h], p + h * stride, v + d, n, D, R - d);
}

typedef struct {
    int token, req, head0, nheads;
} MlaItem;

/* The keys an item's token sees: causal, up to its own position. */
static inline int mla_item_keys(const MlaItem *it, const int32_t *qsl, const int32_t *seq_lens) {
    const int q_len = qsl[it->req + 1] - qsl[it->req];
    return seq_lens[it->req] - q_len + (it->token - qsl[it->req]) + 1;
}

#if PN_AVX2 && defined(__AVX512F__)
#define MLA_WIDE 1
/* ------------------------------------------------------------------------------------------ */
/* wide items (16 heads or more, AVX-512): the heads are the rows of small GEMMs               */
/* ------------------------------------------------------------------------------------------ */

/* An item's heads all see the same keys (they are one token's), so per chunk of MLA_CHUNK keys the
 * step is two small GEMMs around a softmax, with the heads on the vector lanes:
 *   s^T[key][heads] = latents[key][:] . q^T[:][heads]   a broadcast latent element times 16 heads'
 *                                                        q at once: no horizontal sums
 *   softmax down the keys, 16 heads per vector            one update per 64 keys, not per 8
 *   o[heads][:rank] += p^T[key][heads] * c_kv[key][:]     8 heads x 32 columns in registers
 * The latent rows are read from the pool (widened once per chunk for a narrow cache) and stay in
 * L2 for both GEMMs. Heads past the item's are padded to a multiple of 16 (zero queries, their
 * output rows written to a dummy row). */
#define MLA_CHUNK 64 /* keys per softmax update (the generic kernel's CHUNK_KEYS) */
#define MLA_KB 8     /* keys per score block: eight independent FMA chains */

typedef struct {
    float *qt;    /* [D][hp] the scaled queries, transposed; padding heads 0 */
    float *st;    /* [MLA_CHUNK][hp] scores, then probabilities */
    float *lat;   /* [MLA_CHUNK][D] a chunk's latents widened to float32 (narrow caches) */
    float *m, *l; /* [hp] running max and sum */
    float *dummy; /* [rank] where padding heads' output goes */
    float **o;    /* [hp] output rows */
    const float *rows[MLA_CHUNK];
} MlaWide;

static int mla_round16(int n) { return (n + 15) & ~15; }

/* st[j][16 v .. 16 v + 16) for keys j0 .. j0 + MLA_KB (pointers clamped to the last key: the extra
 * scores land in rows past n, never read) */
static void mla_wide_scores(MlaWide *W, int n, int D, int hp) {
    for (int v = 0; v < hp / 16; v++)
        for (int j0 = 0; j0 < n; j0 += MLA_KB) {
            const float *k[MLA_KB];
            __m512 a[MLA_KB];
            for (int t = 0; t < MLA_KB; t++) {
                k[t] = W->rows[mla_imin(j0 + t, n - 1)];
                a[t] = _mm512_setzero_ps();
            }
            const float *q = W->qt + 16 * v;
            for (int d = 0; d < D; d++) {
                const __m512 qv = _mm512_loadu_ps(q + (int64_t)d * hp);
                for (int t = 0; t < MLA_KB; t++) a[t] = _mm512_fmadd_ps(_mm512_set1_ps(k[t][d]), qv, a[t]);
            }
            for (int t = 0; t < MLA_KB && j0 + t < n; t++) _mm512_storeu_ps(W->st + (int64_t)(j0 + t) * hp + 16 * v, a[t]);
        }
}

/* Online-softmax update of 16 heads (vector v) over the chunk's n keys (every one visible): st
 * becomes p, m and l advance, and the heads' output rows are rescaled where the max moved. */
static void mla_wide_softmax(MlaWide *W, int v, int n, int hp, int rank) {
    float *st = W->st + 16 * v;
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int j = 0; j < n; j++) mx = _mm512_max_ps(mx, _mm512_loadu_ps(st + (int64_t)j * hp));
    const __m512 m_old = _mm512_loadu_ps(W->m + 16 * v), m_new = _mm512_max_ps(m_old, mx);
    __m512 sum = _mm512_setzero_ps();
    for (int j = 0; j < n; j++) {
        const __m512 p = pn_exp512(_mm512_sub_ps(_mm512_loadu_ps(st + (int64_t)j * hp), m_new));
        _mm512_storeu_ps(st + (int64_t)j * hp, p);
        sum = _mm512_add_ps(sum, p);
    }
    /* the first chunk: m_old = -inf, corr 0 (pn_exp512 clamps at -87), on rows still 0 */
    const __m512 corr = pn_exp512(_mm512_sub_ps(m_old, m_new));
    _mm512_storeu_ps(W->l + 16 * v, _mm512_fmadd_ps(_mm512_loadu_ps(W->l + 16 * v), corr, sum));
    _mm512_storeu_ps(W->m + 16 * v, m_new);
    float c[16];
    _mm512_storeu_ps(c, corr);
    for (int i = 0; i < 16; i++)
        if (c[i] != 1.0f)
            for (int d = 0; d < rank; d++) W->o[16 * v + i][d] *= c[i];
}

/* o[h0 .. h0 + 8) += sum_j p[j][h] c_kv[j] over 32 columns from d (mask: the columns that exist) */
static inline __attribute__((always_inline)) void mla_wide_pv_cols(MlaWide *W, int h0, int d, int n, int hp,
                                                                   __mmask16 m0, __mmask16 m1) {
    __m512 a[8][2];
    for (int i = 0; i < 8; i++) {
        a[i][0] = _mm512_maskz_loadu_ps(m0, W->o[h0 + i] + d);
        a[i][1] = _mm512_maskz_loadu_ps(m1, W->o[h0 + i] + d + 16);
    }
    for (int j = 0; j < n; j++) {
        const __m512 x0 = _mm512_maskz_loadu_ps(m0, W->rows[j] + d), x1 = _mm512_maskz_loadu_ps(m1, W->rows[j] + d + 16);
        const float *p = W->st + (int64_t)j * hp + h0;
        for (int i = 0; i < 8; i++) {
            const __m512 pb = _mm512_set1_ps(p[i]);
            a[i][0] = _mm512_fmadd_ps(pb, x0, a[i][0]);
            a[i][1] = _mm512_fmadd_ps(pb, x1, a[i][1]);
        }
    }
    for (int i = 0; i < 8; i++) {
        _mm512_mask_storeu_ps(W->o[h0 + i] + d, m0, a[i][0]);
        _mm512_mask_storeu_ps(W->o[h0 + i] + d + 16, m1, a[i][1]);
    }
}

static void mla_wide_pv(MlaWide *W, int n, int hp, int rank) {
    for (int h0 = 0; h0 < hp; h0 += 8) {
        int d = 0;
        for (; d + 32 <= rank; d += 32) mla_wide_pv_cols(W, h0, d, n, hp, 0xffff, 0xffff);
        if (d < rank) {
            const int r = rank - d;
            mla_wide_pv_cols(W, h0, d, n, hp, r >= 16 ? 0xffff : (__mmask16)((1u << r) - 1),
                             r > 16 ? (__mmask16)((1u << (r - 16)) - 1) : 0);
        }
    }
}

/* One item on the wide path (see above); its heads' output rows are out's. */
static void mla_run_item_wide(const MlaItem *it, const float *query, float *out, const void *cache,
                              const int32_t *btab, int keys, int rank, int rope, int block_size,
                              int64_t q_stride_tok, int64_t q_stride_head, int64_t o_stride_tok,
                              int64_t o_stride_head, float scale, int dtype, MlaWide *W) {
    const int D = rank + rope, hp = mla_round16(it->nheads);
    const size_t esize = dtype == PN_DTYPE_F32 ? 4 : dtype >= PN_DTYPE_FP8_E4M3 ? 1 : 2;
    for (int h = 0; h < hp; h++) {
        const float *q = h < it->nheads ? query + it->token * q_stride_tok + (int64_t)(it->head0 + h) * q_stride_head
                                        : NULL;
        for (int d = 0; d < D; d++) W->qt[(int64_t)d * hp + h] = q ? scale * q[d] : 0.0f;
        W->o[h] = h < it->nheads ? out + it->token * o_stride_tok + (int64_t)(it->head0 + h) * o_stride_head
                                 : W->dummy;
        memset(W->o[h], 0, sizeof(float) * rank);
        W->m[h] = -INFINITY;
        W->l[h] = 0.0f;
    }
    const int chunk = MLA_CHUNK; /* whole blocks, or part of one of more than MLA_CHUNK keys */
    for (int c0 = 0; c0 < keys; c0 += chunk) {
        const int n = mla_imin(chunk, keys - c0);
        for (int j = 0; j < n;) { /* the chunk's rows, block by block */
            const int b = (c0 + j) / block_size, t = (c0 + j) % block_size, run = mla_imin(block_size - t, n - j);
            const char *src = (const char *)cache + ((int64_t)btab[b] * block_size + t) * D * esize;
            const float *rows = (const float *)src;
            if (dtype != PN_DTYPE_F32) {
                mla_widen(src, W->lat + (int64_t)j * D, (int64_t)run * D, dtype);
                rows = W->lat + (int64_t)j * D;
            }
            for (int i = 0; i < run; i++) W->rows[j + i] = rows + (int64_t)i * D;
            j += run;
        }
        for (int b = (c0 + n) / block_size; b * block_size < mla_imin(keys, c0 + n + chunk); b++) {
            /* the next chunk's blocks into L2 while this one is used (scattered: no hardware prefetch) */
            const char *next = (const char *)cache + (int64_t)btab[b] * block_size * D * esize;
            for (int64_t i = 0; i < (int64_t)block_size * D * (int64_t)esize; i += 64) __builtin_prefetch(next + i, 0, 2);
        }
        mla_wide_scores(W, n, D, hp);
        for (int v = 0; v < hp / 16; v++) mla_wide_softmax(W, v, n, hp, rank);
        mla_wide_pv(W, n, hp, rank);
    }
    for (int h = 0; h < it->nheads; h++) {
        const float inv = 1.0f / W->l[h]; /* every token sees at least itself: l >= 1 */
        for (int d = 0; d < rank; d++) W->o[h][d] *= inv;
    }
}

/* The wide path's scratch for items of up to `heads` heads; NULL when out of memory. */
static MlaWide *mla_wide_alloc(int heads, int D, int rank) {
    const int hp = mla_round16(heads);
    MlaWide *W = (MlaWide *)calloc(1, sizeof(MlaWide));
    if (!W) return NULL;
    W->qt = (float *)malloc(sizeof(float) * (size_t)D * hp);
    W->st = (float *)malloc(sizeof(float) * (size_t)MLA_CHUNK * hp);
    W->lat = (float *)malloc(sizeof(float) * (size_t)MLA_CHUNK * D);
    W->m = (float *)malloc(sizeof(float) * (size_t)hp);
    W->l = (float *)malloc(sizeof(float) * (size_t)hp);
    W->dummy = (float *)malloc(sizeof(float) * (size_t)rank);
    W->o = (float **)malloc(sizeof(float *) * (size_t)hp);
    if (!W->qt || !W->st || !W->lat || !W->m || !W->l || !W->dummy || !W->o) {
        free(W->qt), free(W->st), free(W->lat), free(W->m), free(W->l), free(W->dummy), free(W->o), free(W);
        return NULL;
    }
    return W;
}

static void mla_wide_free(MlaWide *W) {
    if (W) free(W->qt), free(W->st), free(W->lat), free(W->m), free(W->l), free(W->dummy), free(W->o), free(W);
}
#else
#define MLA_WIDE 0
#endif

/* One block's step of a head's online softmax: s (n scores) becomes exp(s - new max), the running
 * max *m and sum *l advance; returns the factor the head's accumulator is rescaled by. */
static float mla_softmax_step(float *s, int n, float *m, float *l) {
    float m_new = *m;
    for (int j = 0; j < n; j++) m_new = s[j] > m_new ? s[j] : m_new;
    const float corr = expf(*m - m_new); /* m = -inf on the first block: 0, the accumulator is 0 anyway */
    *l = *l * corr + mla_exp_shift(s, n, m_new);
    *m = m_new;
    return corr;
}

/* One item: its heads' online softmax over the token's visible keys, block by block; each block's
 * latents (widened once into lat when the cache is not float32) serve every head of the item. */
static void mla_run_item(const MlaItem *it, const float *query, float *out, const void *cache,
                         const int32_t *block_tables, const int32_t *qsl, const int32_t *seq_lens, int64_t bt_stride,
                         int rank, int rope, int block_size, int64_t q_stride_tok, int64_t q_stride_head,
                         int64_t o_stride_tok, int64_t o_stride_head, float scale, int dtype, float *lat,
                         float *m, float *l) {
    const int D = rank + rope, keys = mla_item_keys(it, qsl, seq_lens);
    const int32_t *btab = block_tables + (int64_t)it->req * bt_stride;
    const size_t esize = dtype == PN_DTYPE_F32 ? 4 : dtype >= PN_DTYPE_FP8_E4M3 ? 1 : 2;
    for (int h = 0; h < it->nheads; h++) {
        m[h] = -INFINITY;
        l[h] = 0.0f;
        memset(out + it->token * o_stride_tok + (int64_t)(it->head0 + h) * o_stride_head, 0, sizeof(float) * rank);
    }
    for (int b = 0; b * block_size < keys; b++) {
        const int n = mla_imin(block_size, keys - b * block_size);
        const char *blk = (const char *)cache + (int64_t)btab[b] * block_size * D * esize;
        const float *rows = (const float *)blk;
        if ((b + 1) * block_size < keys) { /* the next block into L2 while this one is used: the pool's
                                            * blocks are scattered, so no hardware prefetcher finds it */
            const char *next = (const char *)cache + (int64_t)btab[b + 1] * block_size * D * esize;
            const int64_t bytes = (int64_t)mla_imin(block_size, keys - (b + 1) * block_size) * D * esize;
            for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(next + i, 0, 2);
        }
        if (dtype != PN_DTYPE_F32) { /* a block's rows are contiguous: widened in one pass */
            mla_widen(blk, lat, (int64_t)n * D, dtype);
            rows = lat;
        }
        for (int k0 = 0; k0 < n; k0 += MLA_SUB) { /* keys in L1-sized slices: all heads over one, then the next */
            const int nk = mla_imin(MLA_SUB, n - k0);
            const float *keys_k = rows + (int64_t)k0 * D;
            int h = 0;
            for (; h + MLA_HB <= it->nheads; h += MLA_HB) {
                const float *q[MLA_HB];
                float *o[MLA_HB], corr[MLA_HB], s[MLA_HB * MLA_SUB];
                for (int i = 0; i < MLA_HB; i++) {
                    q[i] = query + it->token * q_stride_tok + (int64_t)(it->head0 + h + i) * q_stride_head;
                    o[i] = out + it->token * o_stride_tok + (int64_t)(it->head0 + h + i) * o_stride_head;
                }
                mla_scores4(q, keys_k, nk, D, scale, s, MLA_SUB);
                for (int i = 0; i < MLA_HB; i++) corr[i] = mla_softmax_step(s + i * MLA_SUB, nk, &m[h + i], &l[h + i]);
                mla_pv4(o, corr, s, MLA_SUB, keys_k, nk, D, rank);
            }
            for (; h < it->nheads; h++) { /* the heads past a multiple of MLA_HB, one at a time */
                const int head = it->head0 + h;
                const float *q = query + it->token * q_stride_tok + (int64_t)head * q_stride_head;
                float *o = out + it->token * o_stride_tok + (int64_t)head * o_stride_head;
                float s[MLA_SUB];
                mla_scores(q, keys_k, nk, D, scale, s);
                mla_pv(o, mla_softmax_step(s, nk, &m[h], &l[h]), s, keys_k, nk, D, rank);
            }
        }
    }
    for (int h = 0; h < it->nheads; h++) {
        float *o = out + it->token * o_stride_tok + (int64_t)(it->head0 + h) * o_stride_head;
        const float inv = 1.0f / l[h]; /* every token sees at least itself: l >= 1 */
        for (int d = 0; d < rank; d++) o[d] *= inv;
    }
}

/* Checks that every block a request reads is in the table and the pool, and the lengths agree. */
static int mla_check_metadata(const int32_t *block_tables, const int32_t *qsl, const int32_t *seq_lens,
                              int num_reqs, int64_t num_tokens, int64_t num_blocks, int max_blocks,
                              int64_t bt_stride, int block_size) {
    if (qsl[0] != 0 || qsl[num_reqs] != num_tokens) return PN_ERR_META;
    for (int r = 0; r < num_reqs; r++) {
        const int q_len = qsl[r + 1] - qsl[r], seq_len = seq_lens[r];
        if (q_len < 0 || seq_len < q_len || (int64_t)seq_len > (int64_t)max_blocks * block_size) return PN_ERR_META;
        for (int b = 0; b * block_size < seq_len; b++) {
            const int32_t id = block_tables[(int64_t)r * bt_stride + b];
            if (id < 0 || id >= num_blocks) return PN_ERR_META;
        }
    }
    return PN_OK;
}

int mla_latent_attention(const float *query, float *out, const void *latent_cache, const int32_t *block_tables,
                         const int32_t *query_start_loc, const int32_t *seq_lens, int num_reqs, int64_t num_tokens,
                         int64_t num_blocks, int max_blocks, int64_t bt_stride, int num_heads, int kv_lora_rank,
                         int rope_dim, int block_size, int64_t q_stride_tok, int64_t q_stride_head,
                         int64_t o_stride_tok, int64_t o_stride_head, float scale, int dtype, int num_threads) {
    if (num_reqs < 0 || num_heads <= 0 || kv_lora_rank <= 0 || rope_dim < 0 || block_size <= 0 ||
        block_size > 1024 || dtype < 0 || dtype > PN_DTYPE_FP8_E5M2 || num_threads <= 0)
        return PN_ERR_ARG;
    const int st = mla_check_metadata(block_tables, query_start_loc, seq_lens, num_reqs, num_tokens, num_blocks,
                                      max_blocks, bt_stride, block_size);
    if (st != PN_OK) return st;
    /* heads per item: all of them, unless there are fewer tokens than threads */
    int groups = num_tokens >= num_threads ? 1 : (int)((num_threads + num_tokens - 1) / (num_tokens ? num_tokens : 1));
    groups = mla_imin(groups, num_heads);
    const int per = (num_heads + groups - 1) / groups;
    groups = (num_heads + per - 1) / per;
    const int64_t n_items = num_tokens * groups;
    MlaItem *items = (MlaItem *)malloc(sizeof(MlaItem) * (size_t)(n_items ? n_items : 1));
    if (!items) return PN_ERR_NOMEM;
    for (int r = 0; r < num_reqs; r++)
        for (int t = query_start_loc[r]; t < query_start_loc[r + 1]; t++)
            for (int g = 0; g < groups; g++)
                items[(int64_t)t * groups + g] = (MlaItem){t, r, g * per, mla_imin(per, num_heads - g * per)};
    const int D = kv_lora_rank + rope_dim;
    const int nt = (int)(n_items < num_threads ? (n_items ? n_items : 1) : num_threads);
    int status = PN_OK;
#pragma omp parallel num_threads(nt)
    {
        float *lat = (float *)malloc(sizeof(float) * (size_t)block_size * D);
        float *m = (float *)malloc(sizeof(float) * (size_t)per), *l = (float *)malloc(sizeof(float) * (size_t)per);
#if MLA_WIDE
        MlaWide *W = per >= 16 ? mla_wide_alloc(per, D, kv_lora_rank) : NULL;
        const int ok = lat && m && l && (per < 16 || W);
#else
        const int ok = lat && m && l;
#endif
        if (!ok) {
#pragma omp atomic write
            status = PN_ERR_NOMEM;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < n_items; i++) {
            if (!ok) continue;
            const MlaItem *it = &items[i];
#if MLA_WIDE
            if (it->nheads >= 16) {
                const int keys = mla_item_keys(it, query_start_loc, seq_lens);
                mla_run_item_wide(it, query, out, latent_cache, block_tables + (int64_t)it->req * bt_stride, keys,
                                  kv_lora_rank, rope_dim, block_size, q_stride_tok, q_stride_head, o_stride_tok,
                                  o_stride_head, scale, dtype, W);
                continue;
            }
#endif
            mla_run_item(it, query, out, latent_cache, block_tables, query_start_loc, seq_lens, bt_stride,
                         kv_lora_rank, rope_dim, block_size, q_stride_tok, q_stride_head, o_stride_tok,
                         o_stride_head, scale, dtype, lat, m, l);
        }
#if MLA_WIDE
        mla_wide_free(W);
#endif
        free(lat);
        free(m);
        free(l);
    }
    free(items);
    return status;
}

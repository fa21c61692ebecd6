/* The whole Llama-family decoder stack for small float32 CPU batches, in one call.
 *
 * Why: at decode batch sizes (a few tokens) every layer's matmuls are matrix-vector products
 * bound by reading the weights, which MKL already does at memory bandwidth. What is left is the
 * ~25 torch ops and C calls per layer that each cost microseconds of Python and dispatch: at
 * batch 1 on a 34M model that is ~1.7 ms of a ~9 ms step. This file runs embedding lookup, every
 * layer (RMSNorm, QKV projection + bias, per-head q/k RMSNorm, rotary, KV write, paged
 * attention, output projection, residual adds, gate/up projection fused with SiLU * up, down
 * projection) and the final norm without returning to Python. The LM head stays in torch.
 *
 * Matrix products: y[t, o] = sum_i x[t, i] * W[o, i] with W [out, in] row-major (torch's
 * Linear layout). Threads split the output rows; each work unit reads 4 weight rows once from
 * memory and applies them to all T tokens while they sit in L1, so the weights are streamed
 * once per step whatever T is (register tiles of 4 rows x 6 tokens on 16 lanes in AVX-512
 * builds, 4 x 3 on 8 lanes with AVX2); one float32 token in AVX-512 builds instead reads two
 * sequential row streams per thread (matvec_two_streams). From LdModel.panel_min tokens,
 * projections with a panel copy (LdModel.qkv_p ...) run on dense_gemm.c's or quant_gemm.c's
 * GEMM instead, which lets the decoder take decode batches of up to LD_PANEL_MAX_TOKENS.
 *
 * Attention and the KV write are the paged-attention kernel's own functions (same library,
 * declared in pagedllm_native.h with the structs LdModel and LdBatch).
 *
 * LoRA: a projection with adapter slots (LdModel.qkv_la ...) adds the step's adapters to its
 * output right after its base matmul, as the module path's LinearBase.forward does: lora_sgmv.c
 * over the tokens grouped by slot (LdBatch.lora_*), once per projection for every adapter of the
 * batch. A step without adapter tokens never calls it.
 *
 * bfloat16 models (LdModel.bf16): the projections run on bf16_linear.c's kernel and the
 * embedding rows are widened, but every activation (residual stream, norms, q/k/v, attention,
 * MLP) stays float32; only K/V are rounded to bfloat16 when the cache is bfloat16, as the module
 * path rounds them. See models/cpu_decode.py for why float32 and not bfloat16 activations.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pagedllm_native.h"

static inline float silu(float g) { return g / (1.0f + expf(-g)); }

/* One 8-wide chunk of weight row `row` from element i, as float32: float32 weights are loaded,
 * int8 weights (weight-only quantization, layers/quantization.py) are widened; the per-row
 * scale is applied once to the finished dot product. I8 is a literal at every call site. */
#if PN_AVX2
static inline __attribute__((always_inline)) __m256 load_w8(const void *row, int64_t i, const int I8) {
    if (I8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)row + i))));
    return _mm256_loadu_ps((const float *)row + i);
}
#endif

static inline __attribute__((always_inline)) float load_w1(const void *row, int64_t i, const int I8) {
    return I8 ? (float)((const int8_t *)row)[i] : ((const float *)row)[i];
}

/* Register tile: dots[t][k] = W_k . x_t for 4 weight rows and NT <= 3 tokens (12 independent
 * FMA chains; each 8-wide weight chunk is loaded once for all NT tokens). Missing rows repeat
 * a valid one and their results are ignored. NT and I8 are literals at every call site, so the
 * compiler specialises the loops. */
static inline __attribute__((always_inline)) void tile4(const void *const *w, const float *x,
                                                        int64_t x_stride, int64_t n, const int NT,
                                                        const int I8, float dots[3][4]) {
    int64_t i = 0;
#if PN_AVX2
    __m256 acc[3][4];
    for (int t = 0; t < NT; t++)
        for (int k = 0; k < 4; k++) acc[t][k] = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        __m256 xv[3];
        for (int t = 0; t < NT; t++) xv[t] = _mm256_loadu_ps(x + t * x_stride + i);
        for (int k = 0; k < 4; k++) {
            const __m256 wv = load_w8(w[k], i, I8);
            for (int t = 0; t < NT; t++) acc[t][k] = _mm256_fmadd_ps(wv, xv[t], acc[t][k]);
        }
    }
    for (int t = 0; t < NT; t++)
        for (int k = 0; k < 4; k++) dots[t][k] = pn_hsum256(acc[t][k]);
#else
    for (int t = 0; t < NT; t++)
        for (int k = 0; k < 4; k++) dots[t][k] = 0.0f;
#endif
    for (; i < n; i++)
        for (int t = 0; t < NT; t++)
            for (int k = 0; k < 4; k++) dots[t][k] += load_w1(w[k], i, I8) * x[t * x_stride + i];
}

#if defined(__AVX512F__)
/* tile4 on 16 lanes for NT <= 6 tokens (AVX-512 builds take it wherever the tile runs): 24
 * accumulators, 4 weight vectors and one x vector of the 32 zmm registers; per 16 inputs 10
 * loads feed 24 FMAs (tile4: 7 loads for 12 FMAs of 8 lanes), and a 16-token step reads each
 * unit's weight rows from L1 3 times instead of 6. Decode steps alternated with tile4 in one
 * engine (benchmarks/RESULTS.md): 3-6% faster at batch 1, 4-9% at 16 tokens (34M / 200M). */
static inline __attribute__((always_inline)) void tile4_512(const void *const *w, const float *x,
                                                            int64_t x_stride, int64_t n, const int NT,
                                                            const int I8, float dots[6][4]) {
    __m512 acc[6][4];
    for (int t = 0; t < NT; t++)
        for (int k = 0; k < 4; k++) acc[t][k] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 wv[4];
        for (int k = 0; k < 4; k++)
            wv[k] = I8 ? _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)w[k] + i))))
                       : _mm512_loadu_ps((const float *)w[k] + i);
        for (int t = 0; t < NT; t++) {
            const __m512 xv = _mm512_loadu_ps(x + t * x_stride + i);
            for (int k = 0; k < 4; k++) acc[t][k] = _mm512_fmadd_ps(wv[k], xv, acc[t][k]);
        }
    }
    for (int t = 0; t < NT; t++)
        for (int k = 0; k < 4; k++) dots[t][k] = _mm512_reduce_add_ps(acc[t][k]);
    for (; i < n; i++)
        for (int t = 0; t < NT; t++)
            for (int k = 0; k < 4; k++) dots[t][k] += load_w1(w[k], i, I8) * x[t * x_stride + i];
}
#endif

/* dots[t][k] = rows[k] . x[t] for all T tokens (x rows of length n, contiguous), rows[0..3]
 * float32, or int8 when i8 (unscaled). */
static void dot_rows(const void *const *rows, int i8, const float *x, int64_t T, int64_t n, float (*dots)[4]) {
    int64_t t = 0;
#if defined(__AVX512F__)
#define TILE(NT, I8) tile4_512(rows, x + t * n, n, n, NT, I8, dots + t)
#define TILES(I8)                                                                                               \
    do {                                                                                                        \
        for (; t + 6 <= T; t += 6) TILE(6, I8);                                                                 \
        switch (T - t) {                                                                                        \
        case 5: TILE(5, I8); break;                                                                             \
        case 4: TILE(4, I8); break;                                                                             \
        case 3: TILE(3, I8); break;                                                                             \
        case 2: TILE(2, I8); break;                                                                             \
        case 1: TILE(1, I8); break;                                                                             \
        }                                                                                                       \
    } while (0)
#else
#define TILE(NT, I8) tile4(rows, x + t * n, n, n, NT, I8, dots + t)
#define TILES(I8)                                         \
    do {                                                  \
        for (; t + 3 <= T; t += 3) TILE(3, I8);           \
        if (T - t == 2) TILE(2, I8);                      \
        if (T - t == 1) TILE(1, I8);                      \
    } while (0)
#endif
    if (i8)
        TILES(1);
    else
        TILES(0);
#undef TILES
#undef TILE
}

/* matmul's one-token float32 path: AVX-512 builds */
#if defined(__AVX512F__)
#define LD_TWO_STREAMS 1
#else
#define LD_TWO_STREAMS 0
#endif

#if LD_TWO_STREAMS
/* *d0 = a . x and *d1 = b . x over n floats, each row read front to back. */
static inline void dot_two_rows(const float *a, const float *b, const float *x, int64_t n, float *d0, float *d1) {
    __m512 sa[4], sb[4];
    for (int u = 0; u < 4; u++) sa[u] = sb[u] = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 64 <= n; i += 64)
        for (int u = 0; u < 4; u++) { /* 4 chains per row: FMA latency */
            const __m512 xv = _mm512_loadu_ps(x + i + 16 * u);
            sa[u] = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16 * u), xv, sa[u]);
            sb[u] = _mm512_fmadd_ps(_mm512_loadu_ps(b + i + 16 * u), xv, sb[u]);
        }
    float s0 = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(sa[0], sa[1]), _mm512_add_ps(sa[2], sa[3])));
    float s1 = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(sb[0], sb[1]), _mm512_add_ps(sb[2], sb[3])));
    for (; i < n; i++) s0 += a[i] * x[i], s1 += b[i] * x[i];
    *d0 = s0, *d1 = s1;
}

/* y = W x (+ b) for one token and float32 W [out, in], out even: each thread takes a slice of
 * rows and walks its two halves together, a row of each at a time, so it reads two sequential
 * weight streams. tile4_512 reads four rows at a time, four streams a row apart; on a Xeon with
 * AMX (2 cores, DRAM-bound at 1 token) this took the 200M model's batch-1 decode step from
 * 28.19 to 26.54 ms (steps alternated between the two builds in one engine; RESULTS.md), the 34M
 * model's (weights mostly in the L3) within 1%. */
static void matvec_two_streams(const float *x, const float *w, const float *b, int64_t in, int64_t out, float *y,
                               int threads) {
#pragma omp parallel num_threads(threads)
    {
        const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
        const int64_t pairs = out / 2, lo = 2 * (pairs * tid / nth), n = pairs * (tid + 1) / nth - pairs * tid / nth;
        for (int64_t r = 0; r < n; r++) { /* rows lo + r and lo + n + r of this thread's 2n */
            const int64_t ra = lo + r, rb = lo + n + r;
            float da, db;
            dot_two_rows(w + ra * in, w + rb * in, x, in, &da, &db);
            y[ra] = da + (b ? b[ra] : 0.0f);
            y[rb] = db + (b ? b[rb] : 0.0f);
        }
    }
}
#endif

/* A weight matrix [out, in]: float32 (scale NULL), int8 with one float32 scale per row,
 * group-wise 4/8-bit codes (bits != 0; scale and szero per row and group, quant_linear.c), or
 * e4m3 bytes (fp8 != 0, LdModel.fp8_act's modes; scale per row and group, fp8_linear.c), whose
 * rounded activations go to xq (scratch [T, in]). */
typedef struct {
    const void *data;
    const float *scale, *szero;
    int bits, fp8, bf16;
    int64_t group;
    float *xq;
    const void *panels;          /* the panel copy (LdModel.qkv_p ...): float32 or codes, or NULL */
    const float *pscale, *pszero; /* codes' panel scales and scaled zeros */
    int panel_min;               /* the panel GEMM from this many tokens (always past LD_MAX_TOKENS) */
} Weight;

/* A projection with a panel copy runs on the panel GEMM from W.panel_min tokens
 * (LdModel.panel_min: the Python side picks it per host CPU, models/cpu_decode.py). */

static inline int use_panels(Weight W, int64_t T) {
    return W.panels && (T >= W.panel_min || T > LD_MAX_TOKENS);
}

static inline const void *weight_row(Weight W, int64_t row, int64_t in) {
    return (const char *)W.data + row * in * (W.scale ? 1 : (int64_t)sizeof(float));
}

static inline float row_scale(Weight W, int64_t row) { return W.scale ? W.scale[row] : 1.0f; }

/* y[t, o] = x[t] . W[o] (+ b[o]) for t < T; x, y contiguous [T, in] / [T, out]. Returns 0
 * or qg_linear's error code (group-wise codes: bad group size, scratch allocation). */
/* FP8 weights: the format's activation rounding (fp8_act_quant, the same bits as the module
 * path's layers/quantization/fp8.py), then fp8_linear's kernel. */
static int fp8_matmul(const float *x, int64_t T, Weight W, const float *b, int64_t in, int64_t out, float *y,
                      int threads) {
    if (W.fp8 > 1) {
        const int rc = fp8_act_quant(x, T, in, W.fp8 == 3 ? W.group : in, 0.0f, W.xq, threads);
        if (rc != PN_OK) return rc;
        x = W.xq;
    }
    return fp8_linear(x, T, (const uint8_t *)W.data, W.scale, b, in, out, W.group, y, threads);
}

static int matmul(const float *x, int64_t T, Weight W, const float *b, int64_t in, int64_t out,
                  float *y, int threads) {
    if (W.fp8) return fp8_matmul(x, T, W, b, in, out, y, threads);
    if (use_panels(W, T) && W.bits) /* the module path's GEMM for these rows (grouped.py) */
        return qg_gemm(x, T, (const uint8_t *)W.panels, W.pscale, W.pszero, b, in, out, W.group, W.bits, y, threads);
    if (use_panels(W, T)) return dg_gemm(x, T, (const float *)W.panels, b, in, out, y, threads);
    if (T > LD_MAX_TOKENS) return PN_ERR_ARG; /* sizes dots[] below */
    if (W.bf16) return bf16_linear(x, T, (const uint16_t *)W.data, b, in, out, y, threads);
    if (W.bits) /* group sizes were checked when the weights were installed (grouped.py) */
        return qg_linear(x, T, W.data, W.scale, W.szero, b, in, out, W.group, W.bits, y, threads);
    if (W.scale && qg_linear_i8(x, T, W.data, W.scale, b, in, out, y, threads) == PN_OK)
        return PN_OK; /* int8 on the VNNI kernel where it applies, else the tile below */
#if LD_TWO_STREAMS
    if (T == 1 && !W.scale && out % 2 == 0) {
        matvec_two_streams(x, (const float *)W.data, b, in, out, y, threads);
        return PN_OK;
    }
#endif
    const int64_t units = (out + 3) / 4;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t u = 0; u < units; u++) {
        const int64_t o = u * 4;
        const int nr = out - o < 4 ? (int)(out - o) : 4;
        const void *rows[4];
        for (int k = 0; k < 4; k++) rows[k] = weight_row(W, o + (k < nr ? k : 0), in);
        float dots[LD_MAX_TOKENS][4];
        dot_rows(rows, W.scale != NULL, x, T, in, dots);
        for (int64_t t = 0; t < T; t++)
            for (int k = 0; k < nr; k++)
                y[t * out + o + k] = dots[t][k] * row_scale(W, o + k) + (b ? b[o + k] : 0.0f);
    }
    return PN_OK;
}

/* act[t, j] = silu(gate_up[t, j]) * gate_up[t, I + j] with I = inter, gate_up [T, 2I]; vectorised
 * (pn_exp256, ~2 ulp against expf): at 64 tokens x 1536, on one thread, 0.035 ms against 0.206
 * ms for the scalar expf loop it replaces, per layer (best of 200, a scratch C driver). Split over
 * the threads from SILU_PARALLEL_MIN elements (below, waking the team costs more). */
#define SILU_PARALLEL_MIN 32768
static void silu_and_mul(const float *gate_up, int64_t T, int64_t inter, float *act, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (T * inter >= SILU_PARALLEL_MIN)
    for (int64_t t = 0; t < T; t++) {
        const float *g = gate_up + t * 2 * inter, *u = g + inter;
        float *a = act + t * inter;
        int64_t j = 0;
#if PN_AVX2
        for (; j + 8 <= inter; j += 8) {
            const __m256 gv = _mm256_loadu_ps(g + j);
            /* g / (1 + e^-g), e^-g clamped to pn_exp256's range: past it silu(g) ~ g e^g is ~0 */
            const __m256 e = pn_exp256(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), gv), _mm256_set1_ps(88.0f)));
            const __m256 sg = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
            _mm256_storeu_ps(a + j, _mm256_mul_ps(sg, _mm256_loadu_ps(u + j)));
        }
#endif
        for (; j < inter; j++) a[j] = silu(g[j]) * u[j];
    }
}

/* gate_up [T, 2I] = x . W^T + b with I = inter (gate then up): the caller adds the adapters, then
 * silu_and_mul. On float32 tile4 the gate and up rows of one j are computed by the same unit
 * (their x rows stay in L1 for both). */
static int gate_up_matmul(const float *x, int64_t T, Weight W, const float *b, int64_t in,
                          int64_t inter, float *gate_up, int threads) {
    if (W.bits || W.scale || W.bf16 || use_panels(W, T) || (LD_TWO_STREAMS && T == 1)) /* matmul's kernels */
        return matmul(x, T, W, b, in, 2 * inter, gate_up, threads);
    const int64_t units = (inter + 1) / 2;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t u = 0; u < units; u++) {
        const int64_t j = u * 2;
        const int nj = inter - j < 2 ? 1 : 2;
        const void *rows[4]; /* gate j, gate j+1, up j, up j+1 */
        for (int k = 0; k < 2; k++) {
            const int64_t jk = j + (k < nj ? k : 0);
            rows[k] = weight_row(W, jk, in);
            rows[2 + k] = weight_row(W, inter + jk, in);
        }
        float dots[LD_MAX_TOKENS][4];
        dot_rows(rows, W.scale != NULL, x, T, in, dots);
        for (int64_t t = 0; t < T; t++)
            for (int k = 0; k < nj; k++) {
                const float g = dots[t][k] * row_scale(W, j + k) + (b ? b[j + k] : 0.0f);
                gate_up[t * 2 * inter + j + k] = g;
                gate_up[t * 2 * inter + inter + j + k] = dots[t][2 + k] * row_scale(W, inter + j + k) +
                                                         (b ? b[inter + j + k] : 0.0f);
            }
    }
    return PN_OK;
}

/* out [rows, in] float32 = q [rows, in] int8 * scale[row]: one pass, for batches big enough
 * that MKL's GEMM on the widened weight beats the register-tile kernel. */
int ld_dequant_i8(const int8_t *q, const float *scale, float *out, int64_t rows, int64_t in, int threads) {
    if (rows < 0 || in <= 0 || threads <= 0) return PN_ERR_ARG;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; r++) {
        const int8_t *src = q + r * in;
        float *dst = out + r * in;
        const float s = scale[r];
        int64_t i = 0;
#if PN_AVX2
        const __m256 sv = _mm256_set1_ps(s);
        for (; i + 8 <= in; i += 8)
            _mm256_storeu_ps(dst + i, _mm256_mul_ps(load_w8(src, i, 1), sv));
#endif
        for (; i < in; i++) dst[i] = (float)src[i] * s;
    }
    return PN_OK;
}

/* The small-batch matmul on its own, for linear layers outside the one-call decoder (int8
 * weights at batch sizes where dequantizing for MKL would cost more than it saves):
 * y [T, out] = x [T, in] . W^T (+ bias), W float32 (scale NULL) or int8 with per-row scales. */
int ld_linear(const float *x, int64_t T, const void *w, const float *scale, const float *bias, int64_t in,
              int64_t out, float *y, int threads) {
    if (T <= 0 || T > LD_MAX_TOKENS || in <= 0 || out <= 0 || threads <= 0) return PN_ERR_ARG;
    return matmul(x, T, (Weight){w, scale, NULL, 0, 0, 0, 0, NULL}, bias, in, out, y, threads);
}

int ld_silu_and_mul(const float *gate_up, int64_t T, int64_t inter, float *act, int threads) {
    if (T < 0 || inter <= 0 || threads <= 0) return PN_ERR_ARG;
    silu_and_mul(gate_up, T, inter, act, threads);
    return PN_OK;
}

typedef struct {
    float *residual, *normed, *qkv, *attn, *act, *gate_up, *xq;
    uint16_t *kv16; /* [T, 2 * kv_size]: a step's K and V rounded for a bfloat16 cache */
} Buffers;

/* One projection's arrays of LdModel (layer-indexed). */
typedef struct {
    const void *const *w, *const *p;
    const float *const *s, *const *z, *const *ps, *const *pz, *const *la, *const *lb;
    int64_t group, lora_rank;
} Proj;

#define PROJ(m, name) ((Proj){(m)->name##_w, (m)->name##_p, (m)->name##_s, (m)->name##_z, (m)->name##_ps, \
                              (m)->name##_pz, (m)->name##_la, (m)->name##_lb, (m)->name##_group,      \
                              (m)->name##_lora_rank})

/* Layer l's panel copy of a projection, or NULL where it has none or its kind takes none:
 * float32 (no scale) or group-wise codes with their panel scales and zeros. */
static inline const void *proj_panels(const LdModel *m, Proj P, int l) {
    if (!P.p || !P.p[l] || m->fp8_act || m->bf16) return NULL;
    if (m->quant_bits) return P.ps && P.pz && P.ps[l] && P.pz[l] ? P.p[l] : NULL;
    return P.s[l] ? NULL : P.p[l]; /* own int8 (per-row scales) has none */
}

/* Layer l's weight of one projection. */
static inline Weight proj_weight(const LdModel *m, Proj P, int l, float *xq) {
    const void *panels = proj_panels(m, P, l);
    const int codes = panels && m->quant_bits;
    return (Weight){P.w[l], P.s[l], m->quant_bits ? P.z[l] : NULL, m->quant_bits, m->fp8_act, m->bf16, P.group, xq,
                    panels, codes ? P.ps[l] : NULL, codes ? P.pz[l] : NULL,
                    m->panel_min};
}

/* Every projection of every layer has its panel copy: the decoder may take up to
 * LD_PANEL_MAX_TOKENS tokens (past LD_MAX_TOKENS only the panel GEMMs run). */
static int panels_cover(const LdModel *m) {
    const Proj all[4] = {PROJ(m, qkv), PROJ(m, o), PROJ(m, gate_up), PROJ(m, down)};
    for (int l = 0; l < m->num_layers; l++)
        for (int k = 0; k < 4; k++)
            if (!proj_panels(m, all[k], l)) return 0;
    return 1;
}

/* Layer l's adapters of projection P: y [T, out] += the step's LoRA tokens' (x . A[s]^T) . B[s]^T,
 * x [T, in]; nothing for a step without adapter tokens or a projection without slots. */
static int add_lora(const LdModel *m, const LdBatch *b, Proj P, int l, const float *x, int64_t in, int64_t out,
                    float *y, int threads) {
    if (b->lora_num_segs == 0 || !P.la || !P.la[l]) return PN_OK;
    return lora_sgmv(x, b->num_tokens, in, b->lora_rows, b->lora_seg_slot, b->lora_seg_start, (int)b->lora_num_segs,
                     P.la[l], P.lb[l], m->lora_slots, P.lora_rank, out, y, threads);
}

/* A step with adapter tokens: its segments are valid and every projection with slots has both
 * factors and a rank, checked before anything is written (lora_sgmv checks again per call). */
static int check_lora(const LdModel *m, const LdBatch *b) {
    if (b->lora_num_segs < 0 || b->lora_num_segs > INT32_MAX) return PN_ERR_ARG;
    if (b->lora_num_segs == 0) return PN_OK;
    if (m->lora_slots < 1 || !b->lora_seg_slot || !b->lora_seg_start) return PN_ERR_ARG;
    const Proj all[4] = {PROJ(m, qkv), PROJ(m, o), PROJ(m, gate_up), PROJ(m, down)};
    for (int k = 0; k < 4; k++)
        for (int l = 0; all[k].la && l < m->num_layers; l++)
            if (all[k].la[l] && (!all[k].lb || !all[k].lb[l] || all[k].lora_rank < 1)) return PN_ERR_ARG;
    return lora_check_segments(b->lora_rows, b->lora_seg_slot, b->lora_seg_start, (int)b->lora_num_segs,
                               m->lora_slots, b->num_tokens);
}

static int alloc_buffers(Buffers *B, const LdModel *m, int64_t T) {
    const int64_t qkv = (int64_t)(m->num_heads + 2 * m->num_kv_heads) * m->head_dim;
    B->residual = malloc(sizeof(float) * T * m->hidden);
    B->normed = malloc(sizeof(float) * T * m->hidden);
    B->qkv = malloc(sizeof(float) * T * qkv);
    B->attn = malloc(sizeof(float) * T * m->num_heads * m->head_dim);
    B->act = malloc(sizeof(float) * T * m->intermediate);
    B->gate_up = malloc(sizeof(float) * T * 2 * m->intermediate);
    const int64_t widest = m->intermediate > m->hidden ? m->intermediate : m->hidden; /* a projection's inputs */
    const int64_t xq_in = widest > (int64_t)m->num_heads * m->head_dim ? widest : (int64_t)m->num_heads * m->head_dim;
    B->xq = m->fp8_act > 1 ? malloc(sizeof(float) * T * xq_in) : NULL;
    const int bf16_cache = m->cache_dtype == PN_DTYPE_BF16;
    B->kv16 = bf16_cache ? malloc(sizeof(uint16_t) * T * 2 * m->num_kv_heads * m->head_dim) : NULL;
    return B->residual && B->normed && B->qkv && B->attn && B->act && B->gate_up && (B->xq || m->fp8_act <= 1) &&
           (B->kv16 || !bf16_cache);
}

static void free_buffers(Buffers *B) {
    free(B->residual);
    free(B->normed);
    free(B->qkv);
    free(B->attn);
    free(B->act);
    free(B->gate_up);
    free(B->xq);
    free(B->kv16);
}

/* Writes the step's K and V (rows of the qkv buffer) into layer l's cache; a bfloat16 cache
 * gets them rounded to nearest even, the bits torch's cast gives the module path. */
static int write_kv(const LdModel *m, const LdBatch *b, int l, const float *k, const float *v, int64_t qkv_size,
                    Buffers *B) {
    const int64_t T = b->num_tokens, D = m->head_dim, kv_size = (int64_t)m->num_kv_heads * D;
    if (m->cache_dtype != PN_DTYPE_BF16)
        return pa_write_kv(k, v, m->key_cache[l], m->value_cache[l], b->slot_mapping, T, m->num_blocks,
                           m->num_kv_heads, (int)D, m->block_size, qkv_size, D, qkv_size, D, m->cache_dtype, 1);
    for (int64_t t = 0; t < T; t++) /* [T, 2 * kv_size]: K then V per token */
        for (int64_t j = 0; j < kv_size; j++) {
            B->kv16[t * 2 * kv_size + j] = pn_f32_to_bf16(k[t * qkv_size + j]);
            B->kv16[t * 2 * kv_size + kv_size + j] = pn_f32_to_bf16(v[t * qkv_size + j]);
        }
    return pa_write_kv(B->kv16, B->kv16 + kv_size, m->key_cache[l], m->value_cache[l], b->slot_mapping, T,
                       m->num_blocks, m->num_kv_heads, (int)D, m->block_size, 2 * kv_size, D, 2 * kv_size, D,
                       m->cache_dtype, 1);
}

/* Attention block of layer l: normed -> qkv -> (q/k norm, rotary, KV write, attention) -> attn. */
static int attention_block(const LdModel *m, const LdBatch *b, int l, Buffers *B, int threads) {
    const int64_t T = b->num_tokens, D = m->head_dim;
    const int64_t q_size = m->num_heads * D, kv_size = m->num_kv_heads * D;
    const int64_t qkv_size = q_size + 2 * kv_size;
    int rc = matmul(B->normed, T, proj_weight(m, PROJ(m, qkv), l, B->xq), m->qkv_b[l],
                    m->hidden, qkv_size, B->qkv, threads);
    if (rc == PN_OK) rc = add_lora(m, b, PROJ(m, qkv), l, B->normed, m->hidden, qkv_size, B->qkv, threads);
    if (rc != PN_OK) return rc;
    float *q = B->qkv, *k = B->qkv + q_size, *v = B->qkv + q_size + kv_size;
    for (int64_t t = 0; t < T; t++) {
        if (m->q_norm[l]) pl_add_rms_norm(q + t * qkv_size, NULL, m->q_norm[l], q + t * qkv_size, m->num_heads, D, D, m->eps, 1);
        if (m->k_norm[l]) pl_add_rms_norm(k + t * qkv_size, NULL, m->k_norm[l], k + t * qkv_size, m->num_kv_heads, D, D, m->eps, 1);
    }
    rc = pl_rotary_neox(q, b->positions, m->cos, m->sin, T, m->num_heads, (int)D, qkv_size, D, m->max_position, 1);
    if (rc == 0) rc = pl_rotary_neox(k, b->positions, m->cos, m->sin, T, m->num_kv_heads, (int)D, qkv_size, D, m->max_position, 1);
    if (rc == 0) rc = write_kv(m, b, l, k, v, qkv_size, B);
    if (rc == 0)
        rc = pa_attention(q, B->attn, m->key_cache[l], m->value_cache[l], b->block_tables,
                          b->query_start_loc, b->seq_lens, b->num_reqs, T, m->num_blocks, b->max_blocks,
                          b->bt_stride, m->num_heads, m->num_kv_heads, (int)D, m->block_size, qkv_size, D,
                          q_size, D, m->scale, m->window[l], 0, m->cache_dtype, threads, b->parallel_work, NULL, NULL);
    return rc;
}

/* residual [T, H] = the embedding rows of the step's tokens, as float32. */
static void embed_rows(const LdModel *m, const LdBatch *b, float *residual) {
    const int64_t H = m->hidden;
    for (int64_t t = 0; t < b->num_tokens; t++) {
        if (!m->bf16) {
            memcpy(residual + t * H, (const float *)m->embed + b->input_ids[t] * H, sizeof(float) * H);
            continue;
        }
        const uint16_t *row = (const uint16_t *)m->embed + b->input_ids[t] * H;
        for (int64_t i = 0; i < H; i++) residual[t * H + i] = pn_bf16_to_f32(row[i]);
    }
}

/* Runs the decoder on b->num_tokens tokens and writes the final-normed hidden states
 * [num_tokens, hidden] to out. The KV cache is written in place. Returns 0 or the first
 * negative error code of a step (the kernels validate metadata before writing anything). */
int ld_forward(const LdModel *m, const LdBatch *b, float *out, int threads) {
    const int64_t T = b->num_tokens, H = m->hidden;
    if (T <= 0 || T > LD_PANEL_MAX_TOKENS || threads <= 0) return PN_ERR_ARG;
    if (T > LD_MAX_TOKENS && !panels_cover(m)) return PN_ERR_ARG;
    if (m->quant_bits != 0 && m->quant_bits != 4 && m->quant_bits != 8) return PN_ERR_ARG;
    if (m->fp8_act < 0 || m->fp8_act > 3 || (m->fp8_act && m->quant_bits)) return PN_ERR_ARG;
    if (m->bf16 < 0 || m->bf16 > 1 || (m->bf16 && (m->fp8_act || m->quant_bits))) return PN_ERR_ARG;
    if (m->cache_dtype != PN_DTYPE_F32 && m->cache_dtype != PN_DTYPE_BF16) return PN_ERR_ARG;
    for (int64_t t = 0; t < T; t++)
        if (b->input_ids[t] < 0 || b->input_ids[t] >= m->vocab_size) return PN_ERR_META;
    const int lora_rc = check_lora(m, b);
    if (lora_rc != PN_OK) return lora_rc;
    Buffers B;
    if (!alloc_buffers(&B, m, T)) {
        free_buffers(&B);
        return PN_ERR_NOMEM;
    }
    embed_rows(m, b, B.residual);
    const int64_t q_size = (int64_t)m->num_heads * m->head_dim;
    int rc = 0;
    /* the residual stream lives in B.residual; each norm first adds the block's output to it */
    pl_add_rms_norm(B.residual, NULL, m->input_norm[0], B.normed, T, H, H, m->eps, 1);
    for (int l = 0; l < m->num_layers && rc == 0; l++) {
        const int64_t I = m->intermediate;
        rc = attention_block(m, b, l, &B, threads);
        if (rc == 0)
            rc = matmul(B.attn, T, proj_weight(m, PROJ(m, o), l, B.xq), m->o_b[l], q_size, H,
                        B.normed, threads);
        if (rc == 0) rc = add_lora(m, b, PROJ(m, o), l, B.attn, q_size, H, B.normed, threads);
        if (rc != 0) break;
        pl_add_rms_norm(B.normed, B.residual, m->post_norm[l], B.normed, T, H, H, m->eps, 1);
        rc = gate_up_matmul(B.normed, T, proj_weight(m, PROJ(m, gate_up), l, B.xq), m->gate_up_b[l], H, I,
                            B.gate_up, threads);
        if (rc == 0) rc = add_lora(m, b, PROJ(m, gate_up), l, B.normed, H, 2 * I, B.gate_up, threads);
        if (rc != 0) break;
        silu_and_mul(B.gate_up, T, I, B.act, threads);
        rc = matmul(B.act, T, proj_weight(m, PROJ(m, down), l, B.xq), m->down_b[l], I, H, B.normed, threads);
        if (rc == 0) rc = add_lora(m, b, PROJ(m, down), l, B.act, I, H, B.normed, threads);
        if (rc != 0) break;
        const float *next_norm = l + 1 < m->num_layers ? m->input_norm[l + 1] : m->final_norm;
        pl_add_rms_norm(B.normed, B.residual, next_norm, l + 1 < m->num_layers ? B.normed : out, T, H, H, m->eps, 1);
    }
    free_buffers(&B);
    return rc;
}

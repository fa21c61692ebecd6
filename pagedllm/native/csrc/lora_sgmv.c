/* Batched LoRA over a mixed batch (Punica's SGMV): y[row] += (x[row] . A[s]^T) . B[s]^T for the
 * tokens of each adapter slot s, in one call per projection (layers/lora.py: lora_shrink_expand,
 * whose torch reference lora_shrink_expand_ref this follows name for name).
 *
 * The step's LoRA tokens arrive grouped by slot: segment g holds the tokens seg_start[g] ..
 * seg_start[g + 1] - 1 of the grouping, slot seg_slot[g], and token i is row rows[i] of x and y
 * (rows NULL: token i is row i, one segment covering the whole batch). Base-model tokens are in
 * no segment and are never read or written.
 *
 * Two phases in one parallel region, a barrier between them:
 *   shrink  t [n, R] = x[rows] . A[s]^T   work items (segment, block of LS_RANK_BLOCK ranks): a
 *           thread reads its rows of A once and every token of the segment against them;
 *   expand  y[rows] += t . B[s]^T         work items (segment, block of LS_COL_BLOCK output
 *           columns): items write disjoint parts of y (a row is in one segment), no atomics; an
 *           item dots only over the ranks its columns have non-zero (nonzero_ranks).
 * Both dot products run over a contiguous axis (A [slots, R, in], B [slots, out, R]) and
 * vectorize; t (n x R floats) is the only scratch.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "pagedllm_native.h"

#define LS_RANK_BLOCK 8  /* ranks per shrink item: A rows of 8 x in floats stay in L1/L2 */
#define LS_COL_BLOCK 128 /* output columns per expand item: 128 x R floats of B */
#define LS_SKIP_MIN_TOKENS 16 /* tokens of a segment from which expand skips B's zero ranks */

static inline float dot(const float *u, const float *v, int64_t n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t k = 0; k < n; k++)
        acc += u[k] * v[k];
    return acc;
}

/* PN_ERR_META unless the segments are in order, their slots exist and their rows are in x. */
int lora_check_segments(const int64_t *rows, const int64_t *seg_slot, const int64_t *seg_start, int num_segs,
                        int64_t num_slots, int64_t T) {
    if (seg_start[0] != 0)
        return PN_ERR_META;
    for (int g = 0; g < num_segs; g++)
        if (seg_slot[g] < 0 || seg_slot[g] >= num_slots || seg_start[g + 1] < seg_start[g])
            return PN_ERR_META;
    const int64_t n = seg_start[num_segs];
    if (rows == 0)
        return n == T ? PN_OK : PN_ERR_META;
    for (int64_t i = 0; i < n; i++)
        if (rows[i] < 0 || rows[i] >= T)
            return PN_ERR_META;
    return n <= T ? PN_OK : PN_ERR_META;
}

/* out[j] = m[j * stride ..] . v over n floats, for the 8 rows j of m: 8 independent FMA chains, and
 * their 8 horizontal sums in 10 instructions (pairwise hadd, then the two 128-bit halves) instead
 * of a reduction per dot. Both phases are such dots: shrink's rows are 8 ranks of A (n = in),
 * expand's 8 output columns of B (n = R, 16 to 48, where a reduction per dot cost more than its
 * FMAs). One thread, 64 tokens over 8 adapters, in 512, process time on a loaded 2-core box: the
 * gate_up call (out 3072, R 32) took 1.70 -> 0.57 ms, qkv (1024, R 48) 0.68 -> 0.28 ms, against
 * 2.8 and 0.8 ms for the base projections (oneDNN). */
static inline void dot8(const float *m, int64_t stride, const float *v, int64_t n, float out[8]) {
    int64_t k = 0;
#if PN_AVX2
    __m256 acc[8];
    for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
    for (; k + 8 <= n; k += 8) {
        const __m256 vv = _mm256_loadu_ps(v + k);
        for (int j = 0; j < 8; j++) acc[j] = _mm256_fmadd_ps(_mm256_loadu_ps(m + j * stride + k), vv, acc[j]);
    }
    /* s0123: elements 0-3 of acc 0..3 summed in its low half, 4-7 in its high half; s4567 likewise */
    const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
    const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
    _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                                        _mm256_permute2f128_ps(s0123, s4567, 0x31)));
#else
    for (int j = 0; j < 8; j++) out[j] = 0.0f;
#endif
    for (int j = 0; j < 8; j++)
        for (int64_t kk = k; kk < n; kk++) out[j] += m[j * stride + kk] * v[kk];
}

static void shrink_item(const float *x, int64_t in, const int64_t *rows, int64_t lo, int64_t hi, const float *a,
                        int64_t R, int64_t r0, int64_t r1, float *t) {
    for (int64_t i = lo; i < hi; i++) {
        const float *xr = x + (rows ? rows[i] : i) * in;
        int64_t r = r0;
        if (r1 - r0 == 8) {
            dot8(a + r * in, in, xr, in, t + i * R + r);
            r += 8;
        }
        for (; r < r1; r++)
            t[i * R + r] = dot(xr, a + r * in, in);
    }
}

/* The ranks [*r0, *r1) holding every non-zero entry of columns c0 .. c1 - 1 of b [out, R] (empty:
 * r0 == r1). A fused projection's B is block-diagonal (lora/model.py: each sub-projection's output
 * columns read only its own max_lora_rank ranks), so a column block inside one sub-projection dots
 * over a third of qkv's ranks and half of gate_up's; the terms skipped are exact zeros. The scan reads
 * each column from both ends up to its first non-zero (q's columns: the 32 zero ranks after their
 * 16), once per item: it pays from LS_SKIP_MIN_TOKENS tokens in the segment (decode over many
 * adapters, 2 tokens a segment, ran 1.4x slower with it). */
static void nonzero_ranks(const float *b, int64_t R, int64_t c0, int64_t c1, int64_t *r0, int64_t *r1) {
    int64_t lo = R, hi = 0;
    for (int64_t c = c0; c < c1; c++) {
        const float *col = b + c * R;
        for (int64_t r = 0; r < lo; r++)
            if (col[r] != 0.0f) {
                lo = r;
                break;
            }
        for (int64_t r = R - 1; r >= hi; r--)
            if (col[r] != 0.0f) {
                hi = r + 1;
                break;
            }
    }
    *r0 = lo;
    *r1 = hi > lo ? hi : lo;
}

static void expand_item(const float *t, const int64_t *rows, int64_t lo, int64_t hi, const float *b, int64_t R,
                        int64_t out, int64_t c0, int64_t c1, float *y) {
    int64_t r0 = 0, r1 = R;
    if (hi - lo >= LS_SKIP_MIN_TOKENS)
        nonzero_ranks(b, R, c0, c1, &r0, &r1);
    if (r0 == r1)
        return;
    const int64_t n = r1 - r0;
    for (int64_t i = lo; i < hi; i++) {
        float *yr = y + (rows ? rows[i] : i) * out;
        const float *ti = t + i * R + r0;
        int64_t c = c0;
        for (; c + 8 <= c1; c += 8) {
            float sums[8];
            dot8(b + c * R + r0, R, ti, n, sums);
            for (int j = 0; j < 8; j++) yr[c + j] += sums[j];
        }
        for (; c < c1; c++)
            yr[c] += dot(ti, b + c * R + r0, n);
    }
}

int lora_sgmv(const float *x, int64_t T, int64_t in, const int64_t *rows, const int64_t *seg_slot,
              const int64_t *seg_start, int num_segs, const float *a, const float *b, int64_t num_slots, int64_t R,
              int64_t out, float *y, int threads) {
    if (T < 0 || in < 1 || out < 1 || R < 1 || num_segs < 0 || num_slots < 1)
        return PN_ERR_ARG;
    if (num_segs == 0)
        return PN_OK;
    const int rc = lora_check_segments(rows, seg_slot, seg_start, num_segs, num_slots, T);
    if (rc != PN_OK)
        return rc;
    float *t = malloc(sizeof(float) * (size_t)(seg_start[num_segs] * R > 0 ? seg_start[num_segs] * R : 1));
    if (t == 0)
        return PN_ERR_NOMEM;
    const int64_t rank_blocks = (R + LS_RANK_BLOCK - 1) / LS_RANK_BLOCK;
    const int64_t col_blocks = (out + LS_COL_BLOCK - 1) / LS_COL_BLOCK;
#pragma omp parallel num_threads(threads < 1 ? 1 : threads)
    {
#pragma omp for schedule(static)
        for (int64_t item = 0; item < (int64_t)num_segs * rank_blocks; item++) {
            const int64_t g = item / rank_blocks, r0 = (item % rank_blocks) * LS_RANK_BLOCK;
            shrink_item(x, in, rows, seg_start[g], seg_start[g + 1], a + seg_slot[g] * R * in, R, r0,
                        r0 + LS_RANK_BLOCK < R ? r0 + LS_RANK_BLOCK : R, t);
        } /* the implicit barrier: every t row is complete before any expand reads it */
#pragma omp for schedule(static)
        for (int64_t item = 0; item < (int64_t)num_segs * col_blocks; item++) {
            const int64_t g = item / col_blocks, c0 = (item % col_blocks) * LS_COL_BLOCK;
            expand_item(t, rows, seg_start[g], seg_start[g + 1], b + seg_slot[g] * out * R, R, out, c0,
                        c0 + LS_COL_BLOCK < out ? c0 + LS_COL_BLOCK : out, y);
        }
    }
    free(t);
    return PN_OK;
}

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
 *           columns): items write disjoint parts of y (a row is in one segment), no atomics.
 * Both dot products run over a contiguous axis (A [slots, R, in], B [slots, out, R]) and
 * vectorize; t (n x R floats) is the only scratch.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "pagedllm_native.h"

#define LS_RANK_BLOCK 8  /* ranks per shrink item: A rows of 8 x in floats stay in L1/L2 */
#define LS_COL_BLOCK 128 /* output columns per expand item: 128 x R floats of B */

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

static void shrink_item(const float *x, int64_t in, const int64_t *rows, int64_t lo, int64_t hi, const float *a,
                        int64_t R, int64_t r0, int64_t r1, float *t) {
    for (int64_t r = r0; r < r1; r++)
        for (int64_t i = lo; i < hi; i++)
            t[i * R + r] = dot(x + (rows ? rows[i] : i) * in, a + r * in, in);
}

static void expand_item(const float *t, const int64_t *rows, int64_t lo, int64_t hi, const float *b, int64_t R,
                        int64_t out, int64_t c0, int64_t c1, float *y) {
    for (int64_t i = lo; i < hi; i++) {
        float *yr = y + (rows ? rows[i] : i) * out;
        for (int64_t c = c0; c < c1; c++)
            yr[c] += dot(t + i * R, b + c * R, R);
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

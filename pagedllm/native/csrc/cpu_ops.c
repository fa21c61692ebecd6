/* Small fused CPU ops for the model body, built into the same library as the paged-attention
 * kernel. At decode batch sizes each torch op costs several microseconds of dispatch and
 * thread-team wake-up for almost no arithmetic; these do the whole job in one call and only
 * start OpenMP threads when a call has enough work to pay for them. All math is float32.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "pagedllm_native.h"

#define PARALLEL_MIN_ELEMS (1 << 18) /* below this, one thread is faster than waking a team */

/* residual += x (when residual is not NULL), then
 * out = weight * (r * 1/sqrt(mean(r^2) + eps)) with r the (updated) residual or x.
 * x rows have stride x_stride; residual and out are contiguous [rows, dim]. */
int pl_add_rms_norm(const float *x, float *residual, const float *weight, float *out,
                    int64_t rows, int64_t dim, int64_t x_stride, float eps, int threads) {
    if (rows < 0 || dim <= 0) return PN_ERR_ARG;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * dim >= PARALLEL_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * x_stride;
        float *rr = residual ? residual + r * dim : NULL;
        float *o = out + r * dim;
        float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0}; /* 8 lanes: vectorizes, and sums pairwise-ish */
        int64_t i = 0;
        for (; i + 8 <= dim; i += 8) {
            for (int l = 0; l < 8; l++) {
                float v = xr[i + l];
                if (rr) { v += rr[i + l]; rr[i + l] = v; }
                acc[l] += v * v;
            }
        }
        for (; i < dim; i++) {
            float v = xr[i];
            if (rr) { v += rr[i]; rr[i] = v; }
            acc[0] += v * v;
        }
        float sum = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
        float inv = 1.0f / sqrtf(sum / (float)dim + eps);
        const float *src = rr ? rr : xr;
        for (int64_t j = 0; j < dim; j++) o[j] = weight[j] * (src[j] * inv);
    }
    return PN_OK;
}

/* GPT-NeoX rotary embedding in place: for each token t and head h of x (strides ts, hs; unit
 * stride inside a head), with c/s the cos/sin rows of position pos[t] (each half = head_dim/2):
 *   x1' = x1*c - x2*s,  x2' = x2*c + x1*s   (x1, x2 = the two halves of the head). */
int pl_rotary_neox(float *x, const int64_t *pos, const float *cos_cache, const float *sin_cache,
                   int64_t tokens, int heads, int head_dim, int64_t ts, int64_t hs, int64_t max_pos,
                   int threads) {
    if (head_dim % 2) return PN_ERR_ARG;
    int half = head_dim / 2;
    for (int64_t t = 0; t < tokens; t++)
        if (pos[t] < 0 || pos[t] >= max_pos) return PN_ERR_META;
#pragma omp parallel for num_threads(threads) schedule(static) if (tokens * heads * head_dim >= PARALLEL_MIN_ELEMS)
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos_cache + pos[t] * half;
        const float *s = sin_cache + pos[t] * half;
        for (int h = 0; h < heads; h++) {
            float *v = x + t * ts + (int64_t)h * hs;
            for (int i = 0; i < half; i++) {
                float x1 = v[i], x2 = v[i + half];
                v[i] = x1 * c[i] - x2 * s[i];
                v[i + half] = x2 * c[i] + x1 * s[i];
            }
        }
    }
    return PN_OK;
}

/* The first index of row[0..cols) holding its maximum, or its first NaN where it has one. */
static int64_t argmax_row(const float *row, int64_t cols) {
    float m = row[0];
    int nan = m != m;
    int64_t i = 1;
#if defined(__AVX2__) && defined(__FMA__) /* (where the header includes the intrinsics) */
    if (cols >= 8) { /* max_ps(v, acc) keeps acc where v is NaN: NaNs are looked for beside it */
        __m256 acc = _mm256_loadu_ps(row), unord = _mm256_cmp_ps(acc, acc, _CMP_UNORD_Q);
        for (i = 8; i + 8 <= cols; i += 8) {
            const __m256 v = _mm256_loadu_ps(row + i);
            acc = _mm256_max_ps(v, acc);
            unord = _mm256_or_ps(unord, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, acc);
        m = lanes[0];
        for (int l = 1; l < 8; l++) m = lanes[l] > m ? lanes[l] : m;
        nan = _mm256_movemask_ps(unord) != 0;
    }
#endif
    for (; i < cols; i++) {
        m = row[i] > m ? row[i] : m;
        nan |= row[i] != row[i];
    }
    int64_t best = 0;
    if (nan)
        while (row[best] == row[best]) best++;
    else
        while (row[best] != m) best++;
    return best;
}

/* out[r] = the index of row r's first maximum (x rows of `cols` floats, row stride `stride`); a
 * NaN wins, the first one, as torch's max(dim).indices and numpy's argmax have it. A greedy
 * decode step's whole sampling: torch's CPU reductions with an index are scalar loops behind a
 * dispatch (1 x 8192: ~50 us); here the maximum in vector registers, then its first index. */
int pl_argmax_rows(const float *x, int64_t rows, int64_t cols, int64_t stride, int64_t *out) {
    if (rows < 0 || cols <= 0 || stride < cols) return PN_ERR_ARG;
    for (int64_t r = 0; r < rows; r++) out[r] = argmax_row(x + r * stride, cols);
    return PN_OK;
}

/* y = x W^T (+ bias) with W in MXFP4 as OpenAI's gpt-oss checkpoints ship it
 * (layers/quantization/mxfp4.py): W [out, in] is stored as
 *   blocks [out, in / 32, 16] uint8  two e2m1 (fp4) codes per byte: element 2j in the low
 *                                     nibble, 2j + 1 in the high one
 *   scales [out, in / 32]     uint8  e8m0: the 32 elements of a group are scaled by 2^(s - 127)
 * The weight is never widened in memory: a thread decodes one group of 32 values of one output
 * row into registers (a 16-entry table lookup per nibble, times the group's power of two) and
 * folds it into the dot products of a tile of input rows, then moves to the next group.
 *
 * Threads split the output features; each walks all input rows, MX_ROWS at a time, so a group
 * is decoded once per MX_ROWS rows.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "pagedllm_native.h"

#define MX_GROUP 32 /* elements per scale (the MX block size) */
#define MX_ROWS 16  /* input rows per pass over a weight row */

static const float E2M1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

/* w[0..32) = group g of a weight row, decoded. */
static inline void decode_group(const uint8_t *block, uint8_t scale, float *w) {
    const float s = ldexpf(1.0f, (int)scale - 127);
    for (int j = 0; j < MX_GROUP / 2; j++) {
        w[2 * j] = E2M1[block[j] & 0x0F] * s;
        w[2 * j + 1] = E2M1[block[j] >> 4] * s;
    }
}

/* acc[r] = row o of W dotted with x rows r0 .. r0 + nr. */
static void row_tile(const float *x, int64_t in_features, const uint8_t *blocks, const uint8_t *scales,
                     int64_t groups, int64_t r0, int nr, float *acc) {
    float w[MX_GROUP];
    for (int r = 0; r < nr; r++) acc[r] = 0.0f;
    for (int64_t g = 0; g < groups; g++) {
        decode_group(blocks + g * (MX_GROUP / 2), scales[g], w);
        for (int r = 0; r < nr; r++) {
            const float *xr = x + (r0 + r) * in_features + g * MX_GROUP;
            float sum = 0.0f;
            for (int k = 0; k < MX_GROUP; k++) sum += w[k] * xr[k];
            acc[r] += sum;
        }
    }
}

int mx_linear(const float *x, int64_t rows, const uint8_t *blocks, const uint8_t *scales, const float *bias,
              int64_t in_features, int64_t out_features, float *y, int threads) {
    if (rows < 0 || in_features <= 0 || out_features <= 0 || in_features % MX_GROUP || threads <= 0)
        return PN_ERR_ARG;
    const int64_t groups = in_features / MX_GROUP;
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * out_features * in_features > (1 << 18))
    for (int64_t o = 0; o < out_features; o++) {
        const uint8_t *brow = blocks + o * groups * (MX_GROUP / 2), *srow = scales + o * groups;
        const float b = bias ? bias[o] : 0.0f;
        float acc[MX_ROWS];
        for (int64_t r0 = 0; r0 < rows; r0 += MX_ROWS) {
            const int nr = rows - r0 < MX_ROWS ? (int)(rows - r0) : MX_ROWS;
            row_tile(x, in_features, brow, srow, groups, r0, nr, acc);
            for (int r = 0; r < nr; r++) y[(r0 + r) * out_features + o] = acc[r] + b;
        }
    }
    return PN_OK;
}

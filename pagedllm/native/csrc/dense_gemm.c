/* y = x . W^T (+ bias) for float32 weights packed once into column panels: the CPU linear of
 * the torch path for decode-sized batches (layers/cpu_ops.py routes 4..PANEL_MAX_ROWS = 96
 * rows here).
 *
 * Why not oneDNN / MKL: at 16-96 rows a decode step streams every weight from memory once, and
 * those libraries' packed GEMMs leave that stream mostly unhidden (a batch-64 step of the 34M
 * model: 16.4-18.4 ms for its projections with oneDNN's packed weights, 9-14% less here on a
 * quiet host, equal when its memory bandwidth is contended; from ~128 rows oneDNN's is faster:
 * benchmarks/RESULTS.md). Here each thread owns whole panels; a
 * panel (K x 32 floats, one contiguous stream) is read from memory by the first row tile, which
 * prefetches it DG_PREFETCH floats ahead, and row tiles 1 .. DG_SPREAD of the same panel run
 * from L2 while each prefetches a slice of the thread's next panel, so the weight stream
 * overlaps the math.
 *
 * Packed layout (layers/cpu_ops.py: pack_panels): wp [out / DG_PANEL, in, DG_PANEL], i.e. panel
 * p, input k holds W[p * 32 .. p * 32 + 31][k]. The register tile is moe_experts.c's: DG_ROWS
 * rows x 32 columns of accumulators, per k one broadcast of each row's x and two weight vectors.
 */
#include <omp.h>
#include <stdint.h>

#include "pagedllm_native.h"

/* DG_ROWS (the header): 8 rows = 16 zmm accumulators of the 32 registers; 2 rows = 8 ymm of 16. */

/* The first row tile reads its panel this many floats ahead (16 k steps of 32 floats). */
#define DG_PREFETCH 512
/* Row tiles 1 .. DG_SPREAD of a panel fetch the thread's next panel, into L2 (not L1: the
 * current panel and x rows live there), a slice each: every tile after the first of a 64-row
 * pass (8 tiles of 8 rows). Spreading the fetch over 7 tiles rather than 4 took a chain of the
 * 200M model's 64 projections at 64 rows from 87.6 to 81.5 ms (48 rows: 71.0 -> 68.4; 96:
 * 137.9 -> 134.4), the 34M shapes within 1% (benchmarks/RESULTS.md). */
#define DG_SPREAD 7
/* Rows per pass over the thread's panels: x's block stays in L2 while the panels stream. */
#define DG_ROW_BLOCK 64

static inline v16 splat(float f) { return (v16){0} + f; }

/* Where the row tiles of one panel are and what they prefetch. */
typedef struct {
    const float *panel; /* this panel: 32 floats per k */
    const float *next;  /* the thread's next panel (NULL: none) */
    int tile, spread;   /* this row tile of the panel; tiles 1 .. spread fetch `next` */
} PanelPass;

/* What a row tile prefetches while it runs (a literal at every call site, so each variant's k
 * loop carries only its own prefetches). */
enum { FETCH_NONE, FETCH_AHEAD, FETCH_NEXT };

static inline __attribute__((always_inline)) void prefetch(const int mode, const PanelPass *pp, int64_t K,
                                                           int64_t k) {
    if (mode == FETCH_AHEAD) { /* tile 0: this panel, from memory, into L1 just ahead of use */
        __builtin_prefetch(pp->panel + 32 * k + DG_PREFETCH, 0, 3);
        __builtin_prefetch(pp->panel + 32 * k + DG_PREFETCH + 16, 0, 3);
    } else if (mode == FETCH_NEXT) { /* tiles 1 .. spread: a slice of the next panel, into L2 */
        const float *at = pp->next + ((pp->tile - 1) * K + k) * 32 / pp->spread;
        __builtin_prefetch(at, 0, 2);
        /* one tile alone (9-16 rows) fetches 128 bytes per k: the second line too. Intel's
         * adjacent-line prefetcher pairs lines on its own; AMD Zen 5 does not, and 16 rows ran at
         * half the speed of 8 there (0.73 vs 0.40 ms at 8192 x 512) with every other line missed */
        if (pp->spread == 1) __builtin_prefetch(at + 16, 0, 2);
    }
}

/* y[r][0:32] = sum_k x[r][k] * panel[k][0:32] (+ bias[0:32]) for M rows (M and mode literals at
 * every call site, so the row loops unroll and the accumulators live in registers); x rows K
 * apart, y rows ldy apart. */
static inline __attribute__((always_inline)) void tile(const int M, const int mode, const float *x,
                                                       const PanelPass *pp, int64_t K, const float *bias, float *y,
                                                       int64_t ldy) {
    v16 acc[DG_ROWS][2];
    const v16 b0 = bias ? load16(bias) : splat(0.0f), b1 = bias ? load16(bias + 16) : splat(0.0f);
    for (int r = 0; r < M; r++)
        acc[r][0] = b0, acc[r][1] = b1;
    const float *b = pp->panel;
#pragma GCC unroll 2
    for (int64_t k = 0; k < K; k++) {
        prefetch(mode, pp, K, k);
        const v16 w0 = load16(b + 32 * k), w1 = load16(b + 32 * k + 16);
        for (int r = 0; r < M; r++) {
            acc[r][0] += x[r * K + k] * w0;
            acc[r][1] += x[r * K + k] * w1;
        }
    }
    for (int r = 0; r < M; r++) {
        store16(y + r * ldy, acc[r][0]);
        store16(y + r * ldy + 16, acc[r][1]);
    }
}

/* tile() with the row count m <= DG_ROWS and the prefetch mode as literals in each case. */
static void tile_rows(int m, const float *x, const PanelPass *pp, int64_t K, const float *bias, float *y,
                      int64_t ldy) {
    const int mode = pp->tile == 0 ? FETCH_AHEAD : (pp->next && pp->tile <= pp->spread) ? FETCH_NEXT : FETCH_NONE;
    switch (m) {
#define CASE(M)                                                                                                    \
    case M:                                                                                                        \
        if (mode == FETCH_AHEAD) tile(M, FETCH_AHEAD, x, pp, K, bias, y, ldy);                                     \
        else if (mode == FETCH_NEXT) tile(M, FETCH_NEXT, x, pp, K, bias, y, ldy);                                  \
        else tile(M, FETCH_NONE, x, pp, K, bias, y, ldy);                                                          \
        break;
        CASE(1) CASE(2)
#if DG_ROWS > 2
        CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#endif
#undef CASE
    }
}

/* Panels [lo, hi) for T <= DG_ROW_BLOCK rows of x, one panel at a time (its row tiles in order). */
static void run_panels(const float *x, int64_t T, int64_t K, const float *wp, const float *bias, int64_t N,
                       float *y, int64_t lo, int64_t hi) {
    const int tiles = (int)((T + DG_ROWS - 1) / DG_ROWS);
    const int spread = tiles - 1 < DG_SPREAD ? tiles - 1 : DG_SPREAD;
    for (int64_t p = lo; p < hi; p++) {
        PanelPass pp = {wp + p * K * DG_PANEL, (p + 1 < hi && spread > 0) ? wp + (p + 1) * K * DG_PANEL : 0, 0,
                        spread};
        const float *pb = bias ? bias + p * DG_PANEL : 0;
        for (pp.tile = 0; pp.tile < tiles; pp.tile++) {
            const int64_t r0 = (int64_t)pp.tile * DG_ROWS;
            const int m = T - r0 < DG_ROWS ? (int)(T - r0) : DG_ROWS;
            tile_rows(m, x + r0 * K, &pp, K, pb, y + r0 * N + p * DG_PANEL, N);
        }
    }
}

int dg_gemm(const float *x, int64_t T, const float *wp, const float *bias, int64_t in, int64_t out, float *y,
            int threads) {
    if (T < 0 || in < 1 || out < 1 || out % DG_PANEL)
        return PN_ERR_ARG;
    const int64_t panels = out / DG_PANEL;
    if (threads < 1)
        threads = 1;
    if (threads > panels)
        threads = (int)panels;
#pragma omp parallel num_threads(threads)
    {
        const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
        for (int64_t r0 = 0; r0 < T; r0 += DG_ROW_BLOCK)
            run_panels(x + r0 * in, T - r0 < DG_ROW_BLOCK ? T - r0 : DG_ROW_BLOCK, in, wp, bias, out, y + r0 * out,
                       panels * tid / nth, panels * (tid + 1) / nth);
    }
    return PN_OK;
}

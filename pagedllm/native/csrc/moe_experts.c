/* The routed experts of a float32 MoE layer in one call (layers/moe_cpu.py): tokens grouped by
 * expert, gate/up GEMM -> SiLU(gate) * up -> down GEMM, times the routing weight, summed into
 * each token's output row.
 *
 * Why: at batch 64 with 8 experts and top-2 every expert gets ~16 rows. Torch runs 16 small
 * GEMMs with Python between them; here each weight is streamed once per forward for all of
 * its expert's rows by a register-blocked micro-kernel (up to MOE_ROWS rows x 32 columns of
 * accumulators: per k one broadcast of each row's x and two weight vectors), and the gather,
 * activation, routing weight and scatter-add happen in the same pass.
 *
 * Packed weight layout (built once at load by layers/moe_cpu.py: pack_experts):
 *   w13p [E, inter / MOE_GATE_PANEL, hidden, 2 * MOE_GATE_PANEL]
 *        panel p, input k: gate rows p*16 .. p*16+15 at k, then up rows p*16 .. p*16+15 at k
 *   w2p  [E, hidden / MOE_DOWN_PANEL, inter, MOE_DOWN_PANEL]
 *        panel p, input k: down rows p*32 .. p*32+31 at k
 * so a panel is one contiguous stream of 32 floats per input index.
 *
 * Threads: phase 1 (gate/up) splits every expert's gate panels across threads, phase 2 (down)
 * splits the hidden panels: a thread owns the same output columns of every token, so the
 * scatter-add (a token appears under top_k experts) needs no atomics, and each expert's work is
 * divided evenly whatever the routing.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pagedllm_native.h"


#if defined(__AVX512F__)
#define MOE_ROWS 8 /* 16 zmm accumulators of the 32 registers */
#else
#define MOE_ROWS 2 /* 8 ymm accumulators of the 16 registers */
#endif

#ifndef MOE_PREFETCH
#define MOE_PREFETCH 512
#endif

static inline v16 splat(float f) { return (v16){0} + f; }
/* lane-wise c ? a : b (the ?: operator takes no vectors in C) */
static inline v16 select16(v16i c, v16 a, v16 b) { return (v16)((c & (v16i)a) | (~c & (v16i)b)); }

/* e^x lane-wise: the header's pn_exp512 / pn_exp256 (two halves), expf per lane without AVX2.
 * x is clamped to 88 first: exp(-g) of a very negative SiLU input would overflow 2^n. */
static inline v16 exp16(v16 x) {
    x = select16(x < splat(88.0f), x, splat(88.0f));
#if PN_AVX2 && defined(__AVX512F__)
    return (v16)pn_exp512((__m512)x);
#elif PN_AVX2
    union {
        v16 v;
        __m256 h[2];
    } u = {x};
    u.h[0] = pn_exp256(u.h[0]), u.h[1] = pn_exp256(u.h[1]);
    return u.v;
#else
    for (int i = 0; i < 16; i++) x[i] = expf(x[i]);
    return x;
#endif
}

static inline v16 silu16(v16 g) { return g / (splat(1.0f) + exp16(-g)); }

/* acc[r] = sum_k a[r][k] * b[k][0:32] for M rows (the header's pn_tile32); b is one panel that
 * streams from memory on its first row block: fetch MOE_PREFETCH floats ahead. */
static inline __attribute__((always_inline)) void tile(const int M, const float *const *a, const float *b,
                                                       int64_t K, v16 acc[MOE_ROWS][2]) {
    for (int r = 0; r < M; r++)
        acc[r][0] = acc[r][1] = splat(0.0f);
    pn_tile32(M, a, b, K, acc, MOE_PREFETCH);
}

/* tile() with the row count m <= MOE_ROWS as a literal in each case, so its loops unroll. */
static inline __attribute__((always_inline)) void tile_rows(int m, const float *const *a, const float *panel,
                                                            int64_t K, v16 acc[][2]) {
    switch (m) {
#define CASE(M) case M: tile(M, a, panel, K, acc); break;
        CASE(1) CASE(2)
#if MOE_ROWS > 2
        CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#endif
#undef CASE
    }
}

/* act[r][0:16] = silu(gate) * up of one gate panel for m <= MOE_ROWS rows. */
static void gate_up_rows(int m, const float *const *a, const float *panel, int64_t hidden, float *const *act) {
    v16 acc[MOE_ROWS][2];
    tile_rows(m, a, panel, hidden, acc);
    for (int r = 0; r < m; r++)
        store16(act[r], silu16(acc[r][0]) * acc[r][1]);
}

/* y[r][0:32] += weight[r] * (act rows . one down panel) for m <= MOE_ROWS rows. */
static void down_rows(int m, const float *const *a, const float *panel, int64_t inter, const float *weight,
                      float *const *y) {
    v16 acc[MOE_ROWS][2];
    tile_rows(m, a, panel, inter, acc);
    for (int r = 0; r < m; r++) {
        store16(y[r], load16(y[r]) + weight[r] * acc[r][0]);
        store16(y[r] + 16, load16(y[r] + 16) + weight[r] * acc[r][1]);
    }
}

/* The routing of one call: slots (token, k) grouped by expert (a stable counting sort). */
typedef struct {
    int64_t *start;  /* [E + 1]: expert e's slots are start[e] .. start[e+1] - 1 */
    int64_t *token;  /* [slots]: the token of each slot */
    float *weight;   /* [slots]: its routing weight */
    float *act;      /* [slots, inter]: SiLU(gate) * up */
} Groups;

static int group_slots(const int64_t *ids, const float *topk_w, int64_t slots, int64_t top_k, int64_t E,
                       Groups *g) {
    memset(g->start, 0, (size_t)(E + 1) * sizeof(int64_t));
    for (int64_t s = 0; s < slots; s++) {
        if (ids[s] < 0 || ids[s] >= E)
            return PN_ERR_META;
        g->start[ids[s] + 1]++;
    }
    for (int64_t e = 0; e < E; e++)
        g->start[e + 1] += g->start[e];
    int64_t *fill = malloc((size_t)E * sizeof(int64_t));
    if (!fill)
        return PN_ERR_NOMEM;
    memcpy(fill, g->start, (size_t)E * sizeof(int64_t));
    for (int64_t s = 0; s < slots; s++) {
        const int64_t at = fill[ids[s]]++;
        g->token[at] = s / top_k, g->weight[at] = topk_w[s];
    }
    free(fill);
    return PN_OK;
}

/* Shapes of one call. */
typedef struct {
    int64_t hidden, inter, E;
} MoeDims;

/* The rows of one expert's slots s .. s + m - 1 (m <= MOE_ROWS). */
static inline int block_rows(const Groups *g, int64_t e, int64_t s) {
    const int64_t left = g->start[e + 1] - s;
    return (int)(left < MOE_ROWS ? left : MOE_ROWS);
}

/* Phase 1 for gate panels p0 .. p1 - 1 of every expert. Panel outer, rows inner: a panel
 * (hidden * 32 floats) is read from memory once and from L1/L2 for the other row blocks. */
static void gate_up_phase(const float *x, const float *w13p, const MoeDims *d, const Groups *g, int64_t p0,
                          int64_t p1) {
    const int64_t panels = d->inter / MOE_GATE_PANEL, panel_size = d->hidden * 2 * MOE_GATE_PANEL;
    for (int64_t e = 0; e < d->E; e++)
        for (int64_t p = p0; p < p1; p++)
            for (int64_t s = g->start[e]; s < g->start[e + 1]; s += MOE_ROWS) {
                const int m = block_rows(g, e, s);
                const float *a[MOE_ROWS];
                float *out[MOE_ROWS];
                for (int r = 0; r < m; r++)
                    a[r] = x + g->token[s + r] * d->hidden, out[r] = g->act + (s + r) * d->inter + p * MOE_GATE_PANEL;
                gate_up_rows(m, a, w13p + (e * panels + p) * panel_size, d->hidden, out);
            }
}

/* Phase 2 for hidden panels p0 .. p1 - 1: zero those columns of y, then add every expert. */
static void down_phase(const float *w2p, const MoeDims *d, const Groups *g, int64_t T, float *y, int64_t p0,
                       int64_t p1) {
    const int64_t panels = d->hidden / MOE_DOWN_PANEL, panel_size = d->inter * MOE_DOWN_PANEL;
    for (int64_t t = 0; t < T; t++)
        memset(y + t * d->hidden + p0 * MOE_DOWN_PANEL, 0, (size_t)((p1 - p0) * MOE_DOWN_PANEL) * sizeof(float));
    for (int64_t e = 0; e < d->E; e++)
        for (int64_t p = p0; p < p1; p++)
            for (int64_t s = g->start[e]; s < g->start[e + 1]; s += MOE_ROWS) {
                const int m = block_rows(g, e, s);
                const float *a[MOE_ROWS];
                float *out[MOE_ROWS];
                for (int r = 0; r < m; r++)
                    a[r] = g->act + (s + r) * d->inter, out[r] = y + g->token[s + r] * d->hidden + p * MOE_DOWN_PANEL;
                down_rows(m, a, w2p + (e * panels + p) * panel_size, d->inter, g->weight + s, out);
            }
}

/* [lo, hi) of n items for thread tid of nth. */
static inline void split(int64_t n, int tid, int nth, int64_t *lo, int64_t *hi) {
    *lo = n * tid / nth, *hi = n * (tid + 1) / nth;
}

static void run_phases(const float *x, int64_t T, const float *w13p, const float *w2p, const MoeDims *d,
                       const Groups *g, float *y, int threads) {
#pragma omp parallel num_threads(threads)
    {
        const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
        int64_t lo, hi;
        split(d->inter / MOE_GATE_PANEL, tid, nth, &lo, &hi);
        gate_up_phase(x, w13p, d, g, lo, hi);
#pragma omp barrier
        split(d->hidden / MOE_DOWN_PANEL, tid, nth, &lo, &hi);
        down_phase(w2p, d, g, T, y, lo, hi);
    }
}

int moe_experts(const float *x, int64_t T, const int64_t *ids, const float *topk_w, int64_t top_k,
                const float *w13p, const float *w2p, int64_t E, int64_t hidden, int64_t inter, float *y,
                int threads) {
    if (T < 0 || top_k < 1 || E < 1 || hidden < 1 || inter < 1 || hidden % MOE_DOWN_PANEL ||
        inter % MOE_GATE_PANEL)
        return PN_ERR_ARG;
    const int64_t slots = T * top_k;
    const MoeDims d = {hidden, inter, E};
    Groups g = {malloc((size_t)(E + 1) * sizeof(int64_t)), malloc((size_t)(slots + 1) * sizeof(int64_t)),
                malloc((size_t)(slots + 1) * sizeof(float)), malloc((size_t)(slots * inter + 1) * sizeof(float))};
    int rc = (g.start && g.token && g.weight && g.act) ? group_slots(ids, topk_w, slots, top_k, E, &g)
                                                       : PN_ERR_NOMEM;
    if (rc == PN_OK)
        run_phases(x, T, w13p, w2p, &d, &g, y, threads < 1 ? 1 : threads);
    free(g.start), free(g.token), free(g.weight), free(g.act);
    return rc;
}

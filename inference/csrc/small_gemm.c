/* y = x . w^T (+ bias) for the rows of a decode step: the step's GEMMs, from one row to a full batch.
 *
 * x is [m, k] (row stride x_stride), w is [n, k] contiguous, y is [m, n] (row stride y_stride).
 * Why not MKL: its sgemm at 1-64 rows runs below both the machine's memory bandwidth and its
 * matmul rate (SmolLM2-135M fp32, one thread, all of a step's GEMMs: 1 row 48 ms, 4 rows 73,
 * 8 rows 97, 16 rows 109, 64 rows 288; here 26, 27, 43, 63, 263), and its rounding of a row depends
 * on how many rows share the call. Here a tile of MR rows of x by NR rows of w is multiplied in
 * registers; weight tiles are the outer loop, so each weight is read from memory once per call
 * while every row of x passes it from cache, and the next weight tile is prefetched in order
 * while this one computes (the tile reads NR rows of w side by side, NR streams the hardware
 * prefetchers do not follow: without it 1 row took 33 ms, 16 rows 95). Past ~128 rows MKL's
 * blocking wins (measured: 128 rows 453 ms against 463, 256 rows 860 against 920); the caller stops there.
 *
 * Batch invariance: y[r, o] is computed by the same operations in the same order whatever m is
 * and wherever the row falls in a tile (eight lane sums over k by FMA in order of k, then a fixed
 * pairwise sum of the lanes, the scalar tail, the bias), so a row's logits are the same bits in a
 * step of 1 row, in a verify step of 8 and in a batch of 128. Reassociation is off in this file
 * for that reason (the library's flags allow it elsewhere).
 */
/* NOTE: both pragmas here, before every function: a function under other optimize options is not
 * inlined into these (each load would be a call) */
#pragma GCC optimize("no-associative-math", "fp-contract=off")
#include <stdint.h>
#include <string.h>

#include "lanes.h"

/* the tile, MR rows of x by NR rows of w: its MR * NR accumulators, MR rows of x and one of w in
 * registers (AVX-512 has 32 vector registers, AVX2 16; SSE holds a lanes_t in two) */
#if defined(__AVX512VL__)
#define MR 4
#define NR 6
#elif defined(__AVX__)
#define MR 3
#define NR 4
#else
#define MR 2
#define NR 3
#endif

static inline __attribute__((always_inline)) lanes_t load(const float *p) {
    lanes_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* c + a * b: one fused multiply-add where the CPU has one (x86-64-v3 and up; by intrinsic, since
 * GCC contracts `c + a * b` in some loops and not in others), else a product and a sum (no
 * contraction in this file): either way the same operation for every row count */
#if defined(__FMA__) && defined(__AVX__)
#include <immintrin.h>
static inline __attribute__((always_inline)) lanes_t madd(lanes_t a, lanes_t b, lanes_t c) {
    return (lanes_t)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
}
static inline __attribute__((always_inline)) float madd1(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
#else
static inline __attribute__((always_inline)) lanes_t madd(lanes_t a, lanes_t b, lanes_t c) { return c + a * b; }
static inline __attribute__((always_inline)) float madd1(float a, float b, float c) { return c + a * b; }
#endif

/* `v`, held in a register: the tile loads each row of x and each row of w once per step of k and
 * multiplies them in registers (MR + NR loads for MR * NR FMAs). Left to itself GCC folds the loads
 * into the FMAs' memory operands instead, reloading x for every row of w (MR * NR + NR loads: on a
 * Zen 3 core, 16 loads for 12 FMAs made the tile wait on its loads; measured at 32-64 rows, weights
 * in cache: 41-50 -> 57-73 GFLOP/s). The empty asm says "v may have changed", so it cannot be
 * re-read from memory. Where a vector is two SSE registers there is no such constraint. */
static inline __attribute__((always_inline)) lanes_t in_register(lanes_t v) {
#if defined(__AVX512VL__)
    __asm__("" : "+v"(v));
#elif defined(__AVX__)
    __asm__("" : "+x"(v));
#endif
    return v;
}

/* y[r, o] for the tile's rows r < mr of x and o < nr of w (mr, nr constants where inlined) */
static inline __attribute__((always_inline)) void tile(
    const int mr, const int nr, const float *x, int64_t xs, const float *w, int64_t k, int64_t kv,
    const float *bias, float *y, int64_t ys, const char *pf, const char *pf_end, int64_t pf_step) {
    lanes_t acc[MR][NR];
    for (int r = 0; r < mr; r++)
        for (int o = 0; o < nr; o++) acc[r][o] = (lanes_t){0};
    for (int64_t i = 0; i < kv; i += LANES) {
        lanes_t xv[MR];
        if (pf < pf_end) { /* the next weight tile, in order: one stream the prefetchers would not see */
            for (int64_t p = 0; p < pf_step; p++) __builtin_prefetch(pf + 64 * p, 0, 2);  /* into L2 */
            pf += 64 * pf_step;
        }
        for (int r = 0; r < mr; r++) xv[r] = in_register(load(x + r * xs + i));
        for (int o = 0; o < nr; o++) {
            const lanes_t wv = in_register(load(w + o * k + i));
            for (int r = 0; r < mr; r++) acc[r][o] = madd(wv, xv[r], acc[r][o]);
        }
    }
    for (int r = 0; r < mr; r++) {
        lanes_t row[LANES] = {{0}};
        for (int o = 0; o < nr; o++) row[o] = acc[r][o];
        const lanes_t sums = lane_sums(row);
        for (int o = 0; o < nr; o++) {
            float s = sums[o];
            for (int64_t i = kv; i < k; i++) s = madd1(w[o * k + i], x[r * xs + i], s);
            if (bias) s += bias[o];
            y[r * ys + o] = s;
        }
    }
}

/* one tile of any shape up to MR x NR, dispatched to a copy compiled for that shape */
#define TILE_CASE(A, B) case (A) * 16 + (B): tile(A, B, x, xs, w, k, kv, bias, y, ys, pf, pf_end, pf_step); break;
#if NR == 6
#define TILE_ROW(A) TILE_CASE(A, 1) TILE_CASE(A, 2) TILE_CASE(A, 3) TILE_CASE(A, 4) TILE_CASE(A, 5) TILE_CASE(A, 6)
#elif NR == 4
#define TILE_ROW(A) TILE_CASE(A, 1) TILE_CASE(A, 2) TILE_CASE(A, 3) TILE_CASE(A, 4)
#else
#define TILE_ROW(A) TILE_CASE(A, 1) TILE_CASE(A, 2) TILE_CASE(A, 3)
#endif
static void any_tile(int mr, int nr, const float *x, int64_t xs, const float *w, int64_t k, int64_t kv,
                     const float *bias, float *y, int64_t ys, const char *pf, const char *pf_end, int64_t pf_step) {
    switch (mr * 16 + nr) {
        TILE_ROW(1)
        TILE_ROW(2)
#if MR >= 3
        TILE_ROW(3)
#endif
#if MR >= 4
        TILE_ROW(4)
#endif
        default: break;
    }
}

int small_gemm_f32(const float *x, int64_t m, int64_t k, int64_t x_stride, const float *w, int64_t n,
                   const float *bias, float *y, int64_t y_stride, int threads) {
    if (m < 1 || k < 1 || n < 1 || x_stride < k || y_stride < n) return 1;
    const int64_t kv = k / LANES * LANES;
    /* weight tiles outside, row tiles inside: a tile of w is read from memory once and stays in
     * cache while every row of x passes it */
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t o = 0; o < n; o += NR) {
        const int nr = n - o < NR ? (int)(n - o) : NR;
        const int64_t row_tiles = (m + MR - 1) / MR, steps = kv / LANES > 0 ? kv / LANES : 1;
        /* the next weight tile's lines (none after the last), spread over this tile's row tiles
         * and their k steps */
        const char *next = (const char *)(w + (o + nr) * k);
        const int64_t left = n - o - nr, next_rows = left < NR ? left : NR;
        const int64_t lines = (next_rows * k * (int64_t)sizeof(float) + 63) / 64;
        const int64_t per_step = (lines + row_tiles * steps - 1) / (row_tiles * steps);
        const char *const end = next + 64 * lines;
        const char *pf = next;
        for (int64_t r = 0; r < m; r += MR) {
            const int mr = m - r < MR ? (int)(m - r) : MR;
            any_tile(mr, nr, x + r * x_stride, x_stride, w + o * k, k, kv, bias ? bias + o : NULL,
                     y + r * y_stride + o, y_stride, pf, end, per_step);
            pf += 64 * per_step * steps;
        }
    }
    return 0;
}

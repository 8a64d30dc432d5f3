/* y = x . w^T (+ bias) for a few rows of x: the decode step's GEMMs at the tail of a batch.
 *
 * x is [m, k] (row stride x_stride), w is [n, k] contiguous, y is [m, n] (row stride y_stride),
 * 1 <= m <= SMALL_GEMM_MAX_ROWS. Why not MKL: its sgemm at 2-3 rows runs at a fraction of
 * the memory bandwidth its gemv reaches at 1 row (SmolLM2-135M fp32, two threads: 1 row 35 ms,
 * 2 rows 56 ms, 3 rows 74 ms, 8 rows 47 ms for all of a step's GEMMs), so a verify step with one
 * proposed token cost 1.6x a plain step. Here each weight row is read from memory once and
 * multiplied into every row of x while it sits in L1, so a step costs about its weight bytes
 * whether it carries 1 token or 16.
 *
 * Batch invariance: y[r, o] is computed by the same operations in the same order whatever m is
 * (eight lane sums over k, FMA, then a fixed pairwise sum of the lanes, the scalar tail, the
 * bias), so a row's logits are the same bits in a step of 1 row and in a verify step of 16.
 * Reassociation is off in this file for that reason (the library's flags allow it elsewhere).
 */
/* NOTE: both pragmas here, before every function: a function under other optimize options is not
 * inlined into these (each load would be a call) */
#pragma GCC optimize("no-associative-math", "fp-contract=off")
#include <stdint.h>

#define LANES 8
#define SMALL_GEMM_MAX_ROWS 16
#define PASS 8 /* rows of x per pass over one weight row: their accumulators fit in registers */
#define WROWS 1 /* weight rows per pass (two measured slower at 1-4 rows of x) */

/* eight lanes as one value (GCC's vector extension): AVX registers where the CPU has them, pairs
 * of SSE ones below; the arithmetic per lane is the same either way */
typedef float lanes_t __attribute__((vector_size(LANES * sizeof(float))));

static inline __attribute__((always_inline)) lanes_t load(const float *p) {
    lanes_t v;
    __builtin_memcpy(&v, p, sizeof v);
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

/* out[o * PASS + r] = lane sums of w[o * k + i] * x[r * xs + i] for o < WO, r < M, i < kv (kv a
 * multiple of LANES) */
#define DEFINE_PASS(WO, M)                                                                     \
    static inline void pass_##WO##_##M(const float *w, int64_t k, const float *x, int64_t xs, \
                                       int64_t kv, lanes_t *out) {                             \
        lanes_t acc[WO][M];                                                                    \
        for (int o = 0; o < WO; o++)                                                           \
            for (int r = 0; r < M; r++) acc[o][r] = (lanes_t){0};                              \
        for (int64_t i = 0; i < kv; i += LANES) {                                              \
            lanes_t wv[WO];                                                                    \
            for (int o = 0; o < WO; o++) wv[o] = load(w + o * k + i);                          \
            for (int r = 0; r < M; r++) {                                                      \
                const lanes_t xv = load(x + r * xs + i);                                       \
                for (int o = 0; o < WO; o++) acc[o][r] = madd(wv[o], xv, acc[o][r]);           \
            }                                                                                  \
        }                                                                                      \
        for (int o = 0; o < WO; o++)                                                           \
            for (int r = 0; r < M; r++) out[o * PASS + r] = acc[o][r];                         \
    }
DEFINE_PASS(1, 1)
DEFINE_PASS(1, 2)
DEFINE_PASS(1, 3)
DEFINE_PASS(1, 4)
DEFINE_PASS(1, 5)
DEFINE_PASS(1, 6)
DEFINE_PASS(1, 7)
DEFINE_PASS(1, 8)

/* The row's lanes summed in a fixed pairwise order. NOTE: not inlined: inlined, GCC 12 sums the
 * lanes of one row and of several rows (vectorised across them) in different orders */
static __attribute__((noinline)) float sum_lanes(const float *a) {
    return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

/* lanes for `wo` (1 or WROWS) weight rows and m <= PASS rows of x: out[o * PASS + r] */
static void pass_rows(int64_t wo, int64_t m, const float *w, int64_t k, const float *x, int64_t xs, int64_t kv,
                      lanes_t *out) {
    switch (wo * 8 + m) {
        case 9: pass_1_1(w, k, x, xs, kv, out); break;
        case 10: pass_1_2(w, k, x, xs, kv, out); break;
        case 11: pass_1_3(w, k, x, xs, kv, out); break;
        case 12: pass_1_4(w, k, x, xs, kv, out); break;
        case 13: pass_1_5(w, k, x, xs, kv, out); break;
        case 14: pass_1_6(w, k, x, xs, kv, out); break;
        case 15: pass_1_7(w, k, x, xs, kv, out); break;
        default: pass_1_8(w, k, x, xs, kv, out); break;
    }
}

int small_gemm_f32(const float *x, int64_t m, int64_t k, int64_t x_stride, const float *w, int64_t n,
                   const float *bias, float *y, int64_t y_stride, int threads) {
    if (m < 1 || m > SMALL_GEMM_MAX_ROWS || k < 1 || n < 1 || x_stride < k || y_stride < n) return 1;
    const int64_t kv = k / LANES * LANES;
    const int64_t blocks = (n + WROWS - 1) / WROWS;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t o0 = b * WROWS, wo = n - o0 < WROWS ? n - o0 : WROWS;
        const float *wr = w + o0 * k;
        for (int64_t r0 = 0; r0 < m; r0 += PASS) {
            const int64_t rows = m - r0 < PASS ? m - r0 : PASS;
            lanes_t lanes[WROWS * PASS];
            pass_rows(wo, rows, wr, k, x + r0 * x_stride, x_stride, kv, lanes);
            for (int64_t o = 0; o < wo; o++) {
                for (int64_t r = 0; r < rows; r++) {
                    const float *xr = x + (r0 + r) * x_stride;
                    float s = sum_lanes((const float *)&lanes[o * PASS + r]);
                    for (int64_t i = kv; i < k; i++) s = madd1(wr[o * k + i], xr[i], s);
                    if (bias) s += bias[o0 + o];
                    y[(r0 + r) * y_stride + o0 + o] = s;
                }
            }
        }
    }
    return 0;
}

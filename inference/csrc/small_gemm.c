/* y = x . w^T (+ bias) for a few rows of x: the decode step's GEMMs at the tail of a batch.
 *
 * x is [m, k] (row stride x_stride), w is [n, k] contiguous, y is [m, n] (row stride y_stride),
 * 1 <= m <= SMALL_GEMM_MAX_ROWS. Why not MKL: its sgemm at 2-3 rows runs at a fraction of
 * the memory bandwidth its gemv reaches at 1 row (SmolLM2-135M fp32, two threads: 1 row 35 ms,
 * 2 rows 56 ms, 3 rows 74 ms, 8 rows 47 ms for all of a step's GEMMs). Here each weight row is
 * read from memory once and multiplied into every row of x while it sits in L1: at 1-3 rows a
 * step costs about its weight bytes; from ~4 rows the arithmetic shows (one thread: 1 row 19 ms,
 * 3 rows 26, 8 rows 77), and past 8 rows MKL is faster (the caller stops there).
 *
 * Batch invariance: y[r, o] is computed by the same operations in the same order whatever m is
 * (eight lane sums over k, FMA, then a fixed pairwise sum of the lanes, the scalar tail, the
 * bias), so a row's logits are the same bits in a step of 1 row and in a verify step of 8.
 * Reassociation is off in this file for that reason (the library's flags allow it elsewhere).
 */
/* NOTE: both pragmas here, before every function: a function under other optimize options is not
 * inlined into these (each load would be a call) */
#pragma GCC optimize("no-associative-math", "fp-contract=off")
#include <stdint.h>

#define LANES 8
#define SMALL_GEMM_MAX_ROWS 16
/* rows of x per pass over one weight row: their accumulators fit in registers. NOTE: two weight rows
 * per pass (each x load feeding two products) measured slower at 1-4 rows */
#define PASS 8

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

/* out[r] = lane sums of w[i] * x[r * xs + i] for r < M, i < kv (kv a multiple of LANES) */
#define DEFINE_PASS(M)                                                                       \
    static inline void pass_##M(const float *w, const float *x, int64_t xs, int64_t kv,    \
                                lanes_t *out) {                                            \
        lanes_t acc[M];                                                                      \
        for (int r = 0; r < M; r++) acc[r] = (lanes_t){0};                                   \
        for (int64_t i = 0; i < kv; i += LANES) {                                            \
            const lanes_t wv = load(w + i);                                                  \
            for (int r = 0; r < M; r++) acc[r] = madd(wv, load(x + r * xs + i), acc[r]);    \
        }                                                                                    \
        for (int r = 0; r < M; r++) out[r] = acc[r];                                         \
    }
DEFINE_PASS(1)
DEFINE_PASS(2)
DEFINE_PASS(3)
DEFINE_PASS(4)
DEFINE_PASS(5)
DEFINE_PASS(6)
DEFINE_PASS(7)
DEFINE_PASS(8)

/* The row's lanes summed in a fixed pairwise order. NOTE: not inlined: inlined, GCC 12 sums the
 * lanes of one row and of several rows (vectorised across them) in different orders */
static __attribute__((noinline)) float sum_lanes(const float *a) {
    return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}

/* lanes of m <= PASS rows of x against one weight row */
static void pass_rows(int64_t m, const float *w, const float *x, int64_t xs, int64_t kv, lanes_t *out) {
    switch (m) {
        case 1: pass_1(w, x, xs, kv, out); break;
        case 2: pass_2(w, x, xs, kv, out); break;
        case 3: pass_3(w, x, xs, kv, out); break;
        case 4: pass_4(w, x, xs, kv, out); break;
        case 5: pass_5(w, x, xs, kv, out); break;
        case 6: pass_6(w, x, xs, kv, out); break;
        case 7: pass_7(w, x, xs, kv, out); break;
        default: pass_8(w, x, xs, kv, out); break;
    }
}

int small_gemm_f32(const float *x, int64_t m, int64_t k, int64_t x_stride, const float *w, int64_t n,
                   const float *bias, float *y, int64_t y_stride, int threads) {
    if (m < 1 || m > SMALL_GEMM_MAX_ROWS || k < 1 || n < 1 || x_stride < k || y_stride < n) return 1;
    const int64_t kv = k / LANES * LANES;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t o = 0; o < n; o++) {
        const float *wr = w + o * k;
        lanes_t lanes[SMALL_GEMM_MAX_ROWS];
        for (int64_t r0 = 0; r0 < m; r0 += PASS)
            pass_rows(m - r0 < PASS ? m - r0 : PASS, wr, x + r0 * x_stride, x_stride, kv, lanes + r0);
        for (int64_t r = 0; r < m; r++) {
            float s = sum_lanes((const float *)&lanes[r]);
            for (int64_t i = kv; i < k; i++) s = madd1(wr[i], x[r * x_stride + i], s);
            if (bias) s += bias[o];
            y[r * y_stride + o] = s;
        }
    }
    return 0;
}

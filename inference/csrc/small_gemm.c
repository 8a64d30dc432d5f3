/* y = x . w^T (+ bias) for the rows of a decode step: the step's GEMMs, from one row to a full batch.
 *
 * x is [m, k] (row stride x_stride), w is [n, k] contiguous, y is [m, n] (row stride y_stride).
 *
 * Every output is summed the same way, whatever m is and wherever its row falls: over k in blocks
 * of KB, each block from zero by multiply-adds in order of k, the blocks' sums added in order, then
 * the bias. So a row's outputs are the same bits in a step of 1 row, in an eight-token verify step
 * and in a batch of 128 (speculation on and off then agree bit for bit). Two kernels compute it:
 *
 * - rows (full groups of eight rows): x packed k-major, eight rows to a vector; a tile of MV such
 *   vectors by NR rows of w, each weight broadcast and multiplied into MV accumulators. Nothing is
 *   summed across lanes, each weight is read once per tile and each row vector once per NR weights.
 * - few rows (the rest, fewer than eight): eight rows of w to a vector of outputs, each 8 x 8 piece
 *   of w transposed in registers, each x value broadcast. A step of one row is bound by reading
 *   the weights, so the transposes cost nothing that shows.
 * - wide rows (AVX-512 builds, `small_gemm_f32_wide`, from 16 rows): the rows kernel with sixteen rows
 *   to a 512-bit vector, the same sums lane for lane. On a CPU whose FMA units are 512 bits wide it
 *   does twice the work an instruction: Zen 5 (EPYC, family 26), 2 threads, SmolLM2's shapes, best of
 *   two interleaved medians: 32-256 rows 1.6-1.9x (193-202 -> 338-376 GFLOP/s for q/o/gate/up/down),
 *   16 rows 1.35-1.43x, the LM head 1.1-1.6x; a GRPO 32 x n=8 fp32 rollout 1.39-1.41x. Zen 4 splits a
 *   512-bit FMA in two (the narrow tiles were 0-15% ahead there), so small_gemm.py times both once.
 *
 * Why not MKL: its sgemm at 1-64 rows runs below the machine's memory bandwidth and matmul rate,
 * and rounds a row by how many rows share the call. Past MAX_ROWS (small_gemm.py) MKL takes over.
 * Measured against the kernel before (a tile of 3 rows by 4 weights, eight lanes along k summed by a
 * tree at the end; SmolLM2's GEMMs, one thread, Zen 3, weights streamed from memory, median of 7
 * interleaved): 1-2 rows even (35-38 ms), 4 rows 52 -> 45, 16 rows 97-111 -> 77-88, 32 rows
 * 142-189 -> 128-140, 64 rows 288-332 -> 243-266, 128 rows 616 -> 486-492; 5-7 rows ~5% slower
 * (one group of eight padded). Weights in cache, 1536 x 576: 16-128 rows 58-77 -> 80-90 GFLOP/s.
 */
#pragma GCC optimize("no-associative-math", "fp-contract=off")
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "lanes.h"

#define KB 64
#ifndef PF_FEW
#define PF_FEW 1
#endif
#ifndef PF_FEW_HINT
#define PF_FEW_HINT 2
#endif /* the k of a block summed from zero (a multiple of LANES) */

/* the rows kernel's tile: MV vectors of eight rows by NR rows of w, MV * NR accumulators, MV row
 * vectors and one broadcast weight in registers (AVX-512 has 32 vector registers, AVX2 16).
 * A call's groups go MV at a time; on AVX2 (MV 2) what is left at the end takes a tile of its
 * own: one group NR1 = 12 rows of w, three groups NR3 = 4. A lone group under the 1 x 6 tile had
 * only six chains of multiply-adds, fewer than Zen 3 keeps in flight (two a cycle, four cycles
 * each). SmolLM2's GEMMs, one thread, weights streamed from memory, every row count from 5 to 72,
 * interleaved medians: 5-8 rows (one group) 4-19% faster, 17-24 (three) 4-11%, 33-40 (five)
 * 2-13%, 49-56 and 65-72 a few %; even counts of groups unchanged (the same tiles, 0.91-1.05).
 * AVX-512's lone group already has eight chains (1 x 8), and it has no odd leftover of three. */
#if defined(__AVX512VL__)
#define MV 3
#define NR 8
#define NR1 NR
#define NR3 NR
#elif defined(__AVX__)
#define MV 2
#define NR 6
#define NR1 12
#define NR3 4
#else /* SSE: a vector is two registers */
#define MV 1
#define NR 4
#define NR1 NR
#define NR3 NR
#endif
#define NR_MAX (NR1 > NR ? NR1 : NR) /* the widest tile */
#define TASK (NR * 4) /* outputs of w a parallel task takes, every row */
#define FEW 4
#define ROWS_FROM 5 /* from this many rows the rows kernel takes them all (measured: 5-7 rows a little faster) */ /* rows of the few-rows kernel's tile: its accumulators beside eight weight vectors */

static inline __attribute__((always_inline)) lanes_t load(const float *p) {
    lanes_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline __attribute__((always_inline)) lanes_t splat(float x) { return (lanes_t){x, x, x, x, x, x, x, x}; }

/* c + a * b: one fused multiply-add where the CPU has one (x86-64-v3 and up; by intrinsic, since
 * GCC contracts `c + a * b` in some loops and not in others), else a product and a sum (no
 * contraction in this file): either way the same operation in both kernels */
#if defined(__FMA__) && defined(__AVX__)
#include <immintrin.h>
static inline __attribute__((always_inline)) lanes_t madd(lanes_t a, lanes_t b, lanes_t c) {
    return (lanes_t)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
}
#else
static inline __attribute__((always_inline)) lanes_t madd(lanes_t a, lanes_t b, lanes_t c) { return c + a * b; }
#endif

/* `v`, held in a register: left to itself GCC folds loads into the multiply-adds' memory operands,
 * reloading a value once per use (measured on the tile before this one: 16 loads for 12 FMAs, the
 * tile waiting on its loads). The empty asm says "v may have changed", so it is not re-read. Where
 * a vector is two SSE registers there is no such constraint. */
static inline __attribute__((always_inline)) lanes_t in_register(lanes_t v) {
#if defined(__AVX512VL__)
    __asm__("" : "+v"(v));
#elif defined(__AVX__)
    __asm__("" : "+x"(v));
#endif
    return v;
}

/* r[i] <- the i-th lanes of r[0..7] (an 8 x 8 transpose in registers) */
static inline __attribute__((always_inline)) void transpose8(lanes_t *r) {
    lanes_t t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = __builtin_shufflevector(r[i], r[i + 1], 0, 8, 1, 9, 4, 12, 5, 13);
        t[i + 1] = __builtin_shufflevector(r[i], r[i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = __builtin_shufflevector(t[i], t[i + 2], 0, 1, 8, 9, 4, 5, 12, 13);
        u[i + 1] = __builtin_shufflevector(t[i], t[i + 2], 2, 3, 10, 11, 6, 7, 14, 15);
        u[i + 2] = __builtin_shufflevector(t[i + 1], t[i + 3], 0, 1, 8, 9, 4, 5, 12, 13);
        u[i + 3] = __builtin_shufflevector(t[i + 1], t[i + 3], 2, 3, 10, 11, 6, 7, 14, 15);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = __builtin_shufflevector(u[i], u[i + 4], 0, 1, 2, 3, 8, 9, 10, 11);
        r[i + 4] = __builtin_shufflevector(u[i], u[i + 4], 4, 5, 6, 7, 12, 13, 14, 15);
    }
}

/* ---- rows: x packed eight rows to a vector -------------------------------------------------- */

/* xt[g * k * 8 + kk * 8 + r] = x[(g * 8 + r) * xs + kk] for the m rows in groups of eight, the
 * last group's missing rows zero */
static void pack_rows(const float *x, int64_t m, int64_t k, int64_t xs, float *xt) {
    const int64_t k8 = k / 8 * 8;
    for (int64_t g = 0; g * 8 < m; g++) {
        const float *src = x + g * 8 * xs;
        float *dst = xt + g * k * 8;
        const int rows = m - g * 8 < 8 ? (int)(m - g * 8) : 8;
        for (int64_t kk = 0; kk < k8; kk += 8) {
            lanes_t r[8];
            for (int i = 0; i < 8; i++) r[i] = i < rows ? load(src + i * xs + kk) : splat(0.0f);
            transpose8(r);
            for (int i = 0; i < 8; i++) memcpy(dst + (kk + i) * 8, &r[i], sizeof(lanes_t));
        }
        for (int64_t kk = k8; kk < k; kk++)
            for (int i = 0; i < 8; i++) dst[kk * 8 + i] = i < rows ? src[i * xs + kk] : 0.0f;
    }
}

/* y for `mv` groups of eight rows (packed at xt, groups k * 8 apart) by rows o < nr of w */
static inline __attribute__((always_inline)) void rows_tile(
    const int mv, const int nr, const float *xt, const float *w, int64_t k, const float *bias, float *y, int64_t ys,
    int64_t rows) {
    lanes_t total[3][NR_MAX], acc[3][NR_MAX];
    for (int v = 0; v < mv; v++)
        for (int o = 0; o < nr; o++) total[v][o] = splat(0.0f);
    for (int64_t k0 = 0; k0 < k; k0 += KB) {
        const int64_t k1 = k0 + KB < k ? k0 + KB : k;
        for (int v = 0; v < mv; v++)
            for (int o = 0; o < nr; o++) acc[v][o] = splat(0.0f);
        for (int64_t kk = k0; kk < k1; kk++) {
            /* the next tile's weights (the nr * k floats after this tile's, as rows_any's callers
             * walk w), nr floats further each step of k, so they are covered when k is, into L2
             * (a line twice at nr = 8; the second is nearly free): without it a tile's eight weight
             * streams wait on memory whenever few row groups share each weight. A prefetch past
             * the weights' end is dropped by the CPU, not a fault. Zen 4, a whole SmolLM2 step's
             * GEMMs from memory, interleaved medians: 8 rows 1.63x, 16 1.21x, 24 1.18x, 32 1.14x,
             * 64 1.03x, 128 1.05x (an x86-64-v3 build: 1.51x, 1.42x, 1.22x at 32, 1.12x at 64),
             * the same bits */
            __builtin_prefetch(w + nr * k + kk * nr, 0, 2);
            lanes_t xv[3];
            for (int v = 0; v < mv; v++) xv[v] = in_register(load(xt + v * k * 8 + kk * 8));
            for (int o = 0; o < nr; o++) {
                const lanes_t wv = in_register(splat(w[o * k + kk]));
                for (int v = 0; v < mv; v++) acc[v][o] = madd(xv[v], wv, acc[v][o]);
            }
        }
        for (int v = 0; v < mv; v++)
            for (int o = 0; o < nr; o++) total[v][o] += acc[v][o];
    }
    for (int v = 0; v < mv; v++)
        for (int o = 0; o < nr; o++)
            for (int r = 0; r < LANES && v * 8 + r < rows; r++)
                y[(v * 8 + r) * ys + o] = bias ? total[v][o][r] + bias[o] : total[v][o][r];
}

#define ROWS_CASE(A, B) case (A) * 32 + (B): rows_tile(A, B, xt, w, k, bias, y, ys, rows); break;
#define ROWS_4(A) ROWS_CASE(A, 1) ROWS_CASE(A, 2) ROWS_CASE(A, 3) ROWS_CASE(A, 4)
#define ROWS_6(A) ROWS_4(A) ROWS_CASE(A, 5) ROWS_CASE(A, 6)
#define ROWS_8(A) ROWS_6(A) ROWS_CASE(A, 7) ROWS_CASE(A, 8)
#define ROWS_12(A) ROWS_8(A) ROWS_CASE(A, 9) ROWS_CASE(A, 10) ROWS_CASE(A, 11) ROWS_CASE(A, 12)
#define ROWS_UPTO(N, A) ROWS_UPTO_(N, A)
#define ROWS_UPTO_(N, A) ROWS_##N(A)
/* one tile of `mv` groups by `nr` rows of w (nr up to that mv's width: the last tile of a call may be narrower) */
static void rows_any(int mv, int nr, const float *xt, const float *w, int64_t k, const float *bias, float *y,
                     int64_t ys, int64_t rows) {
    switch (mv * 32 + nr) {
        ROWS_UPTO(NR1, 1)
#if MV >= 2
        ROWS_UPTO(NR, 2)
#endif
#if MV >= 3
        ROWS_UPTO(NR, 3)
#elif MV == 2
        ROWS_UPTO(NR3, 3)
#endif
        default: break;
    }
}

/* groups a tile takes from `left` groups still to do: MV, or at the end three (when MV is 2) or one */
static inline int tile_groups(int64_t left) {
    if (left >= MV) return MV == 2 && left == 3 ? 3 : MV;
    return (int)left;
}

static inline int tile_width(int mv) { return mv == 1 ? NR1 : mv == 3 ? NR3 : NR; }

/* A task's tiles write into `stage` (rows of `TASK` floats), then each row goes out whole (copy_out):
 * rows of y a page or more apart (the LM head's: 49152 floats) fall in the same few cache sets, and
 * the tiles' part-line stores straight into y (a tile's eight outputs are half a line) evicted each
 * other, every line read in again for each tile that finished it. SmolLM2's LM head, wide tile, Zen
 * 5, 2 threads, interleaved medians: 32-256 rows 184-213 -> 300-342 GFLOP/s (narrow tile 1.06-1.08x),
 * the other shapes level; a GRPO 32 x n=8 fp32 rollout in process 1.06-1.16x. The same bits. */
static inline void copy_out(const float *stage, int64_t rows, int64_t cols, float *y, int64_t ys, int task) {
    for (int64_t r = 0; r < rows; r++) memcpy(y + r * ys, stage + r * task, (size_t)cols * sizeof(float));
}

/* ---- few rows: eight outputs to a vector ----------------------------------------------------- */

/* y for rows r < mr of x by rows o < nr (at most eight) of w */
static inline __attribute__((always_inline)) void few_tile(
    const int mr, const int nr, const float *x, int64_t xs, const float *w, int64_t k, const float *bias, float *y,
    int64_t ys, const float *pf) {
    const int64_t k8 = k / 8 * 8;
    lanes_t total[FEW], acc[FEW];
    for (int r = 0; r < FEW; r++) total[r] = acc[r] = splat(0.0f);
    for (int64_t k0 = 0; k0 < k; k0 += KB) {
        const int64_t k1 = k0 + KB < k ? k0 + KB : k;
        for (int r = 0; r < mr; r++) acc[r] = splat(0.0f);
        int64_t kk = k0;
        for (; kk + 8 <= k1 && kk < k8; kk += 8) {
            if (pf && (kk & 15) == 0) /* the next tile's rows, as far along: one line each per 16 k */
                for (int o = 0; o < 8; o++) __builtin_prefetch(pf + o * k + kk, 0, 2);
            lanes_t wt[8];
            for (int o = 0; o < 8; o++) wt[o] = o < nr ? load(w + o * k + kk) : splat(0.0f);
            transpose8(wt); /* wt[i] = w[0..7][kk + i] */
            for (int i = 0; i < 8; i++)
                for (int r = 0; r < mr; r++) acc[r] = madd(splat(x[r * xs + kk + i]), wt[i], acc[r]);
        }
        for (; kk < k1; kk++) { /* k past its last multiple of eight */
            lanes_t wv = splat(0.0f);
            for (int o = 0; o < nr; o++) wv[o] = w[o * k + kk];
            for (int r = 0; r < mr; r++) acc[r] = madd(splat(x[r * xs + kk]), wv, acc[r]);
        }
        for (int r = 0; r < mr; r++) total[r] += acc[r];
    }
    for (int r = 0; r < mr; r++)
        for (int o = 0; o < nr; o++) y[r * ys + o] = bias ? total[r][o] + bias[o] : total[r][o];
}

#define FEW_CASE(A) case A: few_tile(A, nr, x, xs, w, k, bias, y, ys, pf); break;
static void few_any(int mr, int nr, const float *x, int64_t xs, const float *w, int64_t k, const float *bias, float *y,
                    int64_t ys, const float *pf) {
    switch (mr) {
        FEW_CASE(1)
        FEW_CASE(2)
        FEW_CASE(3)
        FEW_CASE(4)
        default: break;
    }
}

/* ---- wide rows: sixteen rows to a 512-bit vector (AVX-512) ------------------------------------- */

/* The rows kernel's tile, a vector holding sixteen rows instead of eight: each lane does the same
 * multiply-adds in the same order as before (lanes are rows, never parts of one sum), so every output
 * is the same bits as the eight-row kernel's. Which is faster depends on the CPU, not the shape: a CPU
 * with full-width 512-bit FMA units (Zen 5, Intel's server cores) does twice the work per instruction,
 * one that splits them in two (Zen 4) does the same and carries more padding; small_gemm.py picks per
 * machine by timing both once. */
#if defined(__AVX512F__)
#define WIDE 1
#define WMV 3 /* vectors of sixteen rows in a tile, by WNR rows of w: 24 accumulators of 32 registers */
#define WNR 8
#define WTASK (WNR * 4)
typedef float wlanes_t __attribute__((vector_size(64)));

static inline __attribute__((always_inline)) wlanes_t wload(const float *p) {
    wlanes_t v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline __attribute__((always_inline)) wlanes_t wsplat(float x) { return (wlanes_t)_mm512_set1_ps(x); }
static inline __attribute__((always_inline)) wlanes_t wmadd(wlanes_t a, wlanes_t b, wlanes_t c) {
    return (wlanes_t)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
}
static inline __attribute__((always_inline)) wlanes_t win_register(wlanes_t v) {
    __asm__("" : "+v"(v));
    return v;
}

/* xt[kk * 16 + r] = x[(g * 16 + r) * xs + kk] for group g's sixteen rows (xt at the group), rows past m zero */
static void pack_group16(const float *x, int64_t m, int64_t k, int64_t xs, int64_t g, float *xt) {
    const int64_t k8 = k / 8 * 8;
    for (int h = 0; h < 2; h++) {
        const int64_t first = g * 16 + h * 8;
        const int rows = m - first < 0 ? 0 : m - first < 8 ? (int)(m - first) : 8;
        const float *src = x + first * xs;
        for (int64_t kk = 0; kk < k8; kk += 8) {
            lanes_t r[8];
            for (int i = 0; i < 8; i++) r[i] = i < rows ? load(src + i * xs + kk) : splat(0.0f);
            transpose8(r);
            for (int i = 0; i < 8; i++) memcpy(xt + (kk + i) * 16 + h * 8, &r[i], sizeof(lanes_t));
        }
        for (int64_t kk = k8; kk < k; kk++)
            for (int i = 0; i < 8; i++) xt[kk * 16 + h * 8 + i] = i < rows ? src[i * xs + kk] : 0.0f;
    }
}

/* y for `mv` groups of sixteen rows (packed at xt, groups k * 16 apart) by rows o < nr of w: rows_tile's
 * sums, lane for lane */
static inline __attribute__((always_inline)) void wide_tile(
    const int mv, const int nr, const float *xt, const float *w, int64_t k, const float *bias, float *y, int64_t ys,
    int64_t rows) {
    wlanes_t total[WMV][WNR], acc[WMV][WNR];
    for (int v = 0; v < mv; v++)
        for (int o = 0; o < nr; o++) total[v][o] = wsplat(0.0f);
    for (int64_t k0 = 0; k0 < k; k0 += KB) {
        const int64_t k1 = k0 + KB < k ? k0 + KB : k;
        for (int v = 0; v < mv; v++)
            for (int o = 0; o < nr; o++) acc[v][o] = wsplat(0.0f);
        for (int64_t kk = k0; kk < k1; kk++) {
            __builtin_prefetch(w + nr * k + kk * nr, 0, 2); /* the next tile's weights, as rows_tile does */
            wlanes_t xv[WMV];
            for (int v = 0; v < mv; v++) xv[v] = win_register(wload(xt + v * k * 16 + kk * 16));
            for (int o = 0; o < nr; o++) {
                const wlanes_t wv = win_register(wsplat(w[o * k + kk]));
                for (int v = 0; v < mv; v++) acc[v][o] = wmadd(xv[v], wv, acc[v][o]);
            }
        }
        for (int v = 0; v < mv; v++)
            for (int o = 0; o < nr; o++) total[v][o] += acc[v][o];
    }
    for (int v = 0; v < mv; v++)
        for (int o = 0; o < nr; o++)
            for (int r = 0; r < 16 && v * 16 + r < rows; r++)
                y[(v * 16 + r) * ys + o] = bias ? total[v][o][r] + bias[o] : total[v][o][r];
}

#define WIDE_CASE(A, B) case (A) * 32 + (B): wide_tile(A, B, xt, w, k, bias, y, ys, rows); break;
#define WIDE_8(A) WIDE_CASE(A, 1) WIDE_CASE(A, 2) WIDE_CASE(A, 3) WIDE_CASE(A, 4) WIDE_CASE(A, 5) WIDE_CASE(A, 6) \
    WIDE_CASE(A, 7) WIDE_CASE(A, 8)
static void wide_any(int mv, int nr, const float *xt, const float *w, int64_t k, const float *bias, float *y,
                     int64_t ys, int64_t rows) {
    switch (mv * 32 + nr) {
        WIDE_8(1)
        WIDE_8(2)
        WIDE_8(3)
        default: break;
    }
}
#else
#define WIDE 0
#endif

/* ---- the call ---------------------------------------------------------------------------------- */

/* NOTE: an output this large is fresh memory of its own (glibc maps anything past 32 MB anew, and
 * unmaps it when freed): the LM head's at 171 rows or more. Its first writes fault it in a 4 KB page
 * at a time (~25 ms for 256 rows x 49152 floats, a third of the product); asked for huge pages
 * (where the kernel's transparent huge pages are `madvise`, the common default) it faults in 2 MB at
 * a time. Nothing else changes: it is a hint, ignored where huge pages are off. */
#define HUGE_FROM ((size_t)32 << 20)
static void advise_huge(void *y, size_t bytes) {
#ifdef MADV_HUGEPAGE
    if (bytes < HUGE_FROM) return;
    const uintptr_t page = 4096, start = ((uintptr_t)y + page - 1) & ~(page - 1);
    const uintptr_t end = ((uintptr_t)y + bytes) & ~(page - 1);
    if (end > start) madvise((void *)start, end - start, MADV_HUGEPAGE);
#else
    (void)y, (void)bytes;
#endif
}

static __thread float *packed; /* the calling thread's packed rows, grown as needed, never freed */
static __thread size_t packed_floats;

int small_gemm_f32(const float *x, int64_t m, int64_t k, int64_t x_stride, const float *w, int64_t n,
                   const float *bias, float *y, int64_t y_stride, int threads) {
    if (m < 1 || k < 1 || n < 1 || x_stride < k || y_stride < n) return 1;
    /* ROWS_FROM rows or more: all of them by the rows kernel, the last group padded with zero rows
     * (cheaper than a second pass over the weights by the few-rows kernel); fewer: the few-rows one */
    const int64_t groups = m >= ROWS_FROM ? (m + 7) / 8 : 0;
    if (groups) {
        const size_t need = (size_t)(groups * k * 8);
        if (need > packed_floats) {
            free(packed);
            packed = aligned_alloc(64, (need * sizeof(float) + 63) / 64 * 64);
            packed_floats = packed ? need : 0;
            if (!packed) return 2;
        }
        pack_rows(x, m, k, x_stride, packed);
    }
    advise_huge(y, (size_t)(m - 1) * y_stride * sizeof(float) + (size_t)n * sizeof(float));
    const float *xt = packed;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t o = 0; o < n; o += TASK) { /* NOTE: TASK outputs a task: both kernels' tiles fit */
        const int64_t o_end = o + TASK < n ? o + TASK : n;
        float stage[3 * 8 * TASK] __attribute__((aligned(64))); /* a tile's rows (MV or three groups) */
        for (int64_t g = 0, mv; g < groups; g += mv) {
            mv = tile_groups(groups - g);
            const int width = tile_width((int)mv);
            for (int64_t t = o; t < o_end; t += width) {
                const int nr = o_end - t < width ? (int)(o_end - t) : width;
                rows_any((int)mv, nr, xt + g * k * 8, w + t * k, k, bias ? bias + t : NULL, stage + (t - o), TASK,
                         m - g * 8);
            }
            copy_out(stage, m - g * 8 < mv * 8 ? m - g * 8 : mv * 8, o_end - o, y + g * 8 * y_stride + o, y_stride,
                     TASK);
        }
        for (int64_t r = groups ? m : 0; r < m; r += FEW) {
            const int mr = m - r < FEW ? (int)(m - r) : FEW;
            for (int64_t t = o; t < o_end; t += 8) {
                const int nr = o_end - t < 8 ? (int)(o_end - t) : 8;
                const float *pf = t + 16 <= n ? w + (t + 8) * k : NULL;
                few_any(mr, nr, x + r * x_stride, x_stride, w + t * k, k, bias ? bias + t : NULL,
                        y + r * y_stride + t, y_stride, pf);
            }
        }
    }
    return 0;
}

/* The same products as small_gemm_f32, the same bits, by the wide rows kernel where the build has
 * AVX-512 and there are WIDE_FROM rows or more (fewer: small_gemm_f32 itself, whose tiles waste less
 * on padding); elsewhere small_gemm_f32. */
#define WIDE_FROM 16
static __thread float *wide_packed;
static __thread size_t wide_packed_floats;

int small_gemm_f32_wide(const float *x, int64_t m, int64_t k, int64_t x_stride, const float *w, int64_t n,
                        const float *bias, float *y, int64_t y_stride, int threads) {
#if WIDE
    if (m < WIDE_FROM || k < 1 || n < 1 || x_stride < k || y_stride < n)
        return small_gemm_f32(x, m, k, x_stride, w, n, bias, y, y_stride, threads);
    const int64_t groups = (m + 15) / 16;
    const size_t need = (size_t)(groups * k * 16);
    if (need > wide_packed_floats) {
        free(wide_packed);
        wide_packed = aligned_alloc(64, (need * sizeof(float) + 63) / 64 * 64);
        wide_packed_floats = wide_packed ? need : 0;
        if (!wide_packed) return 2;
    }
    float *xt = wide_packed; /* the calling thread's buffer, filled and read by the whole team */
    advise_huge(y, (size_t)(m - 1) * y_stride * sizeof(float) + (size_t)n * sizeof(float));
    /* NOTE: the groups packed by the team, not before it: a step's products pack the same rows again
     * for each weight (q, k, v; gate, up), and a serial pack kept the other threads waiting */
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) pack_group16(x, m, k, x_stride, g, xt + g * k * 16);
        #pragma omp for schedule(static)
        for (int64_t o = 0; o < n; o += WTASK) { /* NOTE: WTASK outputs a task, as small_gemm_f32's */
            const int64_t o_end = o + WTASK < n ? o + WTASK : n;
            float stage[WMV * 16 * WTASK] __attribute__((aligned(64))); /* see copy_out */
            for (int64_t g = 0, mv; g < groups; g += mv) {
                mv = groups - g < WMV ? groups - g : WMV;
                for (int64_t t = o; t < o_end; t += WNR) {
                    const int nr = o_end - t < WNR ? (int)(o_end - t) : WNR;
                    wide_any((int)mv, nr, xt + g * k * 16, w + t * k, k, bias ? bias + t : NULL, stage + (t - o),
                             WTASK, m - g * 16);
                }
                copy_out(stage, m - g * 16 < mv * 16 ? m - g * 16 : mv * 16, o_end - o, y + g * 16 * y_stride + o,
                         y_stride, WTASK);
            }
        }
    }
    return 0;
#else
    return small_gemm_f32(x, m, k, x_stride, w, n, bias, y, y_stride, threads);
#endif
}

/* 1 where small_gemm_f32_wide has a kernel of its own in this build (AVX-512), else 0 */
int small_gemm_f32_has_wide(void) { return WIDE; }

/* y = x . w^T (+ bias) in bf16 for the rows of a decode step, fp32 sums, each output rounded once.
 *
 * x is [m, k] bf16 (row stride x_stride); w comes packed by `pack_pairs_bf16`: outputs in blocks of
 * 16, k in pairs, the NVT blocks of a tile interleaved so that a tile reads one stream:
 * P[tile][j][block][lane][2] = w[(tile * NVT + block) * 16 + lane][2j, 2j + 1] (outputs past n and the
 * odd k's partner zero; the last tile may hold fewer blocks); y is [m, n] bf16 (row stride y_stride);
 * bias bf16 or NULL. A pack is read by the build that made it (NVT differs between builds).
 *
 * Every output is summed the same way, whatever m is and wherever its row falls: from zero, over the
 * pairs of k in order, each pair's odd product added and then its even one (each product of two bf16
 * values is exact in fp32, so each add rounds once), then the bias, then rounded to bf16 (nearest,
 * ties to even). That is what AVX-512 BF16's VDPBF16PS does, lane by lane, so on a CPU with it one
 * such instruction does a pair for sixteen outputs; elsewhere fp32 multiply-adds do the same
 * operations in the same order (the same bits: tested against a build for a CPU without it). The one
 * difference is below fp32's normal range (|v| < 1.2e-38): VDPBF16PS flushes such inputs and sums to
 * zero, the multiply-adds keep them; activations and weights never come near it.
 *
 * So a row's outputs are the same bits in a step of one row and in a batch of MAX_ROWS
 * (small_gemm.py). Why not oneDNN (`packed_weights.py`, the same kernel as `F.linear`): its bf16
 * product at a few rows reads weights at about half the machine's memory bandwidth. SmolLM2-135M's
 * decode-step products (every layer and the LM head, q/k/v and gate/up one pack each), 2 threads,
 * Zen 4, medians of interleaved runs, this kernel vs oneDNN on its packs: 1 row 9.6 vs 15.0 ms, 4 rows
 * 10.1 vs 13.9, 16 rows 14.7 vs 20.7, 64 rows 50.4 vs 50.9, 128 rows 90.2 vs 93.3. Tiles tried:
 * 8 rows x 3 blocks, 6 x 4, 4 x 6, 12 x 2, 8 x 1, 2 x 12: within the noise at 1-4 rows, 8 x 1 and
 * 2 x 12 behind from 16 rows (fewer accumulators or fewer rows per weight read).
 */
#pragma GCC optimize("no-associative-math", "fp-contract=off")
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "lanes.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define DPBF16 1
#include <immintrin.h>
#define RT 8  /* rows of a tile */
#define NVT 3 /* blocks of 16 outputs in a tile: RT * NVT accumulators, NVT weights and a row's pair in registers */
#else
#define DPBF16 0
#if defined(__FMA__) && defined(__AVX__)
#include <immintrin.h>
#endif
#define RT 4
#define NVT 1 /* two vectors of eight lanes per block: 8 accumulators and four widened weight vectors */
#endif

/* ---- packing ---------------------------------------------------------------------------------- */

int pack_pairs_bf16(const uint16_t *w, int64_t n, int64_t k, int64_t w_stride, uint16_t *p) {
    if (n < 1 || k < 1 || w_stride < k) return 1;
    const int64_t kp = (k + 1) / 2, blocks = (n + 15) / 16;
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t j = 0; j < kp; j++) {
            const int64_t first = b / NVT * NVT, nv = blocks - first < NVT ? blocks - first : NVT;
            uint16_t *dst = p + first * kp * 32 + (j * nv + (b - first)) * 32;
            for (int l = 0; l < 16; l++) {
                const int64_t o = b * 16 + l;
                for (int e = 0; e < 2; e++) {
                    const int64_t kk = 2 * j + e;
                    dst[l * 2 + e] = o < n && kk < k ? w[o * w_stride + kk] : 0;
                }
            }
        }
    return 0;
}

/* the pair (x[2j], x[2j + 1]) as one 32-bit value, the partner past an odd k zero */
static inline __attribute__((always_inline)) uint32_t x_pair(const uint16_t *x, int64_t j, int64_t k) {
    if (2 * j + 1 < k) {
        uint32_t v;
        memcpy(&v, x + 2 * j, 4);
        return v;
    }
    return x[2 * j];
}

#if DPBF16
/* rows r < R of x by blocks v < NV of the packed weights (p at the tile's first block) */
static inline __attribute__((always_inline)) void tile(
    const int R, const int NV, const uint16_t *x, int64_t xs, const uint16_t *p, int64_t k, const uint16_t *bias,
    uint16_t *y, int64_t ys, int valid) {
    const int64_t kp = (k + 1) / 2;
    __m512 acc[RT][NVT];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < NV; v++) acc[r][v] = _mm512_setzero_ps();
    for (int64_t j = 0; j < kp; j++) {
        __m512bh wv[NVT];
        for (int v = 0; v < NV; v++) wv[v] = (__m512bh)_mm512_loadu_si512(p + (j * NV + v) * 32);
        for (int r = 0; r < R; r++) {
            const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)x_pair(x + r * xs, j, k));
            for (int v = 0; v < NV; v++) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], wv[v], xb);
        }
    }
    /* plus the bias, rounded by VCVTNEPS2BF16 (nearest, ties to even, as `round_bf16`), the outputs
     * past `valid` masked off */
    for (int v = 0; v < NV; v++) {
        const int left = valid - v * 16;
        const __mmask16 keep = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1u);
        const __m512 b = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                    _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(keep, bias + v * 16)), 16))
                              : _mm512_setzero_ps();
        for (int r = 0; r < R; r++) {
            const __m512 sum = bias ? _mm512_add_ps(acc[r][v], b) : acc[r][v];
            _mm256_mask_storeu_epi16(y + r * ys + v * 16, keep, (__m256i)_mm512_cvtneps_pbh(sum));
        }
    }
}
#else
/* one value's rounding, as VCVTNEPS2BF16's: nearest, ties to even, as bf16.h's `f32_to_bf16`, but a
 * NaN keeps its payload (quietened) as the instruction keeps it, where bf16.h gives torch's one NaN */
static inline uint16_t round_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN, quiet */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* a tile's results: outputs o < valid of each row, plus the bias, rounded */
static inline __attribute__((always_inline)) void store(const float *sums, int valid, const uint16_t *bias,
                                                        uint16_t *y) {
    for (int o = 0; o < valid; o++) y[o] = round_bf16(bias ? sums[o] + bf16_to_f32(bias[o]) : sums[o]);
}

static inline __attribute__((always_inline)) lanes_t splat(float v) { return (lanes_t){v, v, v, v, v, v, v, v}; }

/* c + a * b: one fused multiply-add where the CPU has one, else a product and a sum; a product of
 * two bf16 values is exact, so both round once, alike */
static inline __attribute__((always_inline)) lanes_t madd(lanes_t a, lanes_t b, lanes_t c) {
#if defined(__FMA__) && defined(__AVX__)
    return (lanes_t)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return c + a * b;
#endif
}

typedef uint32_t pairs_t __attribute__((vector_size(LANES * sizeof(uint32_t))));

static inline __attribute__((always_inline)) void tile(
    const int R, const int NV, const uint16_t *x, int64_t xs, const uint16_t *p, int64_t k, const uint16_t *bias,
    uint16_t *y, int64_t ys, int valid) {
    (void)NV; /* one block of 16 outputs: two vectors of eight */
    const int64_t kp = (k + 1) / 2;
    lanes_t acc[RT][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = splat(0.0f);
    for (int64_t j = 0; j < kp; j++) {
        lanes_t odd[2], even[2];
        for (int h = 0; h < 2; h++) {
            pairs_t u;
            memcpy(&u, p + j * 32 + h * 16, sizeof u);
            const pairs_t hi = u & 0xffff0000u, lo = u << 16;
            memcpy(&odd[h], &hi, sizeof hi);
            memcpy(&even[h], &lo, sizeof lo);
        }
        for (int r = 0; r < R; r++) {
            const uint32_t xx = x_pair(x + r * xs, j, k), xhi = xx & 0xffff0000u, xlo = xx << 16;
            float xo, xe;
            memcpy(&xo, &xhi, 4);
            memcpy(&xe, &xlo, 4);
            for (int h = 0; h < 2; h++) acc[r][h] = madd(even[h], splat(xe), madd(odd[h], splat(xo), acc[r][h]));
        }
    }
    for (int r = 0; r < R; r++) {
        float sums[16];
        memcpy(sums, &acc[r][0], sizeof(lanes_t));
        memcpy(sums + 8, &acc[r][1], sizeof(lanes_t));
        store(sums, valid, bias, y + r * ys);
    }
}
#endif

#define CASE(A, B) case (A) * 16 + (B): tile(A, B, x, xs, p, k, bias, y, ys, valid); break;
#if NVT == 3
#define ROW(A) CASE(A, 1) CASE(A, 2) CASE(A, 3)
#else
#define ROW(A) CASE(A, 1)
#endif
static void tile_any(int rows, int blocks, const uint16_t *x, int64_t xs, const uint16_t *p, int64_t k,
                     const uint16_t *bias, uint16_t *y, int64_t ys, int valid) {
    switch (rows * 16 + blocks) {
        ROW(1) ROW(2) ROW(3) ROW(4)
#if RT == 8
        ROW(5) ROW(6) ROW(7) ROW(8)
#endif
        default: break;
    }
}

/* ---- the call ---------------------------------------------------------------------------------- */

int small_gemm_bf16(const uint16_t *x, int64_t m, int64_t k, int64_t x_stride, const uint16_t *p, int64_t n,
                    const uint16_t *bias, uint16_t *y, int64_t y_stride, int threads) {
    if (m < 1 || k < 1 || n < 1 || x_stride < k || y_stride < n) return 1;
    const int64_t kp = (k + 1) / 2, blocks = (n + 15) / 16;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b += NVT) { /* a task: NVT blocks of outputs for every row */
        const int nv = blocks - b < NVT ? (int)(blocks - b) : NVT;
        const int valid = n - b * 16 < nv * 16 ? (int)(n - b * 16) : nv * 16;
        for (int64_t r = 0; r < m; r += RT) {
            const int rows = m - r < RT ? (int)(m - r) : RT;
            tile_any(rows, nv, x + r * x_stride, x_stride, p + b * kp * 32, k, bias ? bias + b * 16 : NULL,
                     y + r * y_stride + b * 16, y_stride, valid);
        }
    }
    return 0;
}

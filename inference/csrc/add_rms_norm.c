/* A residual add and the RMSNorm after it, in one pass over each row of x `[rows, n]`:
 *   x[r] <- x[r] + residual[r]
 *   out[r] <- (x[r] * rstd) * weight,   rstd = 1 / sqrt(sum(x[r]^2) / n + eps)
 * and the RMSNorm alone (`rms_norm_f32`: no residual, x left as it is).
 *
 * Bit for bit what torch's CPU ops give for `x.add_(residual)` then `F.rms_norm(x, (n,), weight,
 * eps)` in fp32. F.rms_norm there is a composite (pow(x, 2); mean = sum / n; add_(eps); rsqrt;
 * mul by rstd; mul by weight), each op rounded on its own: so is every step here (no FMA
 * contraction, no reassociation or reciprocals; see the pragma). The one reduction, the sum of
 * squares, follows torch's `cascade_sum` for a contiguous row (aten/src/ATen/native/cpu/
 * SumKernel.cpp: vectorized_inner_sum -> row_sum -> multi_row_sum) with `lanes` = its
 * Vectorized<float> width, which the caller reads from torch's CPU capability: the row as vectors
 * of `lanes` squares, vector v summed lane-wise into accumulator v % 4 through a 4-level cascade,
 * the leftover vectors into accumulator 0, the four folded in order, then the leftover scalars and
 * the lanes added one by one to 0.
 *
 * bf16 rows (`add_rms_norm_bf16`) follow HF's `LlamaRMSNorm` on bf16 tensors: the residual add
 * rounded to bf16, the row widened to fp32 and normalized as above (times ones), rounded to bf16,
 * then times the bf16 weight, rounded (bf16.h: as torch's bf16 ops round): bit for bit those ops.
 */
#pragma GCC optimize("fp-contract=off", "no-associative-math", "no-reciprocal-math")
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

enum { ILP = 4, LEVELS = 4, MAX_LANES = 16, MAX_BF16_ROW = 32768 /* floats of a row on the stack */ };

/* c10::utils::CeilLog2 */
static int ceil_log2(int64_t x) {
    if (x <= 2) return 1;
    return 64 - __builtin_clzll((uint64_t)(x - 1));
}

static inline __attribute__((always_inline)) float sum_of_squares(const float *x, int64_t n, const int lanes) {
    const int64_t vectors = n / lanes, groups = vectors / ILP;
    const int level_power = ceil_log2(groups) / LEVELS > 4 ? ceil_log2(groups) / LEVELS : 4;
    const int64_t level_step = (int64_t)1 << level_power, level_mask = level_step - 1;
    float acc[LEVELS][ILP][MAX_LANES];
    memset(acc, 0, sizeof(acc));
    int64_t g = 0;
    while (g + level_step <= groups) {
        for (int64_t j = 0; j < level_step; j++, g++)
            for (int k = 0; k < ILP; k++)
                for (int l = 0; l < lanes; l++) {
                    const float v = x[(g * ILP + k) * lanes + l];
                    acc[0][k][l] += v * v;
                }
        for (int j = 1; j < LEVELS; j++) {
            for (int k = 0; k < ILP; k++)
                for (int l = 0; l < lanes; l++) {
                    acc[j][k][l] += acc[j - 1][k][l];
                    acc[j - 1][k][l] = 0.0f;
                }
            if (g & (level_mask << (j * level_power))) break;
        }
    }
    for (; g < groups; g++)
        for (int k = 0; k < ILP; k++)
            for (int l = 0; l < lanes; l++) {
                const float v = x[(g * ILP + k) * lanes + l];
                acc[0][k][l] += v * v;
            }
    for (int j = 1; j < LEVELS; j++)
        for (int k = 0; k < ILP; k++)
            for (int l = 0; l < lanes; l++) acc[0][k][l] += acc[j][k][l];
    for (int64_t v = groups * ILP; v < vectors; v++)  /* row_sum's leftover vectors */
        for (int l = 0; l < lanes; l++) {
            const float s = x[v * lanes + l];
            acc[0][0][l] += s * s;
        }
    for (int k = 1; k < ILP; k++)
        for (int l = 0; l < lanes; l++) acc[0][0][l] += acc[0][k][l];
    float total = 0.0f;
    for (int64_t e = vectors * lanes; e < n; e++) total += x[e] * x[e];
    for (int l = 0; l < lanes; l++) total += acc[0][0][l];
    return total;
}

static inline __attribute__((always_inline)) void add_rms_norm_row(float *x, const float *residual, const float *weight,
                                                                   float *out, int64_t n, float eps, const int lanes) {
    if (residual)
        for (int64_t e = 0; e < n; e++) x[e] = x[e] + residual[e];
    const float mean = sum_of_squares(x, n, lanes) / (float)n;
    const float rstd = 1.0f / sqrtf(mean + eps);
    for (int64_t e = 0; e < n; e++) out[e] = (x[e] * rstd) * weight[e];
}

static inline __attribute__((always_inline)) void add_rms_norm_bf16_row(uint16_t *x, const uint16_t *residual,
                                                                        const uint16_t *weight, uint16_t *out,
                                                                        int64_t n, float eps, const int lanes) {
    float row[n];
    if (residual)
        for (int64_t e = 0; e < n; e++) x[e] = f32_to_bf16(bf16_to_f32(x[e]) + bf16_to_f32(residual[e]));
    for (int64_t e = 0; e < n; e++) row[e] = bf16_to_f32(x[e]);
    const float mean = sum_of_squares(row, n, lanes) / (float)n;
    const float rstd = 1.0f / sqrtf(mean + eps);
    for (int64_t e = 0; e < n; e++)
        out[e] = f32_to_bf16(bf16_to_f32(weight[e]) * bf16_to_f32(f32_to_bf16(row[e] * rstd)));
}

/* one row, fp32 or bf16; `lanes` and `bf16` are constants at each call (one specialisation each) */
static inline __attribute__((always_inline)) void norm_row(char *x, const char *residual, const void *weight,
                                                          char *out, int64_t n, float eps, const int lanes,
                                                          const int bf16) {
    if (bf16)
        add_rms_norm_bf16_row((uint16_t *)x, (const uint16_t *)residual, weight, (uint16_t *)out, n, eps, lanes);
    else
        add_rms_norm_row((float *)x, (const float *)residual, weight, (float *)out, n, eps, lanes);
}

static inline __attribute__((always_inline)) int norm_rows(void *x, const void *residual, const void *weight,
                                                           void *out, int64_t rows, int64_t n, float eps, int lanes,
                                                           int threads, const int bf16) {
    if (rows < 0 || n <= 0 || (lanes != 8 && lanes != 16) || n < lanes) return 1;
    const int64_t row_bytes = n * (bf16 ? 2 : 4);
    #pragma omp parallel for num_threads(threads) schedule(static) if (rows * n >= 65536)
    for (int64_t r = 0; r < rows; r++) {
        char *xr = (char *)x + r * row_bytes, *o = (char *)out + r * row_bytes;
        const char *res = residual ? (const char *)residual + r * row_bytes : NULL;
        if (lanes == 16)
            norm_row(xr, res, weight, o, n, eps, 16, bf16);
        else
            norm_row(xr, res, weight, o, n, eps, 8, bf16);
    }
    return 0;
}

int add_rms_norm_f32(float *x, const float *residual, const float *weight, float *out, int64_t rows, int64_t n,
                     float eps, int lanes, int threads) {
    return norm_rows(x, residual, weight, out, rows, n, eps, lanes, threads, 0);
}

/* out <- rms_norm(x) * weight, row by row, as torch's F.rms_norm rounds it (x is not written) */
int rms_norm_f32(const float *x, const float *weight, float *out, int64_t rows, int64_t n, float eps, int lanes,
                 int threads) {
    return add_rms_norm_f32((float *)x, NULL, weight, out, rows, n, eps, lanes, threads);
}

/* x <- bf16(x + residual) (none when residual is NULL: x is not written), out <- rms_norm of x in bf16 */
int add_rms_norm_bf16(uint16_t *x, const uint16_t *residual, const uint16_t *weight, uint16_t *out, int64_t rows,
                      int64_t n, float eps, int lanes, int threads) {
    if (n > MAX_BF16_ROW) return 1;
    return norm_rows(x, residual, weight, out, rows, n, eps, lanes, threads, 1);
}

/* Sampling from untruncated softmax rows on the CPU: one token per row by inverse CDF, in one
 * read of the row (plus its chosen chunk again) instead of the six passes (max, subtract, exp,
 * pad, chunk sums, search) of the torch path.
 *
 * Row r of `logits [rows, row_stride]` (float32, first `vocab` columns used) is scaled by
 * `inv_t[r]` after subtracting its max m: weights w_i = exp((x_i - m) * inv_t). One read of the
 * row: per chunk of CHUNK tokens (in L1 meanwhile) its max and its weight sum relative to that
 * max, rescaled to the row's max after (float within a block of BLOCK tokens, double across).
 * The target u[r] * total picks a chunk by the running sums; the chunk's weights are
 * recomputed in double and scanned to the token (the residual rescaled from the float chunk sum
 * to the double scan, so rounding never walks past the chunk). A token with weight zero never
 * wins. Outputs per row: the token, m and the total (for the caller's log-probs:
 * log p = (x - m) * inv_t - log total), and when `raw_totals` is given the sum of exp(x - m) at
 * temperature 1 (for raw log-probs), in the same read.
 *
 * exp is a polynomial (Cephes' expf: range reduction by ln 2 in two parts, degree-6 minimax,
 * relative error ~2e-7) that the compiler vectorises; arguments below -87 (exp < 1.7e-38, incl.
 * -inf) give exactly 0, so no subnormal is ever produced. Returns 0, or -1 for a vocabulary too
 * large for the per-row chunk table.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define CHUNK 1024
#define MAX_CHUNKS 1024 /* vocabularies up to 1,048,576 tokens */
#define BLOCK 128       /* tokens summed in float before the sum goes into a double */

static inline float exp_poly(float x) {
    float c = x < -87.0f ? -87.0f : x;
    float n = floorf(c * 1.44269504088896341f + 0.5f);
    float r = c - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    float y = p * r * r + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return x < -87.0f ? 0.0f : y * scale;
}

static int64_t sample_row(const float *x, int64_t vocab, float inv_t, double u, float *m_out, double *total_out,
                          double *raw_total_out) {
    /* NOTE: one read of the row from memory: each chunk's max and its sum relative to that max
     * while the chunk is in L1, then the sums are rescaled to the row's max */
    double sums[MAX_CHUNKS], raw_sums[MAX_CHUNKS];
    float chunk_max[MAX_CHUNKS];
    int raw_apart = raw_total_out != NULL && inv_t != 1.0f; /* the raw sum differs from the scaled one */
    int64_t n_chunks = (vocab + CHUNK - 1) / CHUNK;
    float m = -INFINITY;
    for (int64_t c = 0; c < n_chunks; ++c) {
        const float *xc = x + c * CHUNK;
        int64_t len = c == n_chunks - 1 ? vocab - c * CHUNK : CHUNK;
        float mc = -INFINITY;
#pragma omp simd reduction(max : mc)
        for (int64_t i = 0; i < len; ++i) mc = xc[i] > mc ? xc[i] : mc;
        /* NOTE: float sums over BLOCK tokens, double across blocks: a float lane adds only
         * BLOCK / lanes terms (32 at SSE's 4 lanes), so the sum's error no longer grows with the
         * chunk and differs little between builds (1.7e-6 relative at SSE over whole chunks) */
        double s = 0.0, sr = 0.0;
        for (int64_t b = 0; mc > -INFINITY && b < len; b += BLOCK) {
            int64_t end = b + BLOCK < len ? b + BLOCK : len;
            float sb = 0.0f, srb = 0.0f;
            if (raw_apart) {
#pragma omp simd reduction(+ : sb, srb)
                for (int64_t i = b; i < end; ++i) {
                    sb += exp_poly((xc[i] - mc) * inv_t);
                    srb += exp_poly(xc[i] - mc);
                }
            } else {
#pragma omp simd reduction(+ : sb)
                for (int64_t i = b; i < end; ++i) sb += exp_poly((xc[i] - mc) * inv_t);
            }
            s += sb;
            sr += srb;
        }
        sums[c] = s;
        raw_sums[c] = sr;
        chunk_max[c] = mc;
        m = mc > m ? mc : m;
    }
    double total = 0.0, raw_total = 0.0;
    for (int64_t c = 0; c < n_chunks; ++c) {
        sums[c] = sums[c] > 0.0 ? sums[c] * exp(((double)chunk_max[c] - m) * inv_t) : 0.0;
        total += sums[c];
        if (raw_apart && raw_sums[c] > 0.0) raw_total += raw_sums[c] * exp((double)chunk_max[c] - m);
    }
    if (raw_total_out != NULL) *raw_total_out = raw_apart ? raw_total : total;
    *m_out = m;
    *total_out = total;
    /* NOTE: u < 1, yet u * total may round up to total: keep the target strictly inside the mass */
    double target = u * total;
    double below_total = nextafter(total, 0.0);
    if (target > below_total) target = below_total;
    double before = 0.0;
    int64_t c = 0;
    for (; c < n_chunks - 1; ++c) {
        if (before + sums[c] > target) break;
        before += sums[c];
    }
    int past = 0; /* rounding put the target past the last weighted chunk: take its last token */
    while (c > 0 && sums[c] == 0.0) --c, past = 1;
    const float *xc = x + c * CHUNK;
    int64_t len = c == n_chunks - 1 ? vocab - c * CHUNK : CHUNK;
    double inner[CHUNK];
    double acc = 0.0;
    for (int64_t i = 0; i < len; ++i) inner[i] = acc += (double)exp_poly((xc[i] - m) * inv_t);
    double rem = past ? acc : sums[c] > 0.0 ? (target - before) / sums[c] * acc : 0.0;
    if (rem < 0.0) rem = 0.0;
    int64_t last = -1;
    for (int64_t i = 0; i < len; ++i) {
        double w = inner[i] - (i ? inner[i - 1] : 0.0);
        if (w > 0.0) {
            last = i;
            if (inner[i] > rem) return c * CHUNK + i;
        }
    }
    return c * CHUNK + (last < 0 ? 0 : last);
}

int sample_rows_f32(const float *logits, int64_t rows, int64_t vocab, int64_t row_stride, const float *inv_t,
                    const double *u, int64_t *tokens, float *maxes, double *totals, double *raw_totals,
                    int num_threads) {
    if (vocab < 1 || vocab > (int64_t)CHUNK * MAX_CHUNKS) return -1;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < rows; ++r)
        tokens[r] = sample_row(logits + r * row_stride, vocab, inv_t[r], u[r], maxes + r, totals + r,
                               raw_totals == NULL ? NULL : raw_totals + r);
    return 0;
}

/* Rotary position embedding (HF's rotate-half convention) in place, in one pass over q or k, fp32 or bf16.
 *
 * Per token t, head h and i < D/2, with x the head's row and c, s the token's cos / sin rows:
 *   x[i]       <- x[i] * c[i] + (-x[i + D/2]) * s[i]
 *   x[i + D/2] <- x[i + D/2] * c[i + D/2] + x[i] * s[i + D/2]
 * Each product and the sum are rounded on their own (no FMA contraction, below), as torch's
 * separate mul and add kernels round them: the result equals `x * cos + rotate_half(x) * sin`
 * bit for bit. In bf16 (`rotary_bf16`) each of those three ops is rounded to bf16 as torch's bf16 ops
 * round them (bf16.h), so the result equals the same expression on bf16 tensors bit for bit.
 */
#pragma GCC optimize("fp-contract=off")
#include <stdint.h>

#include "bf16.h"

static inline __attribute__((always_inline)) uint16_t bf16_mul(uint16_t a, uint16_t b) {
    return f32_to_bf16(bf16_to_f32(a) * bf16_to_f32(b));
}

static inline __attribute__((always_inline)) uint16_t bf16_add(uint16_t a, uint16_t b) {
    return f32_to_bf16(bf16_to_f32(a) + bf16_to_f32(b));
}

/* one head's row: fp32 or bf16 (a constant at each call, so each export compiles one branch) */
static inline __attribute__((always_inline)) void rotate_row(void *x, const void *cos, const void *sin,
                                                             int64_t half, const int bf16) {
    if (bf16) {
        uint16_t *row = x;
        const uint16_t *c = cos, *s = sin;
        for (int64_t i = 0; i < half; i++) {
            const uint16_t a = row[i], b = row[i + half];
            row[i] = bf16_add(bf16_mul(a, c[i]), bf16_mul(b ^ 0x8000u, s[i]));  /* -b: its sign bit */
            row[i + half] = bf16_add(bf16_mul(b, c[i + half]), bf16_mul(a, s[i + half]));
        }
    } else {
        float *row = x;
        const float *c = cos, *s = sin;
        for (int64_t i = 0; i < half; i++) {
            const float a = row[i], b = row[i + half];
            row[i] = a * c[i] + (-b) * s[i];
            row[i + half] = b * c[i + half] + a * s[i + half];
        }
    }
}

static inline __attribute__((always_inline)) int rotary(char *x, int64_t tokens, int64_t heads, int64_t head_dim,
                                                        int64_t token_stride, const char *cos, const char *sin,
                                                        int threads, const int bf16) {
    if (tokens < 0 || heads <= 0 || head_dim <= 0 || (head_dim & 1)) return 1;
    const int64_t item = bf16 ? 2 : 4, half = head_dim / 2;
    #pragma omp parallel for num_threads(threads) schedule(static) if (tokens * heads >= 256)
    for (int64_t t = 0; t < tokens; t++)
        for (int64_t h = 0; h < heads; h++)
            rotate_row(x + (t * token_stride + h * head_dim) * item, cos + t * head_dim * item,
                       sin + t * head_dim * item, half, bf16);
    return 0;
}

int rotary_f32(float *x, int64_t tokens, int64_t heads, int64_t head_dim, int64_t token_stride,
               const float *cos, const float *sin, int threads) {
    return rotary((char *)x, tokens, heads, head_dim, token_stride, (const char *)cos, (const char *)sin, threads, 0);
}

int rotary_bf16(uint16_t *x, int64_t tokens, int64_t heads, int64_t head_dim, int64_t token_stride,
                const uint16_t *cos, const uint16_t *sin, int threads) {
    return rotary((char *)x, tokens, heads, head_dim, token_stride, (const char *)cos, (const char *)sin, threads, 1);
}

/* Paged decode attention on the CPU: one query token per request, straight from the KV pages.
 *
 * No gather of K/V into a padded batch and no padding: each request reads its own blocks, once
 * for K and once for V, whole rows at a time (all KV heads of a token are contiguous), and every
 * query head scores against them. First pass: scores and their max (a stable softmax); second:
 * the probability-weighted sum of V rows. Work is split over requests.
 *
 * Layout (see inference/cache/kv_buffer.py): a layer's K and V are [num_blocks, block_size,
 * num_kv_heads, head_dim]; q and out are [num_requests, num_heads, head_dim]; block_tables is
 * [num_requests, table_stride] int32; seq_lens [num_requests] int32. Query head h uses KV head
 * h / (num_heads / num_kv_heads). Threads: `num_threads` of the OpenMP runtime torch already
 * loaded (same soname), so the kernel shares torch's thread pool. Returns 0, or -1 for shapes it
 * does not handle, -2 when memory ran out.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
    uint32_t bits = ((uint32_t)x) << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

#define MAX_HEADS 64
#define MAX_DIM 256

#define DEFINE_DECODE(NAME, T, LOAD)                                                                    \
    int NAME(const T *q, const T *k_cache, const T *v_cache, const int32_t *block_tables,              \
             int64_t table_stride, const int32_t *seq_lens, float *out, int64_t num_requests,           \
             int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,  \
             int num_threads) {                                                                         \
        const int64_t group = num_heads / num_kv_heads;                                                 \
        const int64_t row_stride = num_kv_heads * head_dim;                                            \
        if (num_heads > MAX_HEADS || head_dim > MAX_DIM || group * num_kv_heads != num_heads) return -1; \
        int failed = 0;                                                                                 \
        _Pragma("omp parallel for schedule(dynamic, 1) num_threads(num_threads)")                       \
        for (int64_t b = 0; b < num_requests; ++b) {                                                    \
            const int64_t len = seq_lens[b];                                                            \
            if (len <= 0) continue;                                                                     \
            float *scores = (float *)malloc(sizeof(float) * num_heads * len);                           \
            float *acc = (float *)calloc(num_heads * head_dim, sizeof(float));                          \
            float *qf = (float *)malloc(sizeof(float) * num_heads * head_dim);                          \
            if (scores == NULL || acc == NULL || qf == NULL) {                                          \
                failed = 1;                                                                             \
                free(scores); free(acc); free(qf);                                                      \
                continue;                                                                               \
            }                                                                                           \
            float maxs[MAX_HEADS];                                                                      \
            const T *qb = q + b * num_heads * head_dim;                                                 \
            for (int64_t i = 0; i < num_heads * head_dim; ++i) qf[i] = LOAD(qb[i]) * scale;             \
            for (int64_t h = 0; h < num_heads; ++h) maxs[h] = -FLT_MAX;  /* scores are finite */        \
            const int32_t *table = block_tables + b * table_stride;                                     \
            for (int64_t start = 0; start < len; start += block_size) {                                 \
                const int64_t n = len - start < block_size ? len - start : block_size;                  \
                const T *kblock = k_cache + (int64_t)table[start / block_size] * block_size * row_stride; \
                for (int64_t r = 0; r < n; ++r) {                                                       \
                    const T *krow = kblock + r * row_stride;                                            \
                    for (int64_t h = 0; h < num_heads; ++h) {                                           \
                        const T *kh = krow + (h / group) * head_dim;                                    \
                        const float *qh = qf + h * head_dim;                                            \
                        float s = 0.0f;                                                                 \
                        for (int64_t d = 0; d < head_dim; ++d) s += qh[d] * LOAD(kh[d]);                \
                        scores[h * len + start + r] = s;                                                \
                        if (s > maxs[h]) maxs[h] = s;                                                   \
                    }                                                                                   \
                }                                                                                       \
            }                                                                                           \
            for (int64_t h = 0; h < num_heads; ++h) {                                                   \
                float *sh = scores + h * len;                                                           \
                float sum = 0.0f;                                                                       \
                for (int64_t t = 0; t < len; ++t) { sh[t] = expf(sh[t] - maxs[h]); sum += sh[t]; }      \
                const float inv = 1.0f / sum;                                                           \
                for (int64_t t = 0; t < len; ++t) sh[t] *= inv;                                         \
            }                                                                                           \
            for (int64_t start = 0; start < len; start += block_size) {                                 \
                const int64_t n = len - start < block_size ? len - start : block_size;                  \
                const T *vblock = v_cache + (int64_t)table[start / block_size] * block_size * row_stride; \
                for (int64_t r = 0; r < n; ++r) {                                                       \
                    const T *vrow = vblock + r * row_stride;                                            \
                    for (int64_t h = 0; h < num_heads; ++h) {                                           \
                        const T *vh = vrow + (h / group) * head_dim;                                    \
                        const float p = scores[h * len + start + r];                                    \
                        float *ah = acc + h * head_dim;                                                 \
                        for (int64_t d = 0; d < head_dim; ++d) ah[d] += p * LOAD(vh[d]);                \
                    }                                                                                   \
                }                                                                                       \
            }                                                                                           \
            memcpy(out + b * num_heads * head_dim, acc, sizeof(float) * num_heads * head_dim);          \
            free(scores); free(acc); free(qf);                                                          \
        }                                                                                               \
        return failed ? -2 : 0;                                                                         \
    }

#define LOAD_F32(x) (x)
#define LOAD_BF16(x) bf16_to_f32(x)

DEFINE_DECODE(paged_decode_f32, float, LOAD_F32)
DEFINE_DECODE(paged_decode_bf16, uint16_t, LOAD_BF16)

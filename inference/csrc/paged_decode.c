/* Paged decode attention on the CPU: one query token per request, straight from the KV pages.
 *
 * No gather of K/V into a padded batch and no padding: each request reads its own blocks, K and V
 * once each, in one pass with an online softmax. Tokens go by in chunks of eight; per query head a
 * chunk's eight dot products run as eight independent register chains whose lanes one
 * transpose-and-add tree sums, their exponentials are one vector polynomial, and the running sums
 * are rescaled when the running max grows. Nothing per request is allocated and no score is
 * written out and read back. The rows PREFETCH_AHEAD tokens on are prefetched into L2 a piece per
 * KV head: a request's blocks lie anywhere in the pool, which the hardware prefetchers do not
 * follow. Measured against the two-pass kernel this replaced (30 layers x 64 requests x context
 * 220, SmolLM2's heads, one thread, AVX2 EPYC): data in cache 138 -> 75 ms, blocks in random order
 * ~1.1-1.2x, blocks in order about even (both ~2x the time of summing the same bytes: 69 ms).
 * The running sums in vector lanes and the tree max then took 30 layers x 48 requests x context
 * ~236 from 45 to 39 ms (each request's own blocks) and 32 to 27 ms (groups of four sharing a
 * 144-token prompt, as GRPO's samples do). Attending such a group together, block by block so that
 * a shared block is read from memory once, gained nothing more: neighbours in the batch already
 * find the blocks they share in L2.
 * Work is split over requests, so each request's output is the same bits whatever else is in the
 * batch, and a query token's output depends only on its own q, its seq_len and its blocks.
 *
 * Layout (see inference/cache/kv_buffer.py): a layer's K and V are [num_blocks, block_size,
 * num_kv_heads, head_dim]; q and out are [num_requests, num_heads, head_dim]; block_tables is
 * [num_requests, table_stride] int32; seq_lens [num_requests] int32. Query head h uses KV head
 * h / (num_heads / num_kv_heads). Threads: `num_threads` of the OpenMP runtime torch already
 * loaded (same soname), so the kernel shares torch's thread pool. Returns 0, or -1 for shapes it
 * does not handle (head_dim not a multiple of 8 included).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "lanes.h"

#define MAX_HEADS 64
#define MAX_GROUP MAX_HEADS /* query heads per KV head */
#define MAX_DIM 256
#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 32
#endif

typedef int32_t ilanes_t __attribute__((vector_size(LANES * sizeof(int32_t))));
typedef uint32_t ulanes_t __attribute__((vector_size(LANES * sizeof(uint32_t))));
typedef uint16_t hlanes_t __attribute__((vector_size(LANES * sizeof(uint16_t))));

static inline __attribute__((always_inline)) float f32_scalar(const float *p) { return *p; }
static inline __attribute__((always_inline)) float bf16_scalar(const uint16_t *p) {
    const uint32_t bits = ((uint32_t)*p) << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
static inline __attribute__((always_inline)) lanes_t f32_lanes(const float *p) {
    lanes_t v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline __attribute__((always_inline)) lanes_t bf16_lanes(const uint16_t *p) {
    hlanes_t h;
    memcpy(&h, p, sizeof h);
    return (lanes_t)(__builtin_convertvector(h, ulanes_t) << 16);
}

static inline __attribute__((always_inline)) lanes_t splat(float x) {
    return (lanes_t){x, x, x, x, x, x, x, x};
}

/* where mask (all ones / zeros per lane), a, else b */
static inline __attribute__((always_inline)) lanes_t select(ilanes_t mask, lanes_t a, lanes_t b) {
    return (lanes_t)(((ilanes_t)a & mask) | ((ilanes_t)b & ~mask));
}

/* e^x for x <= 0 (scores less their running max), to ~1 ulp: x = n ln2 + r with |r| <= ln2 / 2,
 * e^r by Cephes' degree-6 polynomial, 2^n put in the exponent. Below -87.3 clamped (e^x < 2^-126,
 * a weight that no longer counts against the max's 1). */
static inline __attribute__((always_inline)) lanes_t exp_lanes(lanes_t x) {
    const lanes_t lo = splat(-87.3f);
    x = select(x < lo, lo, x);
    const lanes_t fx = x * splat(1.44269504088896341f) + splat(0.5f);
    ilanes_t n = __builtin_convertvector(fx, ilanes_t);            /* toward zero */
    n += (ilanes_t)(__builtin_convertvector(n, lanes_t) > fx);     /* floor: -1 where truncation rounded up */
    const lanes_t nf = __builtin_convertvector(n, lanes_t);
    const lanes_t r = x - nf * splat(0.693359375f) - nf * splat(-2.12194440e-4f);
    lanes_t y = splat(1.9875691500e-4f);
    y = y * r + splat(1.3981999507e-3f);
    y = y * r + splat(8.3334519073e-3f);
    y = y * r + splat(4.1665795894e-2f);
    y = y * r + splat(1.6666665459e-1f);
    y = y * r + splat(5.0000001201e-1f);
    y = y * r * r + r + splat(1.0f);
    return y * (lanes_t)((n + 127) << 23);
}

static inline __attribute__((always_inline)) lanes_t vmax(lanes_t a, lanes_t b) { return select(a > b, a, b); }

/* the largest lane, by a tree of lane-wise maxima (a scalar scan is eight dependent steps per
 * chunk and head, on the path to the exponentials) */
static inline __attribute__((always_inline)) float max_lanes(lanes_t v) {
    v = vmax(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3));
    v = vmax(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5));
    v = vmax(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6));
    return v[0];
}

/* into L2 (locality 2), leaving L1 to the chunk in use */
static inline __attribute__((always_inline)) void prefetch_bytes(const char *p, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 2);
}

/* One request: its `num_heads` query heads at `qf` (scaled, float, [num_heads, head_dim]) over its
 * first `len` tokens; writes [num_heads, head_dim] to `out`. A chunk's rows are contiguous (all
 * KV heads of a token side by side, the tokens of a block in a row), so K and V stream in order.
 * Inlined with `head_dim` a constant (see DEFINE_DECODE), so a head's accumulators and a chunk's
 * eight dot products sit in registers and run as independent chains. */
#define DEFINE_REQUEST(NAME, T, LANES_OF)                                                               \
    static inline __attribute__((always_inline)) void NAME(                                             \
        const float *qf, const T *k_cache, const T *v_cache, const int32_t *table, int64_t len,         \
        int64_t num_heads, int64_t num_kv_heads, const int64_t head_dim, int64_t block_size, float *out) { \
        const int64_t group = num_heads / num_kv_heads;                                                 \
        const int64_t row_stride = num_kv_heads * head_dim;                                            \
        float acc[MAX_HEADS * MAX_DIM];                                                                 \
        /* NOTE: a head's running sum is eight lanes, added to lane by lane and summed once at the   \
         * end: a scalar sum of each chunk's eight weights was a chain of eight dependent adds */   \
        float run_max[MAX_HEADS];                                                                       \
        lanes_t run_sum[MAX_HEADS];                                                                     \
        for (int64_t h = 0; h < num_heads; ++h) {                                                       \
            run_max[h] = -FLT_MAX;                                                                      \
            run_sum[h] = splat(0.0f);                                                                   \
        }                                                                                               \
        memset(acc, 0, sizeof(float) * num_heads * head_dim);                                           \
        for (int64_t start = 0; start < len; start += block_size) {                                     \
            const int64_t in_block = len - start < block_size ? len - start : block_size;               \
            const int64_t block = table[start / block_size];                                           \
            for (int64_t c = 0; c < in_block; c += LANES) {                                             \
                const int64_t n = in_block - c < LANES ? in_block - c : LANES;                          \
                const ilanes_t valid = (ilanes_t){0, 1, 2, 3, 4, 5, 6, 7} < (ilanes_t){n, n, n, n, n, n, n, n}; \
                /* a short chunk repeats its last row in the missing lanes (masked out below) */         \
                int64_t row_of[LANES];                                                                  \
                for (int64_t t = 0; t < LANES; ++t) row_of[t] = (block * block_size + c + (t < n ? t : n - 1)) * row_stride; \
                /* the rows PREFETCH_AHEAD tokens on, into L2, a KV head's share at a time (a burst of \
                 * prefetches fills the miss queue and stalls the loads behind it) */                   \
                const int64_t ahead = start + c + PREFETCH_AHEAD;                                       \
                const char *k_ahead = NULL, *v_ahead = NULL;                                            \
                int64_t ahead_bytes = 0, ahead_share = 0;                                               \
                if (ahead < len) {                                                                      \
                    const int64_t row = ahead % block_size;                                             \
                    int64_t rows = block_size - row < LANES ? block_size - row : LANES;                 \
                    rows = len - ahead < rows ? len - ahead : rows;                                     \
                    const int64_t at = ((int64_t)table[ahead / block_size] * block_size + row) * row_stride; \
                    k_ahead = (const char *)(k_cache + at);                                             \
                    v_ahead = (const char *)(v_cache + at);                                             \
                    ahead_bytes = rows * row_stride * (int64_t)sizeof(T);                               \
                    ahead_share = (ahead_bytes + num_kv_heads * 64 - 1) / (num_kv_heads * 64) * 64;    \
                }                                                                                       \
                for (int64_t g = 0; g < num_kv_heads; ++g) {                                            \
                    if (g * ahead_share < ahead_bytes) { /* this head's share, never past the rows ahead */ \
                        const int64_t left = ahead_bytes - g * ahead_share;                             \
                        const int64_t share = left < ahead_share ? left : ahead_share;                  \
                        prefetch_bytes(k_ahead + g * ahead_share, share);                               \
                        prefetch_bytes(v_ahead + g * ahead_share, share);                               \
                    }                                                                                   \
                    const T *kg = k_cache + g * head_dim;                                               \
                    const T *vg = v_cache + g * head_dim;                                               \
                    float p[MAX_GROUP][LANES];                                                          \
                    for (int64_t j = 0; j < group; ++j) {                                               \
                        const int64_t h = g * group + j;                                                \
                        const float *qh = qf + h * head_dim;                                            \
                        lanes_t part[LANES];                                                            \
                        for (int64_t t = 0; t < LANES; ++t) part[t] = splat(0.0f);                      \
                        for (int64_t d = 0; d < head_dim; d += LANES) {                                 \
                            const lanes_t qv = f32_lanes(qh + d);                                       \
                            for (int64_t t = 0; t < LANES; ++t) part[t] += qv * LANES_OF(kg + row_of[t] + d); \
                        }                                                                               \
                        const lanes_t scores = select(valid, lane_sums(part), splat(-FLT_MAX));         \
                        const float chunk_max = max_lanes(scores);                                      \
                        if (chunk_max > run_max[h]) {                                                   \
                            const float factor = expf(run_max[h] - chunk_max);                          \
                            run_sum[h] *= splat(factor);                                                \
                            for (int64_t d = 0; d < head_dim; ++d) acc[h * head_dim + d] *= factor;     \
                            run_max[h] = chunk_max;                                                     \
                        }                                                                               \
                        const lanes_t e = select(valid, exp_lanes(scores - splat(run_max[h])), splat(0.0f)); \
                        memcpy(p[j], &e, sizeof e);                                                     \
                        run_sum[h] += e;                                                                \
                    }                                                                                   \
                    for (int64_t j = 0; j < group; ++j) {                                               \
                        float *ah = acc + (g * group + j) * head_dim;                                   \
                        lanes_t a[MAX_DIM / LANES];                                                     \
                        for (int64_t d = 0; d < head_dim; d += LANES) a[d / LANES] = f32_lanes(ah + d); \
                        for (int64_t t = 0; t < n; ++t) {                                               \
                            const lanes_t w = splat(p[j][t]);                                           \
                            for (int64_t d = 0; d < head_dim; d += LANES)                               \
                                a[d / LANES] += w * LANES_OF(vg + row_of[t] + d);                       \
                        }                                                                               \
                        for (int64_t d = 0; d < head_dim; d += LANES) memcpy(ah + d, &a[d / LANES], sizeof(lanes_t)); \
                    }                                                                                   \
                }                                                                                       \
            }                                                                                           \
        }                                                                                               \
        for (int64_t h = 0; h < num_heads; ++h) {                                                       \
            float total = 0.0f;                                                                         \
            for (int i = 0; i < LANES; ++i) total += run_sum[h][i];                                     \
            const float inv = 1.0f / total;                                                             \
            for (int64_t d = 0; d < head_dim; ++d) out[h * head_dim + d] = acc[h * head_dim + d] * inv; \
        }                                                                                               \
    }

/* head_dim a multiple of LANES (the caller checks); the common sizes get their own inlined copy */
#define DEFINE_DECODE(NAME, REQUEST, T, SCALAR_OF)                                                      \
    int NAME(const T *q, const T *k_cache, const T *v_cache, const int32_t *block_tables,              \
             int64_t table_stride, const int32_t *seq_lens, float *out, int64_t num_requests,           \
             int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,  \
             int num_threads) {                                                                         \
        const int64_t group = num_heads / num_kv_heads;                                                 \
        if (num_heads > MAX_HEADS || head_dim > MAX_DIM || head_dim % LANES || \
            group * num_kv_heads != num_heads)                                                          \
            return -1;                                                                                  \
        _Pragma("omp parallel for schedule(dynamic, 1) num_threads(num_threads)")                       \
        for (int64_t b = 0; b < num_requests; ++b) {                                                    \
            const int64_t len = seq_lens[b];                                                            \
            if (len <= 0) continue;                                                                     \
            float qf[MAX_HEADS * MAX_DIM];                                                              \
            const T *qb = q + b * num_heads * head_dim;                                                 \
            for (int64_t i = 0; i < num_heads * head_dim; ++i) qf[i] = SCALAR_OF(qb + i) * scale;       \
            const int32_t *table = block_tables + b * table_stride;                                     \
            float *ob = out + b * num_heads * head_dim;                                                 \
            switch (head_dim) {                                                                         \
            case 64: REQUEST(qf, k_cache, v_cache, table, len, num_heads, num_kv_heads, 64, block_size, ob); break; \
            case 128: REQUEST(qf, k_cache, v_cache, table, len, num_heads, num_kv_heads, 128, block_size, ob); break; \
            case 32: REQUEST(qf, k_cache, v_cache, table, len, num_heads, num_kv_heads, 32, block_size, ob); break; \
            default: REQUEST(qf, k_cache, v_cache, table, len, num_heads, num_kv_heads, head_dim, block_size, ob); \
            }                                                                                           \
        }                                                                                               \
        return 0;                                                                                       \
    }

DEFINE_REQUEST(decode_request_f32, float, f32_lanes)
DEFINE_REQUEST(decode_request_bf16, uint16_t, bf16_lanes)
DEFINE_DECODE(paged_decode_f32, decode_request_f32, float, f32_scalar)
DEFINE_DECODE(paged_decode_bf16, decode_request_bf16, uint16_t, bf16_scalar)

/* Paged decode attention on the CPU: one query token per request, straight from the KV pages.
 *
 * No gather of K/V into a padded batch and no padding: each request reads its own blocks, K and V
 * once each, in one pass with an online softmax taken STEP tokens at a time (a block of 16 in one
 * step). A step first scores its tokens for every query head (per head a chunk of eight tokens as
 * eight independent register chains whose lanes one transpose-and-add tree sums), then moves each
 * head's running max and sums once (exponentials as one vector polynomial), then adds the weighted
 * values. Phases over all heads rather than a chunk's whole chain per head: the heads' chains are
 * independent, so the core overlaps them instead of waiting on one score -> max -> exp -> value
 * chain at a time. While a step computes, the rows of the next step are prefetched, a share per
 * head (K while scoring, V while weighting): a request's blocks lie anywhere in the pool, where the
 * hardware prefetchers do not follow, and a burst of a whole block's prefetches stalls the loads
 * behind it. Measured against the kernel before (one pass, eight tokens a step, rows 32 tokens
 * ahead prefetched a KV head's share at a time), 30 layers x 32 requests x context 205, SmolLM2's
 * heads, one thread, Zen 3 EPYC: blocks in random order in a 750 MB pool 46-53 -> 30-33 ms, data in
 * cache 22-25 -> 22 ms (17 ms without the prefetches, which cost what they save there).
 * The prefetches go to L2 (prefetcht1), not L1: a step's next rows are ~380 lines, and L1's few
 * miss buffers (24 on Zen 4) held the stream to ~10 GB/s of a 28 GB/s machine, latency-bound.
 * Zen 4, SmolLM2's heads, 40 requests sharing prompts four at a time, blocks in random order, 30
 * layers, interleaved medians: 40-47 -> 27-34 ms (1.39-1.51x, the same bits); tiny's heads at 128
 * requests 1.48x; data in cache 1.06x.
 * Rows are addressed through a pointer per token (`kt`, `vt`): written as `base + row + d`, GCC kept
 * every d's offset in a register of its own and recomputed each load's address (three instructions
 * a load). Zen 4, interleaved medians, the same bits at -march=native: SmolLM2's heads (64 requests,
 * from memory) 1.055x, in L2 1.074x, tiny's heads (128) 1.10x; built for x86-64-v3 1.12x, 1.19x and
 * 1.02x.
 * A KV head's rows are read, and in bf16 widened, once for a tile of the query heads that share it
 * (DEFINE_TILES) instead of once per query head, and each tile takes its share of the next step's
 * prefetches spread over its loop rather than in one burst. Zen 4, 2 threads, 30 layers x 64
 * requests x context ~100 from memory, blocks in random order, interleaved medians of 6: SmolLM2's
 * heads (9 over 3) bf16 15.8 -> 11.3 ms, fp32 15.8 -> 15.4; 12 over 12 heads bf16 31.7 -> 29.5;
 * the same bits at -march=native in both dtypes (an x86-64-v3 build's fp32 rounds a few outputs
 * otherwise than before: GCC contracts the two loop shapes' multiply-adds differently there; a
 * request's output is still the same bits in any batch).
 * On AVX-512 the tiles work in sixteen lanes where eight did (DEFINE_WIDE_TILES), every lane the
 * same operations in the same order, so the same bits (checked against the eight-lane kernel over fp32
 * and bf16, head sizes 8-256, blocks of 5-32, native, v3 and v2 builds): a score vector holds two
 * tokens' eight lanes of d, summed by the same tree two halves at once (lane_sums2); the values, a
 * full step's weights and a head's rescaling sixteen lanes of d or of tokens. Zen 5, 2 threads,
 * SmolLM2's heads (9 over 3), blocks in random order in a 20,000-block pool, interleaved medians: bf16
 * 1.34-1.45x (a 128-token prompt's rows 300 -> 220 us a layer, 44 decode rows at context 110 179 ->
 * 134), fp32 1.05-1.25x.
 * Work is split over requests, so each request's output is the same bits whatever else is in the
 * batch, and a query token's output depends only on its own q, its seq_len and its blocks.
 *
 * Layout (see inference/cache/kv_buffer.py): a layer's K and V are [num_blocks, block_size,
 * num_kv_heads, head_dim]; q is [num_requests, num_heads, head_dim] with rows `q_stride` elements
 * apart (a view of the step's q, k and v side by side, uncopied); out is [num_requests, num_heads,
 * head_dim], float, or bf16 where `out_bf16` (rounded once as torch rounds float to bf16, so the
 * same bits as a float output converted after, without the pass over it); block_tables is
 * [num_requests, table_stride] int32; seq_lens [num_requests] int32. Query head h uses KV head
 * h / (num_heads / num_kv_heads). Threads: `num_threads` of the OpenMP runtime torch already
 * loaded (same soname), so the kernel shares torch's thread pool. Returns 0, or -1 for shapes it
 * does not handle (head_dim not a multiple of 8 included).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "lanes.h"

#define MAX_HEADS 64
#define MAX_GROUP MAX_HEADS /* query heads per KV head */
#define MAX_DIM 256

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
 * a weight that no longer counts against the max's 1). For eight lanes (exp_lanes) and, on AVX-512,
 * sixteen (exp_wlanes): the same operations lane by lane. */
#define DEFINE_EXP(NAME, V, IV, SPLAT, SELECT)                                                        \
    static inline __attribute__((always_inline)) V NAME(V x) {                                         \
        const V lo = SPLAT(-87.3f);                                                                     \
        x = SELECT(x < lo, lo, x);                                                                      \
        const V fx = x * SPLAT(1.44269504088896341f) + SPLAT(0.5f);                                     \
        IV n = __builtin_convertvector(fx, IV);                /* toward zero */                        \
        n += (IV)(__builtin_convertvector(n, V) > fx);         /* floor: -1 where truncation rounded up */\
        const V nf = __builtin_convertvector(n, V);                                                     \
        const V r = x - nf * SPLAT(0.693359375f) - nf * SPLAT(-2.12194440e-4f);                         \
        V y = SPLAT(1.9875691500e-4f);                                                                  \
        y = y * r + SPLAT(1.3981999507e-3f);                                                            \
        y = y * r + SPLAT(8.3334519073e-3f);                                                            \
        y = y * r + SPLAT(4.1665795894e-2f);                                                            \
        y = y * r + SPLAT(1.6666665459e-1f);                                                            \
        y = y * r + SPLAT(5.0000001201e-1f);                                                            \
        y = y * r * r + r + SPLAT(1.0f);                                                                \
        return y * (V)((n + 127) << 23);                                                                \
    }
DEFINE_EXP(exp_lanes, lanes_t, ilanes_t, splat, select)

static inline __attribute__((always_inline)) lanes_t vmax(lanes_t a, lanes_t b) { return select(a > b, a, b); }

/* the largest lane, by a tree of lane-wise maxima (a scalar scan is eight dependent steps per
 * chunk and head, on the path to the exponentials) */
static inline __attribute__((always_inline)) float max_lanes(lanes_t v) {
    v = vmax(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3));
    v = vmax(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5));
    v = vmax(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6));
    return v[0];
}

/* AVX-512: sixteen lanes where eight did, each lane the same operations in the same order, so the
 * same bits (DEFINE_WIDE_TILES). In the scores a vector holds two tokens' eight lanes of d (tokens j and j + 4
 * of a chunk), in the values sixteen of d. */
#if defined(__AVX512F__)
#define WIDE_ATTENTION 1
typedef float wlanes_t __attribute__((vector_size(2 * LANES * sizeof(float))));
typedef uint32_t wulanes_t __attribute__((vector_size(2 * LANES * sizeof(uint32_t))));
typedef uint16_t whlanes_t __attribute__((vector_size(2 * LANES * sizeof(uint16_t))));
static inline __attribute__((always_inline)) wlanes_t f32_wlanes(const float *p) {
    wlanes_t v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline __attribute__((always_inline)) wlanes_t bf16_wlanes(const uint16_t *p) {
    whlanes_t h;
    memcpy(&h, p, sizeof h);
    return (wlanes_t)(__builtin_convertvector(h, wulanes_t) << 16);
}
/* eight lanes at a, eight at b, as one vector */
static inline __attribute__((always_inline)) wlanes_t f32_pair(const float *a, const float *b) {
    return __builtin_shufflevector(f32_lanes(a), f32_lanes(b), 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}
static inline __attribute__((always_inline)) wlanes_t bf16_pair(const uint16_t *a, const uint16_t *b) {
    hlanes_t ha, hb;
    memcpy(&ha, a, sizeof ha);
    memcpy(&hb, b, sizeof hb);
    const whlanes_t h = __builtin_shufflevector(ha, hb, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return (wlanes_t)(__builtin_convertvector(h, wulanes_t) << 16);
}
static inline __attribute__((always_inline)) wlanes_t wsplat(float x) {
    return (wlanes_t){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
}
typedef int32_t wilanes_t __attribute__((vector_size(2 * LANES * sizeof(int32_t))));
static inline __attribute__((always_inline)) wlanes_t wselect(wilanes_t mask, wlanes_t a, wlanes_t b) {
    return (wlanes_t)(((wilanes_t)a & mask) | ((wilanes_t)b & ~mask));
}
DEFINE_EXP(exp_wlanes, wlanes_t, wilanes_t, wsplat, wselect)
static inline __attribute__((always_inline)) lanes_t low8(wlanes_t v) {
    return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
}
static inline __attribute__((always_inline)) lanes_t high8(wlanes_t v) {
    return __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
}
/* pair_sums (lanes.h) of the low halves of a and b in the low half, of the high halves in the high */
static inline __attribute__((always_inline)) wlanes_t pair_sums2(wlanes_t a, wlanes_t b) {
    return __builtin_shufflevector(a, b, 0, 2, 16, 18, 4, 6, 20, 22, 8, 10, 24, 26, 12, 14, 28, 30)
         + __builtin_shufflevector(a, b, 1, 3, 17, 19, 5, 7, 21, 23, 9, 11, 25, 27, 13, 15, 29, 31);
}
/* lane_sums (lanes.h) of the eight vectors v[j] = low half of w[j], v[j + 4] = its high half: the same
 * tree, the same order for every output, on two halves at once */
static inline __attribute__((always_inline)) lanes_t lane_sums2(const wlanes_t *w) {
    const wlanes_t u = pair_sums2(pair_sums2(w[0], w[1]), pair_sums2(w[2], w[3]));
    return __builtin_shufflevector(u, u, 0, 1, 2, 3, 8, 9, 10, 11)
         + __builtin_shufflevector(u, u, 4, 5, 6, 7, 12, 13, 14, 15);
}
#else
#define WIDE_ATTENTION 0
#endif

/* VALUES: the weighted values of a step into query heads h0.. h0 + nh - 1 (weights at ph, accumulators
 * at ah), in vectors V of W lanes of d (head_dim a multiple of W): SPLAT, F32 (W floats) and OF (W of T) */
#define DEFINE_VALUES(VALUES, T, V, W, SPLAT, F32, OF)                                                  \
    static inline __attribute__((always_inline)) void VALUES(                                           \
        const int nh, const float *ph, const T *vg, const int64_t *row_of, const int64_t n_step,        \
        const int64_t head_dim, float *ah, const char *pf, const int64_t pf_lines) {                    \
        const int64_t pf_each = n_step ? (pf_lines + n_step - 1) / n_step : 0;                          \
        V a[QK][MAX_DIM / (W)];                                                                         \
        for (int hh = 0; hh < nh; ++hh)                                                                 \
            for (int64_t d = 0; d < head_dim; d += (W)) a[hh][d / (W)] = F32(ah + hh * head_dim + d);   \
        for (int64_t t = 0; t < n_step; ++t) {                                                          \
            V w[QK];                                                                                    \
            for (int hh = 0; hh < nh; ++hh) w[hh] = SPLAT(ph[hh * STEP + t]);                           \
            for (int64_t i = t * pf_each; i < (t + 1) * pf_each && i < pf_lines; ++i)                   \
                __builtin_prefetch(pf + 64 * i, 0, 2);                                                  \
            const T *vt = vg + row_of[t];                                                               \
            for (int64_t d = 0; d < head_dim; d += (W)) {                                               \
                const V v = OF(vt + d);                                                                 \
                for (int hh = 0; hh < nh; ++hh) a[hh][d / (W)] += w[hh] * v;                            \
            }                                                                                           \
        }                                                                                               \
        for (int hh = 0; hh < nh; ++hh)                                                                 \
            for (int64_t d = 0; d < head_dim; d += (W)) memcpy(ah + hh * head_dim + d, &a[hh][d / (W)], sizeof(V));\
    }

/* A KV head's rows are read (and, in bf16, widened) once for up to QK of its query heads at a time:
 * GQA's query heads that share a KV head share its loads. Each head's sums run in the order they did
 * one head at a time (the same bits). QK = 3 keeps a tile's 3 x 8 score chains in registers; the
 * values' accumulators are head_dim / 8 a head, so three heads at head_dim 64, one from 128. */
#define QK 3
#define QV(head_dim) ((head_dim) <= 64 ? 3 : 1)
/* F for a tile of `nh` heads (1 to QK), the count a constant in each call, so its chains sit in registers */
#define BY_TILE(F, nh, ...)                                                                         \
    do {                                                                                            \
        if ((nh) == 3) F(3, __VA_ARGS__);                                                           \
        else if ((nh) == 2) F(2, __VA_ARGS__);                                                      \
        else F(1, __VA_ARGS__);                                                                     \
    } while (0)
#define DEFINE_TILES(NAME, T, LANES_OF)                                                                 \
    /* scores of query heads h0.. h0 + nh - 1 (q at qh, [nh, head_dim]) for a chunk of eight rows */    \
    static inline __attribute__((always_inline)) void NAME##_scores(                                    \
        const int nh, const float *qh, const T *const *kt, const int64_t head_dim, const ilanes_t valid, float *sh,\
        const char *pf, const int64_t pf_lines) {                                                       \
        const int64_t pf_each = (pf_lines + head_dim / LANES - 1) / (head_dim / LANES);                 \
        lanes_t part[QK][LANES];                                                                        \
        for (int hh = 0; hh < nh; ++hh)                                                                 \
            for (int t = 0; t < LANES; ++t) part[hh][t] = splat(0.0f);                                  \
        for (int64_t d = 0; d < head_dim; d += LANES) {                                                 \
            for (int64_t i = d / LANES * pf_each; i < (d / LANES + 1) * pf_each && i < pf_lines; ++i)   \
                __builtin_prefetch(pf + 64 * i, 0, 2);                                                  \
            lanes_t qv[QK];                                                                             \
            for (int hh = 0; hh < nh; ++hh) qv[hh] = f32_lanes(qh + hh * head_dim + d);                 \
            for (int t = 0; t < LANES; ++t) {                                                           \
                const lanes_t kv = LANES_OF(kt[t] + d);                                                 \
                for (int hh = 0; hh < nh; ++hh) part[hh][t] += qv[hh] * kv;                             \
            }                                                                                           \
        }                                                                                               \
        for (int hh = 0; hh < nh; ++hh) {                                                               \
            const lanes_t scores = select(valid, lane_sums(part[hh]), splat(-FLT_MAX));                 \
            memcpy(sh + hh * STEP, &scores, sizeof scores);                                             \
        }                                                                                               \
    }                                                                                                   \
    DEFINE_VALUES(NAME##_values, T, lanes_t, LANES, splat, f32_lanes, LANES_OF)

#if WIDE_ATTENTION
/* NARROW's tiles with sixteen lanes (see WIDE_ATTENTION): the scores' vectors hold two tokens, the
 * values' sixteen of d (head_dim a multiple of 16, else NARROW's) */
#define DEFINE_WIDE_TILES(NAME, NARROW, T, PAIR_OF, WLANES_OF)                                          \
    static inline __attribute__((always_inline)) void NAME##_scores(                                    \
        const int nh, const float *qh, const T *const *kt, const int64_t head_dim, const ilanes_t valid, float *sh,\
        const char *pf, const int64_t pf_lines) {                                                       \
        const int64_t pf_each = (pf_lines + head_dim / LANES - 1) / (head_dim / LANES);                 \
        wlanes_t part[QK][LANES / 2]; /* tokens j (low eight lanes) and j + 4 (high eight) */           \
        for (int hh = 0; hh < nh; ++hh)                                                                 \
            for (int j = 0; j < LANES / 2; ++j) part[hh][j] = wsplat(0.0f);                             \
        for (int64_t d = 0; d < head_dim; d += LANES) {                                                 \
            for (int64_t i = d / LANES * pf_each; i < (d / LANES + 1) * pf_each && i < pf_lines; ++i)   \
                __builtin_prefetch(pf + 64 * i, 0, 2);                                                  \
            wlanes_t qv[QK];                                                                            \
            for (int hh = 0; hh < nh; ++hh) {                                                           \
                const lanes_t q8 = f32_lanes(qh + hh * head_dim + d);                                   \
                qv[hh] = __builtin_shufflevector(q8, q8, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7);\
            }                                                                                           \
            for (int j = 0; j < LANES / 2; ++j) {                                                       \
                const wlanes_t kv = PAIR_OF(kt[j] + d, kt[j + LANES / 2] + d);                          \
                for (int hh = 0; hh < nh; ++hh) part[hh][j] += qv[hh] * kv;                             \
            }                                                                                           \
        }                                                                                               \
        for (int hh = 0; hh < nh; ++hh) {                                                               \
            const lanes_t scores = select(valid, lane_sums2(part[hh]), splat(-FLT_MAX));                \
            memcpy(sh + hh * STEP, &scores, sizeof scores);                                             \
        }                                                                                               \
    }                                                                                                   \
    DEFINE_VALUES(NAME##_wide_values, T, wlanes_t, 2 * LANES, wsplat, f32_wlanes, WLANES_OF)            \
    static inline __attribute__((always_inline)) void NAME##_values(                                    \
        const int nh, const float *ph, const T *vg, const int64_t *row_of, const int64_t n_step,        \
        const int64_t head_dim, float *ah, const char *pf, const int64_t pf_lines) {                    \
        if (head_dim % (2 * LANES))                                                                     \
            NARROW##_values(nh, ph, vg, row_of, n_step, head_dim, ah, pf, pf_lines);                    \
        else                                                                                            \
            NAME##_wide_values(nh, ph, vg, row_of, n_step, head_dim, ah, pf, pf_lines);                 \
    }
#endif

/* A head's weights for a step in place of its scores at sh (`chunks` of eight, masked ones -FLT_MAX),
 * against the running max `top`; their sum added into run_sum, chunk by chunk. A full step's two
 * chunks in one sixteen-lane vector where there is AVX-512, the same operations lane by lane. */
static inline __attribute__((always_inline)) void step_weights(float *sh, int64_t chunks, float top, lanes_t *run_sum) {
#if WIDE_ATTENTION
    if (chunks == 2) {
        const wlanes_t x = f32_wlanes(sh);
        const wlanes_t e = wselect(x > wsplat(-FLT_MAX), exp_wlanes(x - wsplat(top)), wsplat(0.0f));
        *run_sum += low8(e);
        *run_sum += high8(e);
        memcpy(sh, &e, sizeof e);
        return;
    }
#endif
    for (int64_t c = 0; c < chunks; ++c) {
        const lanes_t x = f32_lanes(sh + c * LANES);
        const lanes_t e = select(x > splat(-FLT_MAX), exp_lanes(x - splat(top)), splat(0.0f));
        *run_sum += e;
        memcpy(sh + c * LANES, &e, sizeof e);
    }
}

/* a head's accumulators times `factor` (its running max rose) */
static inline __attribute__((always_inline)) void scale_head(float *ah, int64_t head_dim, float factor) {
#if WIDE_ATTENTION
    if (head_dim % (2 * LANES) == 0) {
        for (int64_t d = 0; d < head_dim; d += 2 * LANES) {
            const wlanes_t a = f32_wlanes(ah + d) * wsplat(factor);
            memcpy(ah + d, &a, sizeof a);
        }
        return;
    }
#endif
    for (int64_t d = 0; d < head_dim; d += LANES) {
        const lanes_t a = f32_lanes(ah + d) * splat(factor);
        memcpy(ah + d, &a, sizeof a);
    }
}

/* One request: its `num_heads` query heads at `qf` (scaled, float, [num_heads, head_dim]) over its
 * first `len` tokens; writes [num_heads, head_dim] to `out`. A chunk's rows are contiguous (all
 * KV heads of a token side by side, the tokens of a block in a row), so K and V stream in order.
 * Inlined with `head_dim` a constant (see DEFINE_DECODE), so a head's accumulators and a chunk's
 * eight dot products sit in registers and run as independent chains. */
/* tokens per step of the online softmax: two chunks of eight (a block of 16 in one step) */
#define STEP 16
#define DEFINE_REQUEST(NAME, T, SCORES, VALUES)                                                               \
    static inline __attribute__((always_inline)) void NAME(                                             \
        const float *qf, const T *k_cache, const T *v_cache, const int32_t *table, int64_t len,         \
        int64_t num_heads, int64_t num_kv_heads, const int64_t head_dim, int64_t block_size, float *out) { \
        const int64_t group = num_heads / num_kv_heads;                                                 \
        const int64_t row_stride = num_kv_heads * head_dim;                                            \
        float acc[MAX_HEADS * MAX_DIM];                                                                 \
        float run_max[MAX_HEADS];                                                                       \
        lanes_t run_sum[MAX_HEADS];                                                                     \
        float s[MAX_HEADS * STEP] __attribute__((aligned(32)));                                        \
        for (int64_t h = 0; h < num_heads; ++h) {                                                       \
            run_max[h] = -FLT_MAX;                                                                      \
            run_sum[h] = splat(0.0f);                                                                   \
        }                                                                                               \
        memset(acc, 0, sizeof(float) * num_heads * head_dim);                                           \
        for (int64_t start = 0; start < len; start += block_size) {                                     \
            const int64_t in_block = len - start < block_size ? len - start : block_size;               \
            const int64_t block = table[start / block_size];                                           \
            for (int64_t c0 = 0; c0 < in_block; c0 += STEP) {                                           \
                const int64_t n_step = in_block - c0 < STEP ? in_block - c0 : STEP;                     \
                const int64_t chunks = (n_step + LANES - 1) / LANES;                                    \
                int64_t row_of[STEP];                                                                   \
                for (int64_t t = 0; t < STEP; ++t)                                                      \
                    row_of[t] = (block * block_size + c0 + (t < n_step ? t : n_step - 1)) * row_stride;  \
                /* the next step's rows (this block's next tokens, or the next block's first), prefetched \
                 * while this step computes: K a share per head of the scores, V per head of the values */ \
                const char *k_next = NULL, *v_next = NULL;                                              \
                int64_t next_lines = 0;                                                                 \
                {                                                                                       \
                    const int64_t at = start + c0 + n_step;                                            \
                    if (at < len) {                                                                     \
                        const int64_t row = at % block_size;                                            \
                        int64_t rows_n = block_size - row < STEP ? block_size - row : STEP;            \
                        rows_n = len - at < rows_n ? len - at : rows_n;                                 \
                        const int64_t off = ((int64_t)table[at / block_size] * block_size + row) * row_stride; \
                        k_next = (const char *)(k_cache + off);                                         \
                        v_next = (const char *)(v_cache + off);                                         \
                        next_lines = (rows_n * row_stride * (int64_t)sizeof(T) + 63) / 64;             \
                    }                                                                                   \
                }                                                                                       \
                const int64_t k_tiles = num_kv_heads * ((group + QK - 1) / QK);                            \
                const int64_t v_tiles = num_kv_heads * ((group + QV(head_dim) - 1) / QV(head_dim));       \
                const int64_t k_share = (next_lines + chunks * k_tiles - 1) / (chunks * k_tiles);  \
                const int64_t v_share = (next_lines + v_tiles - 1) / v_tiles;                       \
                int64_t k_done = 0, v_done = 0;                                                         \
                /* scores of every head for the step's tokens, a KV head's rows read once for a tile    \
                 * of its query heads (DEFINE_TILES) */                                                 \
                for (int64_t c = 0; c < chunks; ++c) {                                                  \
                    const int64_t n = n_step - c * LANES < LANES ? n_step - c * LANES : LANES;          \
                    const ilanes_t valid = (ilanes_t){0, 1, 2, 3, 4, 5, 6, 7} < (ilanes_t){n, n, n, n, n, n, n, n};\
                    const int64_t *rows = row_of + c * LANES;                                           \
                    for (int64_t g = 0; g < num_kv_heads; ++g) {                                        \
                        const T *kt[LANES];                                                             \
                        for (int64_t t = 0; t < LANES; ++t) kt[t] = k_cache + g * head_dim + rows[t];   \
                        for (int64_t h0 = g * group; h0 < (g + 1) * group; h0 += QK) {                  \
                            const int64_t nh = (g + 1) * group - h0 < QK ? (g + 1) * group - h0 : QK;   \
                            const float *qh = qf + h0 * head_dim;                                       \
                            float *sh = s + h0 * STEP + c * LANES;                                      \
                            const int64_t kl = k_share < next_lines - k_done ? k_share : next_lines - k_done;\
                            const char *kp = k_next + 64 * k_done;                                      \
                            k_done += kl;                                                               \
                            BY_TILE(SCORES, nh, qh, kt, head_dim, valid, sh, kp, kl);                   \
                        }                                                                               \
                    }                                                                                   \
                }                                                                                       \
                /* the online softmax, a step at a time: weights in place of the scores */              \
                for (int64_t h = 0; h < num_heads; ++h) {                                               \
                    float *sh = s + h * STEP;                                                           \
                    lanes_t m = f32_lanes(sh);                                                          \
                    for (int64_t c = 1; c < chunks; ++c) m = vmax(m, f32_lanes(sh + c * LANES));        \
                    const float step_max = max_lanes(m);                                                \
                    if (step_max > run_max[h]) {                                                        \
                        const float factor = expf(run_max[h] - step_max);                               \
                        run_sum[h] *= splat(factor);                                                    \
                        scale_head(acc + h * head_dim, head_dim, factor);                               \
                        run_max[h] = step_max;                                                          \
                    }                                                                                   \
                    step_weights(sh, chunks, run_max[h], &run_sum[h]);                                  \
                }                                                                                       \
                /* the weighted values, a KV head's rows read once for a tile of its query heads */     \
                for (int64_t g = 0; g < num_kv_heads; ++g) {                                            \
                    const T *vg = v_cache + g * head_dim;                                               \
                    for (int64_t h0 = g * group; h0 < (g + 1) * group; h0 += QV(head_dim)) {            \
                        const int64_t nh = (g + 1) * group - h0 < QV(head_dim) ? (g + 1) * group - h0 : QV(head_dim);\
                        const float *ph = s + h0 * STEP;                                                \
                        float *ah = acc + h0 * head_dim;                                                \
                        const int64_t vl = v_share < next_lines - v_done ? v_share : next_lines - v_done;\
                        const char *vp = v_next + 64 * v_done;                                          \
                        v_done += vl;                                                                   \
                        BY_TILE(VALUES, nh, ph, vg, row_of, n_step, head_dim, ah, vp, vl);              \
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
    int NAME(const T *q, int64_t q_stride, const T *k_cache, const T *v_cache, const int32_t *block_tables,\
             int64_t table_stride, const int32_t *seq_lens, void *out, int out_bf16, int64_t num_requests,\
             int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,\
             int num_threads) {                                                                         \
        const int64_t group = num_heads / num_kv_heads;                                                 \
        if (num_heads > MAX_HEADS || head_dim > MAX_DIM || head_dim % LANES ||                          \
            group * num_kv_heads != num_heads || q_stride < num_heads * head_dim)                       \
            return -1;                                                                                  \
        const int64_t width = num_heads * head_dim;                                                     \
        _Pragma("omp parallel for schedule(dynamic, 1) num_threads(num_threads)")                       \
        for (int64_t b = 0; b < num_requests; ++b) {                                                    \
            const int64_t len = seq_lens[b];                                                            \
            if (len <= 0) continue;                                                                     \
            float qf[MAX_HEADS * MAX_DIM];                                                              \
            const T *qb = q + b * q_stride;                                                             \
            for (int64_t i = 0; i < width; ++i) qf[i] = SCALAR_OF(qb + i) * scale;                      \
            const int32_t *table = block_tables + b * table_stride;                                     \
            float narrow[MAX_HEADS * MAX_DIM]; /* a bf16 output in fp32, before its one rounding */     \
            float *ob = out_bf16 ? narrow : (float *)out + b * width;                                   \
            switch (head_dim) {                                                                         \
            case 64: REQUEST(qf, k_cache, v_cache, table, len, num_heads, num_kv_heads, 64, block_size, ob); break;\
            case 128: REQUEST(qf, k_cache, v_cache, table, len, num_heads, num_kv_heads, 128, block_size, ob); break;\
            case 32: REQUEST(qf, k_cache, v_cache, table, len, num_heads, num_kv_heads, 32, block_size, ob); break;\
            default: REQUEST(qf, k_cache, v_cache, table, len, num_heads, num_kv_heads, head_dim, block_size, ob);\
            }                                                                                           \
            if (out_bf16)                                                                               \
                for (int64_t i = 0; i < width; ++i) ((uint16_t *)out)[b * width + i] = f32_to_bf16(narrow[i]);\
        }                                                                                               \
        return 0;                                                                                       \
    }

DEFINE_TILES(tile_f32, float, f32_lanes)
DEFINE_TILES(tile_bf16, uint16_t, bf16_lanes)
#if WIDE_ATTENTION
DEFINE_WIDE_TILES(wide_f32, tile_f32, float, f32_pair, f32_wlanes)
DEFINE_WIDE_TILES(wide_bf16, tile_bf16, uint16_t, bf16_pair, bf16_wlanes)
DEFINE_REQUEST(decode_request_f32, float, wide_f32_scores, wide_f32_values)
DEFINE_REQUEST(decode_request_bf16, uint16_t, wide_bf16_scores, wide_bf16_values)
#else
DEFINE_REQUEST(decode_request_f32, float, tile_f32_scores, tile_f32_values)
DEFINE_REQUEST(decode_request_bf16, uint16_t, tile_bf16_scores, tile_bf16_values)
#endif
DEFINE_DECODE(paged_decode_f32, decode_request_f32, float, f32_scalar)
DEFINE_DECODE(paged_decode_bf16, decode_request_bf16, uint16_t, bf16_scalar)

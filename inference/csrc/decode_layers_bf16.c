/* A dense decoder's blocks over one bf16 step on the CPU in one call (`models/dense/native_layers.py`).
 *
 * Why: at a decode step's few rows the products are small, and the Python between them was a third
 * of the step (SmolLM2, 16 rows, 2 threads, Zen 4: ~8 of ~24 ms; per block a norm, three products,
 * two rotations, a KV store, attention, a fused add and norm, SiLU, a product and an add, each a
 * torch op or a ctypes call with its checks and allocations). Here a block is the same kernels
 * called in the same order on the same rows (`decoder.attention_inputs` / `after_attention`),
 * so the result is the same bits; SwiGLU's activation is the one op that is new in C (below).
 *
 * The step's attention is the native decode kernel over every query row (the backend's plan on the
 * CPU: each prefill row attends as a decode row of its own after the whole step's K and V are
 * stored), so a prefill chunk takes this path too. The last block's attention output and input
 * are narrowed to the rows whose logits are wanted before the rest of it, as the decoder does.
 *
 * Per block, `table` holds 12 addresses (`LAYER_FIELDS`): the input norm's weight, the q/k/v pack
 * and its bias (0: none), the output projection's pack and bias, the post-attention norm's weight,
 * the gate/up pack and bias, the down pack and bias, and the block's K and V pages. */
#pragma GCC optimize("no-associative-math", "no-reciprocal-math", "fp-contract=off")

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

enum { IN_NORM, QKV, QKV_BIAS, O, O_BIAS, POST_NORM, GATE_UP, GATE_UP_BIAS, DOWN, DOWN_BIAS, K_CACHE, V_CACHE,
       LAYER_FIELDS };

/* the library's own kernels (their files say what each computes) */
int small_gemm_bf16(const uint16_t *x, int64_t m, int64_t k, int64_t x_stride, const uint16_t *p, int64_t n,
                    const uint16_t *bias, uint16_t *y, int64_t y_stride, int threads);
int add_rms_norm_bf16(uint16_t *x, const uint16_t *residual, const uint16_t *weight, uint16_t *out, int64_t rows,
                      int64_t n, float eps, int lanes, int threads);
int rotary_bf16(uint16_t *x, int64_t tokens, int64_t heads, int64_t head_dim, int64_t token_stride,
                const uint16_t *cos, const uint16_t *sin, int threads);
int store_rows(char *k_dst, char *v_dst, const char *k, const char *v, int64_t src_stride, const int64_t *slots,
               int64_t rows, int64_t row_bytes);
int paged_decode_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *k_cache, const uint16_t *v_cache,
                      const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens, void *out,
                      int out_bf16, int64_t num_requests, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                      int64_t block_size, float scale, int num_threads);

/* ---- SwiGLU's activation --------------------------------------------------------------------- */

static inline __attribute__((always_inline)) float pow2i(int k) { /* 2^k for k in [-126, 127] */
    const uint32_t bits = (uint32_t)(k + 127) << 23;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* e^d: d = q ln2 + s (Cody-Waite, ln2 in two parts), e^s by a degree-7 polynomial (minimax
 * coefficients), times 2^q in two halves so that q down to -150 stays normal. Its last bits may
 * differ from torch's exp; after SiLU's division and the rounding to bf16 they never show (checked
 * over every bf16 input against torch under each ATen capability: tests/inference/models/dense/test_native_layers.py). */
static inline __attribute__((always_inline)) float exp_f32(float d) {
    const float clamped = d < -104.0f ? -104.0f : (d > 100.0f ? 100.0f : d);
    const float rounder = 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer, ties to even */
    const float qf = (clamped * 1.44269504088896341f + rounder) - rounder;
    const int q = (int)qf;
    float s = __builtin_fmaf(qf, -0.693145751953125f, clamped);
    s = __builtin_fmaf(qf, -1.428606765330187045e-06f, s);
    float u = 0.000198527617612853646278381f;
    u = __builtin_fmaf(u, s, 0.00139304355252534151077271f);
    u = __builtin_fmaf(u, s, 0.00833336077630519866943359f);
    u = __builtin_fmaf(u, s, 0.0416664853692054748535156f);
    u = __builtin_fmaf(u, s, 0.166666671633720397949219f);
    u = __builtin_fmaf(u, s, 0.5f);
    u = 1.0f + __builtin_fmaf(s * s, u, s);
    u = (u * pow2i(q >> 1)) * pow2i(q - (q >> 1));
    u = d < -104.0f ? 0.0f : u;
    return d > 100.0f ? __builtin_inff() : u;
}

/* gate <- bf16(bf16(silu(gate)) * up), row by row (rows `stride` apart): torch's
 * `F.silu(gate, inplace=True).mul_(up)` in bf16, silu in fp32 rounded once, then the product rounded */
int silu_mul_bf16(uint16_t *gate, const uint16_t *up, int64_t rows, int64_t cols, int64_t stride, int threads) {
    if (rows < 0 || cols < 0 || stride < cols || threads < 1) return 1;
    #pragma omp parallel for num_threads(threads) schedule(static) if (rows * cols >= 16384)
    for (int64_t r = 0; r < rows; r++) {
        uint16_t *g = gate + r * stride;
        const uint16_t *u = up + r * stride;
        for (int64_t c = 0; c < cols; c++) {
            const float x = bf16_to_f32(g[c]);
            const float silu = bf16_to_f32(f32_to_bf16(x / (1.0f + exp_f32(-x))));
            g[c] = f32_to_bf16(silu * bf16_to_f32(u[c]));
        }
    }
    return 0;
}

/* ---- the blocks ------------------------------------------------------------------------------ */

static void add_rows(uint16_t *y, const uint16_t *x, int64_t count) { /* y <- bf16(y + x), torch's add_ */
    for (int64_t i = 0; i < count; i++) y[i] = f32_to_bf16(bf16_to_f32(y[i]) + bf16_to_f32(x[i]));
}

static void take_rows(uint16_t *dst, const uint16_t *src, const int64_t *keep, int64_t kept, int64_t width) {
    for (int64_t j = 0; j < kept; j++) memcpy(dst + j * width, src + keep[j] * width, (size_t)width * 2);
}

#define PTR(type, layer, field) ((type *)(intptr_t)(layer)[field])
#define TRY(call)                      \
    do {                               \
        const int status_ = (call);    \
        if (status_) {                 \
            free(work);                \
            return 100 + status_;      \
        }                              \
    } while (0)

/* `x [rows, hidden]`: the step's embedded tokens in, the last block's output out (its first `kept`
 * rows where `keep` narrows it, else all). `cos`, `sin [rows, head_dim]`; `slots [rows]` (int64);
 * `tables [rows, *]` (int32, rows `table_stride` apart) and `seq_lens [rows]`: each query row's
 * pages and the tokens it attends. Returns 0, or nonzero for a shape the kernels refuse. */
int decode_layers_bf16(const int64_t *table, int64_t num_layers, uint16_t *x, int64_t rows, int64_t hidden,
                       int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t intermediate,
                       const uint16_t *cos, const uint16_t *sin, const int64_t *slots, const int32_t *tables,
                       int64_t table_stride, const int32_t *seq_lens, int64_t block_size, float scale, float eps,
                       int lanes, const int64_t *keep, int64_t kept, int threads) {
    if (num_layers < 1 || rows < 1 || hidden < 1 || num_heads < 1 || num_kv_heads < 1 || head_dim < 1 ||
        intermediate < 1 || threads < 1 || (keep && (kept < 1 || kept > rows)))
        return 1;
    for (int64_t j = 0; keep && j < kept; j++)
        if (keep[j] < 0 || keep[j] >= rows) return 2;
    const int64_t q_width = num_heads * head_dim, kv_width = num_kv_heads * head_dim;
    const int64_t qkv_width = q_width + 2 * kv_width, gate_up_width = 2 * intermediate;
    /* per row: h, qkv, attention out, its projection, h after the second norm, gate/up, and the
     * narrowed x and attention out of the last block (the down product lands in x itself) */
    const int64_t per_row = hidden + qkv_width + q_width + hidden + hidden + gate_up_width + hidden + q_width;
    uint16_t *work = aligned_alloc(64, (size_t)((rows * per_row * 2 + 63) / 64 * 64));
    if (!work) return 3;
    uint16_t *h = work, *qkv = h + rows * hidden, *att = qkv + rows * qkv_width, *proj = att + rows * q_width;
    uint16_t *h2 = proj + rows * hidden, *gate_up = h2 + rows * hidden;
    uint16_t *x_kept = gate_up + rows * gate_up_width, *att_kept = x_kept + rows * hidden;
    uint16_t *cur = x; /* the block's input rows */
    int64_t m = rows;
    for (int64_t i = 0; i < num_layers; i++) {
        const int64_t *layer = table + i * LAYER_FIELDS;
        /* attention_inputs: q, k, v of every row, RoPE in place */
        TRY(add_rms_norm_bf16(cur, NULL, PTR(uint16_t, layer, IN_NORM), h, m, hidden, eps, lanes, threads));
        TRY(small_gemm_bf16(h, m, hidden, hidden, PTR(uint16_t, layer, QKV), qkv_width, PTR(uint16_t, layer, QKV_BIAS),
                            qkv, qkv_width, threads));
        TRY(rotary_bf16(qkv, m, num_heads, head_dim, qkv_width, cos, sin, threads));
        TRY(rotary_bf16(qkv + q_width, m, num_kv_heads, head_dim, qkv_width, cos, sin, threads));
        /* the backend: this step's K and V into their slots, then every row's attention */
        TRY(store_rows(PTR(char, layer, K_CACHE), PTR(char, layer, V_CACHE), (const char *)(qkv + q_width),
                       (const char *)(qkv + q_width + kv_width), qkv_width * 2, slots, m, kv_width * 2));
        TRY(paged_decode_bf16(qkv, qkv_width, PTR(uint16_t, layer, K_CACHE), PTR(uint16_t, layer, V_CACHE), tables,
                              table_stride, seq_lens, att, 1, m, num_heads, num_kv_heads, head_dim, block_size, scale,
                              threads));
        const uint16_t *o = att;
        if (i == num_layers - 1 && keep) { /* only the sampled rows go on past the last attention */
            take_rows(att_kept, att, keep, kept, q_width);
            take_rows(x_kept, cur, keep, kept, hidden);
            o = att_kept, cur = x_kept, m = kept;
        }
        /* after_attention: proj <- o W_o + x; h2 = norm(proj); out = down(silu(gate) * up) + proj */
        TRY(small_gemm_bf16(o, m, q_width, q_width, PTR(uint16_t, layer, O), hidden, PTR(uint16_t, layer, O_BIAS), proj,
                            hidden, threads));
        TRY(add_rms_norm_bf16(proj, cur, PTR(uint16_t, layer, POST_NORM), h2, m, hidden, eps, lanes, threads));
        TRY(small_gemm_bf16(h2, m, hidden, hidden, PTR(uint16_t, layer, GATE_UP), gate_up_width,
                            PTR(uint16_t, layer, GATE_UP_BIAS), gate_up, gate_up_width, threads));
        TRY(silu_mul_bf16(gate_up, gate_up + intermediate, m, intermediate, gate_up_width, threads));
        /* NOTE: the block's input was last read by the norm above (its residual): x takes the output */
        TRY(small_gemm_bf16(gate_up, m, intermediate, gate_up_width, PTR(uint16_t, layer, DOWN), hidden,
                            PTR(uint16_t, layer, DOWN_BIAS), x, hidden, threads));
        add_rows(x, proj, m * hidden);
        cur = x;
    }
    free(work);
    return 0;
}

/* A step's K and V rows into their cache slots: k_dst[slots[i]] <- k[i] and v_dst[slots[i]] <- v[i],
 * each row `row_bytes` (one token's heads side by side), sources `src_stride` bytes apart.
 *
 * Why: torch's index_copy_ walks its rows an element at a time through a TensorIterator, ~70 us
 * a call for a decode step's 32 rows of SmolLM2's 3 x 64 floats, twice per layer; a row here is
 * one memcpy. Slots are not checked (the caller's slot mapping is the scheduler's). Returns 0.
 */
#include <stdint.h>
#include <string.h>

int store_rows(char *k_dst, char *v_dst, const char *k, const char *v, int64_t src_stride, const int64_t *slots,
               int64_t rows, int64_t row_bytes) {
    if (rows < 0 || row_bytes <= 0 || src_stride < row_bytes) return 1;
    for (int64_t i = 0; i < rows; i++) {
        memcpy(k_dst + slots[i] * row_bytes, k + i * src_stride, (size_t)row_bytes);
        memcpy(v_dst + slots[i] * row_bytes, v + i * src_stride, (size_t)row_bytes);
    }
    return 0;
}

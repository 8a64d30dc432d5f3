/* bf16 <-> fp32 as torch's CPU ops convert them: widening is exact; narrowing rounds to nearest,
 * ties to even (c10's round_to_nearest_even; a NaN becomes a quiet NaN). A bf16 op of torch's is
 * these around the fp32 op (a product of two bf16 values is exact in fp32, then rounded once). */
#ifndef ROLLOUT_ENGINE_BF16_H
#define ROLLOUT_ENGINE_BF16_H

#include <stdint.h>
#include <string.h>

static inline __attribute__((always_inline)) float bf16_to_f32(uint16_t v) {
    const uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline __attribute__((always_inline)) uint16_t f32_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  /* NaN */
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

#endif

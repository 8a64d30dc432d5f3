/* Eight floats as one value (GCC's vector extension: one AVX register where the CPU has them, a
 * pair of SSE ones below) and the sum of the lanes of eight such values at once, shared by the
 * kernels that reduce eight dot products at a time (small_gemm.c, paged_decode.c). */
#ifndef ROLLOUT_ENGINE_LANES_H
#define ROLLOUT_ENGINE_LANES_H

#define LANES 8

typedef float lanes_t __attribute__((vector_size(LANES * sizeof(float))));

/* (a0+a1, a2+a3, b0+b1, b2+b3, a4+a5, a6+a7, b4+b5, b6+b7) */
static inline __attribute__((always_inline)) lanes_t pair_sums(lanes_t a, lanes_t b) {
    return __builtin_shufflevector(a, b, 0, 2, 8, 10, 4, 6, 12, 14)
         + __builtin_shufflevector(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
}

/* lane j = the lanes of v[j] summed as ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)), for all
 * eight at once: every output's lanes are summed in that order, whichever lane of the tree it is in
 * (in a file compiled without reassociation, as small_gemm.c is) */
static inline __attribute__((always_inline)) lanes_t lane_sums(const lanes_t *v) {
    const lanes_t u0 = pair_sums(pair_sums(v[0], v[1]), pair_sums(v[2], v[3]));
    const lanes_t u1 = pair_sums(pair_sums(v[4], v[5]), pair_sums(v[6], v[7]));
    return __builtin_shufflevector(u0, u1, 0, 1, 2, 3, 8, 9, 10, 11)
         + __builtin_shufflevector(u0, u1, 4, 5, 6, 7, 12, 13, 14, 15);
}

#endif

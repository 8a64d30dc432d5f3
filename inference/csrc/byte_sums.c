/* Moving weight bytes with their checksum in one pass (used by weight_sync; see weight_sync/memcopy.py).
 *
 * The checksum of a byte range is the sum, modulo 2^64, of its bytes read as little-endian 64-bit
 * words, the last partial word zero-padded. Copies of 1 MiB and more use streaming (non-temporal)
 * stores when the destination is 64-byte aligned: the destination (an engine's staging buffer,
 * a shared-memory segment another process reads) is not read back by this core soon, and a
 * streaming store skips reading each destination line before writing it, a third of a plain
 * copy's memory traffic (400 MB: 24 ms against torch's copy_ at 36-40 ms on one core).
 *
 * Publishing a piece of a shared segment: `publish_piece` stores its checksum, then its token
 * with release order (after an sfence, so the streaming stores before it are visible first);
 * `wait_piece` polls the token with acquire order, sleeping between polls (2 us doubling to
 * 200 us), up to a timeout.
 */
#include <stdint.h>
#include <string.h>
#include <time.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define STORE_FENCE() _mm_sfence()
#else
#define STORE_FENCE() __atomic_thread_fence(__ATOMIC_SEQ_CST)
#endif

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the checksum reads little-endian words: a big-endian build would disagree with its peers"
#endif

#define STREAM_MIN_BYTES (1 << 20)

static inline uint64_t load_word(const uint8_t *p) {
    uint64_t w;
    memcpy(&w, p, 8);
    return w;
}

static inline uint64_t tail_word(const uint8_t *p, int64_t n) {
    uint64_t w = 0;
    memcpy(&w, p, (size_t)n);
    return w;
}

/* The words of [src, src + n) from byte `i` on: copied to dst and summed. */
static uint64_t plain_words(uint8_t *dst, const uint8_t *src, int64_t i, int64_t n) {
    uint64_t acc = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w = load_word(src + i);
        memcpy(dst + i, &w, 8);
        acc += w;
    }
    if (i < n) {
        memcpy(dst + i, src + i, (size_t)(n - i));
        acc += tail_word(src + i, n - i);
    }
    return acc;
}

int copy_sum_u64(uint8_t *dst, const uint8_t *src, int64_t n, uint64_t *out) {
    if (n < 0) return 1;
    uint64_t acc = 0;
    int64_t i = 0;
    if (n >= STREAM_MIN_BYTES && ((uintptr_t)dst & 63) == 0) {
#if defined(__AVX512F__)
        __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
        for (; i + 128 <= n; i += 128) {
            __m512i v0 = _mm512_loadu_si512((const void *)(src + i));
            __m512i v1 = _mm512_loadu_si512((const void *)(src + i + 64));
            _mm512_stream_si512((void *)(dst + i), v0);
            _mm512_stream_si512((void *)(dst + i + 64), v1);
            a0 = _mm512_add_epi64(a0, v0);
            a1 = _mm512_add_epi64(a1, v1);
        }
        _mm_sfence();
        acc += (uint64_t)_mm512_reduce_add_epi64(_mm512_add_epi64(a0, a1));
#elif defined(__AVX2__)
        __m256i a0 = _mm256_setzero_si256(), a1 = _mm256_setzero_si256();
        for (; i + 64 <= n; i += 64) {
            __m256i v0 = _mm256_loadu_si256((const __m256i *)(src + i));
            __m256i v1 = _mm256_loadu_si256((const __m256i *)(src + i + 32));
            _mm256_stream_si256((__m256i *)(dst + i), v0);
            _mm256_stream_si256((__m256i *)(dst + i + 32), v1);
            a0 = _mm256_add_epi64(a0, v0);
            a1 = _mm256_add_epi64(a1, v1);
        }
        _mm_sfence();
        uint64_t lanes[4];
        _mm256_storeu_si256((__m256i *)lanes, _mm256_add_epi64(a0, a1));
        acc += lanes[0] + lanes[1] + lanes[2] + lanes[3];
#endif
    }
    *out = acc + plain_words(dst, src, i, n);
    return 0;
}

/* slot: [token, checksum] (two uint64 words of a shared header). */
int publish_piece(uint64_t *slot, uint64_t checksum, uint64_t token) {
    STORE_FENCE();
    __atomic_store_n(&slot[1], checksum, __ATOMIC_RELAXED);
    __atomic_store_n(&slot[0], token, __ATOMIC_RELEASE);
    return 0;
}

/* 0 once slot's token equals `token` (its checksum in *checksum), 1 after timeout_us without. */
int wait_piece(const uint64_t *slot, uint64_t token, int64_t timeout_us, uint64_t *checksum) {
    struct timespec start, now;
    clock_gettime(CLOCK_MONOTONIC, &start);
    long nap_ns = 2000;
    for (;;) {
        if (__atomic_load_n(&slot[0], __ATOMIC_ACQUIRE) == token) {
            *checksum = __atomic_load_n(&slot[1], __ATOMIC_RELAXED);
            return 0;
        }
        clock_gettime(CLOCK_MONOTONIC, &now);
        int64_t waited_us = (int64_t)(now.tv_sec - start.tv_sec) * 1000000 + (now.tv_nsec - start.tv_nsec) / 1000;
        if (waited_us >= timeout_us) return 1;
        struct timespec nap = {0, nap_ns};
        nanosleep(&nap, NULL);
        if (nap_ns < 200000) nap_ns *= 2;
    }
}

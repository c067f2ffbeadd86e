/* The two ceilings a float32 step on one core runs into, measured with nothing else in the way
 * (bench/cpu_ceilings.py builds this file and calls it):
 *
 *   fma_seconds(n)     n rounds of 12 independent multiply-adds in registers, of the widest FMA the
 *                      build has (fma_lanes(): 16 float32 with AVX-512, 8 with AVX2), no memory at
 *                      all: 24 * lanes * n FLOPs. The skinny products can at best reach this.
 *   dot_bf16_seconds(n) the same with vdpbf16ps (AVX-512 BF16), what the bfloat16 products use: each
 *                      multiplies 32 pairs of bfloat16 and adds them into 16 float32, 64 FLOPs, so
 *                      n rounds are 12 * 64 * n FLOPs (-1 where the build has no AVX-512 BF16).
 *   dot_u8s8_seconds(n) the same with vpdpbusd (AVX-512 VNNI): 64 byte products an instruction,
 *                      128 integer ops, so n rounds are 12 * 128 * n ops (-1 without AVX-512 VNNI).
 *   read_gbps(...)     reading `chunks` chunks of `chunk` bytes from a buffer of `size` bytes, at
 *                      random chunk-aligned places (random = 1) or one after another (0), summing
 *                      every 64-byte line; with `ahead` > 0 each line of the chunk `ahead` chunks on
 *                      is asked for (prefetcht1) as a line of this one is read, as the decode kernel
 *                      does for the blocks of a row. A paged KV cache read block by block is the
 *                      random case (a 16-token block of one layer's float32 keys is 12 KB).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

#if defined(__AVX512F__)
#define FMA(i) "vfmadd231ps %%zmm12, %%zmm13, %%zmm" #i "\n"
#define ZERO(i) "vxorps %%zmm" #i ", %%zmm" #i ", %%zmm" #i "\n"
#define LANES 16
#elif defined(__AVX2__) && defined(__FMA__)
#define FMA(i) "vfmadd231ps %%ymm12, %%ymm13, %%ymm" #i "\n"
#define ZERO(i) "vxorps %%ymm" #i ", %%ymm" #i ", %%ymm" #i "\n"
#define LANES 8
#endif

/* n rounds of 12 independent OP(i) on registers 0-11 (12 and 13 the operands, zeroed first) */
#define TWELVE_CHAINS(OP, n)                                                                           \
    __asm__ volatile(ZERO(12) ZERO(13) ZERO(0) ZERO(1) ZERO(2) ZERO(3) ZERO(4) ZERO(5) ZERO(6) ZERO(7) \
                     ZERO(8) ZERO(9) ZERO(10) ZERO(11)                                                 \
                     "1:\n" OP(0) OP(1) OP(2) OP(3) OP(4) OP(5) OP(6) OP(7) OP(8) OP(9) OP(10) OP(11)  \
                     "dec %0\n jnz 1b\n"                                                               \
                     : "+r"(n) : : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7",     \
                       "xmm8", "xmm9", "xmm10", "xmm11", "xmm12", "xmm13", "cc")

/* Seconds taken by n rounds of 12 independent multiply-adds (-1 where the build has no FMA). */
double fma_seconds(int64_t n) {
#if defined(LANES)
    const double t0 = now();
    TWELVE_CHAINS(FMA, n);
    return now() - t0;
#else
    (void)n;
    return -1.0;
#endif
}

/* Seconds taken by n rounds of 12 independent vdpbf16ps (-1 where the build has none). */
double dot_bf16_seconds(int64_t n) {
#if defined(__AVX512BF16__)
#define DOT(i) "vdpbf16ps %%zmm12, %%zmm13, %%zmm" #i "\n"
    const double t0 = now();
    TWELVE_CHAINS(DOT, n);
    return now() - t0;
#else
    (void)n;
    return -1.0;
#endif
}

/* Seconds taken by n rounds of 12 independent vpdpbusd (-1 where the build has no AVX-512 VNNI): each
 * multiplies 64 unsigned by 64 signed bytes and adds them by fours into 16 int32, 128 integer ops; an
 * int8 product path (activations quantized to bytes, as llama.cpp's Q8 x Q4 dot products) would be
 * made of these. */
double dot_u8s8_seconds(int64_t n) {
#if defined(__AVX512VNNI__)
#define DOT8(i) "vpdpbusd %%zmm12, %%zmm13, %%zmm" #i "\n"
    const double t0 = now();
    TWELVE_CHAINS(DOT8, n);
    return now() - t0;
#else
    (void)n;
    return -1.0;
#endif
}

int fma_lanes(void) {
#if defined(LANES)
    return LANES;
#else
    return 0;
#endif
}

/* GB/s of reading `chunks` chunks of `chunk` bytes (a multiple of 64) out of buf [size]. */
double read_gbps(const char *buf, int64_t size, int64_t chunk, int64_t chunks, int random, int64_t ahead,
                 uint64_t seed, double *sink) {
    const int64_t slots = size / chunk;
    int64_t *at = malloc(sizeof(int64_t) * (size_t)chunks);
    if (at == NULL || slots < 1) {
        free(at);
        return 0.0;
    }
    for (int64_t i = 0; i < chunks; ++i) {
        seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;       /* one LCG step */
        at[i] = random ? (int64_t)((seed >> 33) % (uint64_t)slots) : i % slots;
    }
    uint64_t acc = 0;
    const double t0 = now();
    for (int64_t i = 0; i < chunks; ++i) {
        const char *p = buf + at[i] * chunk;
        const char *q = ahead > 0 && i + ahead < chunks ? buf + at[i + ahead] * chunk : NULL;
        for (int64_t x = 0; x < chunk; x += 64) {
#if defined(__AVX2__)
            if (q) _mm_prefetch(q + x, _MM_HINT_T1);
#endif
            uint64_t v;
            memcpy(&v, p + x, sizeof v);
            acc += v;
        }
    }
    const double s = now() - t0;
    *sink = (double)acc;
    free(at);
    return (double)chunks * (double)chunk / s / 1e9;
}

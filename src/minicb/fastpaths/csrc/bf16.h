/* bfloat16 <-> float32, and float16 -> float32, for minicb's C kernels (paged_decode.c, fused_ops.c,
 * skinny_gemm.c, int8_gemm.c).
 *
 * A bfloat16 is the top 16 bits of a float32, so widening is a shift; narrowing rounds to nearest,
 * ties to even (what torch's .to(torch.bfloat16) does), and keeps a NaN a NaN. ckernels.build hashes
 * this header with the source that includes it, so an edit here rebuilds every kernel.
 */
#ifndef MINICB_BF16_H
#define MINICB_BF16_H

#include <stdint.h>
#include <string.h>

static inline float bf16_load(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t bf16_store(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);   /* quiet NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* A float16 (a GGUF block's scale) as a float32, exactly: the plain C loops' conversion (the vector
 * loops use vcvtph2ps). */
static inline float half_load(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 31u, f = h & 1023u;
    uint32_t u = sign | (e == 31 ? 0x7f800000u | f << 13 : (e + 112) << 23 | f << 13);
    float v;
    memcpy(&v, &u, sizeof v);
    if (e == 0) v = (sign ? -1.0f : 1.0f) * (float)f * (1.0f / 16777216.0f);   /* zero, subnormal */
    return v;
}

#endif

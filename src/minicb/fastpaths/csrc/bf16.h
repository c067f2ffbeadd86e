/* bfloat16 <-> float32 for minicb's C kernels (paged_decode.c, fused_ops.c, skinny_gemm.c).
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

#endif

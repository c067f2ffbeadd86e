/* e^x in float32 as vector math libraries compute it, for minicb's C kernels (paged_decode.c's
 * softmax, fused_ops.c's SiLU).
 *
 * x = n ln2 + r with n an integer and |r| <= ln2 / 2, e^r by a degree-7 polynomial (Cephes' expf
 * coefficients, relative error about 1e-7: a float32 rounding), 2^n by writing n into the exponent
 * bits. Plain arithmetic, so a loop of it vectorises (given -fno-trapping-math, without which GCC keeps
 * the clamp as a branch), where a call to libm's expf is one number at a time. For x <= 0 only (a
 * softmax's score minus its max; a SiLU's -|x|): below -87 e^x is clamped to e^-87 (1.6e-38, the
 * smallest normal float's order), which against the 1 it is added to or compared with is nothing
 * either way. Kept away from large results on purpose: a product or quotient that lands among the
 * denormal numbers costs a microcode assist per vector (a SiLU written as x / (1 + e^-x) also computed
 * x / (1 + e^88) for every lane, and its loop ran slower than torch's own SiLU on a Zen 4 core).
 */
#ifndef MINICB_EXP_F32_H
#define MINICB_EXP_F32_H

#include <math.h>
#include <stdint.h>

static inline float exp_f32(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;      /* ln2 split in two: exact n*hi */
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const union { int32_t i; float f; } two_n = {.i = ((int32_t)n + 127) << 23};   /* 2^n */
    return p * two_n.f;
}

#endif

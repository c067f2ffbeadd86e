/* What a product on int8 activations and 4-bit weights would reach on this core: the question behind
 * W2's 1.5x bar (bench/int8_product.py builds this file, checks it against numpy and times it).
 *
 * The bfloat16 products run at 96% of vdpbf16ps's peak (bench/cpu_ceilings.py), and vpdpbusd
 * (AVX-512 VNNI: 64 unsigned-by-signed byte products into 16 int32) has twice that peak. A product
 * made of it, as llama.cpp's Q4 x Q8 dot products are: the weights as the GGUF's Q4_1 blocks (per 32
 * inputs of an output: w = d q + m, q in 0..15), the activations rounded to bytes per 32 inputs of a
 * row (x = s p, p in -127..127), so that a block's sum is
 *
 *     sum_i w_i x_i = d s (sum_i q_i p_i) + m (s sum_i p_i)
 *
 * the integer sum exact on vpdpbusd, then one convert, one multiply and two multiply-adds per block
 * and vector of 16 outputs: 12 instructions where bfloat16 takes 16 (vdpbf16ps, 2 inputs each) for
 * the same 16 outputs x 32 inputs of a row. This file measures what that count gives.
 *
 * Layout (made by int8_product.py): weights in panels of 64 outputs, per panel and block 8 groups of 4
 * inputs, each group 4 vectors of 16 outputs x 4 bytes (the q, unpacked to bytes); d and m per panel
 * and block as 64 floats each. Activations: per row and block 32 signed bytes, s and s * sum(p).
 * Rows go RB at a time over a panel (3 x 4 integer sums and 3 x 4 float accumulators in registers).
 */
#include <stdint.h>
#include <time.h>
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
#include <immintrin.h>
#endif

#define RB 3

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

/* y [rows, out] = x [rows, in] @ W^T from the layouts above; nb = in / 32 blocks, out a multiple of 64.
 * Returns 0, or -1 where the build has no AVX-512 VNNI. */
int int8_product(const uint8_t *wq, const float *wd, const float *wm, const int8_t *xq, const float *xs,
                 const float *xsum, float *y, int64_t rows, int64_t nb, int64_t out) {
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
    const int64_t panels = out / 64;
    for (int64_t pn = 0; pn < panels; ++pn) {
        const uint8_t *wp = wq + pn * nb * 2048;
        const float *dp = wd + pn * nb * 64, *mp = wm + pn * nb * 64;
        for (int64_t r0 = 0; r0 < rows; r0 += RB) {
            const int nr = (int)(rows - r0 < RB ? rows - r0 : RB);
            __m512 acc[RB][4];
            for (int r = 0; r < RB; ++r)
                for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_setzero_ps();
            for (int64_t b = 0; b < nb; ++b) {
                __m512i isum[RB][4];
                for (int r = 0; r < RB; ++r)
                    for (int v = 0; v < 4; ++v) isum[r][v] = _mm512_setzero_si512();
                const uint8_t *wb = wp + b * 2048;
                for (int g = 0; g < 8; ++g) {
                    __m512i w[4];
                    for (int v = 0; v < 4; ++v) w[v] = _mm512_loadu_si512(wb + g * 256 + v * 64);
                    for (int r = 0; r < RB; ++r) {
                        if (r >= nr) break;
                        const __m512i xb = _mm512_set1_epi32(*(const int32_t *)(xq + ((r0 + r) * nb + b) * 32 + g * 4));
                        for (int v = 0; v < 4; ++v) isum[r][v] = _mm512_dpbusd_epi32(isum[r][v], w[v], xb);
                    }
                }
                for (int r = 0; r < RB; ++r) {
                    if (r >= nr) break;
                    const __m512 s = _mm512_set1_ps(xs[(r0 + r) * nb + b]);
                    const __m512 ssum = _mm512_set1_ps(xsum[(r0 + r) * nb + b]);
                    for (int v = 0; v < 4; ++v) {
                        const __m512 ds = _mm512_mul_ps(_mm512_loadu_ps(dp + b * 64 + v * 16), s);
                        acc[r][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r][v]), ds, acc[r][v]);
                        acc[r][v] = _mm512_fmadd_ps(_mm512_loadu_ps(mp + b * 64 + v * 16), ssum, acc[r][v]);
                    }
                }
            }
            for (int r = 0; r < nr; ++r)
                for (int v = 0; v < 4; ++v) _mm512_storeu_ps(y + (r0 + r) * out + pn * 64 + v * 16, acc[r][v]);
        }
    }
    return 0;
#else
    (void)wq, (void)wd, (void)wm, (void)xq, (void)xs, (void)xsum, (void)y, (void)rows, (void)nb, (void)out;
    return -1;
#endif
}

/* seconds for `repeats` calls of int8_product (-1 without AVX-512 VNNI) */
double int8_product_seconds(const uint8_t *wq, const float *wd, const float *wm, const int8_t *xq,
                            const float *xs, const float *xsum, float *y, int64_t rows, int64_t nb, int64_t out,
                            int repeats) {
    const double t0 = now();
    for (int i = 0; i < repeats; ++i)
        if (int8_product(wq, wd, wm, xq, xs, xsum, y, rows, nb, out)) return -1.0;
    return now() - t0;
}

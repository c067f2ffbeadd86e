/* Linear layers on int8 activations and the GGUF's own 4-bit weights: y = x @ W^T with x rounded to
 * bytes, W as the file's Q4_1 blocks. The products of llama.cpp's CPU backend, opt-in here
 * (MINICB_INT8_PRODUCTS=1; int8_gemm.py says when and why).
 *
 * Why: a bfloat16 product of many rows (a W2 decode step, a prompt chunk) runs at 96% of the
 * vdpbf16ps peak (bench/cpu_ceilings.py): 2 multiply-adds per 32-bit lane. vpdpbusd (AVX-512 VNNI)
 * does 4 byte products per lane in the same time, so a product of bytes has twice the ceiling. A
 * Q4_1 block is 32 inputs of one output, w = d q + m (q in 0..15, d and m float16); the activations
 * are rounded per row and block of 32 inputs, x ~ s p (p in -127..127, s = max |x| / 127). Then
 *
 *     sum_i w_i x_i ~ d s (sum_i q_i p_i) + m s (sum_i p_i)
 *
 * the integer sum exact on vpdpbusd, then per block and 16 outputs a convert, a multiply and two
 * multiply-adds. The weights are the file's exactly (the bfloat16 path rounds d q + m to bfloat16);
 * what changes is x, rounded to 8 bits per 32 inputs: its effect on the tokens is a measured figure
 * (python bench/agreement.py --modes fast,int8), not a rounding of the same sum.
 *
 * Layout (int8_gemm.py's pack): panels of 64 outputs; per panel and block of 32 inputs, 1,280 bytes:
 *
 *     [pair of groups gp < 4][vector v < 4][output o < 16][input t < 4]   one byte each, 1,024 in all:
 *         low nibble  q of output 64 panel + 16 v + o, input 32 block + 8 gp + t
 *         high nibble the same output, input 32 block + 8 gp + 4 + t
 *     d [64] float16, m [64] float16                                     the panel's outputs' scales
 *
 * so that one 64-byte load is 16 outputs x 4 inputs of two groups, and a mask and a shift make the
 * two vectors of bytes vpdpbusd multiplies by 4 broadcast activation bytes: 0.625 bytes a weight,
 * a third of bfloat16's, which also makes steps of few rows (memory-bound) faster.
 *
 * Activations (minicb_int8_quantize): each row rounded once, laid out as one run of bytes,
 *
 *     p [in] int8, then s [in / 32] and s * sum(p) [in / 32] float32       (1.25 in bytes a row)
 *
 * which the layer stack makes in the part before each product (the norm, the SiLU, a part of its
 * own after the attention), so that the product's items, shares of its panels, all read one rounding
 * of each row: rounding inside every item (tried first) took 13% of the products' time on W2.
 * minicb_int8_q4 (int8_gemm.py's matmul) rounds into a scratch buffer of its own first.
 *
 * Numerics: every build gives the same bits: the integer sums are exact, the rounding of x is
 * p = x * (127 / max) to nearest even (a block holding an inf or a NaN gets s = NaN, so the outputs it
 * reaches are NaN on every build; one whose max is under 127 / FLT_MAX counts as zeros), and each block adds (float)isum * (d * s) and then m * (s sum p)
 * to its float32 accumulator by fused multiply-adds (fmaf in the plain C loop), blocks in order.
 * Outputs rounded once to bfloat16. Threads split the panels as skinny_gemm.c's do: the same bits on
 * any thread count.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "omp_id.h"
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define INT8_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define INT8_AVX2 1
#endif

#define TW 64           /* outputs per panel */
#define QB 32           /* inputs per block */
#define BLOCK_BYTES 1280 /* one panel's block: 1,024 bytes of nibbles, then d and m (64 float16 each) */
#if defined(INT8_AVX2)
#define RB 4            /* rows per pass: 4 int16 and 4 float sums of 8 outputs, in 16 registers */
#else
#define RB 3            /* rows per pass: 3 x 4 integer sums and 3 x 4 float sums in 32 registers */
#endif

/* bytes of a rounded row of `in` inputs: p, then s and s * sum(p) per block */
#define QROW(in) ((in) + 8 * ((in) / QB))

/* rows of bfloat16 x (row stride xstride, `in` a multiple of 32) rounded per block of 32 inputs, into
 * rows of `qstride` pairs of bytes at xq (qstride counts 2-byte units, as the layer stack counts its
 * bfloat16 buffers; at least QROW(in) / 2) */
void minicb_int8_quantize(const uint16_t *x, int64_t xstride, int64_t rows, int64_t in, char *xq,
                          int64_t qstride) {
    const int64_t nb = in / QB;
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t b = 0; b < nb; ++b) {
            const uint16_t *xb = x + r * xstride + b * QB;
            char *row = xq + r * 2 * qstride;
            int8_t *p = (int8_t *)row + b * QB;
            float *xs = (float *)(row + in), *xm = xs + nb;
#if defined(INT8_VNNI)
            const __m512 lo = _mm512_castsi512_ps(
                _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)xb)), 16));
            const __m512 hi = _mm512_castsi512_ps(
                _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(xb + 16))), 16));
            const __m512 alo = _mm512_abs_ps(lo), ahi = _mm512_abs_ps(hi), big = _mm512_set1_ps(FLT_MAX);
            const int finite = !(_mm512_cmp_ps_mask(alo, big, _CMP_NLE_UQ)        /* inf or NaN: not <= */
                                 | _mm512_cmp_ps_mask(ahi, big, _CMP_NLE_UQ));
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(alo, ahi));   /* finite blocks' only */
            const float inv = amax > 0 ? 127.0f / amax : 0.0f;
            int sum = 0;
            if (finite && inv <= FLT_MAX) {
                const __m512 iv = _mm512_set1_ps(inv);
                const __m512i plo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, iv));
                const __m512i phi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, iv));
                _mm_storeu_si128((__m128i *)p, _mm512_cvtsepi32_epi8(plo));
                _mm_storeu_si128((__m128i *)(p + 16), _mm512_cvtsepi32_epi8(phi));
                sum = _mm512_reduce_add_epi32(_mm512_add_epi32(plo, phi));
            } else {
                memset(p, 0, QB);
            }
#else
            float amax = 0.0f;
            int finite = 1;
            for (int i = 0; i < QB; ++i) {
                const float v = fabsf(bf16_load(xb[i]));
                finite &= v <= FLT_MAX;            /* false for inf and NaN */
                amax = v > amax ? v : amax;
            }
            const float inv = amax > 0 ? 127.0f / amax : 0.0f;
            int sum = 0;
            for (int i = 0; i < QB; ++i) {
                const float v = finite && inv <= FLT_MAX ? nearbyintf(bf16_load(xb[i]) * inv) : 0.0f;
                p[i] = (int8_t)v;                  /* |v| <= 127: inv * max rounds to 127 */
                sum += p[i];
            }
#endif
            /* a block with an inf or a NaN: s is NaN, so every output it reaches is NaN, as bfloat16's
             * products would make it; a block whose max is under 127 / FLT_MAX (about 2^-121, where
             * 127 / max overflows) counts as zeros */
            const float s = !finite ? NAN : inv <= FLT_MAX ? amax / 127.0f : 0.0f;
            xs[b] = s;
            xm[b] = s * (float)sum;
        }
}

/* acc[r][j] for nr <= RB rounded rows (from xq, `qbytes` bytes apart) and one panel `p` */
static void panel(const char *xq, int64_t qbytes, int64_t in, const uint8_t *p, int nr, float acc[RB][TW]) {
    const int64_t nb = in / QB;
#define XQ(r) ((const int8_t *)(xq + (r) * qbytes))                     /* row r's p */
#define XS(r, b) (((const float *)(xq + (r) * qbytes + in))[b])        /* its s of block b */
#define XM(r, b) (((const float *)(xq + (r) * qbytes + in))[nb + (b)]) /* its s * sum(p) */
#if defined(INT8_VNNI)
#define PANEL_INT8(NR)                                                                                 \
    {                                                                                                  \
        const __m512i low = _mm512_set1_epi8(15);                                                      \
        __m512 a[NR][4];                                                                               \
        for (int r = 0; r < NR; ++r)                                                                   \
            for (int v = 0; v < 4; ++v) a[r][v] = _mm512_setzero_ps();                                 \
        for (int64_t b = 0; b < nb; ++b) {                                                             \
            const uint8_t *blk = p + b * BLOCK_BYTES;                                                  \
            __m512i isum[NR][4];                                                                       \
            for (int r = 0; r < NR; ++r)                                                               \
                for (int v = 0; v < 4; ++v) isum[r][v] = _mm512_setzero_si512();                       \
            for (int gp = 0; gp < 4; ++gp)                                                             \
                for (int v = 0; v < 4; ++v) {                                                          \
                    const __m512i raw = _mm512_loadu_si512(blk + 256 * gp + 64 * v);                   \
                    const __m512i w0 = _mm512_and_si512(raw, low);                                     \
                    const __m512i w1 = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);               \
                    for (int r = 0; r < NR; ++r) {                                                     \
                        const int8_t *xr = XQ(r) + b * QB + 8 * gp;                                    \
                        int32_t x0, x1;                                                                \
                        memcpy(&x0, xr, 4);                                                            \
                        memcpy(&x1, xr + 4, 4);                                                        \
                        isum[r][v] = _mm512_dpbusd_epi32(isum[r][v], w0, _mm512_set1_epi32(x0));       \
                        isum[r][v] = _mm512_dpbusd_epi32(isum[r][v], w1, _mm512_set1_epi32(x1));       \
                    }                                                                                  \
                }                                                                                      \
            const __m256i *dm = (const __m256i *)(blk + 1024);                                         \
            for (int v = 0; v < 4; ++v) {      /* each scale widened once, for every row */           \
                const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(dm + v));                          \
                const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(dm + 4 + v));                      \
                for (int r = 0; r < NR; ++r) {                                                         \
                    const __m512 ds = _mm512_mul_ps(d, _mm512_set1_ps(XS(r, b)));                      \
                    a[r][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r][v]), ds, a[r][v]);            \
                    a[r][v] = _mm512_fmadd_ps(m, _mm512_set1_ps(XM(r, b)), a[r][v]);                   \
                }                                                                                      \
            }                                                                                          \
        }                                                                                              \
        for (int r = 0; r < NR; ++r)                                                                   \
            for (int v = 0; v < 4; ++v) _mm512_storeu_ps(acc[r] + 16 * v, a[r][v]);                    \
        return;                                                                                        \
    }
    switch (nr) {      /* a constant row count each, so the sums live in registers */
    case 1: PANEL_INT8(1)
    case 2: PANEL_INT8(2)
    default: PANEL_INT8(3)
    }
#elif defined(INT8_AVX2)
    /* No vpdpbusd: vpmaddubsw multiplies 32 unsigned by signed byte pairs and adds each two into an
     * int16 (at most 2 x 15 x 127 = 3,810), so a block's eight of them (two groups of 4 inputs a pair,
     * four pairs) add up in int16 without overflow (at most 30,480), and one vpmaddwd by ones makes the
     * int32 sum of each output's 32 products: 10 instructions for 8 outputs x 32 inputs of a row, where
     * the bfloat16 AVX2 loop takes 32 multiply-adds. 16 registers: the panel goes 8 outputs (one vector)
     * at a time, for up to RB rows. */
    const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
#define UNIT_AVX2(NR)                                                                                  \
    {                                                                                                  \
        __m256 a[NR];                                                                                  \
        for (int r = 0; r < NR; ++r) a[r] = _mm256_setzero_ps();                                       \
        for (int64_t b = 0; b < nb; ++b) {                                                             \
            const uint8_t *blk = p + b * BLOCK_BYTES;                                                  \
            __m256i s16[NR];                                                                           \
            for (int r = 0; r < NR; ++r) s16[r] = _mm256_setzero_si256();                              \
            for (int gp = 0; gp < 4; ++gp) {                                                           \
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(blk + 256 * gp + off));       \
                const __m256i w0 = _mm256_and_si256(raw, low);                                         \
                const __m256i w1 = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);                   \
                for (int r = 0; r < NR; ++r) {                                                         \
                    const int8_t *xr = XQ(r) + b * QB + 8 * gp;                                        \
                    int32_t x0, x1;                                                                    \
                    memcpy(&x0, xr, 4);                                                                \
                    memcpy(&x1, xr + 4, 4);                                                            \
                    s16[r] = _mm256_add_epi16(s16[r], _mm256_maddubs_epi16(w0, _mm256_set1_epi32(x0))); \
                    s16[r] = _mm256_add_epi16(s16[r], _mm256_maddubs_epi16(w1, _mm256_set1_epi32(x1))); \
                }                                                                                      \
            }                                                                                          \
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 1024 + 16 * u))); \
            const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 1152 + 16 * u))); \
            for (int r = 0; r < NR; ++r) {                                                             \
                const __m256 isum = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16[r], ones));               \
                a[r] = _mm256_fmadd_ps(isum, _mm256_mul_ps(d, _mm256_set1_ps(XS(r, b))), a[r]);        \
                a[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(XM(r, b)), a[r]);                             \
            }                                                                                          \
        }                                                                                              \
        for (int r = 0; r < NR; ++r) _mm256_storeu_ps(acc[r] + 8 * u, a[r]);                           \
        continue;                                                                                      \
    }
    for (int u = 0; u < TW / 8; ++u) {         /* outputs 8u.. : vector u / 2 of the layout, half u % 2 */
        const int64_t off = 64 * (u / 2) + 32 * (u % 2);
        switch (nr) {
        case 1: UNIT_AVX2(1)
        case 2: UNIT_AVX2(2)
        case 3: UNIT_AVX2(3)
        default: UNIT_AVX2(4)
        }
    }
#else
    for (int r = 0; r < nr; ++r)
        for (int j = 0; j < TW; ++j) acc[r][j] = 0.0f;
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *blk = p + b * BLOCK_BYTES;
        const uint16_t *dm = (const uint16_t *)(blk + 1024);
        for (int r = 0; r < nr; ++r) {
            const int8_t *xr = XQ(r) + b * QB;
            for (int j = 0; j < TW; ++j) {
                const int v = j / 16, o = j % 16;
                int32_t isum = 0;
                for (int gp = 0; gp < 4; ++gp)
                    for (int t = 0; t < 4; ++t) {
                        const uint8_t byte = blk[256 * gp + 64 * v + 4 * o + t];
                        isum += (byte & 15) * xr[8 * gp + t] + (byte >> 4) * xr[8 * gp + 4 + t];
                    }
                const float ds = half_load(dm[j]) * XS(r, b);
                acc[r][j] = fmaf((float)isum, ds, acc[r][j]);
                acc[r][j] = fmaf(half_load(dm[TW + j]), XM(r, b), acc[r][j]);
            }
        }
    }
#endif
}

/* the panels [*p0, *p1) of part `part` of `parts` (skinny_gemm.c's share) */
static inline void share(int64_t panels, int part, int parts, int64_t *p0, int64_t *p1) {
    *p0 = panels * part / parts;
    *p1 = panels * (part + 1) / parts;
}

/* y [rows, out] (bfloat16, row stride ystride) from rounded rows xq (minicb_int8_quantize, `qstride`
 * 2-byte units apart) and the packed blocks: the outputs of part `part` of `parts` (the signature of
 * skinny_gemm.c's _part entries, which layer_stack.c calls from its threads) */
void minicb_int8_q4_part(const char *xq, int64_t qstride, const uint8_t *packed, uint16_t *y, int64_t ystride,
                         int64_t rows, int64_t in, int64_t out, int part, int parts) {
    const int64_t panels = (out + TW - 1) / TW, panel_bytes = in / QB * BLOCK_BYTES, qbytes = 2 * qstride;
    int64_t p0, p1;
    share(panels, part, parts, &p0, &p1);
    for (int64_t pn = p0; pn < p1; ++pn) {
        const int64_t o0 = pn * TW, no = out - o0 < TW ? out - o0 : TW;
        for (int64_t r0 = 0; r0 < rows; r0 += RB) {
            float acc[RB][TW];
            const int nr = (int)(rows - r0 < RB ? rows - r0 : RB);
            panel(xq + r0 * qbytes, qbytes, in, packed + pn * panel_bytes, nr, acc);
            for (int r = 0; r < nr; ++r) {
                uint16_t *yr = y + (r0 + r) * ystride + o0;
                for (int64_t j = 0; j < no; ++j) yr[j] = bf16_store(acc[r][j]);
            }
        }
    }
}

/* the whole product from bfloat16 x [rows, in]: its rows rounded into a buffer of this call's, then
 * the panels on `nthreads` OpenMP threads (one when it reads under 512 KiB of weights); returns 1
 * when the buffer could not be allocated, else 0 */
int minicb_int8_q4(const uint16_t *x, int64_t xstride, const uint8_t *packed, uint16_t *y, int64_t ystride,
                   int64_t rows, int64_t in, int64_t out, int nthreads) {
    const int64_t panels = (out + TW - 1) / TW, bytes = panels * (in / QB) * BLOCK_BYTES;
    const int parts = nthreads > 1 && bytes >= 524288 ? nthreads : 1;
    char *xq = malloc((size_t)(rows * QROW(in)) + 1);
    if (!xq) return 1;
    minicb_int8_quantize(x, xstride, rows, in, xq, QROW(in) / 2);
    if (parts == 1)
        minicb_int8_q4_part(xq, QROW(in) / 2, packed, y, ystride, rows, in, out, 0, 1);
    else
        _Pragma("omp parallel num_threads(parts)")
        minicb_int8_q4_part(xq, QROW(in) / 2, packed, y, ystride, rows, in, out, omp_thread(), omp_threads());
    free(xq);
    return 0;
}

/* 2: the AVX-512 VNNI loop; 1: the AVX2 loop; 0: plain C (correct everywhere, slow: int8_gemm.py uses
 * it only in tests) */
int minicb_int8_path(void) {
#if defined(INT8_VNNI)
    return 2;
#elif defined(INT8_AVX2)
    return 1;
#else
    return 0;
#endif
}

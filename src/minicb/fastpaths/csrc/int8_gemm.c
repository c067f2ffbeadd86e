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
 * what changes is x, rounded to 8 bits per 32 inputs: a measured figure (bench/int8_product.py
 * --agreement), not a rounding of the same sum.
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
 * Activations (quantize_rows): per row and block, p [32] int8, s and s * sum(p) as float32, in a
 * scratch buffer of the calling thread, made again by every call (each share of the panels rounds
 * its rows itself: a few percent of the product).
 *
 * Numerics: every build gives the same bits: the integer sums are exact, the rounding of x is
 * x * (127 / max) to nearest even, and each block adds (float)isum * (d * s) and then m * (s sum p)
 * to its float32 accumulator by fused multiply-adds (fmaf in the plain C loop), blocks in order.
 * Outputs rounded once to bfloat16. Threads split the panels as skinny_gemm.c's do: the same bits on
 * any thread count.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "omp_id.h"
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define INT8_VNNI 1
#endif

#define TW 64           /* outputs per panel */
#define QB 32           /* inputs per block */
#define BLOCK_BYTES 1280 /* one panel's block: 1,024 bytes of nibbles, then d and m (64 float16 each) */
#define RB 3            /* rows per pass: 3 x 4 integer sums and 3 x 4 float sums in 32 registers */
#define CHUNK 256       /* rows rounded at once (the scratch: 256 x in bytes) */

/* float16 -> float32 (the plain C loop; the AVX-512 loop converts with vcvtph2ps) */
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 31u, f = h & 1023u;
    uint32_t u = sign | (e == 31 ? 0x7f800000u | f << 13 : (e + 112) << 23 | f << 13);
    float v;
    memcpy(&v, &u, sizeof v);
    if (e == 0) v = (sign ? -1.0f : 1.0f) * (float)f * (1.0f / 16777216.0f);   /* zero, subnormal */
    return v;
}

/* the calling thread's scratch: rounded rows [rows][in] int8, then s and s * sum(p) per row and block */
static _Thread_local struct {
    char *p;
    size_t size;
} scratch;

static char *scratch_of(size_t size) {
    if (size > scratch.size) {
        free(scratch.p);
        scratch.p = malloc(size);
        scratch.size = scratch.p ? size : 0;
    }
    return scratch.p;
}

/* rows of bfloat16 x (row stride xstride, `in` a multiple of 32) rounded per block of 32 inputs */
static void quantize_rows(const uint16_t *x, int64_t xstride, int64_t rows, int64_t in, int8_t *xq,
                          float *xs, float *xm) {
    const int64_t nb = in / QB;
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t b = 0; b < nb; ++b) {
            const uint16_t *xb = x + r * xstride + b * QB;
            int8_t *p = xq + r * in + b * QB;
#if defined(INT8_VNNI)
            const __m512 lo = _mm512_castsi512_ps(
                _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)xb)), 16));
            const __m512 hi = _mm512_castsi512_ps(
                _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(xb + 16))), 16));
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
            const __m512 inv = _mm512_set1_ps(amax > 0 ? 127.0f / amax : 0.0f);
            const __m512i plo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv));
            const __m512i phi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
            _mm_storeu_si128((__m128i *)p, _mm512_cvtsepi32_epi8(plo));
            _mm_storeu_si128((__m128i *)(p + 16), _mm512_cvtsepi32_epi8(phi));
            const int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(plo, phi));
#else
            float amax = 0.0f;
            for (int i = 0; i < QB; ++i) amax = fmaxf(amax, fabsf(bf16_load(xb[i])));
            const float inv = amax > 0 ? 127.0f / amax : 0.0f;
            int sum = 0;
            for (int i = 0; i < QB; ++i) {
                const float v = nearbyintf(bf16_load(xb[i]) * inv);
                p[i] = (int8_t)(v > 127.0f ? 127 : v < -127.0f ? -127 : v);
                sum += p[i];
            }
#endif
            const float s = amax / 127.0f;
            xs[r * nb + b] = s;
            xm[r * nb + b] = s * (float)sum;
        }
}

/* acc[r][j] for nr <= RB rows (rounded: xq, xs, xm at row 0 of them) and one panel `p` */
static void panel(const int8_t *xq, const float *xs, const float *xm, int64_t in, const uint8_t *p, int nr,
                  float acc[RB][TW]) {
    const int64_t nb = in / QB;
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
                        const int8_t *xr = xq + r * in + b * QB + 8 * gp;                              \
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
                    const __m512 ds = _mm512_mul_ps(d, _mm512_set1_ps(xs[r * nb + b]));                \
                    a[r][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r][v]), ds, a[r][v]);            \
                    a[r][v] = _mm512_fmadd_ps(m, _mm512_set1_ps(xm[r * nb + b]), a[r][v]);             \
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
#else
    for (int r = 0; r < nr; ++r)
        for (int j = 0; j < TW; ++j) acc[r][j] = 0.0f;
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *blk = p + b * BLOCK_BYTES;
        const uint16_t *dm = (const uint16_t *)(blk + 1024);
        for (int r = 0; r < nr; ++r) {
            const int8_t *xr = xq + r * in + b * QB;
            for (int j = 0; j < TW; ++j) {
                const int v = j / 16, o = j % 16;
                int32_t isum = 0;
                for (int gp = 0; gp < 4; ++gp)
                    for (int t = 0; t < 4; ++t) {
                        const uint8_t byte = blk[256 * gp + 64 * v + 4 * o + t];
                        isum += (byte & 15) * xr[8 * gp + t] + (byte >> 4) * xr[8 * gp + 4 + t];
                    }
                const float ds = half_to_float(dm[j]) * xs[r * nb + b];
                acc[r][j] = fmaf((float)isum, ds, acc[r][j]);
                acc[r][j] = fmaf(half_to_float(dm[TW + j]), xm[r * nb + b], acc[r][j]);
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

/* y [rows, out] (bfloat16, row stride ystride) from bfloat16 x [rows, in] and the packed blocks: the
 * outputs of part `part` of `parts` (the signature of skinny_gemm.c's _part entries, which
 * layer_stack.c calls from its threads). Where the scratch cannot be allocated, its outputs are NaN. */
void minicb_int8_q4_part(const uint16_t *x, int64_t xstride, const uint8_t *packed, uint16_t *y,
                         int64_t ystride, int64_t rows, int64_t in, int64_t out, int part, int parts) {
    const int64_t panels = (out + TW - 1) / TW, nb = in / QB, panel_bytes = nb * BLOCK_BYTES;
    int64_t p0, p1;
    share(panels, part, parts, &p0, &p1);
    if (p0 == p1) return;
    const int64_t chunk = rows < CHUNK ? rows : CHUNK;
    char *buf = scratch_of((size_t)(chunk * in + 2 * chunk * nb * (int64_t)sizeof(float)));
    if (!buf) {             /* no scratch: this part's outputs are NaN, never an old buffer's values */
        for (int64_t r = 0; r < rows; ++r)
            for (int64_t j = p0 * TW; j < (p1 * TW < out ? p1 * TW : out); ++j) y[r * ystride + j] = 0x7fc0;
        return;
    }
    int8_t *xq = (int8_t *)buf;
    float *xs = (float *)(buf + chunk * in), *xm = xs + chunk * nb;
    for (int64_t c0 = 0; c0 < rows; c0 += CHUNK) {
        const int64_t crows = rows - c0 < CHUNK ? rows - c0 : CHUNK;
        quantize_rows(x + c0 * xstride, xstride, crows, in, xq, xs, xm);
        for (int64_t pn = p0; pn < p1; ++pn) {
            const int64_t o0 = pn * TW, no = out - o0 < TW ? out - o0 : TW;
            for (int64_t r0 = 0; r0 < crows; r0 += RB) {
                float acc[RB][TW];
                const int nr = (int)(crows - r0 < RB ? crows - r0 : RB);
                panel(xq + r0 * in, xs + r0 * nb, xm + r0 * nb, in, packed + pn * panel_bytes, nr, acc);
                for (int r = 0; r < nr; ++r) {
                    uint16_t *yr = y + (c0 + r0 + r) * ystride + o0;
                    for (int64_t j = 0; j < no; ++j) yr[j] = bf16_store(acc[r][j]);
                }
            }
        }
    }
}

/* the whole product on `nthreads` OpenMP threads (one when it reads under 512 KiB of weights);
 * returns 1 when a thread's scratch could not be allocated, else 0 */
int minicb_int8_q4(const uint16_t *x, int64_t xstride, const uint8_t *packed, uint16_t *y, int64_t ystride,
                   int64_t rows, int64_t in, int64_t out, int nthreads) {
    const int64_t panels = (out + TW - 1) / TW, bytes = panels * (in / QB) * BLOCK_BYTES;
    const int parts = nthreads > 1 && bytes >= 524288 ? nthreads : 1;
    const size_t need = (size_t)((rows < CHUNK ? rows : CHUNK) * (in + 2 * (in / QB) * (int64_t)sizeof(float)));
    int failed = 0;
    if (parts == 1) {
        if (!scratch_of(need)) return 1;
        minicb_int8_q4_part(x, xstride, packed, y, ystride, rows, in, out, 0, 1);
        return 0;
    }
    _Pragma("omp parallel num_threads(parts) reduction(|:failed)") {
        if (!scratch_of(need)) failed = 1;
        else minicb_int8_q4_part(x, xstride, packed, y, ystride, rows, in, out, omp_thread(), omp_threads());
    }
    return failed;
}

/* 2: the AVX-512 VNNI loop; 0: plain C (correct everywhere, slow: int8_gemm.py uses it only in tests) */
int minicb_int8_path(void) {
#if defined(INT8_VNNI)
    return 2;
#else
    return 0;
#endif
}

/* Linear layers of a decode step with few rows: y[rows, out] = x[rows, in] @ W[out, in]^T.
 *
 * Why: a decode step of one to a few sequences multiplies a handful of rows by every weight of the
 * model. Its arithmetic is tiny; its time is reading the weights from memory once. oneDNN's products
 * (cpu_linear.py) are built for many rows, and on one to a few rows they read SmolLM2's weights well
 * below what one core can stream (bench/RESULTS.md, "A decode step beside the weight-read floor").
 *
 * The weights are packed once (skinny_gemm.py) into panels of TW = 64 outputs, each panel stored
 * input by input, so that one panel is one straight run of memory:
 *
 *     float32:   P[panel][i][64]          = W[panel * 64 + j][i]
 *     bfloat16:  P[panel][i / 2][64][2]   = W[panel * 64 + j][i]     (pairs of inputs side by side)
 *
 * (A bfloat16 model read from a GGUF also gets panels of the file's own Q4_1 / Q8_0 blocks, for steps
 * of one row: panel_blocks, below.)
 *
 * For each input i the loop loads the panel's 64 weights (four 512-bit vectors), broadcasts x[r][i]
 * and adds the products into 4 accumulators per row: no horizontal sums, every weight loaded once and
 * used for every row (up to RB rows at once; more rows re-read the panel from the L2 cache). bfloat16
 * uses vdpbf16ps where the CPU has AVX-512 BF16: it multiplies a pair of inputs by a pair of weights
 * exactly and adds both to a float32 accumulator, hence the pairs in the layout.
 *
 * CPUs with AVX2 and FMA but no AVX-512 (AMD's Zen 1-3, Intel before Skylake-X) have 16 vector
 * registers of 8 float32: there the loops take a panel in two halves of 32 outputs (four vectors),
 * three rows at a time in float32 and two in bfloat16, for steps of 1 to 3 rows; row groups of 4 to 6
 * take tiles of 16 outputs instead (float32: 6 rows a tile, bfloat16: two tiles of up to 3), which
 * load each weight once for more rows and fetch the next panel from memory while they multiply. A
 * CPU without AVX-512 BF16 has no bfloat16 product either: its loop widens the weights to float32 in
 * registers (a pair of bfloat16 in one 32-bit lane: the first is the lane shifted left by 16, the
 * second the lane with its low half cleared) and multiplies in float32. The weights still stream from
 * memory as bfloat16, half the bytes of float32: on a step of few rows that is most of the time.
 * The float32 tiles keep both multiply-add units busy (12 accumulators, 8 loads to 12 multiply-adds),
 * so on a Zen 2 core they beat oneDNN on prompt chunks of thousands of rows too (skinny_gemm.ROWS).
 *
 * Numerics: each output is a float32 sum over the inputs in their order (oneDNN sums in another
 * order), rounded once to the output dtype (bfloat16: to nearest even). The AVX-512 and AVX2 loops use
 * fused multiply-adds; the plain C loops below (CPUs without AVX2, and a test build) round each
 * product apart, and in bfloat16 add a pair's two products before the sum: so every build agrees with
 * oneDNN and with the others to float32 rounding, not bit for bit. vdpbf16ps treats subnormal
 * bfloat16 inputs (smaller than 2^-126) as zero; the other loops do not.
 *
 * Threads: the panels are split over `nthreads` (OpenMP) when a call is big enough to be worth it
 * (SKINNY below).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "omp_id.h"
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define TW 64       /* outputs per panel: four vectors of 16 float32 */
#define RB 6        /* input rows per pass over a panel: 6 x 4 = 24 accumulators of the 32 registers */
#define HALF 32     /* outputs per pass of the AVX2 loops: four vectors of 8 float32 */

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define SKINNY_F32_AVX2 1       /* float32 on AVX2 where there is no AVX-512 */
#endif
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512BF16__)
#define SKINNY_BF16_AVX2 1      /* bfloat16 widened on AVX2 where there is no vdpbf16ps */
#endif

#if defined(__AVX2__)
#define TILE_MIN 4  /* row groups of 4 to 6 rows take the tiles, of 1 to 3 the halves */
#ifndef SKINNY_PREFETCH
#define SKINNY_PREFETCH 2   /* the next panel: 2 spread over passes, 1 bunched at each pass's start, 0 not */
#endif

/* pass_share: pass `pass` of `passes`' even share of the next panel's `lines` cache lines: `*n` lines
 * from the address returned (none past the last line).
 *
 * What the AVX2 tiles share. next_share: the part of the next panel (`lines` cache lines, 0 for none)
 * that pass `pass` of the row group at r0 asks for, so that the panel's lines are spread evenly over
 * all of its tile passes ((the groups of TILE_MIN rows or more) x `group_passes`).
 * PREFETCH_START(steps) paces them over a pass of `steps` steps (SKINNY_PREFETCH), PREFETCH_TICK()
 * asks for one when it is due, and STORE_TILE(NR) stores a tile's accumulators, two vectors (16
 * outputs from c) a row. */
static inline const char *pass_share(const void *next, int64_t lines, int64_t passes, int64_t pass,
                                     int64_t *n) {
    const int64_t per = (lines + passes - 1) / passes;
    const int64_t first = pass * per, left = lines - first > 0 ? lines - first : 0;
    *n = left < per ? left : per;
    return *n ? (const char *)next + 64 * first : NULL;
}
static inline const char *next_share(const void *next, int64_t lines, int64_t rows, int64_t r0,
                                     int64_t group_passes, int64_t pass, int64_t *n) {
    const int64_t passes = (rows / RB + (rows % RB >= TILE_MIN)) * group_passes;
    return pass_share(next, lines, passes, r0 / RB * group_passes + pass, n);
}
#define PREFETCH_START(steps)                                                                          \
    const int64_t every = !pf_lines || !SKINNY_PREFETCH ? (steps) + 1                                  \
                          : SKINNY_PREFETCH == 2 && (steps) / pf_lines > 1 ? (steps) / pf_lines : 1;   \
    int64_t due = every, line = 0;
#define PREFETCH_TICK()                                                                                \
    if (--due == 0) {                                                                                  \
        due = every;                                                                                   \
        if (line < pf_lines) _mm_prefetch(pf + 64 * line++, _MM_HINT_T1);                              \
    }
#define STORE_TILE(NR)                                                                                 \
    for (int r = 0; r < NR; ++r) {                                                                     \
        _mm256_storeu_ps(acc[r] + c, a[r][0]);                                                         \
        _mm256_storeu_ps(acc[r] + c + 8, a[r][1]);                                                     \
    }
#endif

#if defined(__AVX512F__)
/* The same for the AVX-512 loops, where every row group is one pass over the whole panel: the next
 * panel's `lines` shared among the call's ceil(rows / RB) passes of `steps` steps each. A pass asks
 * for at most one line a step, so a call of fewer passes than that (fewer than 19 rows: the panel is
 * multiplied for too short a time to hide its reading) asks for none and leaves it to the hardware.
 * What it is worth depends on the memory: SmolLM2's products from memory on two threads (`python
 * bench/linear_paths.py --prefetch --dtype bfloat16 --threads 2`, bench/RESULTS.md, issue 47) ran
 * 1.01-1.37x as fast with it from 24 to 128 rows at 32.5 GB/s (0.97x at 256), 1.01-1.04x at 62 GB/s.
 * (Tried: asking for part of the panel at 12-16 rows, one line a step, made them slower.) */
static inline const char *next_share512(const void *next, int64_t lines, int64_t steps, int64_t rows,
                                        int64_t r0, int64_t *n) {
    const int64_t passes = (rows + RB - 1) / RB;
    return pass_share(next, next && (lines + passes - 1) / passes <= steps ? lines : 0, passes, r0 / RB, n);
}
#endif

#if defined(SKINNY_F32_AVX2)
#define TILE 16     /* outputs per tile of the AVX2 float32 loop for 4 to 6 rows: two vectors */

/* acc[r][c + j] for j < 16 (one tile of a float32 panel) and 4 <= nr <= 6 rows: 12 accumulators, the
 * tile's two weight vectors loaded once per input and used by every row, a broadcast input per row:
 * 12 multiply-adds to 8 loads (the halves below do 12 to 15), so the multiply-adds set the pace.
 * On the way it asks for `pf_lines` lines of the next panel from `pf`, one every `in / pf_lines`
 * inputs (`_MM_HINT_T1`: into the L2 cache, from where the next panel's tiles will read them): the
 * next panel streams in from memory while this one is multiplied, at an even pace. Asking for them
 * bunched at the start of each pass (SKINNY_PREFETCH=1), or not at all (0), leaves the arithmetic
 * waiting for memory (`python bench/linear_paths.py --prefetch` builds and times all three). */
static void tile_f32_avx2(const float *x, int64_t xstride, const float *p, int64_t in, int nr, int c,
                          float (*acc)[TW], const char *pf, int64_t pf_lines) {
#define TILE_F32_STEP(NR)                                                                              \
    {                                                                                                  \
        const float *pi = p + i * TW + c;                                                              \
        const __m256 w0 = _mm256_loadu_ps(pi), w1 = _mm256_loadu_ps(pi + 8);                           \
        for (int r = 0; r < NR; ++r) {                                                                 \
            const __m256 xv = _mm256_set1_ps(x[r * xstride + i]);                                      \
            a[r][0] = _mm256_fmadd_ps(xv, w0, a[r][0]);                                                \
            a[r][1] = _mm256_fmadd_ps(xv, w1, a[r][1]);                                                \
        }                                                                                              \
    }
#define TILE_F32(NR)                                                                                   \
    {                                                                                                  \
        __m256 a[NR][2];                                                                               \
        for (int r = 0; r < NR; ++r) a[r][0] = a[r][1] = _mm256_setzero_ps();                         \
        PREFETCH_START(in)                                                                             \
        for (int64_t i = 0; i < in; ++i) {                                                             \
            PREFETCH_TICK()                                                                            \
            TILE_F32_STEP(NR)                                                                          \
        }                                                                                              \
        STORE_TILE(NR)                                                                                 \
        return;                                                                                        \
    }
    switch (nr) {      /* 4 to 6 */
    case 4: TILE_F32(4)
    case 5: TILE_F32(5)
    default: TILE_F32(6)
    }
}

/* acc[r][h + j] for j < 32 (one half of a float32 panel) and nr <= 3 rows: 12 accumulators, the three
 * broadcast inputs and the weight that each multiply-add reads straight from memory. */
static void half_f32_avx2(const float *x, int64_t xstride, const float *p, int64_t in, int nr, int h,
                          float (*acc)[TW]) {
#define HALF_F32(NR)                                                                                   \
    {                                                                                                  \
        __m256 a[NR][4];                                                                               \
        for (int r = 0; r < NR; ++r)                                                                   \
            for (int v = 0; v < 4; ++v) a[r][v] = _mm256_setzero_ps();                                 \
        for (int64_t i = 0; i < in; ++i) {                                                             \
            const float *pi = p + i * TW + h;                                                          \
            for (int r = 0; r < NR; ++r) {                                                             \
                const __m256 xv = _mm256_set1_ps(x[r * xstride + i]);                                  \
                for (int v = 0; v < 4; ++v)                                                            \
                    a[r][v] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(pi + 8 * v), a[r][v]);               \
            }                                                                                          \
        }                                                                                              \
        for (int r = 0; r < NR; ++r)                                                                   \
            for (int v = 0; v < 4; ++v) _mm256_storeu_ps(acc[r] + h + 8 * v, a[r][v]);                 \
        return;                                                                                        \
    }
    switch (nr) {
    case 1: HALF_F32(1)
    case 2: HALF_F32(2)
    default: HALF_F32(3)
    }
}
#endif

#if defined(SKINNY_BF16_AVX2)
/* The same for one half of a bfloat16 panel and nr <= 2 rows. Each 256-bit load holds 8 outputs'
 * pairs; the shift and the mask widen it to the 8 weights of the pair's first input and of its
 * second. An odd last input is paired with a zero input (the panel pads its weight with zero). */
static void half_bf16_avx2(const uint16_t *x, int64_t xstride, const uint16_t *p, int64_t in, int nr,
                           int h, float (*acc)[TW]) {
#define HALF_BF16(NR)                                                                                  \
    {                                                                                                  \
        const __m256i high = _mm256_set1_epi32((int)0xffff0000u);                                     \
        __m256 a[NR][4];                                                                               \
        for (int r = 0; r < NR; ++r)                                                                   \
            for (int v = 0; v < 4; ++v) a[r][v] = _mm256_setzero_ps();                                 \
        for (int64_t i = 0; i < in; i += 2) {                                                          \
            const uint16_t *pi = p + i * TW + 2 * h;                                                   \
            __m256 x0[NR], x1[NR];                                                                     \
            for (int r = 0; r < NR; ++r) {                                                             \
                x0[r] = _mm256_set1_ps(bf16_load(x[r * xstride + i]));                                 \
                x1[r] = _mm256_set1_ps(i + 1 < in ? bf16_load(x[r * xstride + i + 1]) : 0.0f);         \
            }                                                                                          \
            for (int v = 0; v < 4; ++v) {                                                              \
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(pi + 16 * v));                \
                const __m256 w0 = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));                     \
                const __m256 w1 = _mm256_castsi256_ps(_mm256_and_si256(raw, high));                    \
                for (int r = 0; r < NR; ++r)                                                           \
                    a[r][v] = _mm256_fmadd_ps(x1[r], w1, _mm256_fmadd_ps(x0[r], w0, a[r][v]));         \
            }                                                                                          \
        }                                                                                              \
        for (int r = 0; r < NR; ++r)                                                                   \
            for (int v = 0; v < 4; ++v) _mm256_storeu_ps(acc[r] + h + 8 * v, a[r][v]);                 \
        return;                                                                                        \
    }
    if (nr == 1) HALF_BF16(1)
    HALF_BF16(2)
}

#define BTILE 16    /* outputs per tile of the AVX2 bfloat16 loop for 4 to 6 rows */

/* acc[r][c + j] for j < 16 (one tile of a bfloat16 panel) and nr <= 3 rows of xf, rows already widened
 * to float32 (in_even inputs a row, the odd last one paired with a zero). Per pair of inputs: one
 * cache line of weights (16 outputs' pairs), widened to four vectors and used by every row; each row's
 * pair of products is summed apart (a multiply, a multiply-add) and added to its accumulator, so an
 * accumulator waits on one addition per pair, not on two chained multiply-adds. The next panel is
 * fetched as the float32 tiles do it. */
static void tile_bf16_avx2(const float *xf, int64_t in_even, const uint16_t *p, int nr, int c,
                           float (*acc)[TW], const char *pf, int64_t pf_lines) {
#define TILE_BF16(NR)                                                                                  \
    {                                                                                                  \
        const __m256i high = _mm256_set1_epi32((int)0xffff0000u);                                     \
        __m256 a[NR][2];                                                                               \
        for (int r = 0; r < NR; ++r) a[r][0] = a[r][1] = _mm256_setzero_ps();                         \
        PREFETCH_START(in_even / 2)                                                                    \
        for (int64_t i = 0; i < in_even; i += 2) {                                                     \
            PREFETCH_TICK()                                                                            \
            const uint16_t *pi = p + i * TW + 2 * c;                                                   \
            const __m256i ra = _mm256_loadu_si256((const __m256i *)pi);                                \
            const __m256i rb = _mm256_loadu_si256((const __m256i *)(pi + 16));                         \
            const __m256 a0 = _mm256_castsi256_ps(_mm256_slli_epi32(ra, 16));                          \
            const __m256 a1 = _mm256_castsi256_ps(_mm256_and_si256(ra, high));                         \
            const __m256 b0 = _mm256_castsi256_ps(_mm256_slli_epi32(rb, 16));                          \
            const __m256 b1 = _mm256_castsi256_ps(_mm256_and_si256(rb, high));                         \
            for (int r = 0; r < NR; ++r) {                                                             \
                const __m256 x0 = _mm256_set1_ps(xf[r * in_even + i]);                                 \
                const __m256 x1 = _mm256_set1_ps(xf[r * in_even + i + 1]);                             \
                a[r][0] = _mm256_add_ps(a[r][0], _mm256_fmadd_ps(x1, a1, _mm256_mul_ps(x0, a0)));      \
                a[r][1] = _mm256_add_ps(a[r][1], _mm256_fmadd_ps(x1, b1, _mm256_mul_ps(x0, b0)));      \
            }                                                                                          \
        }                                                                                              \
        STORE_TILE(NR)                                                                                 \
        return;                                                                                        \
    }
    if (nr == 2) TILE_BF16(2)
    TILE_BF16(3)
}
#endif

/* acc[r][j] = sum_i x[r][i] * P[i][j] for one float32 panel P [in][TW] and nr <= RB rows of x, the
 * rows r0.. of `rows`; `next` is the panel after this one (NULL for the last), which the AVX2 tiles
 * fetch into the L2 cache while they compute. */
static void panel_f32(const float *x, int64_t xstride, const float *p, int64_t in, int nr,
                      float acc[RB][TW], const float *next, int64_t r0, int64_t rows) {
    (void)next, (void)r0, (void)rows;
#if defined(__AVX512F__)
#define PANEL_F32(NR)                                                                                  \
    {                                                                                                  \
        __m512 a[NR][4];                                                                               \
        for (int r = 0; r < NR; ++r)                                                                   \
            for (int v = 0; v < 4; ++v) a[r][v] = _mm512_setzero_ps();                                 \
        PREFETCH_START(in)                                                                             \
        for (int64_t i = 0; i < in; ++i) {                                                             \
            PREFETCH_TICK()                                                                            \
            const float *pi = p + i * TW;                                                              \
            const __m512 w0 = _mm512_loadu_ps(pi), w1 = _mm512_loadu_ps(pi + 16),                     \
                         w2 = _mm512_loadu_ps(pi + 32), w3 = _mm512_loadu_ps(pi + 48);                 \
            for (int r = 0; r < NR; ++r) {                                                             \
                const __m512 xv = _mm512_set1_ps(x[r * xstride + i]);                                  \
                a[r][0] = _mm512_fmadd_ps(xv, w0, a[r][0]);                                            \
                a[r][1] = _mm512_fmadd_ps(xv, w1, a[r][1]);                                            \
                a[r][2] = _mm512_fmadd_ps(xv, w2, a[r][2]);                                            \
                a[r][3] = _mm512_fmadd_ps(xv, w3, a[r][3]);                                            \
            }                                                                                          \
        }                                                                                              \
        for (int r = 0; r < NR; ++r)                                                                   \
            for (int v = 0; v < 4; ++v) _mm512_storeu_ps(acc[r] + 16 * v, a[r][v]);                    \
        return;                                                                                        \
    }
    int64_t pf_lines;        /* this group's share of the next panel: [in][TW] float32 */
    const char *pf = next_share512(next, in * TW * 4 / 64, in, rows, r0, &pf_lines);
    switch (nr) {      /* a constant row count each, so the accumulators live in registers */
    case 1: PANEL_F32(1)
    case 2: PANEL_F32(2)
    case 3: PANEL_F32(3)
    case 4: PANEL_F32(4)
    case 5: PANEL_F32(5)
    default: PANEL_F32(6)
    }
#elif defined(SKINNY_F32_AVX2)
    if (nr >= TILE_MIN) {
        /* the next panel's lines (in * TW floats) spread over this group's TW / TILE passes and the rest */
        const int64_t lines = next ? in * TW * (int64_t)sizeof(float) / 64 : 0;
        for (int c = 0; c < TW; c += TILE) {
            int64_t n;
            const char *pf = next_share(next, lines, rows, r0, TW / TILE, c / TILE, &n);
            tile_f32_avx2(x, xstride, p, in, nr, c, acc, pf, n);
        }
        return;
    }
    for (int h = 0; h < TW; h += HALF)
        for (int r = 0; r < nr; r += 3)
            half_f32_avx2(x + r * xstride, xstride, p, in, nr - r < 3 ? nr - r : 3, h, acc + r);
#else
    for (int r = 0; r < nr; ++r) {
        for (int j = 0; j < TW; ++j) acc[r][j] = 0;
        for (int64_t i = 0; i < in; ++i) {
            const float xi = x[r * xstride + i];
            for (int j = 0; j < TW; ++j) acc[r][j] += xi * p[i * TW + j];
        }
    }
#endif
}

/* Two bfloat16 inputs side by side, as one 32-bit lane (the first in the low half). */
static inline uint32_t load_pair(const uint16_t *x) {
    uint32_t pair;
    memcpy(&pair, x, sizeof pair);
    return pair;
}

/* The plain C loops' product of a pair of inputs and a pair of bfloat16 weights (panel_bf16 and
 * panel_q4 share it, so that both round alike wherever the compiler fuses a multiply and an add). */
#define PAIR_PRODUCT(x0, w0, x1, w1) ((x0) * bf16_load(w0) + (x1) * bf16_load(w1))

/* The same for a bfloat16 panel P [ceil(in / 2)][TW][2] (an odd last input paired with a zero). */
static void panel_bf16(const uint16_t *x, int64_t xstride, const uint16_t *p, int64_t in, int nr,
                       float acc[RB][TW], const uint16_t *next, int64_t r0, int64_t rows) {
    (void)next, (void)r0, (void)rows;
#if defined(__AVX512BF16__)
#define PANEL_BF16_STEP(NR, PAIR)                                                                      \
    {                                                                                                  \
        const uint16_t *pi = p + i * TW;                                                               \
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(pi), w1 = (__m512bh)_mm512_loadu_si512(pi + 32), \
                       w2 = (__m512bh)_mm512_loadu_si512(pi + 64),                                     \
                       w3 = (__m512bh)_mm512_loadu_si512(pi + 96);                                     \
        for (int r = 0; r < NR; ++r) {                                                                 \
            const uint16_t *xr = x + r * xstride + i;                                                  \
            const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)(PAIR));                              \
            a[r][0] = _mm512_dpbf16_ps(a[r][0], xv, w0);                                               \
            a[r][1] = _mm512_dpbf16_ps(a[r][1], xv, w1);                                               \
            a[r][2] = _mm512_dpbf16_ps(a[r][2], xv, w2);                                               \
            a[r][3] = _mm512_dpbf16_ps(a[r][3], xv, w3);                                               \
        }                                                                                              \
    }
#define PANEL_BF16(NR)                                                                                 \
    {                                                                                                  \
        __m512 a[NR][4];                                                                               \
        for (int r = 0; r < NR; ++r)                                                                   \
            for (int v = 0; v < 4; ++v) a[r][v] = _mm512_setzero_ps();                                 \
        PREFETCH_START(in / 2)                                                                         \
        int64_t i = 0;                                                                                 \
        for (; i + 1 < in; i += 2) {                                                                   \
            PREFETCH_TICK()                                                                            \
            PANEL_BF16_STEP(NR, load_pair(xr))                            /* both inputs of the pair */ \
        }                                                                                              \
        if (i < in) PANEL_BF16_STEP(NR, (uint32_t)xr[0])                  /* the last of an odd count */ \
        for (int r = 0; r < NR; ++r)                                                                   \
            for (int v = 0; v < 4; ++v) _mm512_storeu_ps(acc[r] + 16 * v, a[r][v]);                    \
        return;                                                                                        \
    }
    int64_t pf_lines;        /* this group's share of the next panel: [in / 2 pairs][TW][2] bfloat16 */
    const char *pf = next_share512(next, (in + 1) / 2 * TW * 4 / 64, in / 2, rows, r0, &pf_lines);
    switch (nr) {
    case 1: PANEL_BF16(1)
    case 2: PANEL_BF16(2)
    case 3: PANEL_BF16(3)
    case 4: PANEL_BF16(4)
    case 5: PANEL_BF16(5)
    default: PANEL_BF16(6)
    }
#elif defined(SKINNY_BF16_AVX2)
    if (nr >= TILE_MIN) {
        /* The group's rows widened once ([nr][in_even] float32, on the stack below 64 KiB), then
         * tiles of two sub-groups (2+2, 3+2 or 3+3 rows); the next panel spread over all of them. */
        const int64_t in_even = (in + 1) & ~(int64_t)1;
        float small[6 * 2048];
        float *xf = nr * in_even <= 6 * 2048 ? small : malloc(sizeof(float) * (size_t)(nr * in_even));
        if (xf != NULL) {
            for (int r = 0; r < nr; ++r) {
                for (int64_t i = 0; i < in; ++i) xf[r * in_even + i] = bf16_load(x[r * xstride + i]);
                if (in < in_even) xf[r * in_even + in] = 0.0f;
            }
            const int64_t lines = next ? in_even * TW * (int64_t)sizeof(uint16_t) / 64 : 0;
            const int first_rows = (nr + 1) / 2;
            for (int c = 0; c < TW; c += BTILE)
                for (int half = 0; half < 2; ++half) {
                    int64_t n;                                /* two passes a tile: one per sub-group */
                    const char *pf = next_share(next, lines, rows, r0, TW / BTILE * 2, c / BTILE * 2 + half,
                                                &n);
                    const int rr = half ? first_rows : 0, cnt = half ? nr - first_rows : first_rows;
                    tile_bf16_avx2(xf + rr * in_even, in_even, p, cnt, c, acc + rr, pf, n);
                }
            if (xf != small) free(xf);
            return;
        }
    }
    for (int h = 0; h < TW; h += HALF)
        for (int r = 0; r < nr; r += 2)
            half_bf16_avx2(x + r * xstride, xstride, p, in, nr - r < 2 ? nr - r : 2, h, acc + r);
#else
    for (int r = 0; r < nr; ++r) {
        for (int j = 0; j < TW; ++j) acc[r][j] = 0;
        for (int64_t i = 0; i < in; i += 2) {
            const float x0 = bf16_load(x[r * xstride + i]);
            const float x1 = i + 1 < in ? bf16_load(x[r * xstride + i + 1]) : 0.0f;
            const uint16_t *pi = p + i * TW;
            for (int j = 0; j < TW; ++j) acc[r][j] += PAIR_PRODUCT(x0, pi[2 * j], x1, pi[2 * j + 1]);
        }
    }
#endif
}

/* ---- The same bfloat16 products from the GGUF's blocks (Q4_1, Q8_0) ----
 *
 * SmolLM2's GGUF stores its layers' weights as Q4_1: blocks of 32 inputs of one output, each weight
 * w = d * q + m with a 4-bit q and a float16 scale d and offset m per block, about 5 bits a weight;
 * its embedding (the tied LM head) as Q8_0: w = d * q with an 8-bit signed q. minicb's bfloat16 model
 * holds each w rounded to bfloat16 (16 bits), and a decode step of one row reads all of them from
 * memory: 270 MB, most of a one-sequence step's time. panel_blocks reads the blocks instead (6 and 9
 * bits a weight) and makes each bfloat16 weight in registers just before its product: d * q (+ m) in
 * float32, exactly the loader's value (d * q is exact in float32, so the fused multiply-add rounds
 * once, as the loader's add does), rounded to nearest even by vcvtne2ps2bf16 as torch's cast rounds
 * (skinny_gemm.blocks_weight says why the two cannot differ here). Same bfloat16 weights, same pairs,
 * same vdpbf16ps in the same order: the same bits as panel_bf16 on the bfloat16 panels, from 3/8
 * (Q4_1) or 9/16 (Q8_0) of the bytes and about eight more vector instructions per 32 weights. On one
 * row that arithmetic splits over the threads where the memory's bandwidth may not (bench/RESULTS.md).
 *
 * Layout (skinny_gemm.pack_blocks packs it): per panel of TW outputs, per block of 32 inputs,
 *
 *     Q4_1   scales [4 vectors][D1, D2, M1, M2][16] float16    then [16 pairs][4 vectors][16] bytes
 *     Q8_0   scales [4 vectors][D1, D2][16] float16            then [16 pairs][4 vectors][32] bytes
 *
 * Vector v of a pair holds what one 512-bit load of the bfloat16 panel holds: outputs 16v .. 16v+15,
 * each with the pair's two inputs. Its first 16 bfloat16 words (outputs 16v .. 16v+7) come from the
 * low nibbles of its 16 bytes (Q8_0: its first 16 bytes), its last 16 (outputs 16v+8 .. 16v+15) from
 * the high nibbles (the last 16 bytes), so one vcvtne2ps2bf16 of the two halves gives the words in the
 * panel's order; D1 (M1) holds the scale (offset) of each first-half word's output, D2 (M2) of each
 * second-half one's. Where the kernel has no AVX-512 BF16 loop, a plain C loop makes each block's
 * bfloat16 weights the same way and multiplies them as panel_bf16's plain C loop does. */
#define QBLOCK 32                                        /* inputs of a block */
#define Q4_SCALES 512                                    /* bytes of a panel's block: scales, then pairs */
#define Q4_PAIR 64
#define Q8_SCALES 256
#define Q8_PAIR 128
#define Q4_PANEL(in) ((in) / QBLOCK * (Q4_SCALES + QBLOCK / 2 * Q4_PAIR))
#define Q8_PANEL(in) ((in) / QBLOCK * (Q8_SCALES + QBLOCK / 2 * Q8_PAIR))

/* word t of vector v of pair j of a block `blk` (q4: Q4_1, else Q8_0), as bfloat16 */
static inline uint16_t block_word(const uint8_t *blk, int q4, int v, int j, int t) {
    const int second = t >= 16, lane = t - 16 * second;
    const uint16_t *sc = (const uint16_t *)blk + (q4 ? 64 : 32) * v + 16 * second + lane;
    const float d = half_load(sc[0]), m = q4 ? half_load(sc[32]) : 0.0f;
    if (q4) {
        const uint8_t byte = blk[Q4_SCALES + Q4_PAIR * j + 16 * v + lane];
        return bf16_store(d * (float)(second ? byte >> 4 : byte & 15) + m);
    }
    return bf16_store(d * (float)(int8_t)blk[Q8_SCALES + Q8_PAIR * j + 32 * v + t]);
}

static void panel_blocks(const uint16_t *x, int64_t xstride, const uint8_t *p, int64_t in, int nr,
                         float acc[RB][TW], int q4) {
    const int64_t block_bytes = q4 ? Q4_PANEL(QBLOCK) : Q8_PANEL(QBLOCK);
#if defined(__AVX512BF16__)
    /* the weights of vector v of pair j, as the bfloat16 panel holds them */
#define Q4_WORDS(v, j)                                                                                 \
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(pairs + Q4_PAIR * (j) + 16 * (v)))); \
    const __m512bh w = _mm512_cvtne2ps_pbh(                                                            \
        _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), d2[v], m2[v]),                    \
        _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(q, low)), d1[v], m1[v]));
#define Q8_WORDS(v, j)                                                                                 \
    const int8_t *b8 = (const int8_t *)pairs + Q8_PAIR * (j) + 32 * (v);                               \
    const __m512bh w = _mm512_cvtne2ps_pbh(                                                            \
        _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b8 + 16)))), d2[v]), \
        _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)b8))), d1[v]));
#define PANEL_BLOCKS(NR, WORDS, SCALES, SCALE_STRIDE)                                                   \
    {                                                                                                  \
        const __m512i low = _mm512_set1_epi32(15);                                                     \
        (void)low;                                                                                     \
        __m512 a[NR][4];                                                                               \
        for (int r = 0; r < NR; ++r)                                                                   \
            for (int v = 0; v < 4; ++v) a[r][v] = _mm512_setzero_ps();                                 \
        for (int64_t kb = 0; kb < in / QBLOCK; ++kb) {                                                 \
            const uint8_t *blk = p + kb * block_bytes, *pairs = blk + SCALES;                          \
            __m512 d1[4], d2[4], m1[4], m2[4];                                                         \
            for (int v = 0; v < 4; ++v) {          /* m1, m2: Q4_1's offsets (Q8_0 leaves them) */    \
                const __m256i *sc = (const __m256i *)(blk + SCALE_STRIDE * v);                         \
                d1[v] = _mm512_cvtph_ps(_mm256_loadu_si256(sc));                                       \
                d2[v] = _mm512_cvtph_ps(_mm256_loadu_si256(sc + 1));                                   \
                m1[v] = SCALE_STRIDE > 64 ? _mm512_cvtph_ps(_mm256_loadu_si256(sc + 2)) : d1[v];       \
                m2[v] = SCALE_STRIDE > 64 ? _mm512_cvtph_ps(_mm256_loadu_si256(sc + 3)) : d2[v];       \
            }                                                                                          \
            (void)m1, (void)m2;                                                                        \
            for (int j = 0; j < QBLOCK / 2; ++j) {                                                     \
                const int64_t i = kb * QBLOCK + 2 * j;                                                 \
                for (int v = 0; v < 4; ++v) {   /* the four vectors side by side: four sums at once */ \
                    WORDS(v, j)                                                                        \
                    for (int r = 0; r < NR; ++r)                                                       \
                        a[r][v] = _mm512_dpbf16_ps(                                                    \
                            a[r][v], (__m512bh)_mm512_set1_epi32((int)load_pair(x + r * xstride + i)), w); \
                }                                                                                      \
            }                                                                                          \
        }                                                                                              \
        for (int r = 0; r < NR; ++r)                                                                   \
            for (int v = 0; v < 4; ++v) _mm512_storeu_ps(acc[r] + 16 * v, a[r][v]);                    \
        return;                                                                                        \
    }
#define BLOCKS_ROWS(WORDS, SCALES, SCALE_STRIDE)                                                       \
    switch (nr) {                                                                                      \
    case 1: PANEL_BLOCKS(1, WORDS, SCALES, SCALE_STRIDE)                                               \
    case 2: PANEL_BLOCKS(2, WORDS, SCALES, SCALE_STRIDE)                                               \
    case 3: PANEL_BLOCKS(3, WORDS, SCALES, SCALE_STRIDE)                                               \
    case 4: PANEL_BLOCKS(4, WORDS, SCALES, SCALE_STRIDE)                                               \
    case 5: PANEL_BLOCKS(5, WORDS, SCALES, SCALE_STRIDE)                                               \
    default: PANEL_BLOCKS(6, WORDS, SCALES, SCALE_STRIDE)                                              \
    }
    if (q4)
        BLOCKS_ROWS(Q4_WORDS, Q4_SCALES, 128)
    else
        BLOCKS_ROWS(Q8_WORDS, Q8_SCALES, 64)
#else
    /* plain C: each block's weights made in bfloat16 (block_word), then panel_bf16's plain C loop */
    (void)block_word;
    for (int r = 0; r < nr; ++r)
        for (int c = 0; c < TW; ++c) acc[r][c] = 0;
    for (int64_t kb = 0; kb < in / QBLOCK; ++kb) {
        const uint8_t *blk = p + kb * block_bytes;
        uint16_t w[QBLOCK / 2][TW][2];
        for (int v = 0; v < 4; ++v)
            for (int j = 0; j < QBLOCK / 2; ++j)
                for (int t = 0; t < 32; ++t) w[j][16 * v + t / 2][t % 2] = block_word(blk, q4, v, j, t);
        for (int r = 0; r < nr; ++r)
            for (int j = 0; j < QBLOCK / 2; ++j) {
                const int64_t i = kb * QBLOCK + 2 * j;
                const float x0 = bf16_load(x[r * xstride + i]), x1 = bf16_load(x[r * xstride + i + 1]);
                for (int c = 0; c < TW; ++c) acc[r][c] += PAIR_PRODUCT(x0, w[j][c][0], x1, w[j][c][1]);
            }
    }
#endif
}

static void panel_q4(const uint16_t *x, int64_t xstride, const uint8_t *p, int64_t in, int nr,
                     float acc[RB][TW], const uint8_t *next, int64_t r0, int64_t rows) {
    (void)next, (void)r0, (void)rows;
    panel_blocks(x, xstride, p, in, nr, acc, 1);
}

static void panel_q8(const uint16_t *x, int64_t xstride, const uint8_t *p, int64_t in, int nr,
                     float acc[RB][TW], const uint8_t *next, int64_t r0, int64_t rows) {
    (void)next, (void)r0, (void)rows;
    panel_blocks(x, xstride, p, in, nr, acc, 0);
}

static inline float f32_store(float x) { return x; }

/* y [rows, out] (row stride ystride) from x [rows, in] (row stride xstride) and the packed panels.
 *
 * Rows are taken CHUNK at a time, every panel for each chunk: a prompt chunk of thousands of rows
 * would otherwise stream its whole input (up to 2,048 x 1,536 floats, 12 MB: more than a core's share
 * of L3) from memory once per panel. A chunk's rows (at most 1.5 MB) stay in the caches while the
 * panels go by, and the weights are read once per chunk instead, which at 256 rows costs little: the
 * products of a chunk are 256 multiply-adds per weight read.
 *
 * Threads: NAME_part(..., part, parts) computes the outputs of one share of the panels, the panels
 * cut into `parts` runs of consecutive panels as even as whole panels allow (`share`), every row of
 * them. NAME runs the parts on `nthreads` OpenMP threads when the call reads at least 512 KiB of
 * weights; layer_stack.c calls the parts from its own threads, one parallel region for a whole step.
 * Which thread computes an output does not change how: each output is the same loop over the same
 * inputs in the same order, so every thread count gives the same bits. */
#ifndef CHUNK
#define CHUNK 256
#endif
#define SPLIT_BYTES 524288      /* below: one thread (waking a second costs more than it saves) */

/* the panels [*p0, *p1) of part `part` of `parts` */
static inline void share(int64_t panels, int part, int parts, int64_t *p0, int64_t *p1) {
    *p0 = panels * part / parts;
    *p1 = panels * (part + 1) / parts;
}

#define SKINNY(NAME, T, PT, PANEL, STORE, PANEL_SIZE)                                                 \
    void NAME##_part(const T *x, int64_t xstride, const PT *packed, T *y, int64_t ystride, int64_t rows, \
                     int64_t in, int64_t out, int part, int parts) {                                  \
        const int64_t panels = (out + TW - 1) / TW;                                                   \
        const int64_t panel_size = PANEL_SIZE(in);            /* in PT: one panel's whole run */      \
        int64_t p0, p1;                                                                               \
        share(panels, part, parts, &p0, &p1);                                                         \
        for (int64_t c0 = 0; c0 < rows; c0 += CHUNK) {                                                \
            const int64_t crows = rows - c0 < CHUNK ? rows - c0 : CHUNK;                              \
            const T *xc = x + c0 * xstride;                                                           \
            T *yc = y + c0 * ystride;                                                                 \
            for (int64_t b = p0; b < p1; ++b) {                                                       \
                float acc[RB][TW];                                                                    \
                const int64_t o0 = b * TW;                                                            \
                const int64_t no = out - o0 < TW ? out - o0 : TW;                                     \
                /* the next panel to ask the memory for: the next chunk's first after the last */    \
                const PT *next = b + 1 < p1 ? packed + (b + 1) * panel_size                           \
                                 : c0 + CHUNK < rows ? packed + p0 * panel_size : NULL;               \
                for (int64_t r0 = 0; r0 < crows; r0 += RB) {                                          \
                    const int nr = (int)(crows - r0 < RB ? crows - r0 : RB);                          \
                    PANEL(xc + r0 * xstride, xstride, packed + b * panel_size, in, nr, acc, next,     \
                          r0, crows);                                                                 \
                    for (int r = 0; r < nr; ++r) {                                                    \
                        T *yr = yc + (r0 + r) * ystride + o0;                                         \
                        for (int64_t j = 0; j < no; ++j) yr[j] = STORE(acc[r][j]);                    \
                    }                                                                                 \
                }                                                                                     \
            }                                                                                         \
        }                                                                                             \
    }                                                                                                 \
    void NAME(const T *x, int64_t xstride, const PT *packed, T *y, int64_t ystride, int64_t rows,     \
              int64_t in, int64_t out, int nthreads) {                                                \
        const int64_t panels = (out + TW - 1) / TW;                                                   \
        const int64_t work = panels * PANEL_SIZE(in) * (int64_t)sizeof(PT);                           \
        const int parts = nthreads > 1 && work >= SPLIT_BYTES ? nthreads : 1;                         \
        if (parts == 1) {                                                                             \
            NAME##_part(x, xstride, packed, y, ystride, rows, in, out, 0, 1);                         \
            return;                                                                                   \
        }                                                                                             \
        _Pragma("omp parallel num_threads(parts)")                                                    \
        NAME##_part(x, xstride, packed, y, ystride, rows, in, out, omp_thread(), omp_threads());      \
    }

#define F32_PANEL(in) ((in) * TW)
#define BF16_PANEL(in) ((((in) + 1) & ~(int64_t)1) * TW)       /* bfloat16: `in` made even */
SKINNY(minicb_skinny_f32, float, float, panel_f32, f32_store, F32_PANEL)
SKINNY(minicb_skinny_bf16, uint16_t, uint16_t, panel_bf16, bf16_store, BF16_PANEL)
SKINNY(minicb_skinny_q4, uint16_t, uint8_t, panel_q4, bf16_store, Q4_PANEL)
SKINNY(minicb_skinny_q8, uint16_t, uint8_t, panel_q8, bf16_store, Q8_PANEL)

int minicb_skinny_panel_width(void) { return TW; }

/* Which loop a dtype runs in this build: for float32 (bf16 = 0) 2 AVX-512, 1 AVX2, 0 plain C; for
 * bfloat16 (bf16 = 1) 2 vdpbf16ps, 1 AVX2 widening to float32, 0 plain C. */
int minicb_skinny_path(int bf16) {
#if defined(__AVX512BF16__)
    const int b = 2;
#elif defined(SKINNY_BF16_AVX2)
    const int b = 1;
#else
    const int b = 0;
#endif
#if defined(__AVX512F__)
    const int f = 2;
#elif defined(SKINNY_F32_AVX2)
    const int f = 1;
#else
    const int f = 0;
#endif
    return bf16 ? b : f;
}

/* Greedy sampling without most of the LM head: the same tokens, from a cheap estimate of every logit
 * and the exact logits of the few that could be the largest.
 *
 * A greedy step needs one number per row, the index of its largest logit, but the LM head computes all
 * of them: SmolLM2's is 49,152 x 576 multiply-adds a row, a sixth of a decode step of 64 rows
 * (bench/results/decode-floor-s26.txt), about 8% of a whole W2 run (bench/results/greedy-head-s27.txt).
 * Here:
 *
 *   1. estimate: every logit from the row x and the weights W both rounded to bytes per block of 32
 *      inputs (x ~ s p, W ~ d q), summed exactly on vpdpbusd (64 byte products an instruction, twice
 *      vdpbf16ps's 32): a ~ sum_b d s sum_i q p;
 *   2. bound: how far a can be from the logit the bfloat16 product computes (Cauchy-Schwarz, with
 *      W' the bfloat16 weights, W^ = d q and x^ = s p):
 *          |x.W' - x^.W^| <= |x - x^| |W^| + |x| |W' - W^|,   plus the float32 sums' rounding,
 *      B = (dn |W^_j| + xn |W'_j - W^_j| + c max|W'_j|) (1 + 2^-8): dn, xn, c per row (norms of
 *      x - x^ and x, 2^-12 |x|_1), the three per-output norms computed once at load (greedy_head.py);
 *   3. prune: the largest logit is at least L0 = max_j (a_j - B_j), so an output whose a_j + B_j is
 *      below L0 cannot be the argmax; with a margin of two bfloat16 steps (L = L0 - |L0| 2^-6) it
 *      cannot even tie with it once the logits are rounded to bfloat16 as the product rounds them;
 *   4. recompute: the 64-output panels that hold a survivor are multiplied exactly by the skinny
 *      kernel's own panel loop (`skinny`, the same function on the same panel: the same bits as the
 *      full product), and the first largest of those is the token: what argmax of the whole row says.
 *
 * On W2's rows (python bench/greedy_head.py) a row keeps a median of 4 of the 768 panels (mean 16).
 * The estimate reads 1 byte a weight where the bfloat16 panels read 2. A row that is not finite (or so
 * large that a logit could overflow) gets token -1: the caller then computes the whole LM head.
 *
 * Layout of the estimate's weights (greedy_head.py's pack): the skinny kernel's panels of 64 outputs;
 * per panel and block of 32 inputs 2,048 bytes, [chunk c < 8][vector v < 4][output o < 16][input t < 4]
 * = q + 128 of output 16 v + o, input 32 b + 4 c + t (unsigned: vpdpbusd multiplies unsigned by signed
 * bytes; the 128s are taken out again with the row's sum of p), and d [panels][blocks][64] float32.
 */
#define _DEFAULT_SOURCE     /* syscall() (team_queue.h's futex), which -std=c11 alone does not declare */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "omp_id.h"
#include "team_queue.h"
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define GREEDY_VNNI 1
#else
#define GREEDY_VNNI 0
#endif

#define QB 32           /* inputs per block */
#define GW 16           /* outputs per vector of the bound */
#define PW 64           /* outputs per panel of the skinny kernel (TW there): what step 4 recomputes */
#define GROUPS_PER_ITEM 8   /* panels of 64 outputs a work item of steps 1-3 and of step 4 */
#define RB 3            /* rows per pass over a panel: 3 x 4 integer and float sums, 4 weight vectors */

#if GREEDY_VNNI
#define VEC __m512
#define VNEG_INF _mm512_set1_ps(-INFINITY)
#define VMAX(v) _mm512_reduce_max_ps(v)
#else
#define VEC float
#define VNEG_INF (-INFINITY)
#define VMAX(v) (v)
#endif

typedef void (*skinny_fn)(const uint16_t *x, int64_t xstride, const uint16_t *panels, uint16_t *y,
                          int64_t ystride, int64_t rows, int64_t in, int64_t out, int part, int parts);

int minicb_greedy_vnni(void) { return GREEDY_VNNI; }

/* Row r of x rounded per block: p, s, the blocks' sums of p, and the row's dn, xn, c (step 2); 0 if
 * the row is not finite or too large to bound (then the caller takes the whole LM head). The sums of
 * squares are float32 (their relative error, at most 2^-15 for 576 terms, is far inside the bound's
 * factor 1 + 2^-8); plain loops the compiler vectorises: a row is rounded by every thread. */
static int quantize_row(const uint16_t *x, int64_t in, int8_t *p, float *s, int32_t *psum, float *norms) {
    float dn = 0, xn = 0, l1 = 0;
    int finite = 1;
    for (int64_t b = 0; b < in / QB; ++b) {
        const uint16_t *xb = x + b * QB;
        float amax = 0;
        for (int i = 0; i < QB; ++i) {
            const float v = fabsf(bf16_load(xb[i]));
            finite &= v <= FLT_MAX;                                /* false for inf and NaN */
            amax = v > amax ? v : amax;
        }
        const float inv = amax > 0 && finite ? 127.0f / amax : 0.0f;
        const float sb = inv > 0 && inv <= FLT_MAX ? amax / 127.0f : 0.0f;
        int32_t sum = 0;
        for (int i = 0; i < QB; ++i) {
            const float v = bf16_load(xb[i]);
            const float q = sb > 0 ? nearbyintf(v * inv) : 0.0f;
            const float e = v - sb * q;
            p[b * QB + i] = (int8_t)q;
            sum += (int32_t)q;
            dn += e * e;
            xn += v * v;
            l1 += fabsf(v);
        }
        s[b] = sb;
        psum[b] = sum;
    }
    if (!finite || !(l1 < 1e30f)) return 0;                       /* a logit could leave float32's range */
    norms[0] = sqrtf(dn);
    norms[1] = sqrtf(xn);
    norms[2] = l1 * 0x1p-12f;
    return 1;
}

/* The estimate of rows r0..r0+nr of one panel of 64 outputs (the skinny kernel's panel g), into
 * est[nr][64]: per block of 32 inputs, 8 chunks of 4 inputs, each one broadcast of the row's 4 bytes
 * against the 4 vectors of 16 outputs (int8_gemm.c's PANEL_INT8, on whole bytes). */
#if GREEDY_VNNI
#define ESTIMATE(NR)                                                                                   \
    {                                                                                                  \
        __m512 acc[NR][4];                                                                             \
        for (int r = 0; r < NR; ++r)                                                                   \
            for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_setzero_ps();                               \
        for (int64_t b = 0; b < nb; ++b) {                                                             \
            const uint8_t *blk = wq + (g * nb + b) * 2048;                                             \
            __m512i is[NR][4];                                                                         \
            for (int r = 0; r < NR; ++r) {                                                             \
                const __m512i c = _mm512_set1_epi32(-128 * psum[(r0 + r) * nb + b]);                   \
                for (int v = 0; v < 4; ++v) is[r][v] = c;                                              \
            }                                                                                          \
            for (int c = 0; c < 8; ++c) {                                                              \
                __m512i w[4];                                                                          \
                for (int v = 0; v < 4; ++v) w[v] = _mm512_loadu_si512(blk + 256 * c + 64 * v);        \
                for (int r = 0; r < NR; ++r) {                                                         \
                    int32_t x4;                                                                        \
                    memcpy(&x4, p + (r0 + r) * in + b * QB + 4 * c, 4);                                \
                    const __m512i xb = _mm512_set1_epi32(x4);                                          \
                    for (int v = 0; v < 4; ++v) is[r][v] = _mm512_dpbusd_epi32(is[r][v], w[v], xb);    \
                }                                                                                      \
            }                                                                                          \
            for (int v = 0; v < 4; ++v) {                                                              \
                const __m512 d = _mm512_loadu_ps(wd + (g * nb + b) * PW + 16 * v);                     \
                for (int r = 0; r < NR; ++r)                                                           \
                    acc[r][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is[r][v]),                          \
                                                _mm512_mul_ps(d, _mm512_set1_ps(s[(r0 + r) * nb + b])), acc[r][v]); \
            }                                                                                          \
        }                                                                                              \
        for (int r = 0; r < NR; ++r)                                                                   \
            for (int v = 0; v < 4; ++v) _mm512_storeu_ps(est[r] + 16 * v, acc[r][v]);                  \
        return;                                                                                        \
    }
#endif
static void estimate(const int8_t *p, const float *s, const int32_t *psum, int64_t in, int64_t r0, int nr,
                     const uint8_t *wq, const float *wd, int64_t g, float est[RB][PW]) {
    const int64_t nb = in / QB;
#if GREEDY_VNNI
    switch (nr) {      /* a constant row count each, so the sums live in registers */
    case 1: ESTIMATE(1)
    case 2: ESTIMATE(2)
    default: ESTIMATE(3)
    }
#else
    for (int r = 0; r < nr; ++r)
        for (int o = 0; o < PW; ++o) est[r][o] = 0;
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *blk = wq + (g * nb + b) * 2048;
        for (int r = 0; r < nr; ++r) {
            const int8_t *xr = p + (r0 + r) * in + b * QB;
            for (int o = 0; o < PW; ++o) {
                int32_t is = -128 * psum[(r0 + r) * nb + b];
                for (int c = 0; c < 8; ++c)
                    for (int t = 0; t < 4; ++t) is += (int32_t)blk[256 * c + 4 * o + t] * xr[4 * c + t];
                est[r][o] = fmaf((float)is, wd[(g * nb + b) * PW + o] * s[(r0 + r) * nb + b], est[r][o]);
            }
        }
    }
#endif
}

/* Steps 1-3 for panel g and every row: the estimates, their bounds, the panel's largest a + B per row
 * (high [rows][groups]) and each row's largest a - B so far (low, this thread's). */
static void bound_panel(const int8_t *p, const float *s, const int32_t *psum, const float *norms, int64_t rows,
                        int64_t in, const uint8_t *wq, const float *wd, const float *wn, const float *en,
                        const float *wmax, int64_t vocab, int64_t g, int64_t groups, float *high, float *low) {
    for (int64_t r0 = 0; r0 < rows; r0 += RB) {
        const int nr = rows - r0 < RB ? (int)(rows - r0) : RB;
        VEC lo[RB], hi[RB];
        for (int r = 0; r < nr; ++r) lo[r] = hi[r] = VNEG_INF;
        float est[RB][PW];
        estimate(p, s, psum, in, r0, nr, wq, wd, g, est);
        for (int64_t j0 = g * PW; j0 < (g + 1) * PW && j0 < vocab; j0 += GW) {
            const int no = vocab - j0 < GW ? (int)(vocab - j0) : GW;
#if GREEDY_VNNI
            const __mmask16 live = no == GW ? (__mmask16)0xffff : (__mmask16)((1u << no) - 1);
            const __m512 vwn = _mm512_maskz_loadu_ps(live, wn + j0), ven = _mm512_maskz_loadu_ps(live, en + j0);
            const __m512 vwm = _mm512_maskz_loadu_ps(live, wmax + j0);
            for (int r = 0; r < nr; ++r) {
                const float *n3 = norms + 3 * (r0 + r);
                const __m512 b = _mm512_add_ps(
                    _mm512_mul_ps(_mm512_fmadd_ps(_mm512_set1_ps(n3[0]), vwn,
                                                  _mm512_fmadd_ps(_mm512_set1_ps(n3[1]), ven,
                                                                  _mm512_mul_ps(_mm512_set1_ps(n3[2]), vwm))),
                                  _mm512_set1_ps(1.00390625f)),
                    _mm512_set1_ps(1e-30f));
                const __m512 e = _mm512_loadu_ps(est[r] + (j0 - g * PW));
                lo[r] = _mm512_mask_max_ps(lo[r], live, lo[r], _mm512_sub_ps(e, b));
                hi[r] = _mm512_mask_max_ps(hi[r], live, hi[r], _mm512_add_ps(e, b));
            }
#else
            for (int r = 0; r < nr; ++r) {
                const float *n3 = norms + 3 * (r0 + r);
                for (int o = 0; o < no; ++o) {
                    const int64_t j = j0 + o;
                    const float bound = fmaf(n3[0], wn[j], fmaf(n3[1], en[j], n3[2] * wmax[j])) * 1.00390625f
                                        + 1e-30f;
                    const float l = est[r][j - g * PW] - bound, u = est[r][j - g * PW] + bound;
                    lo[r] = l > lo[r] ? l : lo[r];
                    hi[r] = u > hi[r] ? u : hi[r];
                }
            }
#endif
        }
        for (int r = 0; r < nr; ++r) {
            const float l = VMAX(lo[r]);
            low[r0 + r] = l > low[r0 + r] ? l : low[r0 + r];
            high[(r0 + r) * groups + g] = VMAX(hi[r]);
        }
    }
}

/* tokens[r] for rows of x [rows, in] (bfloat16, row stride xstride): the first largest logit of
 * x @ W'^T, W' [vocab, in] as the skinny kernel's `panels`; -1 where the row cannot be bounded.
 * *recomputed: how many 64-output panels step 4 multiplied, all rows together. Returns 1 if it could
 * not allocate its scratch (nothing written), else 0. */
int minicb_greedy_head(const uint16_t *x, int64_t xstride, int64_t rows, int64_t in, const uint8_t *wq,
                       const float *wd, const float *wn, const float *en, const float *wmax, int64_t vocab,
                       skinny_fn skinny, const uint16_t *panels, int64_t *tokens, int64_t *recomputed,
                       int num_threads) {
    const int64_t nb = in / QB, groups = (vocab + PW - 1) / PW;
    const int nt = num_threads > 1 ? num_threads : 1;
    /* scratch, per thread (each rounds every row itself: a few microseconds, where a part of its
     * own would be one more wait): p [rows][in]; s and psum [rows][nb]; norms [rows][3]; ok and cut
     * [rows]; the largest a - B per row [rows]; the gathered rows [rows][in], their outputs [rows][64]
     * and which rows they are [rows]. Shared: per row and group the largest a + B, the recomputed
     * best and its index [rows][groups]. */
    const size_t per = (size_t)rows * ((size_t)in / 4 + 2 * (size_t)nb + 6 + (size_t)in / 2 + PW / 2 + 1) + 16;
    float *mem = malloc(4 * ((size_t)nt * per + 3 * (size_t)rows * (size_t)groups));
    if (mem == NULL) return 1;
    float *high = mem + nt * per, *best = high + rows * groups;
    int32_t *where = (int32_t *)(best + rows * groups);
#define LOW_OF(u) (mem + (u) * per + rows * (nb + 4))    /* thread u's largest a - B per row */
#define SCRATCH(u)                                                                                     \
    float *s = mem + (u) * per, *norms = s + rows * nb, *cut = norms + 3 * rows, *my_low = LOW_OF(u);  \
    int32_t *psum = (int32_t *)(my_low + rows), *ok = psum + rows * nb, *pick = ok + rows;             \
    int8_t *p = (int8_t *)(pick + rows);                                                               \
    uint16_t *xb = (uint16_t *)(p + rows * in), *yb = xb + rows * in;
    /* two parts as one queue of items (team_queue.h), steps 1-3 and step 4: a thread the OS takes
     * away holds up nobody unless it holds an item, and a waiting thread sleeps instead of spinning
     * (OpenMP's barriers spin: served, beside the event loop and a client, three of them cost more
     * than the head saved) */
    team_queue_t q = {0};
    atomic_llong total = 0;
    const int64_t gitems = (groups + GROUPS_PER_ITEM - 1) / GROUPS_PER_ITEM;
    for (int u = 0; u < nt; ++u) {
        SCRATCH(u)
        for (int64_t r = 0; r < rows; ++r) my_low[r] = -INFINITY;
        (void)s, (void)norms, (void)cut, (void)psum, (void)ok, (void)pick, (void)p, (void)xb, (void)yb;
    }
    TEAM_OR_ALONE({
        const int t = omp_thread();
        SCRATCH(t)
        for (int64_t r = 0; r < rows; ++r)        /* every row rounded, into this thread's copy */
            ok[r] = quantize_row(x + r * xstride, in, p + r * in, s + r * nb, psum + r * nb, norms + 3 * r);
        int base = 0, mine = team_take(&q), cut_made = 0;
        int64_t count = 0;
        TEAM_PHASE(&q, base, mine, gitems, {       /* steps 1-3: GROUPS_PER_ITEM panels an item, every row */
            for (int64_t g = item * GROUPS_PER_ITEM; g < (item + 1) * GROUPS_PER_ITEM && g < groups; ++g)
                bound_panel(p, s, psum, norms, rows, in, wq, wd, wn, en, wmax, vocab, g, groups, high, my_low);
        });
        /* step 4: a group's surviving rows in one call, so that its panel is read once for all of them
         * (each row's sums are its own: the same bits as alone) */
        TEAM_PHASE(&q, base, mine, gitems, {
            if (!cut_made) {                        /* each row's cut, from every thread's lower bounds */
                for (int64_t r = 0; r < rows; ++r) {
                    float l0 = -INFINITY;
                    for (int u = 0; u < nt; ++u) {
                        const float l = LOW_OF(u)[r];
                        l0 = l > l0 ? l : l0;
                    }
                    cut[r] = ok[r] ? l0 - fabsf(l0) * 0x1p-6f - 1e-6f : INFINITY;  /* two bfloat16 steps, and a little */
                }
                cut_made = 1;
            }
            for (int64_t g = item * GROUPS_PER_ITEM; g < (item + 1) * GROUPS_PER_ITEM && g < groups; ++g) {
                int k = 0;
                for (int64_t r = 0; r < rows; ++r) {
                    best[r * groups + g] = -INFINITY;
                    if (high[r * groups + g] >= cut[r]) {
                        memcpy(xb + k * in, x + r * xstride, sizeof(uint16_t) * in);
                        pick[k++] = (int32_t)r;
                    }
                }
                if (k == 0) continue;
                const int64_t no = vocab - g * PW < PW ? vocab - g * PW : PW;
                skinny(xb, in, panels + g * PW * ((in + 1) & ~(int64_t)1), yb, PW, k, in, no, 0, 1);
                count += k;
                for (int i = 0; i < k; ++i) {
                    float top = -INFINITY;
                    int64_t at = 0;
                    for (int64_t j = 0; j < no; ++j) {
                        const float v = bf16_load(yb[i * PW + j]);
                        if (v > top) top = v, at = j;
                    }
                    best[pick[i] * groups + g] = top;
                    where[pick[i] * groups + g] = (int32_t)(g * PW + at);
                }
            }
        });
        atomic_fetch_add(&total, count);
    })
    {   /* the first largest recomputed logit of each row, groups in order (the calling thread's copy) */
        SCRATCH(0)
        (void)s, (void)norms, (void)cut, (void)my_low, (void)psum, (void)pick, (void)p, (void)xb, (void)yb;
        for (int64_t r = 0; r < rows; ++r) {
            float top = -INFINITY;
            int64_t at = -1;
            for (int64_t g = 0; g < groups && ok[r]; ++g)
                if (best[r * groups + g] > top) top = best[r * groups + g], at = where[r * groups + g];
            tokens[r] = at;
        }
    }
#undef SCRATCH
#undef LOW_OF
    *recomputed = atomic_load(&total);
    free(mem);
    return 0;
}

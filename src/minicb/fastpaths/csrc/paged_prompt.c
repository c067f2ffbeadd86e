/* Paged prompt attention for the CPU: a prompt chunk's queries in tiles, each tile against its
 * sequence's keys in one pass, flash-attention style (an online softmax).
 *
 * paged_decode.c attends one query token at a time: a 2,048-token prompt chunk fed to it token by token
 * reads every key of its sequence again for each of the chunk's tokens, from the paged cache, and does
 * a few multiply-adds per key it reads. Here the chunk's tokens come in tiles of consecutive tokens of
 * one sequence, and a tile is attended as a whole: each key is read once per tile and kv head and used
 * by all the tile's queries of that kv head (tile rows x the query heads that share it, GQA's group:
 * 16 tokens x 3 heads for SmolLM2, 48 queries). The 48 queries sit in the lanes of the vectors, one
 * query per lane ("lanes"), so a key's element is broadcast once and multiplied into 48 queries by 3
 * vector instructions, and each key's 48 scores come out as 3 vectors:
 *
 *     keys of the sequence, through its block table, KC at a time
 *     0        KC       2KC      ...                     start          start + rows
 *     |--------|--------|--- ... ------------------------|---------------|
 *                                                        tile: row i is the token at start + i and
 *                                                        sees keys 0 .. start + i (the causal cut:
 *                                                        only the last chunks have keys to cut)
 *
 *     per work item (tile, kv head g), m = -inf, l = 0, O = 0 for every lane, then per chunk of keys:
 *       S[j][lane] = scale * K[t0 + j] . q[lane]       -inf where key t0 + j is after the lane's token
 *       M[lane] = max(m[lane], max_j S[j][lane]),  c[lane] = exp(m[lane] - M[lane]),  m = M
 *       P[j][lane] = exp(S[j][lane] - M[lane]),    l[lane] = c[lane] l[lane] + sum_j P[j][lane]
 *       O[d][lane] = c[lane] O[d][lane] + sum_j V[t0 + j][d] P[j][lane]
 *     and at the end out[lane] = O[.][lane] / l[lane].
 *
 * That is FlashAttention's online softmax (Dao et al., 2022): when a chunk brings a larger score, what
 * was summed so far is rescaled by c, so one pass over the keys and values suffices and nothing of the
 * context's length is kept. With the queries across the lanes the softmax's maxima and sums are per
 * lane: plain vector operations, no sum across a vector's lanes anywhere (the decode kernel folds 16
 * of them per 16 scores). The work items, (tile, kv head), are independent: one OpenMP thread each,
 * a kv head at a time (its keys and values of a 2,048-token context, 512 KB in bfloat16, stay in a
 * Zen 4 core's L2 from one tile to the next), the last tiles (the longest contexts) first. Each item
 * is computed the same way whichever thread runs it, so the bits do not depend on the thread count.
 *
 * Layouts: q and out [rows, q_heads, head_dim] (the step's rows; a tile writes only its own), k_cache
 * and v_cache one layer's [num_slots, kv_heads, head_dim], block_tables int32 [seqs, max_blocks],
 * tiles int32 [n_tiles][4] = (first row, rows, position of the first row, sequence). The keys of the
 * tile's own tokens must be in the cache already (the backend writes a step's K/V first).
 *
 * Two versions of the per-chunk loops: portable C (any head_dim, float64 too), and on a CPU with AVX-512
 * for head_dim a multiple of 8, register blocks of 8 keys x 3 vectors of scores (24 sums in
 * registers) and of 8 head_dim values x 3 vectors of outputs. Dtypes as in paged_decode.c: float32 and
 * float64 compute in their own type; bfloat16 is widened to float32 (the tile's queries once, each chunk
 * of keys and values once per work item) and the output rounded once. Native bfloat16 (AVX-512 BF16):
 * the scores take the stored query and key pairs on vdpbf16ps (exact products summed in float32), and
 * so does the weighted sum of the values, two keys a lane: each chunk's softmax weights are rounded to
 * bfloat16 (the sum they are divided by is of the float32 ones), which halves that sum's
 * multiply-adds, two thirds of a tile's. A tile ran 1.2-1.3x as fast at 256-2,048 tokens on a Zen 4
 * core, and LP end to end ~2% (bench/RESULTS.md, issue 47; -DF32_WEIGHTED_SUM builds the float32 sum
 * for that comparison). The price is one bfloat16 rounding of each term p_j v_j, where the float32 sum
 * rounds only the output (tests/model/test_paged_prompt.py bounds both). minicb_paged_prompt_bf16_widen
 * always widens: it multiply-adds in the float32 kernel's order, so it is that kernel on widened
 * inputs, rounded.
 */
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "bf16.h"
#include "exp_f32.h"
#include "omp_id.h"

#define LANES 48 /* queries per lane block: 3 AVX-512 vectors of 16 floats */
#define KC 32    /* keys per step of the online softmax */

int minicb_paged_prompt_lanes(void) { return LANES; }

#if defined(__AVX512F__)
#define FAST512 1
#else
#define FAST512 0
#endif
int minicb_paged_prompt_avx512(void) { return FAST512; }

#define SAME(x) (x)
static inline double exp_f64(double x) { return exp(x); }

/* ---- The portable loops: one function per type (T stored, A computed) --------------------------- */
#define PORTABLE(NAME, T, A, LOAD)                                                                    \
    /* s[j][lane] = scale * k_j . q_lane for the chunk's n keys kp[j]; qt [D][LANES] the queries */   \
    static void NAME##_scores(A *s, const A *qt, const T **kp, int64_t n, int64_t D, A scale) { \
        for (int64_t j = 0; j < n; ++j) {                                                             \
            A acc[LANES] = {0};                                                                       \
            for (int64_t d = 0; d < D; ++d) {                                                         \
                const A k = LOAD(kp[j][d]);                                                           \
                for (int l = 0; l < LANES; ++l) acc[l] += k * qt[d * LANES + l];                      \
            }                                                                                         \
            for (int l = 0; l < LANES; ++l) s[j * LANES + l] = acc[l] * scale;                        \
        }                                                                                             \
    }                                                                                                 \
    /* o[d][lane] = c[lane] o[d][lane] + sum_j V_j[d] p[j][lane] */                                   \
    static void NAME##_values(A *o, const A *c, const A *p, const T **vp, int64_t n, int64_t D) {  \
        for (int64_t d = 0; d < D; ++d) {                                                             \
            A *od = o + d * LANES;                                                                    \
            for (int l = 0; l < LANES; ++l) od[l] *= c[l];                                            \
            for (int64_t j = 0; j < n; ++j) {                                                         \
                const A v = LOAD(vp[j][d]);                                                           \
                for (int l = 0; l < LANES; ++l) od[l] += v * p[j * LANES + l];                        \
            }                                                                                         \
        }                                                                                             \
    }
PORTABLE(f32, float, float, SAME)
PORTABLE(f64, double, double, SAME)
PORTABLE(bf16, uint16_t, float, bf16_load)

#define SOFTMAX_FN(NAME, A, EXP)                                                                      \
    /* The online softmax's step for keys t0..t0+n (scores s, in place: their weights): m the maxima, \
     * sum the sums, c what earlier sums are rescaled by, lim[lane] the lane's last key. */           \
    static void NAME##_softmax(A *s, A *m, A *sum, A *c, const A *lim, int64_t t0, int64_t n, int nl) { \
        A mx[LANES];                                                                                  \
        for (int l = 0; l < nl; ++l) mx[l] = m[l];                                                    \
        for (int64_t j = 0; j < n; ++j) {                                                             \
            const A t = (A)(t0 + j);                                                                  \
            for (int l = 0; l < nl; ++l) {                                                            \
                const A x = t <= lim[l] ? s[j * LANES + l] : -INFINITY;                               \
                mx[l] = x > mx[l] ? x : mx[l];                                                        \
            }                                                                                         \
        }                                                                                             \
        for (int l = 0; l < nl; ++l) {                                                                \
            c[l] = EXP(m[l] - mx[l]); /* m = -inf (the first chunk): sum and o are 0 anyway */        \
            sum[l] *= c[l];                                                                           \
            m[l] = mx[l];                                                                             \
        }                                                                                             \
        for (int64_t j = 0; j < n; ++j) {                                                             \
            const A t = (A)(t0 + j);                                                                  \
            for (int l = 0; l < nl; ++l) {                                                            \
                const A p = t <= lim[l] ? EXP(s[j * LANES + l] - mx[l]) : 0;                          \
                s[j * LANES + l] = p;                                                                 \
                sum[l] += p;                                                                          \
            }                                                                                         \
        }                                                                                             \
    }
SOFTMAX_FN(f32, float, exp_f32)
SOFTMAX_FN(f64, double, exp_f64)

/* ---- The AVX-512 loops (float32 arithmetic, head_dim a multiple of 8) ---------------------------- */
#if FAST512
#define RK 8 /* keys per register block of scores: 8 keys x 3 vectors = 24 sums */
#define RD 8 /* head_dim values per register block of outputs: 8 x 3 vectors */

/* These take the first nv vectors of lanes (16 nv lanes: a short tile needs fewer), a constant where
 * they are inlined (BY_NV), so that their sums stay in registers. */
#define INLINE static inline __attribute__((always_inline))
#define BY_NV(nv, CALL)                                                                               \
    switch (nv) {                                                                                     \
    case 1: CALL(1); break;                                                                           \
    case 2: CALL(2); break;                                                                           \
    default: CALL(3); break;                                                                          \
    }

/* The scores of n keys kp[j] (float32: the cache's, or bfloat16 widened into scratch). */
INLINE void scores512_f32(float *s, const float *qt, const float **kp, int64_t n, int64_t D, float scale,
                          const int nv) {
    const __m512 vs = _mm512_set1_ps(scale);
    for (int64_t j0 = 0; j0 < n; j0 += RK) {
        const float *k[RK];                   /* past the chunk's end: its last key again, not stored */
        for (int r = 0; r < RK; ++r) k[r] = kp[j0 + r < n ? j0 + r : n - 1];
        __m512 a[RK][3];
        for (int r = 0; r < RK; ++r)
            for (int v = 0; v < nv; ++v) a[r][v] = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; ++d) {
            __m512 qv[3];
            for (int v = 0; v < nv; ++v) qv[v] = _mm512_loadu_ps(qt + d * LANES + 16 * v);
            for (int r = 0; r < RK; ++r) {
                const __m512 kb = _mm512_set1_ps(k[r][d]);
                for (int v = 0; v < nv; ++v) a[r][v] = _mm512_fmadd_ps(kb, qv[v], a[r][v]);
            }
        }
        for (int r = 0; r < RK && j0 + r < n; ++r)
            for (int v = 0; v < nv; ++v) _mm512_storeu_ps(s + (j0 + r) * LANES + 16 * v, _mm512_mul_ps(a[r][v], vs));
    }
}

#if defined(__AVX512BF16__)
/* The same on vdpbf16ps: qp [D / 2][LANES] the queries' stored bfloat16 pairs, kp[j] the stored keys. */
INLINE void scores512_bf16n(float *s, const uint32_t *qp, const uint16_t **kp, int64_t n, int64_t D, float scale,
                            const int nv) {
    const __m512 vs = _mm512_set1_ps(scale);
    for (int64_t j0 = 0; j0 < n; j0 += RK) {
        const uint16_t *k[RK];
        for (int r = 0; r < RK; ++r) k[r] = kp[j0 + r < n ? j0 + r : n - 1];
        __m512 a[RK][3];
        for (int r = 0; r < RK; ++r)
            for (int v = 0; v < nv; ++v) a[r][v] = _mm512_setzero_ps();
        for (int64_t p = 0; p < D / 2; ++p) {
            __m512bh qv[3];
            for (int v = 0; v < nv; ++v) qv[v] = (__m512bh)_mm512_loadu_si512(qp + p * LANES + 16 * v);
            for (int r = 0; r < RK; ++r) {
                uint32_t pair;
                memcpy(&pair, k[r] + 2 * p, sizeof pair);
                const __m512bh kb = (__m512bh)_mm512_set1_epi32((int)pair);
                for (int v = 0; v < nv; ++v) a[r][v] = _mm512_dpbf16_ps(a[r][v], kb, qv[v]);
            }
        }
        for (int r = 0; r < RK && j0 + r < n; ++r)
            for (int v = 0; v < nv; ++v) _mm512_storeu_ps(s + (j0 + r) * LANES + 16 * v, _mm512_mul_ps(a[r][v], vs));
    }
}
#endif

/* An output register block of the weighted sums, RD head_dim values x nv vectors of lanes at o (row
 * stride LANES): loaded and rescaled by the online softmax's c, and stored back. Both weighted-sum
 * loops below (float32 and vdpbf16ps) start and end a block this way. */
INLINE void out_block_rescaled(__m512 a[RD][3], const float *o, const __m512 *cv, const int nv) {
    for (int e = 0; e < RD; ++e)
        for (int v = 0; v < nv; ++v) a[e][v] = _mm512_mul_ps(_mm512_loadu_ps(o + e * LANES + 16 * v), cv[v]);
}

INLINE void out_block_store(float *o, __m512 a[RD][3], const int nv) {
    for (int e = 0; e < RD; ++e)
        for (int v = 0; v < nv; ++v) _mm512_storeu_ps(o + e * LANES + 16 * v, a[e][v]);
}

#if defined(__AVX512BF16__)
/* 16-bit element 2i of a result takes element i of the first source, 2i + 1 that of the second:
 * PAIR_INTER the two halves of one vector (elements i and 16 + i), PAIR_LO / PAIR_HI two vectors' first
 * and last 16 (element indices 32 and up name the second vector). */
static const int16_t PAIR_INTER[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                       8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
static const int16_t PAIR_LO[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                    8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
static const int16_t PAIR_HI[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                    24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};

/* o = c o + the weighted sum of n values on vdpbf16ps: the weights p [n][LANES] (float32, the softmax's)
 * rounded to bfloat16 two keys at a time into pp [n / 2][LANES] pairs, vp[j] the stored values, taken
 * two keys at a time into vpair [n / 2][D] pairs (an odd last key paired with a zero weight and
 * value). One vdpbf16ps multiplies two keys' weights by their values and adds both to the sums: half
 * the multiply-add instructions of the float32 loop, which is most of a tile's arithmetic. */
INLINE void values512_bf16n(float *o, const float *c, const float *p, const uint16_t **vp, uint32_t *pp,
                            uint32_t *vpair, int64_t n, int64_t D, const int nv) {
    const int64_t np = (n + 1) / 2;
    const __m512i inter = _mm512_loadu_si512(PAIR_INTER), pick_lo = _mm512_loadu_si512(PAIR_LO),
                  pick_hi = _mm512_loadu_si512(PAIR_HI);
    for (int64_t jp = 0; jp < np; ++jp) {
        const int64_t j = 2 * jp, odd = j + 1 < n;
        for (int v = 0; v < nv; ++v) {
            const __m512 p0 = _mm512_loadu_ps(p + j * LANES + 16 * v);
            const __m512 p1 = odd ? _mm512_loadu_ps(p + (j + 1) * LANES + 16 * v) : _mm512_setzero_ps();
            const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);   /* p0's 16, then p1's 16 */
            _mm512_storeu_si512(pp + jp * LANES + 16 * v, _mm512_permutexvar_epi16(inter, both));
        }
        for (int64_t d0 = 0; d0 < D; d0 += 32) {   /* 32 values of each key: their pairs, in order */
            const int64_t left = D - d0 < 32 ? D - d0 : 32;                  /* 8, 16, 24 or 32 */
            const __mmask32 k = (__mmask32)((1ull << left) - 1);
            const __m512i a = _mm512_maskz_loadu_epi16(k, vp[j] + d0);
            const __m512i b = odd ? _mm512_maskz_loadu_epi16(k, vp[j + 1] + d0) : _mm512_setzero_si512();
            const __m512i lo = _mm512_permutex2var_epi16(a, pick_lo, b);
            const __m512i hi = _mm512_permutex2var_epi16(a, pick_hi, b);
            _mm512_mask_storeu_epi32(vpair + jp * D + d0, (__mmask16)k, lo);              /* values 0-15 */
            _mm512_mask_storeu_epi32(vpair + jp * D + d0 + 16, (__mmask16)(k >> 16), hi);  /* 16-31 */
        }
    }
    __m512 cv[3];
    for (int v = 0; v < nv; ++v) cv[v] = _mm512_loadu_ps(c + 16 * v);
    for (int64_t d0 = 0; d0 < D; d0 += RD) {
        __m512 a[RD][3];
        out_block_rescaled(a, o + d0 * LANES, cv, nv);
        for (int64_t jp = 0; jp < np; ++jp) {
            __m512bh pv[3];
            for (int v = 0; v < nv; ++v) pv[v] = (__m512bh)_mm512_loadu_si512(pp + jp * LANES + 16 * v);
            const uint32_t *vj = vpair + jp * D + d0;
            for (int e = 0; e < RD; ++e) {
                const __m512bh vb = (__m512bh)_mm512_set1_epi32((int)vj[e]);
                for (int v = 0; v < nv; ++v) a[e][v] = _mm512_dpbf16_ps(a[e][v], vb, pv[v]);
            }
        }
        out_block_store(o + d0 * LANES, a, nv);
    }
}
#endif

/* o = c o + the weighted sum of n values vp[j] (float32), 8 head_dim values x nv vectors at a time. */
INLINE void values512(float *o, const float *c, const float *p, const float **vp, int64_t n, int64_t D,
                      const int nv) {
    __m512 cv[3];
    for (int v = 0; v < nv; ++v) cv[v] = _mm512_loadu_ps(c + 16 * v);
    for (int64_t d0 = 0; d0 < D; d0 += RD) {
        __m512 a[RD][3];
        out_block_rescaled(a, o + d0 * LANES, cv, nv);
        for (int64_t j = 0; j < n; ++j) {
            __m512 pv[3];
            for (int v = 0; v < nv; ++v) pv[v] = _mm512_loadu_ps(p + j * LANES + 16 * v);
            const float *vj = vp[j] + d0;
            for (int e = 0; e < RD; ++e) {
                const __m512 vb = _mm512_set1_ps(vj[e]);
                for (int v = 0; v < nv; ++v) a[e][v] = _mm512_fmadd_ps(vb, pv[v], a[e][v]);
            }
        }
        out_block_store(o + d0 * LANES, a, nv);
    }
}
#endif

/* Which loops a work item takes: 0 portable, 1 AVX-512 float32 (bfloat16 widened into scratch first),
 * 2 AVX-512 with the scores on vdpbf16ps. */
static inline int fast_mode(int64_t D, int native) {
    if (!FAST512 || D % 8 != 0) return 0;
    return native ? 2 : 1;
}

/* Scratch per thread, in A: qt [D][LANES] (the queries transposed; native: their bfloat16 pairs),
 * o [D][LANES], s [KC][LANES], m, sum, c, lim [LANES], KC x D each for widened keys and values (native:
 * the values' pairs in the second) and KC / 2 x LANES for the native weights' pairs. */
#define SCRATCH(D) (2 * (D) * LANES + KC * LANES + 4 * LANES + 2 * KC * (D) + KC / 2 * LANES)

/* One work item: tile `tile` of the step, kv head g. MODE: fast_mode's answer for this type. */
#define TILE_FN(NAME, T, A, LOAD, STORE)                                                         \
    static void NAME##_item(const T *q, const T *k_cache, const T *v_cache, const int32_t *table,      \
                            const int32_t *tile, T *out, int64_t q_heads, int64_t kv_heads, int64_t D, \
                            int64_t bs, A scale, int64_t g, A *buf, int mode) {                        \
        const int64_t group = q_heads / kv_heads, slot_len = kv_heads * D;                             \
        const int64_t first = tile[0], rows = tile[1], start = tile[2], lanes = rows * group;          \
        A *qt = buf, *o = qt + D * LANES, *s = o + D * LANES, *m = s + KC * LANES, *sum = m + LANES;   \
        A *c = sum + LANES, *lim = c + LANES, *kw = lim + LANES, *vw = kw + KC * D;                    \
        const T *kp[KC], *vp[KC];                                                                      \
        for (int64_t l0 = 0; l0 < lanes; l0 += LANES) { /* more than one block: group > LANES / rows */ \
            const int64_t nl = lanes - l0 < LANES ? lanes - l0 : LANES;                                \
            const int nv = (int)(nl + 15) / 16;       /* vectors of lanes the AVX-512 loops take */    \
            /* lane l: query head g * group + (l0 + l) % group of row (l0 + l) / group; unused lanes  \
             * get a zero query (and a row's limit: they see key 0, so no lane's max stays -inf) */    \
            for (int l = 0; l < LANES; ++l) {                                                          \
                const int64_t i = (l0 + (l < nl ? l : 0)) / group, h = (l0 + l) % group;              \
                const T *qr = q + ((first + i) * q_heads + g * group + h) * D;                         \
                lim[l] = (A)(start + i);                                                               \
                m[l] = -INFINITY, sum[l] = 0;                                                          \
                if (mode == 2) {                  /* bfloat16 pairs, as stored (A is float here) */    \
                    uint32_t *qp = (uint32_t *)qt;                                                     \
                    for (int64_t p = 0; p < D / 2; ++p) {                                              \
                        uint32_t pair = 0;                                                             \
                        if (l < nl) memcpy(&pair, qr + 2 * p, sizeof pair);                            \
                        qp[p * LANES + l] = pair;                                                      \
                    }                                                                                  \
                } else {                                                                               \
                    for (int64_t d = 0; d < D; ++d) qt[d * LANES + l] = l < nl ? LOAD(qr[d]) : 0;      \
                }                                                                                      \
            }                                                                                          \
            memset(o, 0, sizeof(A) * (size_t)(D * LANES));                                             \
            const int64_t end = start + (l0 + nl - 1) / group + 1;   /* the last lane's keys */       \
            for (int64_t t0 = 0; t0 < end; t0 += KC) {                                                 \
                const int64_t n = end - t0 < KC ? end - t0 : KC;                                       \
                for (int64_t j = 0; j < n; ++j) {                                                      \
                    const int64_t t = t0 + j, slot = (int64_t)table[t / bs] * bs + t % bs;             \
                    kp[j] = k_cache + slot * slot_len + g * D;                                         \
                    vp[j] = v_cache + slot * slot_len + g * D;                                         \
                }                                                                                      \
                NAME##_chunk(s, qt, o, m, sum, c, lim, kp, vp, kw, vw, t0, n, D, scale, mode, nv);     \
            }                                                                                          \
            for (int64_t l = 0; l < nl; ++l) {                                                         \
                const int64_t i = (l0 + l) / group, h = (l0 + l) % group;                              \
                T *orow = out + ((first + i) * q_heads + g * group + h) * D;                           \
                const A inv = (A)1 / sum[l];                                                           \
                for (int64_t d = 0; d < D; ++d) orow[d] = STORE(o[d * LANES + l] * inv);               \
            }                                                                                          \
        }                                                                                              \
    }

/* One chunk of keys: scores, the softmax's step, the values; on the loops `mode` names. */
static inline void f64_chunk(double *s, const double *qt, double *o, double *m, double *sum, double *c,
                             const double *lim, const double **kp, const double **vp, double *kw,
                             double *vw, int64_t t0, int64_t n, int64_t D, double scale, int mode, int nv) {
    (void)kw, (void)vw, (void)mode, (void)nv;
    f64_scores(s, qt, kp, n, D, scale);
    f64_softmax(s, m, sum, c, lim, t0, n, LANES);
    f64_values(o, c, s, vp, n, D);
}

static inline void f32_chunk(float *s, const float *qt, float *o, float *m, float *sum, float *c,
                             const float *lim, const float **kp, const float **vp, float *kw,
                             float *vw, int64_t t0, int64_t n, int64_t D, float scale, int mode, int nv) {
    (void)kw, (void)vw;
#if FAST512
    if (mode) {
#define F32_STEPS(NV)                                                                                 \
    scores512_f32(s, qt, kp, n, D, scale, NV);                                                        \
    f32_softmax(s, m, sum, c, lim, t0, n, 16 * NV);                                                   \
    values512(o, c, s, vp, n, D, NV)
        BY_NV(nv, F32_STEPS)
        return;
    }
#endif
    (void)mode, (void)nv;
    f32_scores(s, qt, kp, n, D, scale);
    f32_softmax(s, m, sum, c, lim, t0, n, LANES);
    f32_values(o, c, s, vp, n, D);
}

static inline void bf16_chunk(float *s, const float *qt, float *o, float *m, float *sum, float *c,
                              const float *lim, const uint16_t **kp, const uint16_t **vp, float *kw,
                              float *vw, int64_t t0, int64_t n, int64_t D, float scale, int mode, int nv) {
#if FAST512
    if (mode) { /* the chunk's values (and keys, unless native) widened once, then float32's loops */
        const int native = mode == 2;
        const float *kf[KC], *vf[KC];
#if defined(__AVX512BF16__) && !defined(F32_WEIGHTED_SUM)   /* the flag: float32's sum (a bench's A/B) */
        if (native) {
#define BF16N_STEPS(NV)                                                                               \
    scores512_bf16n(s, (const uint32_t *)qt, kp, n, D, scale, NV);                                    \
    f32_softmax(s, m, sum, c, lim, t0, n, 16 * NV);                                                   \
    values512_bf16n(o, c, s, vp, (uint32_t *)(vw + KC * D), (uint32_t *)vw, n, D, NV)
            BY_NV(nv, BF16N_STEPS)
            return;
        }
#endif
        for (int64_t j = 0; j < n; ++j) {
            for (int64_t d = 0; d < D; ++d) vw[j * D + d] = bf16_load(vp[j][d]);
            vf[j] = vw + j * D;
            if (!native) {
                for (int64_t d = 0; d < D; ++d) kw[j * D + d] = bf16_load(kp[j][d]);
                kf[j] = kw + j * D;
            }
        }
#if defined(__AVX512BF16__)
#define BF16_SCORES(NV)                                                                               \
    if (native) scores512_bf16n(s, (const uint32_t *)qt, kp, n, D, scale, NV);                        \
    else scores512_f32(s, qt, kf, n, D, scale, NV)
#else
#define BF16_SCORES(NV) scores512_f32(s, qt, kf, n, D, scale, NV)
#endif
#define BF16_STEPS(NV)                                                                                \
    BF16_SCORES(NV);                                                                                  \
    f32_softmax(s, m, sum, c, lim, t0, n, 16 * NV);                                                   \
    values512(o, c, s, vf, n, D, NV)
        BY_NV(nv, BF16_STEPS)
        return;
    }
#endif
    (void)kw, (void)vw, (void)mode, (void)nv;
    bf16_scores(s, qt, kp, n, D, scale);
    f32_softmax(s, m, sum, c, lim, t0, n, LANES);
    bf16_values(o, c, s, vp, n, D);
}

TILE_FN(f32, float, float, SAME, SAME)
TILE_FN(f64, double, double, SAME, SAME)
TILE_FN(bf16, uint16_t, float, bf16_load, bf16_store)

#if defined(__AVX512BF16__)
#define BF16_NATIVE 1
#else
#define BF16_NATIVE 0
#endif

/* The entry points: every (tile, kv head) of the step over `num_threads` threads, or (item >= 0) only
 * work item `item` of them, in the order below (layer_stack.c hands the items to its threads itself).
 * Each thread takes the next item (`*next`: schedule(dynamic) counted by hand, no worksharing
 * construct), with its own scratch; a call of one thread runs alone, not as a team of one
 * (TEAM_OR_ALONE, omp_id.h).
 * Returns 0, or 1 when a thread could not allocate its scratch. */
#define PAGED_PROMPT(NAME, ITEM, T, A, NATIVE)                                                          \
    static void NAME##_items(const T *q, const T *k_cache, const T *v_cache, const int32_t *block_tables, \
                             const int32_t *tiles, int64_t n_tiles, T *out, int64_t q_heads,            \
                             int64_t kv_heads, int64_t D, int64_t max_blocks, int64_t block_size,       \
                             double scale, int mode, int64_t items, atomic_llong *next,                 \
                             atomic_int *failed) {                                                      \
        A *buf = malloc(sizeof(A) * (size_t)SCRATCH(D));                                               \
        if (buf == NULL) {                                                                             \
            atomic_store(failed, 1);                                                                   \
            return;                                                                                    \
        }                                                                                              \
        /* one kv head after another, its last tiles (the longest contexts) first */                  \
        for (int64_t w; (w = atomic_fetch_add(next, 1)) < items;) {                                    \
            const int32_t *tile = tiles + 4 * (n_tiles - 1 - w % n_tiles);                             \
            ITEM(q, k_cache, v_cache, block_tables + (int64_t)tile[3] * max_blocks, tile, out,         \
                 q_heads, kv_heads, D, block_size, (A)scale, w / n_tiles, buf, mode);                  \
        }                                                                                              \
        free(buf);                                                                                     \
    }                                                                                                  \
    int NAME(const T *q, const T *k_cache, const T *v_cache, const int32_t *block_tables,               \
             const int32_t *tiles, int64_t n_tiles, T *out, int64_t q_heads, int64_t kv_heads,          \
             int64_t head_dim, int64_t max_blocks, int64_t block_size, double scale, int num_threads,   \
             int64_t item) {                                                                           \
        const int64_t items = item >= 0 ? item + 1 : n_tiles * kv_heads;                               \
        const int mode = sizeof(A) == sizeof(float) ? fast_mode(head_dim, NATIVE) : 0;                 \
        atomic_llong next = item >= 0 ? item : 0;                                                      \
        atomic_int failed = 0;                                                                         \
        TEAM_OR_ALONE(NAME##_items(q, k_cache, v_cache, block_tables, tiles, n_tiles, out, q_heads,     \
                                   kv_heads, head_dim, max_blocks, block_size, scale, mode, items, &next, \
                                   &failed))                                                           \
        return atomic_load(&failed);                                                                   \
    }

PAGED_PROMPT(minicb_paged_prompt_f32, f32_item, float, float, 0)
PAGED_PROMPT(minicb_paged_prompt_f64, f64_item, double, double, 0)
PAGED_PROMPT(minicb_paged_prompt_bf16, bf16_item, uint16_t, float, BF16_NATIVE)
PAGED_PROMPT(minicb_paged_prompt_bf16_widen, bf16_item, uint16_t, float, 0)

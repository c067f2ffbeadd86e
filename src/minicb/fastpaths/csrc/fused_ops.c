/* Fused elementwise ops of a LLaMA layer for the CPU: RMSNorm (alone, or after the residual add), rotary
 * embedding, and the MLP's SiLU times up, one pass each.
 *
 * In eager PyTorch, RMSNorm is six ops (widen, square, mean, add eps, rsqrt, two multiplies) and the
 * rotary embedding of q and k ten (negate and concatenate the halves, two multiplies, an add, twice):
 * each a separate pass over the step's activations, with a freshly allocated result, and microseconds
 * of dispatch. vLLM's CPU build runs them as one loop each (its torch.compile'd graph). These are the
 * loops, called through ctypes a few times per layer (cpu_fused.py).
 *
 * Numerics, op for op as llama.py computes them (so that only the order of RMSNorm's sum differs):
 *   rmsnorm: h = float32(x); h = h * (1 / sqrt(mean(h * h) + eps)); out = w * T(h)
 *   rope:    out[d] = x[d] * cos[d] - x[d + half] * sin[d]        for d <  half
 *            out[d] = x[d] * cos[d] + x[d - half] * sin[d]        for d >= half
 *            each product and the sum rounded to T, as the separate torch ops round them; compiled
 *            with -ffp-contract=off, so no multiply-add is fused: float32 results equal torch's bit
 *            for bit, and bfloat16 ones too (each step rounded to bfloat16 as torch rounds it).
 *   add + rmsnorm: x = T(x + delta), then rmsnorm of it (torch's add, then the loop above)
 *   silu * up: T(T(g / (1 + e^-g)) * u), e^ from exp_f32.h (a polynomial, not torch's: see there)
 * T is float or bfloat16 (uint16_t, the top half of a float32), arithmetic in float. Rows are split
 * over OpenMP threads when a call has enough of them to be worth it.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "bf16.h"
#include "exp_f32.h"

static inline float f32_load(float x) { return x; }
static inline float f32_store(float x) { return x; }

/* the body (the arguments) for each row r of `rows`, split over nthreads when the call has at least 64 Ki
 * elements (`work`), else a plain loop. Not `omp parallel for ... if(work >= 65536)`: with its condition
 * false that still opens a team (of one thread, nested when the caller is layer_stack.c's team), a
 * malloc and futex calls each time, and the stack calls these for every run of rows of every layer */
#define FOR_ROWS(...)                                                                                  \
    if (work >= 65536 && nthreads > 1) {                                                             \
        _Pragma("omp parallel for num_threads(nthreads) schedule(static)")                           \
        for (int64_t r = 0; r < rows; ++r) { __VA_ARGS__ }                                           \
    } else {                                                                                         \
        for (int64_t r = 0; r < rows; ++r) { __VA_ARGS__ }                                           \
    }

/* one row of RMSNorm: o = w * T(h * (1 / sqrt(mean(h * h) + eps))), h = float32(xr) */
#define NORM_ROW(T, LOAD, STORE, xr, w, o, dim, eps)                                                   \
    do {                                                                                             \
        float ss = 0;                                                                                \
        _Pragma("omp simd reduction(+:ss)")                                                          \
        for (int64_t d = 0; d < dim; ++d) { float v = LOAD(xr[d]); ss += v * v; }                    \
        const float inv = 1.0f / sqrtf(ss / (float)dim + (float)eps);                                \
        _Pragma("omp simd")                                                                          \
        for (int64_t d = 0; d < dim; ++d) o[d] = STORE(LOAD(w[d]) * LOAD(STORE(LOAD(xr[d]) * inv))); \
    } while (0)

#define RMSNORM(NAME, T, LOAD, STORE)                                                                  \
    void NAME(const T *x, const T *w, T *out, int64_t rows, int64_t dim, double eps, int nthreads) {  \
        const int64_t work = rows * dim;                                                             \
        FOR_ROWS(NORM_ROW(T, LOAD, STORE, (x + r * dim), w, (out + r * dim), dim, eps);)              \
    }

/* the residual add and the next RMSNorm in one pass: x += delta (rounded to T, as torch's add rounds
 * it), in place, then out = RMSNorm(x) */
#define ADD_RMSNORM(NAME, T, LOAD, STORE)                                                              \
    void NAME(T *x, const T *delta, const T *w, T *out, int64_t rows, int64_t dim, double eps,       \
              int nthreads) {                                                                        \
        const int64_t work = rows * dim;                                                             \
        FOR_ROWS(                                                                                    \
            T *xr = x + r * dim;                                                                     \
            const T *dr = delta + r * dim;                                                           \
            _Pragma("omp simd")                                                                      \
            for (int64_t d = 0; d < dim; ++d) xr[d] = STORE(LOAD(xr[d]) + LOAD(dr[d]));              \
            NORM_ROW(T, LOAD, STORE, xr, w, (out + r * dim), dim, eps);                              \
        )                                                                                            \
    }

/* the MLP's activation: out [rows, inter] = T(T(silu(g)) * u), g and u the halves of each row of gu
 * [rows, stride >= 2 * inter] (the gate/up product); silu(g) = g / (1 + e^-g), computed as
 * g e^-|g| / (1 + e^-|g|) for g < 0 so that e^ never overflows, rounded to T as torch's silu rounds
 * it, then the product rounded again (two torch ops, one pass here) */
#define SILU_MUL(NAME, T, LOAD, STORE)                                                                 \
    static void NAME##_row(const T *restrict g, T *restrict o, const int64_t n) {                    \
        const T *restrict u = g + n;                                                                 \
        _Pragma("omp simd")                                                                          \
        for (int64_t i = 0; i < n; ++i) {                                                            \
            const float x = LOAD(g[i]);                                                              \
            const float e = exp_f32(x < 0 ? x : -x);            /* e^-|x|: never overflows */        \
            const float silu = (x < 0 ? x * e : x) / (1.0f + e); /* x / (1 + e^-x), both signs */    \
            o[i] = STORE(LOAD(STORE(silu)) * LOAD(u[i]));                                            \
        }                                                                                            \
    }                                                                                                \
    void NAME(const T *gu, T *out, int64_t rows, int64_t inter, int64_t stride, int nthreads) {      \
        const int64_t work = rows * inter;                                                           \
        FOR_ROWS(                                                                                    \
            NAME##_row(gu + r * stride, out + r * inter, inter);                                     \
        )                                                                                            \
    }

/* x [rows, heads, dim] rotated in place by its row's cos / sin [rows, dim]; row r of x starts at
 * x + r * stride (stride >= heads * dim: q and k may be views into the q/k/v product's rows) */
#define ROPE(NAME, T, LOAD, STORE)                                                                     \
    static void NAME##_one(T *x, const T *cos, const T *sin, int64_t rows, int64_t heads, int64_t dim, \
                           int64_t stride, int nthreads) {                                            \
        const int64_t half = dim / 2;                                                                 \
        const int64_t work = rows * heads * dim;                                                      \
        FOR_ROWS(                                                                                     \
            const T *c = cos + r * dim, *s = sin + r * dim;                                           \
            for (int64_t h = 0; h < heads; ++h) {                                                     \
                T *v = x + r * stride + h * dim;                                                      \
                _Pragma("omp simd")                                                                   \
                for (int64_t d = 0; d < half; ++d) {                                                  \
                    const float a = LOAD(v[d]), b = LOAD(v[d + half]);                                \
                    const float lo = LOAD(STORE(a * LOAD(c[d]))) + LOAD(STORE(-b * LOAD(s[d])));      \
                    const float hi = LOAD(STORE(b * LOAD(c[d + half]))) + LOAD(STORE(a * LOAD(s[d + half]))); \
                    v[d] = STORE(lo);                                                                 \
                    v[d + half] = STORE(hi);                                                          \
                }                                                                                     \
            }                                                                                         \
        )                                                                                             \
    }                                                                                                 \
    void NAME(T *q, T *k, const T *cos, const T *sin, int64_t rows, int64_t q_heads, int64_t kv_heads, \
              int64_t dim, int64_t q_stride, int64_t k_stride, int nthreads) {                        \
        NAME##_one(q, cos, sin, rows, q_heads, dim, q_stride, nthreads);                              \
        NAME##_one(k, cos, sin, rows, kv_heads, dim, k_stride, nthreads);                             \
    }

RMSNORM(minicb_rmsnorm_f32, float, f32_load, f32_store)
RMSNORM(minicb_rmsnorm_bf16, uint16_t, bf16_load, bf16_store)
ROPE(minicb_rope_f32, float, f32_load, f32_store)
ROPE(minicb_rope_bf16, uint16_t, bf16_load, bf16_store)
ADD_RMSNORM(minicb_add_rmsnorm_f32, float, f32_load, f32_store)
ADD_RMSNORM(minicb_add_rmsnorm_bf16, uint16_t, bf16_load, bf16_store)
SILU_MUL(minicb_silu_mul_f32, float, f32_load, f32_store)
SILU_MUL(minicb_silu_mul_bf16, uint16_t, bf16_load, bf16_store)

/* Greedy sampling: out[r] = the index of the first maximum of row r of x [rows, n] (row stride `stride`),
 * a NaN counting as larger than everything (the first NaN): what torch.max(x, -1).indices returns; and
 * where `finite` is not NULL, finite[r] = whether that maximum is a finite number (not a NaN, not an
 * infinity: the sampler's check that the row could be scored, without another pass over the logits).
 * torch's own loop on bfloat16 logits compares one value at a time (5.8 ms for SmolLM2's 64 x 49,152
 * logits on a Zen 4 core); here each value becomes an integer key whose order is the values' order
 * (sign-magnitude to two's complement, -0 given +0's key, every NaN the largest key), so that both
 * passes, the largest key and the first index holding it, are plain integer loops that vectorise. */
#define ARGMAX(NAME, T, S, NAN_KEY, MAG, EXP_ALL)                                                      \
    static inline S NAME##_key(T b) {                                                                  \
        const S s = (S)b;                                                                              \
        if ((b & MAG) > EXP_ALL) return NAN_KEY;                     /* a NaN, either sign */          \
        return s >= 0 ? s : (S)((s ^ MAG) + 1);                     /* -0 -> 0, -x below every +x */  \
    }                                                                                                  \
    void NAME(const T *x, int64_t rows, int64_t n, int64_t stride, int64_t *out, uint8_t *finite,      \
              int nthreads) {                                                                          \
        const int64_t work = rows * n;                                                                 \
        FOR_ROWS(                                                                                      \
            const T *xr = x + r * stride;                                                              \
            S best = NAME##_key(xr[0]);                                                                \
            _Pragma("omp simd reduction(max:best)")                                                    \
            for (int64_t i = 1; i < n; ++i) { const S k = NAME##_key(xr[i]); best = k > best ? k : best; } \
            int64_t at = 0;                                                                            \
            while (NAME##_key(xr[at]) != best) ++at;                                                   \
            out[r] = at;                                                                               \
            if (finite) finite[r] = (xr[at] & MAG) < EXP_ALL;         /* exponent not all ones */     \
        )                                                                                              \
    }

ARGMAX(minicb_argmax_bf16, uint16_t, int16_t, (int16_t)0x7fff, 0x7fffu, 0x7f80u)
ARGMAX(minicb_argmax_f32, uint32_t, int32_t, (int32_t)0x7fffffff, 0x7fffffffu, 0x7f800000u)

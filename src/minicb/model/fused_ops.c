/* Fused elementwise ops of a LLaMA layer for the CPU: RMSNorm and rotary embedding, one pass each.
 *
 * In eager PyTorch, RMSNorm is six ops (widen, square, mean, add eps, rsqrt, two multiplies) and the
 * rotary embedding of q and k ten (negate and concatenate the halves, two multiplies, an add, twice):
 * each a separate pass over the step's activations, with a freshly allocated result, and microseconds
 * of dispatch. vLLM's CPU build runs them as one loop each (its torch.compile'd graph). These are the
 * two loops, called once per norm and once per layer through ctypes (cpu_fused.py).
 *
 * Numerics, op for op as llama.py computes them (so that only the order of RMSNorm's sum differs):
 *   rmsnorm: h = float32(x); h = h * (1 / sqrt(mean(h * h) + eps)); out = w * T(h)
 *   rope:    out[d] = x[d] * cos[d] - x[d + half] * sin[d]        for d <  half
 *            out[d] = x[d] * cos[d] + x[d - half] * sin[d]        for d >= half
 *            each product and the sum rounded to T, as the separate torch ops round them; compiled
 *            with -ffp-contract=off, so no multiply-add is fused: float32 results equal torch's bit
 *            for bit, and bfloat16 ones too (each step rounded to bfloat16 as torch rounds it).
 * T is float or bfloat16 (uint16_t, the top half of a float32), arithmetic in float. Rows are split
 * over OpenMP threads when a call has enough of them to be worth it.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "bf16.h"

static inline float f32_load(float x) { return x; }
static inline float f32_store(float x) { return x; }

/* a loop over rows, split over nthreads when the call has at least 64 Ki elements (`work`) */
#define PARALLEL_ROWS _Pragma("omp parallel for num_threads(nthreads) schedule(static) if(work >= 65536)")

#define RMSNORM(NAME, T, LOAD, STORE)                                                                  \
    void NAME(const T *x, const T *w, T *out, int64_t rows, int64_t dim, double eps, int nthreads) {  \
        const int64_t work = rows * dim;                                                             \
        PARALLEL_ROWS                                                                                \
        for (int64_t r = 0; r < rows; ++r) {                                                         \
            const T *xr = x + r * dim;                                                               \
            T *o = out + r * dim;                                                                    \
            float ss = 0;                                                                            \
            _Pragma("omp simd reduction(+:ss)")                                                      \
            for (int64_t d = 0; d < dim; ++d) { float v = LOAD(xr[d]); ss += v * v; }                \
            const float inv = 1.0f / sqrtf(ss / (float)dim + (float)eps);                            \
            _Pragma("omp simd")                                                                      \
            for (int64_t d = 0; d < dim; ++d) o[d] = STORE(LOAD(w[d]) * LOAD(STORE(LOAD(xr[d]) * inv))); \
        }                                                                                            \
    }

/* x [rows, heads, dim] rotated in place by its row's cos / sin [rows, dim] */
#define ROPE(NAME, T, LOAD, STORE)                                                                     \
    static void NAME##_one(T *x, const T *cos, const T *sin, int64_t rows, int64_t heads, int64_t dim, \
                           int nthreads) {                                                            \
        const int64_t half = dim / 2;                                                                 \
        const int64_t work = rows * heads * dim;                                                      \
        PARALLEL_ROWS                                                                                 \
        for (int64_t r = 0; r < rows; ++r) {                                                          \
            const T *c = cos + r * dim, *s = sin + r * dim;                                           \
            for (int64_t h = 0; h < heads; ++h) {                                                     \
                T *v = x + (r * heads + h) * dim;                                                     \
                _Pragma("omp simd")                                                                   \
                for (int64_t d = 0; d < half; ++d) {                                                  \
                    const float a = LOAD(v[d]), b = LOAD(v[d + half]);                                \
                    const float lo = LOAD(STORE(a * LOAD(c[d]))) + LOAD(STORE(-b * LOAD(s[d])));      \
                    const float hi = LOAD(STORE(b * LOAD(c[d + half]))) + LOAD(STORE(a * LOAD(s[d + half]))); \
                    v[d] = STORE(lo);                                                                 \
                    v[d + half] = STORE(hi);                                                          \
                }                                                                                     \
            }                                                                                         \
        }                                                                                             \
    }                                                                                                 \
    void NAME(T *q, T *k, const T *cos, const T *sin, int64_t rows, int64_t q_heads, int64_t kv_heads, \
              int64_t dim, int nthreads) {                                                            \
        NAME##_one(q, cos, sin, rows, q_heads, dim, nthreads);                                        \
        NAME##_one(k, cos, sin, rows, kv_heads, dim, nthreads);                                       \
    }

RMSNORM(minicb_rmsnorm_f32, float, f32_load, f32_store)
RMSNORM(minicb_rmsnorm_bf16, uint16_t, bf16_load, bf16_store)
ROPE(minicb_rope_f32, float, f32_load, f32_store)
ROPE(minicb_rope_bf16, uint16_t, bf16_load, bf16_store)

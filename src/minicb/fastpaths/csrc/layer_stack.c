/* Every decoder layer of a step in one C call: the same kernels the layers call one by one from
 * Python, called from here instead.
 *
 * Why: on the CPU fast paths a decoder layer is about a dozen calls from Python (the fused norms,
 * the rotary embedding, the skinny products, the cache write, the decode kernel, the SiLU), each with
 * its argument checks, its ctypes conversion and a torch tensor or two for its result: about 5 ms of a
 * SmolLM2 decode step whatever its size (bench/decode_floor.py's "fwd oth"), a quarter of a
 * one-sequence step. vLLM's CPU build compiles its model's graph for the same reason. Here the graph
 * is short enough to write down: per layer
 *
 *     h   = RMSNorm(x)                       (the previous layer's add_rmsnorm did it; layer 0: rmsnorm)
 *     qkv = h @ Wqkv                         skinny product, [rows, (q_heads + 2 kv_heads) * 64]
 *     q, k rotated in place in qkv           rope, on row-strided views
 *     k, v copied to their cache slots       (slot -1: a padding row, not stored)
 *     q copied to a contiguous buffer        the kernels read it whole
 *     attn = decode(q, cache)                decode rows; prompt chunks: prompt(q, cache), tile by tile
 *     x += attn @ Wo; h = RMSNorm(x)         skinny product, then add_rmsnorm in place
 *     act = silu(g) * u of h @ Wgu           skinny product, then silu_mul
 *     x += act @ Wdown; h = RMSNorm'(x)      the next layer's input norm, or the model's final norm
 *
 * The kernels come as function pointers (each library keeps its own build flags: fused_ops.c rounds as
 * torch does, paged_decode.c and skinny_gemm.c use fused multiply-adds), so the results are those of
 * the Python path bit for bit: the same functions on the same buffers in the same order.
 * layer_stack.py decides when a step qualifies and passes the pointers.
 *
 * Threads: the whole stack is one OpenMP parallel region of `nthreads` threads, not one per kernel
 * call (a one-sequence step is about 300 calls of a few tens of microseconds each). The team is woken
 * once a step and the step's work is one queue of numbered items (team_queue.h), nine parts a layer;
 * a part's items start once every item of the part before is done, because each part reads what the
 * one before wrote:
 *
 *     products (skinny _part)    PARTS_PER_THREAD shares of the panels a thread, times the step's
 *                                runs of PRODUCT_ROWS rows (one run in a decode step)
 *     attention                  the rows, ATTN_ROWS at a time (a step with prompt chunks: each tile's
 *                                kv heads, then the decode rows); fewer at a time when the step has
 *                                fewer than ATTN_ROWS rows per thread, so that no thread sits idle
 *                                while another reads every row's keys
 *     norms, rotary, cache copies, SiLU     the rows cut into ROWS_PER_THREAD runs a thread (one row:
 *                                           one item, while the others wait for the next part)
 *
 * Whichever thread is free takes the next item. That is what a busy machine needs: a part waits for
 * items, not for threads, so a thread whose core the OS gave to another process (the server's event
 * loop, a client) holds up nobody unless it holds an item, and the running thread takes what it has
 * not. With barriers between the parts (until the eighteenth session; `-DTEAM_BARRIERS` builds that
 * rule again) each of the nine a layer waited for every thread to arrive: beside a process busy 1 ms
 * in every 3, a one-sequence bfloat16 step took 1.20-1.63x as long as with the queue, 16 and 64
 * sequences 1.03-1.23x (three runs of `python bench/decode_floor.py --stack-builds
 * "queue=,barriers=-DTEAM_BARRIERS" --beside 1,2 ...`, bench/RESULTS.md, issue 47); on an idle machine
 * the two are level.
 *
 * A product's items are cut by rows as well as by panels in a step of more than PRODUCT_ROWS rows:
 * SmolLM2's o and down products have 9 panels and its qkv 15, which four shares cannot split evenly,
 * so with every row in each share one thread waited for the other a panel in five (o, down) or in
 * eight (qkv) of every row, the 2,048 of a prompt step too. Runs of 256 rows (the skinny kernel's own
 * CHUNK: it reads its panels once per run either way) give 32 items a product. W2 and LP in bfloat16
 * on two threads, alternating with the old rule (`python bench/decode_floor.py --stack-builds
 * "rows=,panels=-DPRODUCT_ROWS=100000" --workload W2`, bench/RESULTS.md, issue 47): 1.02x the output
 * tokens per second in each.
 *
 * One row's attention stays on one thread. Split over its kv heads (tried: each thread reading its
 * heads' 128-byte runs of every key), a 2,000-key step took longer on two threads than with the row
 * on one: the memory system fetches the neighbouring runs too, so both threads read all the keys.
 *
 * Each output is computed by the same code whichever thread runs it (the products' sums run over
 * the inputs in the same order, a row's norm is one row's loop), so the bits do not depend on the
 * thread count (tests/model/test_layer_stack.py compares 1, 2 and 3 threads, and 2 of which one never
 * comes: `-DTEAM_ABSENT_THREADS`).
 */
#define _DEFAULT_SOURCE     /* syscall() (team_queue.h's futex), which -std=c11 alone does not declare */
#include <stdint.h>
#include <string.h>

#include "omp_id.h"
#include "team_queue.h"

typedef void (*skinny_fn)(const void *x, int64_t xstride, const void *panels, void *y, int64_t ystride,
                          int64_t rows, int64_t in, int64_t out, int part, int parts);
typedef void (*norm_fn)(const void *x, const void *w, void *out, int64_t rows, int64_t dim, double eps,
                        int nthreads);
typedef void (*add_norm_fn)(void *x, const void *delta, const void *w, void *out, int64_t rows, int64_t dim,
                            double eps, int nthreads);
typedef void (*rope_fn)(void *q, void *k, const void *cos, const void *sin, int64_t rows, int64_t q_heads,
                        int64_t kv_heads, int64_t dim, int64_t q_stride, int64_t k_stride, int nthreads);
typedef void (*silu_fn)(const void *gu, void *out, int64_t rows, int64_t inter, int64_t stride, int nthreads);
typedef int (*decode_fn)(const void *q, const void *k_cache, const void *v_cache, const int32_t *block_tables,
                         const int32_t *context_lens, void *out, int64_t rows, int64_t q_heads, int64_t kv_heads,
                         int64_t head_dim, int64_t max_blocks, int64_t block_size, int64_t max_context,
                         double scale, int nthreads);
typedef void (*quantize_fn)(const void *x, int64_t xstride, int64_t rows, int64_t in, void *xq, int64_t qstride);
typedef int (*prompt_fn)(const void *q, const void *k_cache, const void *v_cache, const int32_t *block_tables,
                         const int32_t *tiles, int64_t n_tiles, void *out, int64_t q_heads, int64_t kv_heads,
                         int64_t head_dim, int64_t max_blocks, int64_t block_size, double scale, int nthreads,
                         int64_t item);

/* the kernels, for the model's dtype (skinny: its `_part` entry, one thread's share of the panels).
 * quantize, where not NULL, rounds a product's input rows first (int8_gemm.c): each part that makes
 * a product's input rounds its rows into b->xq as well, and the product reads those */
typedef struct {
    skinny_fn skinny;
    norm_fn norm;
    add_norm_fn add_norm;
    rope_fn rope;
    silu_fn silu;
    decode_fn decode;
    prompt_fn prompt;
    quantize_fn quantize;
} kernels_t;

/* one layer's weights (panels for the products) and its cache */
typedef struct {
    const void *input_norm, *qkv, *o, *post_norm, *gate_up, *down;
    void *k_cache, *v_cache;
} layer_t;

typedef struct {
    int64_t rows, hidden, q_heads, kv_heads, head_dim, inter, elem;   /* elem: bytes per value */
    int64_t max_blocks, block_size, max_context;
    int64_t qstride;        /* b->xq's row stride in 2-byte units (with quantize) */
    double eps, scale;
    int nthreads;
} dims_t;

/* the step's buffers: x [rows, hidden] (the residual stream, updated in place), h [rows, hidden] (the
 * normed input of the next product; on return the final norm of x), qkv, q [rows, q_heads * 64],
 * attn [rows, q_heads * 64], a [rows, hidden], gu [rows, 2 * inter], act [rows, inter]; xq [rows,
 * qstride] the next product's input rounded (with quantize; else NULL) */
typedef struct {
    char *x, *h, *qkv, *q, *attn, *a, *gu, *act, *xq;
} buffers_t;

/* a step with prompt chunks (NULL: a step of decode rows): the chunks' tiles for the prompt kernel (its
 * block tables one per sequence), and the step's decode rows, whose tables and contexts are then the
 * block_tables and context_lens arguments, one per decode row */
typedef struct {
    const int32_t *tiles, *seq_tables;
    int64_t n_tiles, seq_max_blocks;
    const int64_t *decode_rows;
    int64_t n_decodes;
} prompts_t;

#define AT(p, i) ((p) + (i) * e)
#define ATTN_ROWS 4     /* rows per call of the decode kernel: the threads take them as they finish */

/* Decode rows per work item: ATTN_ROWS, or as few as shares `rows` among the `nt` threads. A decode
 * row's attention reads its whole context from memory (1,000 keys: 0.75 MB in bfloat16 per layer), so
 * 2 or 3 long rows in one item left the second thread idle while the first read them all: with 2, 3
 * and 5 rows of ~1,000 keys (bfloat16, 2 threads) the stack took 1.31x, 1.32x and 1.41x as long a step
 * as with the rows shared (`python bench/decode_floor.py --stack-builds "now=,fixed=-DFIXED_ATTN_ROWS"
 * ...`, its docstring; bench/RESULTS.md). */
static inline int64_t rows_per_item(int64_t rows, int nt) {
#ifdef FIXED_ATTN_ROWS          /* the rule before: always ATTN_ROWS (the bench above builds both) */
    (void)rows, (void)nt;
    return ATTN_ROWS;
#else
    const int64_t even = (rows + nt - 1) / nt;
    return even < 1 ? 1 : even < ATTN_ROWS ? even : ATTN_ROWS;
#endif
}
#ifndef PARTS_PER_THREAD
#define PARTS_PER_THREAD 2  /* a product's items: this many shares of its panels per thread */
#endif
#define ROWS_PER_THREAD 2   /* a norm's, rotary's or SiLU's items: the rows cut into this many runs a thread */
#ifndef PRODUCT_ROWS
#define PRODUCT_ROWS 256    /* a product's rows per item in a step of more rows (skinny_gemm.c's CHUNK) */
#endif

#ifdef TEAM_ABSENT_THREADS   /* tests: every thread but the first stays away, which a barrier would wait for */
#define TAKES_PART(t) ((t) == 0)
#else
#define TAKES_PART(t) 1
#endif

/* rows [*r0, *r1) of run `i` of `runs` */
static inline void run_of(int64_t rows, int64_t i, int64_t runs, int64_t *r0, int64_t *r1) {
    *r0 = rows * i / runs;
    *r1 = rows * (i + 1) / runs;
}

/* Returns 0, or 1 when the decode kernel could not allocate its scratch. */
int minicb_layer_stack(const kernels_t *f, const layer_t *layers, int64_t num_layers, const void *final_norm,
                       const dims_t *d, const buffers_t *b, const void *cos, const void *sin,
                       const int64_t *slots, const int32_t *block_tables, const int32_t *context_lens,
                       const prompts_t *p) {
    const int64_t hidden = d->hidden, e = d->elem, hd = d->head_dim, all = d->rows;
    const int64_t qdim = d->q_heads * hd, kvdim = d->kv_heads * hd;
    const int64_t qkv_out = qdim + 2 * kvdim, gu_out = 2 * d->inter;
    atomic_int failed = 0;
    team_queue_t q = {0};
    _Pragma("omp parallel num_threads(d->nthreads)") if (TAKES_PART(omp_thread())) {
        const int nt = omp_threads();
        const int64_t parts = nt > 1 ? nt * PARTS_PER_THREAD : 1;        /* a product's shares of panels */
        const int64_t products = parts * ((all + PRODUCT_ROWS - 1) / PRODUCT_ROWS);   /* ... x runs of rows */
        const int64_t runs = all < nt * ROWS_PER_THREAD ? all : nt * ROWS_PER_THREAD;   /* a row-wise part's */
        const int64_t per = rows_per_item(p ? p->n_decodes : all, nt);       /* decode rows per work item */
        const int64_t tiles = p ? p->n_tiles * d->kv_heads : 0;                /* (tile, kv head) items */
        const int64_t attn_items = tiles + ((p ? p->n_decodes : all) + per - 1) / per;
        int base = 0, mine = team_take(&q);
        int64_t r0, r1;
        /* item `item` of a product: share item % parts of the panels, rows [c0, c0 + n): run item / parts;
         * with quantize, of the rows rounded into xq */
#define PRODUCT(X, XS, W, Y, YS, IN, OUT)                                                                     \
    if (OK) {                                                                                                 \
        const int64_t c0 = item / parts * PRODUCT_ROWS, n = all - c0 < PRODUCT_ROWS ? all - c0 : PRODUCT_ROWS; \
        const int64_t xs = f->quantize ? d->qstride : (XS);                                                   \
        f->skinny(AT(f->quantize ? b->xq : (X), c0 * xs), xs, W, AT(Y, c0 * (YS)), YS, n, IN, OUT,              \
                  (int)(item % parts), (int)parts);                                                           \
    }
        /* rows [r0, r1) of X [rows, IN] rounded into xq, for the next product (with quantize) */
#define ROUND(X, IN)                                                                                          \
    if (f->quantize) f->quantize(AT(X, r0 * (IN)), IN, r1 - r0, IN, AT(b->xq, r0 * d->qstride), d->qstride);
        TEAM_PHASE(&q, base, mine, runs, {
            run_of(all, item, runs, &r0, &r1);
            f->norm(AT(b->x, r0 * hidden), layers[0].input_norm, AT(b->h, r0 * hidden), r1 - r0, hidden, d->eps, 1);
            ROUND(b->h, hidden)
        });
        for (int64_t l = 0; l < num_layers; ++l) {
            const layer_t *L = layers + l;
            /* after a failed attention every item is skipped: each checks the flag once its phase may start */
#define OK (!atomic_load_explicit(&failed, memory_order_relaxed))
            TEAM_PHASE(&q, base, mine, products, PRODUCT(b->h, hidden, L->qkv, b->qkv, qkv_out, hidden, qkv_out));
            TEAM_PHASE(&q, base, mine, runs, if (OK) {
                run_of(all, item, runs, &r0, &r1);
                char *qkv = AT(b->qkv, r0 * qkv_out);
                f->rope(qkv, AT(qkv, qdim), AT((const char *)cos, r0 * hd), AT((const char *)sin, r0 * hd), r1 - r0,
                        d->q_heads, d->kv_heads, hd, qkv_out, qkv_out, 1);
                for (int64_t r = r0; r < r1; ++r) {
                    const char *row = AT(b->qkv, r * qkv_out);
                    memcpy(AT(b->q, r * qdim), row, qdim * e);
                    if (slots[r] >= 0) {
                        memcpy(AT((char *)L->k_cache, slots[r] * kvdim), AT(row, qdim), kvdim * e);
                        memcpy(AT((char *)L->v_cache, slots[r] * kvdim), AT(row, qdim + kvdim), kvdim * e);
                    }
                }
            });
            /* a prompt's rows attend to each other's keys: after every row's copy. Each (tile, kv head), then
             * the decode rows, `per` at a time (a step without prompts: rows in order, `per` a call) */
            TEAM_PHASE(&q, base, mine, attn_items, if (OK) {
                int bad = 0;
                if (item < tiles) {
                    bad = f->prompt(b->q, L->k_cache, L->v_cache, p->seq_tables, p->tiles, p->n_tiles, b->attn,
                                    d->q_heads, d->kv_heads, hd, p->seq_max_blocks, d->block_size, d->scale, 1, item);
                } else if (p) {   /* `per` decode rows, in runs of consecutive rows of q: one call each */
                    const int64_t i0 = (item - tiles) * per;
                    const int64_t i1 = i0 + per < p->n_decodes ? i0 + per : p->n_decodes;
                    for (int64_t i = i0, j; i < i1; i = j) {
                        for (j = i + 1; j < i1 && p->decode_rows[j] == p->decode_rows[j - 1] + 1; ++j)
                            ;
                        const int64_t r = p->decode_rows[i];
                        bad |= f->decode(AT(b->q, r * qdim), L->k_cache, L->v_cache, block_tables + i * d->max_blocks,
                                         context_lens + i, AT(b->attn, r * qdim), j - i, d->q_heads, d->kv_heads, hd,
                                         d->max_blocks, d->block_size, d->max_context, d->scale, 1);
                    }
                } else {
                    const int64_t c = item * per, m = all - c < per ? all - c : per;
                    bad = f->decode(AT(b->q, c * qdim), L->k_cache, L->v_cache, block_tables + c * d->max_blocks,
                                    context_lens + c, AT(b->attn, c * qdim), m, d->q_heads, d->kv_heads, hd,
                                    d->max_blocks, d->block_size, d->max_context, d->scale, 1);
                }
                if (bad) atomic_store_explicit(&failed, 1, memory_order_relaxed);
            });
            if (f->quantize)       /* the attention's rows are whole only now (a prompt's: every kv head) */
                TEAM_PHASE(&q, base, mine, runs, if (OK) {
                    run_of(all, item, runs, &r0, &r1);
                    ROUND(b->attn, qdim)
                });
            TEAM_PHASE(&q, base, mine, products, PRODUCT(b->attn, qdim, L->o, b->a, hidden, qdim, hidden));
            TEAM_PHASE(&q, base, mine, runs, if (OK) {
                run_of(all, item, runs, &r0, &r1);
                f->add_norm(AT(b->x, r0 * hidden), AT(b->a, r0 * hidden), L->post_norm, AT(b->h, r0 * hidden), r1 - r0,
                            hidden, d->eps, 1);
                ROUND(b->h, hidden)
            });
            TEAM_PHASE(&q, base, mine, products, PRODUCT(b->h, hidden, L->gate_up, b->gu, gu_out, hidden, gu_out));
            TEAM_PHASE(&q, base, mine, runs, if (OK) {
                run_of(all, item, runs, &r0, &r1);
                f->silu(AT(b->gu, r0 * gu_out), AT(b->act, r0 * d->inter), r1 - r0, d->inter, gu_out, 1);
                ROUND(b->act, d->inter)
            });
            TEAM_PHASE(&q, base, mine, products, PRODUCT(b->act, d->inter, L->down, b->a, hidden, d->inter, hidden));
            TEAM_PHASE(&q, base, mine, runs, if (OK) {
                run_of(all, item, runs, &r0, &r1);
                f->add_norm(AT(b->x, r0 * hidden), AT(b->a, r0 * hidden),
                            l + 1 < num_layers ? layers[l + 1].input_norm : final_norm, AT(b->h, r0 * hidden), r1 - r0,
                            hidden, d->eps, 1);
                if (l + 1 < num_layers) ROUND(b->h, hidden)
            });
#undef OK
#undef PRODUCT
#undef ROUND
        }
    }
    return atomic_load(&failed);
}

/*
 * fi_cpu.c - the CPU backend: fills fi_backend_ops with host memory and
 * the kernels of the best SIMD flavour, and spreads work over a persistent
 * fi_pool.
 *
 * Flavours (fi_kernels_impl.h): portable C, AVX2 (fi_cpu_avx2.c),
 * AVX-VNNI (fi_cpu_avxvnni.c) and AVX512-VNNI (fi_cpu_avx512.c), chosen
 * at run time from CPUID; each is a table of kernels for one block range.
 *
 * Work split: matmul by output rows in guided chunks of 16-row multiples
 * claimed from an atomic counter (so a thread slowed by a noisy neighbour
 * takes fewer rows; chunk edges on multiples of 16 keep every row's
 * arithmetic, and so the result, the same for any thread count);
 * attention by (token, position segment); the element-wise ops
 * by tokens or element ranges, and only when big enough to pay for a
 * dispatch. Activations for quantised weights are quantised once per
 * call, for every product of that input (matmul_n), inside the same job,
 * into a scratch buffer owned by the backend (grown on demand; when
 * growing fails the tokens are processed in groups that fit): to 16-bit
 * quants with one scale per token, or per block below 12 bits for Q4
 * weights where the AMX tile unit serves them (fi_cpu_q16_impl.h), or to
 * 8 bits (fi_cpu_backend_set_act_bits).
 *
 * Not thread-safe: one thread drives a backend, as the engine does.
 */
#include "fi_kernels_impl.h"
#include "fi_cpu_q16_impl.h"

#include <assert.h>
#include <math.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <sched.h>
#include <sys/mman.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#if defined(FI_HAVE_X86) && FI_HAVE_X86
#include <cpuid.h>
#endif

#define S_ALIGN 64
#define S_SCRATCH_MIN ((size_t)1 << 20) /* bytes of scratch made at start */
#define S_PAR_ELEMS 32768               /* element-wise ops: go parallel above this */
#define S_PAR_SWIGLU 8192               /* SwiGLU (an exp per element): above this */
#define S_PAR_ROWS 32768                /* RMSNorm and RoPE (elements): above this; below,
                                           a dispatch costs more than the vector work
                                           (RMSNorm also from S_OWN_PREP tokens, for
                                           the split by tokens; see s_rmsnorm) */
#define S_ATT_SEG 256                   /* positions per segment (batch-invariant) */
#define S_ATT_HEADS 8                   /* query heads sharing a pass over K/V */
#define S_ATT_SPLIT 2                   /* under this many items a thread: split by KV heads */

/* Memory for packed weights, handed out in order from chunks of huge
 * pages: a decode step streams every weight once, and on 4 KiB pages the
 * page walks of ~85 MB a step show. Freed with the backend. */
#define S_CHUNK_BYTES ((size_t)32 << 20)
#define S_HUGE ((size_t)2 << 20)
typedef struct s_chunk {
    struct s_chunk *next;   /* older chunk */
    uint8_t *base;          /* S_HUGE aligned */
    size_t size, used;      /* bytes, bytes handed out */
} s_chunk;

/* One thread's range of items (see "per-thread ranges"). */
typedef struct s_range {
    _Alignas(S_ALIGN) _Atomic uint64_t v; /* first << 32 | end of what is left */
} s_range;

typedef struct s_cpu {
    fi_pool *pool;          /* workers, caller is worker 0 */
    int n_threads;          /* pool size */
    fi_cpu_kernels k;       /* the chosen kernels */
    fi_q16_kernels q16;     /* the chosen 16-bit-activation kernels */
    int act_bits;           /* activations of quantised matmuls: 12, 16 or 8 */
    int kv_bits;            /* KV cache rows: 16 (FI_KV_ROW_F16) or 8 (FI_KV_ROW_Q8) */
    uint8_t *scratch;       /* quantised activations, S_ALIGN aligned */
    size_t scratch_bytes;   /* its size */
    uint8_t *amax;          /* matmul_argmax's keys, one _Atomic uint64_t per token */
    size_t amax_bytes;      /* its size */
    s_chunk *packed;        /* the packed weights' memory (weight_upload) */
    float *rope_tab;        /* [rope_rows][rope_half] (cos, sin) pairs */
    int rope_rows;          /* positions covered, 0: empty */
    int rope_half;          /* head_dim / 2 it was made for */
    float rope_theta;       /* theta it was made for */
    s_range *rows_rg;       /* per-thread ranges (n_threads each): matmul rows, */
    s_range *toks_rg;       /* token rows of the input a matmul prepares, */
    s_range *att_rg;        /* attention items */
} s_cpu;

static const fi_backend_ops s_cpu_ops;

/* --- memory ------------------------------------------------------------ */

static size_t s_round_up(size_t n, size_t a) {
    return (n + a - 1) / a * a;
}

/* Zeroed memory; from 2 MiB up (the KV cache) on transparent huge pages
 * where the kernel grants them: a step reads every sequence's cache rows,
 * and on 4 KiB pages the page walks show. */
static void *s_alloc(void *ctx, size_t bytes) {
    size_t a = bytes >= S_HUGE ? S_HUGE : S_ALIGN;
    size_t n = s_round_up(bytes ? bytes : 1, a);
    void *p = aligned_alloc(a, n);
    if (!p)
        return NULL;
#if defined(MADV_HUGEPAGE)
    if (a == S_HUGE)
        (void)madvise(p, n, MADV_HUGEPAGE); /* a hint: fine if refused */
#endif
    memset(p, 0, n);
    return p;
}

static void s_free(void *ctx, void *p) {
    free(p);
}

static int s_copy(void *ctx, void *dst, const void *src, size_t bytes) {
    if (bytes)
        memmove(dst, src, bytes);
    return 0;
}

static int s_sync(void *ctx) {
    return 0;
}

/* Makes the buffer *buf (of *size bytes, S_ALIGN aligned) at least
 * `bytes` long; 0 on success, -1 (old buffer kept) when memory runs out.
 * The contents are not kept. */
static int s_reserve_at(uint8_t **buf, size_t *size, size_t bytes) {
    if (bytes <= *size)
        return 0;
    size_t n = s_round_up(bytes + bytes / 4, S_ALIGN);
    uint8_t *p = aligned_alloc(S_ALIGN, n);
    if (!p)
        return -1;
    free(*buf);
    *buf = p;
    *size = n;
    return 0;
}

/* The scratch, at least `bytes` long. */
static int s_reserve(s_cpu *c, size_t bytes) {
    return s_reserve_at(&c->scratch, &c->scratch_bytes, bytes);
}

/* --- per-thread ranges -------------------------------------------------
 *
 * Items [0, n) (token rows, weight rows, attention items) split into one
 * contiguous range per thread, at multiples of `align`. Thread ith takes
 * pieces from the front of its own range (a quarter of what is left, at
 * least `align`); once it is spent, it takes the back half of the largest
 * range left. The pool runs index 0 on the caller and, with nothing
 * amiss, each other index on the same worker call after call, so a thread
 * works on the same items in every call: the token rows it normalised are
 * the ones it quantises and attends for, and its weight rows are one run
 * that the prefetchers follow. A slow or absent thread's items are still
 * done, by whoever comes first. */

/* Where range i of nth begins: i n / nth rounded to a multiple of align
 * (n for i = nth). */
static int s_range_at(int n, int i, int nth, int align) {
    if (i >= nth)
        return n;
    long p = ((long)n * i / nth + align / 2) / align * align;
    return p < n ? (int)p : n;
}

static void s_ranges_init(s_range *g, int nth, int n, int align) {
    assert(nth >= 1 && n >= 0 && align >= 1);
    for (int i = 0; i < nth; i++) {
        uint32_t a = (uint32_t)s_range_at(n, i, nth, align), b = (uint32_t)s_range_at(n, i + 1, nth, align);
        atomic_store_explicit(&g[i].v, (uint64_t)a << 32 | b, memory_order_relaxed);
    }
}

/* Thread ith's next piece [*a, *b); 0 when no items are left. */
static int s_ranges_next(s_range *g, int ith, int nth, int align, int *a, int *b) {
    uint64_t v = atomic_load_explicit(&g[ith].v, memory_order_relaxed);
    for (;;) {
        int lo = (int)(v >> 32), hi = (int)(uint32_t)v;
        if (lo >= hi)
            break;
        int len = ((hi - lo) / 4 + align - 1) / align * align;
        int end = lo + (len > align ? len : align);
        end = end < hi ? end : hi;
        if (atomic_compare_exchange_weak_explicit(&g[ith].v, &v, (uint64_t)end << 32 | (uint32_t)hi,
                                                  memory_order_relaxed, memory_order_relaxed)) {
            *a = lo;
            *b = end;
            return 1;
        }
    }
    for (;;) {
        int best = -1, most = 0;
        uint64_t bv = 0;
        for (int i = 0; i < nth; i++) {
            uint64_t w = atomic_load_explicit(&g[i].v, memory_order_relaxed);
            int left = (int)(uint32_t)w - (int)(w >> 32);
            if (left > most) {
                most = left;
                best = i;
                bv = w;
            }
        }
        if (best < 0)
            return 0;
        int lo = (int)(bv >> 32), hi = (int)(uint32_t)bv;
        int start = (hi - (most + 1) / 2) / align * align;
        start = start > lo ? start : lo;
        if (atomic_compare_exchange_weak_explicit(&g[best].v, &bv, (uint64_t)lo << 32 | (uint32_t)start,
                                                  memory_order_relaxed, memory_order_relaxed)) {
            *a = start;
            *b = hi;
            return 1;
        }
    }
}

/* --- matmul ------------------------------------------------------------ */

#define S_MM_MAX FI_MATMUL_N_MAX /* products of one input per call (matmul_n) */
#define S_WAIT_SPINS 4096   /* pauses before a waiting thread yields its core */
#define S_OWN_PREP 8        /* below this many tokens each thread prepares the whole input */

/* One call: up to S_MM_MAX products of the same input, whose rows the
 * threads claim as one range through per-thread ranges (see above).
 * Product i owns rows [row0[i], row0[i] + nrows[i]), and row0[i+1] is that
 * end rounded up to 16, so that every claim (multiples of 16) begins at a
 * multiple of 16 of its product, as in a call of its own. Quantised
 * weights need the input quantised first (and split, for the AMX kernels):
 * with x set, the threads first quantise token rows (their own range of
 * tokens, then any left) and begin on the products once qdone reaches n,
 * so that the input is prepared once per call, in parallel, and no thread
 * waits for a second dispatch. */
typedef struct s_mm_job {
    const s_cpu *c;                 /* kernels */
    int count;                      /* products */
    fi_mm_task task[S_MM_MAX];      /* each product's task */
    fi_mm_fn fn[S_MM_MAX];          /* and its kernel */
    int row0[S_MM_MAX + 1];         /* first row of each product in the range */
    int nrows[S_MM_MAX];            /* and its rows */
    float *acc;                     /* NULL, or (one product) rows to add y to */
    _Atomic uint64_t *amax;         /* NULL, or (one product) each token's argmax key */
    s_range *rows;                  /* their ranges of rows */
    /* the input to prepare (x NULL: nothing to prepare) */
    const float *x;                 /* n rows of cols floats */
    int n, cols, bits;              /* shape, activation bits (12, 16 or 8) */
    int qmax;                       /* 12 and 16: the quants' bound (fi_q16_qmax) */
    size_t xrow;                    /* bytes per quantised row */
    uint8_t *xq;                    /* the quantised rows */
    uint8_t *xs;                    /* their split tiles, or NULL */
    size_t xs_off;                  /* xs - xq */
    size_t own;                     /* > 0: each thread prepares the whole input
                                       itself, at xq + slot * own (see s_matmul_n) */
    s_range *toks;                  /* else the threads' ranges of token rows */
    int acc_by_tokens;              /* 1: acc summed after all rows, by token ranges */
    /* the counters threads write, each on its own line */
    _Alignas(S_ALIGN) atomic_int qnext;  /* slots taken (own) */
    _Alignas(S_ALIGN) atomic_int qdone;  /* input rows prepared */
    _Alignas(S_ALIGN) atomic_int rdone;  /* product rows made (acc_by_tokens) */
} s_mm_job;

static void s_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

/* Quantises (and, with xs, splits) input row k into xq's rows. */
static void s_prep_row(const s_mm_job *j, int k, uint8_t *xq, uint8_t *xs) {
    const s_cpu *c = j->c;
    const float *x = j->x + (size_t)k * j->cols;
    uint8_t *q = xq + (size_t)k * j->xrow;
    int nb = j->cols / FI_QK;
    if (j->bits == 8) {
        c->k.quantize_q8x(x, (fi_block_q8x *)(void *)q, nb);
        return;
    }
    if (j->task[0].xtok) /* one scale per token: every task's the same */
        c->q16.quantize_tok(x, (fi_block_q16x *)(void *)q, nb);
    else
        c->q16.quantize(x, (fi_block_q16x *)(void *)q, nb, j->qmax);
    if (xs)
        c->q16.split((const fi_block_q16x *)(const void *)q, nb,
                     xs + (size_t)(k / 16) * FI_Q16_TILE_BYTES(nb), k % 16, j->qmax);
}

/* acc[t][r] += y[t][r] for t < n, r0 <= r < r1 (rows `stride` apart):
 * matmul_add's sum, by the thread that just wrote those rows of y. */
static void s_acc_rows(float *acc, const float *y, int n, int stride, int r0, int r1) {
    for (int t = 0; t < n; t++) {
        float *a = acc + (size_t)t * stride;
        const float *b = y + (size_t)t * stride;
        for (int r = r0; r < r1; r++)
            a[r] += b[r];
    }
}

/* matmul_argmax's result as one number per token, which each thread
 * raises with the best of the rows it made: the value's bits in an order
 * that compares as the floats do (-0 as 0), then the index complemented,
 * so that the first index wins a tie. 0 stands for no value yet (or only
 * NaNs, which never win). */
static uint64_t s_amax_key(float v, int32_t i) {
    uint32_t u;
    if (v == 0.0f)
        v = 0.0f; /* -0 */
    memcpy(&u, &v, sizeof u);
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return ((uint64_t)u << 32) | (uint32_t)~(uint32_t)i;
}

/* Raises amax[t] with the best of y[t][r0..r1) for t < n (rows `stride`
 * apart), as fi_argmax_f32 picks it: the rows this thread just made. */
static void s_amax_rows(const s_cpu *c, _Atomic uint64_t *amax, const float *y, int n, int stride,
                        int r0, int r1) {
    for (int t = 0; t < n; t++) {
        const float *row = y + (size_t)t * stride;
        int32_t i = r0 + c->k.argmax(row + r0, r1 - r0);
        if (isnan(row[i]))
            continue; /* NaNs only */
        uint64_t k = s_amax_key(row[i], i), cur = atomic_load_explicit(&amax[t], memory_order_relaxed);
        while (k > cur && !atomic_compare_exchange_weak_explicit(&amax[t], &cur, k, memory_order_relaxed,
                                                                 memory_order_relaxed))
            ; /* cur reloaded */
    }
}

/* Rows [r0, r1) of the job's range, product by product, each with
 * matmul_add's sum or matmul_argmax's keys. */
static void s_mm_rows(const s_mm_job *j, const fi_mm_task *task, int r0, int r1) {
    for (int i = 0; i < j->count; i++) {
        int e = j->row0[i] + j->nrows[i];
        int a = r0 > j->row0[i] ? r0 : j->row0[i], b = r1 < e ? r1 : e;
        if (a >= b)
            continue;
        j->fn[i](&task[i], a - j->row0[i], b - j->row0[i]);
        if (j->acc && !j->acc_by_tokens)
            s_acc_rows(j->acc, task[0].y, task[0].n, task[0].y_stride, a, b);
        if (j->amax)
            s_amax_rows(j->c, j->amax, task[0].y, task[0].n, task[0].y_stride, a, b);
    }
}

/* Waits until *c reaches n (spinning, then yielding the core). */
static void s_wait_for(atomic_int *c, int n) {
    for (int spins = 0; atomic_load_explicit(c, memory_order_acquire) < n; spins++) {
        if (spins < S_WAIT_SPINS) {
            s_relax();
        } else {
            sched_yield();
            spins = 0;
        }
    }
}

static void s_mm_worker(void *arg, int ith, int nth) {
    s_mm_job *j = arg;
    const fi_mm_task *task = j->task;
    fi_mm_task mine[S_MM_MAX];
    int a, b;
    if (j->x && j->own) {
        /* a few tokens: the whole input prepared by this thread, for it
         * alone (cheaper than sharing the rows between cores and waiting
         * for the last one) */
        int slot = atomic_fetch_add_explicit(&j->qnext, 1, memory_order_relaxed);
        uint8_t *xq = j->xq + (size_t)slot * j->own, *xs = j->xs ? xq + j->xs_off : NULL;
        for (int k = 0; k < j->n; k++)
            s_prep_row(j, k, xq, xs);
        for (int i = 0; i < j->count; i++) {
            mine[i] = j->task[i];
            mine[i].x = xq;
            mine[i].xs = xs;
        }
        task = mine;
    } else if (j->x) {
        /* one locked add per thread: the other may be polling the line */
        int done = 0;
        while (s_ranges_next(j->toks, ith, nth, 1, &a, &b)) {
            for (int k = a; k < b; k++)
                s_prep_row(j, k, j->xq, j->xs);
            done += b - a;
        }
        atomic_fetch_add_explicit(&j->qdone, done, memory_order_release);
        /* every row is claimed; the last few may still be in other hands */
        s_wait_for(&j->qdone, j->n);
    }
    int made = 0;
    while (s_ranges_next(j->rows, ith, nth, 16, &a, &b)) {
        s_mm_rows(j, task, a, b);
        made += b - a;
    }
    if (j->acc_by_tokens) {
        /* the sum by the thread whose tokens these are (it normalises them
         * next), once every row of y is made */
        atomic_fetch_add_explicit(&j->rdone, made, memory_order_release);
        s_wait_for(&j->rdone, j->row0[1]);
        int t0 = s_range_at(j->n, ith, nth, 1), t1 = s_range_at(j->n, ith + 1, nth, 1);
        s_acc_rows(j->acc + (size_t)t0 * task[0].y_stride, task[0].y + (size_t)t0 * task[0].y_stride, t1 - t0,
                   task[0].y_stride, 0, j->nrows[0]);
    }
}

static void s_mm_run(s_cpu *c, s_mm_job *j) {
    atomic_init(&j->qnext, 0);
    atomic_init(&j->qdone, 0);
    atomic_init(&j->rdone, 0);
    int nth = c->n_threads == 1 || j->row0[j->count] < 32 ? 1 : c->n_threads;
    /* matmul_add with tokens enough to split: each thread sums its own
     * tokens' rows (x stays with the thread that normalises it) instead of
     * the rows it made, all tokens' of them, half of which the other core
     * normalised and holds: 16 tokens of 576 took 6-7 us a call less */
    j->acc_by_tokens = j->acc && nth > 1 && j->n >= S_OWN_PREP;
    j->rows = c->rows_rg;
    j->toks = c->toks_rg;
    s_ranges_init(j->rows, nth, j->row0[j->count], 16);
    if (j->x && !j->own)
        s_ranges_init(j->toks, nth, j->n, 1);
    if (nth == 1)
        s_mm_worker(j, 0, 1);
    else
        fi_pool_run(c->pool, s_mm_worker, j);
}

/* The kernel for weights of type t with activations of `bits` bits (12
 * and 16 share the 16-bit kernels; bits is ignored for float weights,
 * which take float activations). */
static fi_mm_fn s_mm_fn(const s_cpu *c, fi_dtype t, int bits) {
    switch (t) {
    case FI_DTYPE_F32: return c->k.mm_f32;
    case FI_DTYPE_F16: return c->k.mm_f16;
    case FI_DTYPE_BF16: return c->k.mm_bf16;
    case FI_DTYPE_Q4_0: return bits != 8 ? c->q16.mm_q4_0 : c->k.mm_q4_0;
    case FI_DTYPE_Q4_1: return bits != 8 ? c->q16.mm_q4_1 : c->k.mm_q4_1;
    case FI_DTYPE_Q8_0: return bits != 8 ? c->q16.mm_q8_0 : c->k.mm_q8_0;
    }
    return NULL;
}

/* The products of matmul_n; with acc (count 1) matmul_add's sum, with
 * amax (count 1) matmul_argmax's keys (s_amax_key, zeroed by the caller). */
static void s_products(s_cpu *c, int count, float *const *y, const fi_weight *const *w,
                       const float *x, int n, float *acc, _Atomic uint64_t *amax) {
    assert(count >= 1 && count <= S_MM_MAX);
    const int cols = w[0]->cols, bits = c->act_bits;
    const int quant = fi_dtype_block_elems(w[0]->type) > 1, qmax = fi_q16_qmax(w[0]->type, bits);
    const int xtok = bits == 16;
    for (int i = 1; i < count; i++)
        if ((fi_dtype_block_elems(w[i]->type) > 1) != quant || w[i]->cols != cols ||
            fi_q16_qmax(w[i]->type, bits) != qmax) {
            /* float and quantised weights, other widths, or weights that
             * take their inputs in other ranges: one call each */
            for (int m = 0; m < count; m++)
                s_products(c, 1, &y[m], &w[m], x, n, NULL, NULL);
            return;
        }
    assert((!acc && !amax) || count == 1);
    s_mm_job j = {.c = c, .count = count, .acc = acc, .amax = amax};
    for (int i = 0; i < count; i++) {
        j.fn[i] = s_mm_fn(c, w[i]->type, bits);
        assert(j.fn[i]);
        j.task[i] = (fi_mm_task){
            .w = w[i]->data, .wp = w[i]->dev, .w_stride = w[i]->row_bytes, .cols = cols,
            .x = (const uint8_t *)x, .x_stride = (size_t)cols * sizeof(float),
            .n = n, .y = y[i], .y_stride = w[i]->rows, .qmax = qmax, .xtok = xtok,
        };
        j.nrows[i] = w[i]->rows;
        j.row0[i + 1] = j.row0[i] + (w[i]->rows + 15) / 16 * 16;
    }
    if (!quant) {
        s_mm_run(c, &j);
        return;
    }
    /* Quantised weights: the activations quantised once for every product
     * (in groups of tokens that fit the scratch), then integer dot
     * products; for the AMX kernels also split once, in tiles of 16. */
    const int nb = cols / FI_QK;
    const size_t xrow = (size_t)nb * (bits != 8 ? sizeof(fi_block_q16x) : sizeof(fi_block_q8x));
    int split = bits != 8 && c->q16.split && n >= FI_Q16_AMX_MIN;
    for (int i = 0; i < count; i++)
        split = split && fi_q16_tiles(w[i]->type, qmax, xtok);
    size_t tile = FI_Q16_TILE_BYTES(nb);
    int group = n;
    /* the whole input, quantised (and split) */
    const size_t one =
        s_round_up((size_t)n * xrow, S_ALIGN) + (split ? (size_t)((n + 15) / 16) * tile : 0);
    if (s_reserve(c, one) != 0) {
        /* short of memory: groups of 16 tokens at a time if they fit */
        size_t g16 = s_round_up(16 * xrow, S_ALIGN) + tile;
        if (split && c->scratch_bytes >= g16) {
            group = (int)(c->scratch_bytes / g16) * 16;
        } else {
            split = 0;
            group = (int)(c->scratch_bytes / xrow);
        }
    }
    if (group < 1) {
        /* out of memory for even one row: make the failure visible */
        for (int i = 0; i < count; i++)
            for (size_t e = 0; e < (size_t)n * (size_t)w[i]->rows; e++)
                y[i][e] = NAN;
        if (acc)
            s_acc_rows(acc, y[0], n, w[0]->rows, 0, w[0]->rows);
        if (amax)
            s_amax_rows(c, amax, y[0], n, w[0]->rows, 0, w[0]->rows);
        return;
    }
    /* A few tokens: every thread prepares the whole input for itself,
     * rather than wait for rows that another core made. From S_OWN_PREP
     * tokens on, each prepares its own range of tokens, whose rows it
     * normalised or attended for: 16 tokens of 576 columns took 5.0 us a
     * call with each of two threads preparing all 16, against 2.7 us. */
    int own = c->n_threads > 1 && n < S_OWN_PREP && j.row0[count] >= 32 && group == n &&
              s_reserve(c, one * (size_t)c->n_threads) == 0;
    for (int k0 = 0; k0 < n; k0 += group) {
        int g = n - k0 < group ? n - k0 : group;
        j.x = x + (size_t)k0 * cols;
        j.n = g;
        j.cols = cols;
        j.bits = bits;
        j.qmax = qmax;
        j.xrow = xrow;
        j.xq = c->scratch;
        j.xs_off = s_round_up((size_t)g * xrow, S_ALIGN);
        j.xs = split && g >= FI_Q16_AMX_MIN ? c->scratch + j.xs_off : NULL;
        j.own = own ? one : 0;
        for (int i = 0; i < count; i++) {
            j.task[i].x = j.xq;
            j.task[i].x_stride = xrow;
            j.task[i].n = g;
            j.task[i].y = y[i] + (size_t)k0 * w[i]->rows;
            j.task[i].xs = j.xs;
        }
        j.acc = acc ? acc + (size_t)k0 * w[0]->rows : NULL;
        j.amax = amax ? amax + k0 : NULL;
        s_mm_run(c, &j);
    }
}

/* bytes (S_ALIGN aligned) from the packed chunks, or NULL. */
static uint8_t *s_packed_alloc(s_cpu *c, size_t bytes) {
    bytes = s_round_up(bytes, S_ALIGN);
    s_chunk *k = c->packed;
    if (!k || k->size - k->used < bytes) {
        size_t size = s_round_up(bytes > S_CHUNK_BYTES ? bytes : S_CHUNK_BYTES, S_HUGE);
        k = calloc(1, sizeof *k);
        uint8_t *base = k ? aligned_alloc(S_HUGE, size) : NULL;
        if (!base) {
            free(k);
            return NULL;
        }
#if defined(MADV_HUGEPAGE)
        (void)madvise(base, size, MADV_HUGEPAGE); /* a hint: fine if refused */
#endif
        k->base = base;
        k->size = size;
        k->next = c->packed;
        c->packed = k;
    }
    uint8_t *p = k->base + k->used;
    k->used += bytes;
    return p;
}

/* Quantised matrices get a copy in the packed layout where the kernels
 * read one (fi_q16_kernels.pack: the AVX2 and AVX512 kernels): same
 * bytes, same results, but each block's scales come in one load and its
 * quants need no shuffling. Without memory for it the kernels read the
 * matrix in place (gathered into the same layout), as the portable ones
 * always do. The copies live until the backend
 * is destroyed (weights are uploaded once, at load). */
static int s_weight_upload(void *ctx, fi_weight *w) {
    s_cpu *c = ctx;
    w->dev = NULL;
    int packable = w->type == FI_DTYPE_Q4_0 || w->type == FI_DTYPE_Q4_1 || w->type == FI_DTYPE_Q8_0;
    if (!c->q16.pack || !packable || w->rows < 16)
        return 0;
    uint8_t *p = s_packed_alloc(c, (size_t)(w->rows / 16) * 16 * w->row_bytes);
    if (!p)
        return 0;
    c->q16.pack(w->type, w->data, w->row_bytes, w->rows, w->cols, p);
    w->dev = p;
    return 0;
}

static void s_weight_release(void *ctx, fi_weight *w) {
    (void)ctx;
    w->dev = NULL; /* its chunk goes with the backend */
}

static void s_matmul_n(void *ctx, int count, float *const *y, const fi_weight *const *w,
                       const float *x, int n) {
    s_products(ctx, count, y, w, x, n, NULL, NULL);
}

static void s_matmul_add(void *ctx, float *acc, float *y, const fi_weight *w, const float *x, int n) {
    s_products(ctx, 1, &y, &w, x, n, acc, NULL);
}

static void s_matmul(void *ctx, float *y, const fi_weight *w, const float *x, int n) {
    s_products(ctx, 1, &y, &w, x, n, NULL, NULL);
}

static void s_matmul_argmax(void *ctx, float *y, int32_t *idx, const fi_weight *w, const float *x,
                            int n) {
    s_cpu *c = ctx;
    if (s_reserve_at(&c->amax, &c->amax_bytes, (size_t)n * sizeof(_Atomic uint64_t)) != 0) {
        /* out of memory for the keys: a pass over the rows after */
        s_products(c, 1, &y, &w, x, n, NULL, NULL);
        for (int t = 0; t < n; t++)
            idx[t] = fi_argmax_f32(y + (size_t)t * w->rows, w->rows);
        return;
    }
    _Atomic uint64_t *keys = (_Atomic uint64_t *)(void *)c->amax;
    for (int t = 0; t < n; t++)
        atomic_init(&keys[t], 0);
    s_products(c, 1, &y, &w, x, n, NULL, keys);
    for (int t = 0; t < n; t++) {
        uint64_t k = atomic_load_explicit(&keys[t], memory_order_relaxed);
        idx[t] = k ? (int32_t)~(uint32_t)k : 0;
    }
}

/* --- small ops ------------------------------------------------------------ */

static void s_get_rows(void *ctx, float *y, const fi_weight *w, const int32_t *tok, int n) {
    for (int t = 0; t < n; t++) {
        const uint8_t *row = (const uint8_t *)w->data + (size_t)tok[t] * w->row_bytes;
        fi_dequantize_row(w->type, row, y + (size_t)t * w->cols, w->cols);
    }
}

typedef struct s_norm_job {
    const fi_cpu_kernels *k;
    float *y;           /* output rows */
    const float *x;     /* input rows (may alias y) */
    const float *g;     /* gain, dim */
    int n, dim;         /* shape */
    float eps;          /* added to the mean square */
} s_norm_job;

static void s_norm_worker(void *arg, int ith, int nth) {
    s_norm_job *j = arg;
    int t0 = (int)((long)j->n * ith / nth), t1 = (int)((long)j->n * (ith + 1) / nth);
    for (int t = t0; t < t1; t++)
        j->k->rmsnorm(j->y + (size_t)t * j->dim, j->x + (size_t)t * j->dim, j->g, j->dim, j->eps);
}

static void s_rmsnorm(void *ctx, float *y, const float *x, const float *g, int n, int dim,
                      float eps) {
    s_cpu *c = ctx;
    s_norm_job j = {.k = &c->k, .y = y, .x = x, .g = g, .n = n, .dim = dim, .eps = eps};
    /* in parallel from S_OWN_PREP tokens, with the same split by tokens
     * as the next product's input (s_range_at, align 1), so each thread
     * quantises rows it normalised */
    if (c->n_threads > 1 && n > 1 && ((size_t)n * dim >= S_PAR_ROWS || n >= S_OWN_PREP))
        fi_pool_run(c->pool, s_norm_worker, &j);
    else
        s_norm_worker(&j, 0, 1);
}

/* cos and sin of pos * theta^(-2i/head_dim), computed in double. */
static void s_rope_angle(double pos, int i, int head_dim, float theta, float *cs, float *sn) {
    double ang = pos * pow((double)theta, -2.0 * i / head_dim);
    *cs = (float)cos(ang);
    *sn = (float)sin(ang);
}

/* Makes the rope table cover positions < need for (theta, head_dim): one
 * (cos, sin) pair per position and pair index, so the 2 * n_layers rope
 * calls of a token compute their angles once. 0, or -1 when memory runs
 * out (the caller then computes angles directly). */
static int s_rope_table(s_cpu *c, int need, int head_dim, float theta) {
    int half = head_dim / 2;
    if (c->rope_theta != theta || c->rope_half != half)
        c->rope_rows = 0; /* another model's settings: start over */
    if (need <= c->rope_rows)
        return 0;
    int rows = need > 2 * c->rope_rows ? need : 2 * c->rope_rows;
    if (rows < 256)
        rows = 256;
    float *tab = realloc(c->rope_tab, (size_t)rows * half * 2 * sizeof *tab);
    if (!tab)
        return -1;
    if (c->rope_rows == 0) {
        c->rope_theta = theta;
        c->rope_half = half;
    }
    for (int p = c->rope_rows; p < rows; p++)
        for (int i = 0; i < half; i++)
            s_rope_angle(p, i, head_dim, theta, &tab[((size_t)p * half + i) * 2],
                         &tab[((size_t)p * half + i) * 2 + 1]);
    c->rope_tab = tab;
    c->rope_rows = rows;
    return 0;
}

typedef struct s_rope_job {
    const fi_cpu_kernels *k;    /* rope kernel */
    float *x;                   /* n rows of n_heads * head_dim */
    const int32_t *pos;         /* each row's position */
    const float *tab;           /* the rope table, or NULL */
    int n, n_heads, head_dim;   /* shape */
    float theta;                /* base */
} s_rope_job;

static void s_rope_worker(void *arg, int ith, int nth) {
    const s_rope_job *j = arg;
    const int half = j->head_dim / 2, n_heads = j->n_heads, head_dim = j->head_dim;
    const int32_t *pos = j->pos;
    const float theta = j->theta;
    int t0 = (int)((long)j->n * ith / nth), t1 = (int)((long)j->n * (ith + 1) / nth);
    for (int t = t0; t < t1; t++) {
        float *row = j->x + (size_t)t * n_heads * head_dim;
        if (j->tab) {
            j->k->rope(row, n_heads, head_dim, j->tab + (size_t)pos[t] * half * 2);
            continue;
        }
        /* no table (out of memory for it): the angles here */
        for (int i = 0; i < half; i++) {
            float cs, sn;
            s_rope_angle(pos[t], i, head_dim, theta, &cs, &sn);
            for (int h = 0; h < n_heads; h++) {
                float *p = row + (size_t)h * head_dim + 2 * i;
                float a = p[0], b = p[1];
                p[0] = a * cs - b * sn;
                p[1] = a * sn + b * cs;
            }
        }
    }
}

static void s_rope(void *ctx, float *x, int n, int n_heads, int head_dim, const int32_t *pos,
                   float theta) {
    s_cpu *c = ctx;
    int maxp = 0;
    for (int t = 0; t < n; t++)
        maxp = pos[t] > maxp ? pos[t] : maxp;
    s_rope_job j = {.k = &c->k, .x = x, .pos = pos, .n = n, .n_heads = n_heads, .head_dim = head_dim,
                    .theta = theta};
    j.tab = s_rope_table(c, maxp + 1, head_dim, theta) == 0 ? c->rope_tab : NULL;
    if (c->n_threads > 1 && n > 1 && (size_t)n * n_heads * head_dim >= S_PAR_ROWS)
        fi_pool_run(c->pool, s_rope_worker, &j);
    else
        s_rope_worker(&j, 0, 1);
}

/* Attention work item: token t, position segment seg, all heads, or
 * (when there are fewer items than S_ATT_SPLIT per thread: one sequence's
 * decode) a share of the KV heads. The query heads that share a KV head
 * are done together, so each K/V row is converted from fp16 once per
 * group, and an item of all heads reads whole cache rows, in runs of
 * contiguous rows. Positions past S_ATT_SEG are split into segments of
 * S_ATT_SEG whose partial softmax states (max, sum, unnormalised output)
 * are merged after the parallel part, as in flash-decoding: decode at a
 * long context keeps every thread busy, and the split never depends on
 * the batch. Neither does a head's arithmetic depend on which item holds
 * it: KV heads are independent. */
typedef struct s_att_job {
    const fi_cpu_kernels *k;    /* att_dots / att_wsum / exp_sum */
    float *out;                 /* n rows of n_heads*head_dim */
    const float *q;             /* queries */
    const uint8_t *kc, *vc;     /* key and value caches */
    size_t row_bytes;           /* bytes per cache row */
    int q8;                     /* rows are FI_KV_ROW_Q8 (else FI_KV_ROW_F16) */
    const int32_t *pos;         /* position of each query token */
    const fi_kv_map *map;       /* where each position's row is */
    int n, n_heads, n_kv_heads, head_dim;
    int segs;                   /* position segments per token */
    int hparts;                 /* items per (token, segment): shares of the KV heads */
    int seg_len;                /* positions per segment (last may be short) */
    float *part;                /* segs > 1: per (t, seg): o[n_heads][head_dim], m[n_heads], l[n_heads] */
    s_range *rg;                /* the threads' ranges of items */
} s_att_job;

/* Partial state of (token t, segment seg): the heads' unnormalised outputs
 * (n_heads*head_dim floats), then their maxima and their sums. */
static float *s_att_part(const s_att_job *j, int t, int seg) {
    size_t i = (size_t)t * j->segs + seg;
    return j->part + i * (size_t)j->n_heads * (size_t)(j->head_dim + 2);
}

/* Asks for nr whole cache rows from row on to be brought into the cache
 * ahead of use. */
static void s_att_prefetch(const uint8_t *c, size_t row, int nr, size_t row_bytes) {
    const char *p = (const char *)(c + row * row_bytes);
    for (size_t b = 0; b < (size_t)nr * row_bytes; b += 64)
        __builtin_prefetch(p + b, 0, 3);
}

/* Reads one byte of every cache line of the nr whole rows from row on and
 * returns their sum (for an empty asm to consume, so that the loads stay). */
static uint64_t s_att_touch(const uint8_t *c, size_t row, int nr, size_t row_bytes) {
    const uint8_t *p = c + row * row_bytes;
    const size_t n = (size_t)nr * row_bytes;
    uint64_t sum = p[n - 1]; /* the last line, where n is not a multiple of 64 */
    for (size_t b = 0; b < n; b += 64)
        sum += p[b];
    return sum;
}

/* One pass per segment and KV head: all the scores of a set of query
 * heads (at most S_ATT_SEG per head, so they fit on the stack), one
 * maximum and one exp pass per head, then one weighted sum; no rescaling.
 * The rows are walked in runs that stay inside one cache block.
 *
 * A layer's cache is seldom in the processor's caches when attention
 * starts (the matmuls between layers stream megabytes of weights), and
 * the runs are a few KiB each, scattered over the pool. An item of all
 * the KV heads (batched decode, long contexts) therefore first reads one
 * byte of every line of its K and V runs, run by run, and only then does
 * the arithmetic, from cache. Plain loads, independent of each other, keep
 * many more misses in flight than the arithmetic's own loads or software
 * prefetches issued beside it: on the 2-core Zen 5 machine, with this read
 * pass against those prefetches (alternated step by step in one process,
 * positions 16-272), steps of 16 sequences' decode took 2-4% less time,
 * of 13-15 sequences 9% less, all decode steps together 5-6%, one
 * sequence's the same. An item of some KV heads
 * (one sequence's decode at a short context, the heads shared out between
 * threads) needs only part of each row: while its first KV head scores a
 * run, it prefetches the next run of K and this run of V, whole rows, for
 * the other heads. A token's operations depend only on its own position
 * and the block size, never on the other tokens or the thread split. */
static void s_att_item(const s_att_job *j, int t, int seg, int kh0, int kh1) {
    const int hd = j->head_dim, nh = j->n_heads;
    const int group = nh / j->n_kv_heads;
    const size_t rb = j->row_bytes;
    const float scale = 1.0f / sqrtf((float)hd);
    const int p_begin = seg * j->seg_len;
    const int p_end = p_begin + j->seg_len < j->pos[t] + 1 ? p_begin + j->seg_len : j->pos[t] + 1;
    const int bs = j->map->block_size;
    const int32_t *tbl = j->map->tables + (size_t)j->map->seq[t] * (size_t)j->map->max_blocks;
    float *part = j->segs > 1 ? s_att_part(j, t, seg) : NULL;
    if (p_end <= p_begin) {
        /* past pos[t]: an empty segment, which the merge skips */
        assert(part);
        for (int h = kh0 * group; h < kh1 * group; h++) {
            part[(size_t)nh * hd + h] = -INFINITY;
            part[(size_t)nh * (hd + 1) + h] = 0.0f;
        }
        return;
    }
    /* run r: rows run_row[r].. hold positions run_p[r]..run_p[r+1]-1 */
    size_t run_row[S_ATT_SEG];
    int run_p[S_ATT_SEG + 1], nrun = 0;
    for (int p = p_begin; p < p_end; nrun++) {
        run_row[nrun] = (size_t)tbl[p / bs] * (size_t)bs + (size_t)(p % bs);
        run_p[nrun] = p;
        p += bs - p % bs < p_end - p ? bs - p % bs : p_end - p;
    }
    run_p[nrun] = p_end;
    const int whole = kh0 == 0 && kh1 == j->n_kv_heads; /* whole rows: read them first */
    if (whole) {
        uint64_t sum = 0;
        for (int r = 0; r < nrun; r++) {
            sum += s_att_touch(j->kc, run_row[r], run_p[r + 1] - run_p[r], rb);
            sum += s_att_touch(j->vc, run_row[r], run_p[r + 1] - run_p[r], rb);
        }
        __asm__ volatile("" : : "r"(sum));
    } else {
        s_att_prefetch(j->kc, run_row[0], run_p[1] - run_p[0], rb);
    }
    float sc[S_ATT_HEADS * S_ATT_SEG];
    /* KV head kh's values: hd of them from byte kh*hd*es of a row; (Q8)
     * its scale soff bytes after them, past every head's quants (qbytes) */
    const size_t es = j->q8 ? 1 : sizeof(uint16_t);
    const size_t qbytes = rb - 4 * (size_t)j->n_kv_heads;
    for (int kh = kh0; kh < kh1; kh++) {
        const uint8_t *kc = j->kc + (size_t)kh * hd * es, *vc = j->vc + (size_t)kh * hd * es;
        const size_t soff = qbytes + 4 * (size_t)kh - (size_t)kh * hd; /* used only when q8 */
        for (int g0 = 0; g0 < group; g0 += S_ATT_HEADS) {
            const int gn = group - g0 < S_ATT_HEADS ? group - g0 : S_ATT_HEADS;
            const int h0 = kh * group + g0;
            const float *q = j->q + ((size_t)t * nh + h0) * hd;
            float *o = part ? part + (size_t)h0 * hd : j->out + ((size_t)t * nh + h0) * hd;
            float m[S_ATT_HEADS], l[S_ATT_HEADS];
            for (int r = 0; r < nrun; r++) {
                int cn = run_p[r + 1] - run_p[r];
                if (!whole && kh == kh0 && g0 == 0) {
                    if (r + 1 < nrun)
                        s_att_prefetch(j->kc, run_row[r + 1], run_p[r + 2] - run_p[r + 1], rb);
                    s_att_prefetch(j->vc, run_row[r], cn, rb);
                }
                if (j->q8)
                    j->k->att_dots_q8(sc + (run_p[r] - p_begin), S_ATT_SEG, q, gn,
                                      (const int8_t *)(kc + run_row[r] * rb), rb, soff, cn, hd, scale);
                else
                    j->k->att_dots(sc + (run_p[r] - p_begin), S_ATT_SEG, q, gn,
                                   (const uint16_t *)(const void *)(kc + run_row[r] * rb), rb / 2, cn, hd,
                                   scale);
            }
            for (int g = 0; g < gn; g++)
                l[g] = j->k->exp_sum(sc + g * S_ATT_SEG, p_end - p_begin, &m[g]);
            memset(o, 0, (size_t)gn * hd * sizeof *o);
            for (int r = 0; r < nrun; r++) {
                const int cn = run_p[r + 1] - run_p[r];
                if (j->q8)
                    j->k->att_wsum_q8(o, sc + (run_p[r] - p_begin), S_ATT_SEG, gn,
                                      (const int8_t *)(vc + run_row[r] * rb), rb, soff, cn, hd);
                else
                    j->k->att_wsum(o, sc + (run_p[r] - p_begin), S_ATT_SEG, gn,
                                   (const uint16_t *)(const void *)(vc + run_row[r] * rb), rb / 2, cn, hd);
            }
            for (int g = 0; g < gn; g++) {
                if (part) {
                    part[(size_t)nh * hd + h0 + g] = m[g];
                    part[(size_t)nh * (hd + 1) + h0 + g] = l[g];
                } else {
                    float il = 1.0f / l[g];
                    for (int d = 0; d < hd; d++)
                        o[(size_t)g * hd + d] *= il;
                }
            }
        }
    }
}

/* Prefetches the keys and values of the first run of item (t, seg): the
 * next item a thread will take, while it works on the one before. */
static void s_att_prefetch_item(const s_att_job *j, int t, int seg) {
    const int p = seg * j->seg_len, bs = j->map->block_size;
    if (p > j->pos[t])
        return;
    const int32_t *tbl = j->map->tables + (size_t)j->map->seq[t] * (size_t)j->map->max_blocks;
    const int np = bs - p % bs < j->pos[t] + 1 - p ? bs - p % bs : j->pos[t] + 1 - p;
    const size_t row = (size_t)tbl[p / bs] * (size_t)bs + (size_t)(p % bs);
    s_att_prefetch(j->kc, row, np, j->row_bytes);
    s_att_prefetch(j->vc, row, np, j->row_bytes);
}

/* Items (t, seg, part) numbered (t segs + seg) hparts + part, from the
 * thread's range (so the tokens it attends for are those whose rows it
 * normalised and will quantise); where items share out the KV heads, the
 * next (t, seg)'s first rows are prefetched while the thread works on the
 * current one (items of whole rows read theirs first). Part p of hparts takes KV heads
 * [p n_kv / hparts, (p + 1) n_kv / hparts). */
static void s_att_worker(void *arg, int ith, int nth) {
    s_att_job *j = arg;
    const int hp = j->hparts, nkv = j->n_kv_heads;
    int a, b;
    while (s_ranges_next(j->rg, ith, nth, 1, &a, &b))
        for (int i = a; i < b; i++) {
            const int ts = i / hp, p = i % hp;
            if (hp > 1 && i + 1 < b && (i + 1) % hp == 0)
                s_att_prefetch_item(j, (ts + 1) / j->segs, (ts + 1) % j->segs);
            s_att_item(j, ts / j->segs, ts % j->segs, p * nkv / hp, (p + 1) * nkv / hp);
        }
}

/* Combines the segments' partial states into out (segs > 1). A segment
 * past pos[t] is empty (m = -inf, l = 0) and weighs nothing. */
static void s_att_merge(const s_att_job *j) {
    const int hd = j->head_dim, nh = j->n_heads;
    for (int t = 0; t < j->n; t++)
        for (int h = 0; h < nh; h++) {
            float m = -INFINITY;
            for (int s = 0; s < j->segs; s++) {
                float ms = s_att_part(j, t, s)[(size_t)nh * hd + h];
                m = ms > m ? ms : m;
            }
            float *o = j->out + ((size_t)t * nh + h) * hd;
            float l = 0.0f;
            memset(o, 0, (size_t)hd * sizeof *o);
            for (int s = 0; s < j->segs; s++) {
                const float *ps = s_att_part(j, t, s);
                float ls = ps[(size_t)nh * (hd + 1) + h];
                if (ls == 0.0f)
                    continue;
                float w = expf(ps[(size_t)nh * hd + h] - m);
                l += w * ls;
                for (int d = 0; d < hd; d++)
                    o[d] += w * ps[(size_t)h * hd + d];
            }
            float il = 1.0f / l;
            for (int d = 0; d < hd; d++)
                o[d] *= il;
        }
}

static void s_attention(void *ctx, float *out, const float *q, const void *k, const void *v,
                        int n, const int32_t *pos, const fi_kv_map *map, int n_heads,
                        int n_kv_heads, int head_dim) {
    s_cpu *c = ctx;
    assert(n_kv_heads > 0 && n_heads % n_kv_heads == 0 && head_dim > 0 && map->block_size > 0);
    s_att_job j = {.k = &c->k, .out = out, .q = q, .kc = k, .vc = v, .pos = pos, .map = map,
                   .row_bytes = fi_kv_row_bytes((fi_kv_row)c->kv_bits, n_kv_heads, head_dim),
                   .q8 = c->kv_bits == FI_KV_ROW_Q8, .n = n,
                   .n_heads = n_heads, .n_kv_heads = n_kv_heads, .head_dim = head_dim, .segs = 1,
                   .hparts = 1};
    int maxp = 0;
    for (int t = 0; t < n; t++)
        maxp = pos[t] > maxp ? pos[t] : maxp;
    j.seg_len = maxp + 1;
    /* Positions go in fixed segments of S_ATT_SEG whatever the batch, so
     * that a token's result does not depend on which other tokens share
     * the call (continuous batching must equal one sequence at a time):
     * a token at position p always has ceil((p+1)/S_ATT_SEG) segments,
     * merged in order. Long contexts also give every thread work. */
    if (maxp + 1 > S_ATT_SEG) {
        int segs = (maxp + 1 + S_ATT_SEG - 1) / S_ATT_SEG;
        size_t bytes = (size_t)n * n_heads * segs * (head_dim + 2) * sizeof(float);
        if (s_reserve(c, bytes) != 0) {
            /* out of memory: make the failure visible */
            for (size_t i = 0; i < (size_t)n * n_heads * head_dim; i++)
                out[i] = NAN;
            return;
        }
        j.segs = segs;
        j.seg_len = S_ATT_SEG;
        j.part = (float *)c->scratch;
    }
    /* few items (one sequence's decode at a short context: one item): the
     * KV heads shared out, so that every thread has work */
    if (c->n_threads > 1 && n * j.segs < S_ATT_SPLIT * c->n_threads)
        j.hparts = n_kv_heads;
    int items = n * j.segs * j.hparts;
    int nth = c->n_threads > 1 && items > 1 ? c->n_threads : 1;
    j.rg = c->att_rg;
    s_ranges_init(j.rg, nth, items, 1);
    if (nth > 1)
        fi_pool_run(c->pool, s_att_worker, &j);
    else
        s_att_worker(&j, 0, 1);
    if (j.segs > 1)
        s_att_merge(&j);
}

typedef struct s_ew_job {
    const fi_cpu_kernels *k;    /* swiglu kernel */
    float *y;           /* g for swiglu, y for add */
    const float *x;     /* u for swiglu, x for add */
    size_t n;           /* elements */
    int swiglu;         /* 1: swiglu, 0: add */
} s_ew_job;

static void s_ew_worker(void *arg, int ith, int nth) {
    s_ew_job *j = arg;
    size_t i0 = j->n * (size_t)ith / (size_t)nth, i1 = j->n * (size_t)(ith + 1) / (size_t)nth;
    float *y = j->y;
    const float *x = j->x;
    if (j->swiglu) {
        j->k->swiglu(y + i0, x + i0, i1 - i0);
    } else {
        for (size_t i = i0; i < i1; i++)
            y[i] += x[i];
    }
}

static void s_ew(s_cpu *c, s_ew_job *j) {
    if (c->n_threads > 1 && j->n >= (j->swiglu ? S_PAR_SWIGLU : S_PAR_ELEMS))
        fi_pool_run(c->pool, s_ew_worker, j);
    else
        s_ew_worker(j, 0, 1);
}

static void s_store_f16(void *ctx, uint16_t *dst, const float *src, size_t n) {
    s_cpu *c = ctx;
    c->k.to_f16(dst, src, n);
}

static void s_kv_store(void *ctx, void *cache, const float *src, int n, const int32_t *slot,
                       int row, int head_dim) {
    s_cpu *c = ctx;
    if (c->kv_bits == FI_KV_ROW_Q8) {
        /* each head's quants (kv_quant), then the row's head scales */
        const int nh = row / head_dim;
        const size_t rb = fi_kv_row_bytes(FI_KV_ROW_Q8, nh, head_dim), qbytes = rb - 4 * (size_t)nh;
        for (int t = 0; t < n; t++) {
            uint8_t *dst = (uint8_t *)cache + (size_t)slot[t] * rb;
            const float *x = src + (size_t)t * (size_t)row;
            for (int h = 0; h < nh; h++) {
                float sc = c->k.kv_quant((int8_t *)dst + (size_t)h * head_dim, x + (size_t)h * head_dim,
                                         head_dim);
                memcpy(dst + qbytes + 4 * (size_t)h, &sc, sizeof sc);
            }
        }
        return;
    }
    for (int t = 0; t < n; t++)
        c->k.to_f16((uint16_t *)cache + (size_t)slot[t] * (size_t)row, src + (size_t)t * (size_t)row,
                    (size_t)row);
}

static void s_swiglu(void *ctx, float *g, const float *u, size_t n) {
    s_ew_job j = {.k = &((s_cpu *)ctx)->k, .y = g, .x = u, .n = n, .swiglu = 1};
    s_ew(ctx, &j);
}

static void s_add(void *ctx, float *y, const float *x, size_t n) {
    s_ew_job j = {.k = &((s_cpu *)ctx)->k, .y = y, .x = x, .n = n, .swiglu = 0};
    s_ew(ctx, &j);
}

/* --- backend ------------------------------------------------------------ */

static void s_destroy(void *ctx) {
    s_cpu *c = ctx;
    if (!c)
        return;
    while (c->packed) {
        s_chunk *k = c->packed;
        c->packed = k->next;
        free(k->base);
        free(k);
    }
    fi_pool_destroy(&c->pool);
    free(c->scratch);
    free(c->amax);
    free(c->rope_tab);
    free(c->rows_rg);
    free(c->toks_rg);
    free(c->att_rg);
    free(c);
}

static const fi_backend_ops s_cpu_ops = {
    .name = "cpu",
    .destroy = s_destroy,
    .alloc = s_alloc,
    .free = s_free,
    .to_backend = s_copy,
    .to_host = s_copy,
    .copy = s_copy,
    .weight_upload = s_weight_upload,
    .weight_release = s_weight_release,
    .sync = s_sync,
    .matmul = s_matmul,
    .get_rows = s_get_rows,
    .rmsnorm = s_rmsnorm,
    .rope = s_rope,
    .attention = s_attention,
    .store_f16 = s_store_f16,
    .kv_store = s_kv_store,
    .matmul_n = s_matmul_n,
    .host_memory = 1,
    .matmul_add = s_matmul_add,
    .matmul_argmax = s_matmul_argmax,
    .swiglu = s_swiglu,
    .add = s_add,
};

/* x86 extensions the kernels can use, as bits. */
#define S_X86_AVX2 1u       /* AVX2 + FMA + F16C */
#define S_X86_AVXVNNI 2u    /* and AVX-VNNI */
#define S_X86_AVX512 4u     /* and AVX512 F/BW/VL/VNNI with ZMM state saved */

/* AVX2 and FMA as the compiler's run-time check sees them; F16C (every
 * AVX2 part has it, but clang's __builtin_cpu_supports cannot name it)
 * from CPUID 1 ECX bit 29; AVX-VNNI from CPUID 7.1 EAX bit 4; AVX512
 * F/BW/VL from CPUID 7.0 EBX bits 16/30/31 and VNNI from ECX bit 11, plus
 * XCR0 bits 1-2 and 5-7 (the OS saves the opmask and ZMM registers). */
static unsigned s_cpu_x86_features(void) {
    unsigned f = 0;
#if defined(FI_HAVE_X86) && FI_HAVE_X86 && (defined(__GNUC__) || defined(__clang__))
    unsigned a, b, c, d;
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma"))
        return 0;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !((c >> 29) & 1u))
        return 0;
    f |= S_X86_AVX2;
    int osxsave = (c >> 27) & 1u;
    if (__get_cpuid_count(7, 1, &a, &b, &c, &d) && ((a >> 4) & 1u))
        f |= S_X86_AVXVNNI;
    if (osxsave && __get_cpuid_count(7, 0, &a, &b, &c, &d) && ((b >> 16) & 1u) && ((b >> 30) & 1u) &&
        ((b >> 31) & 1u) && ((c >> 11) & 1u)) {
        unsigned lo, hi;
        __asm__ __volatile__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
        if ((lo & 0xe6u) == 0xe6u)
            f |= S_X86_AVX512;
    }
#endif
    return f;
}

/* Fills k (8-bit activations and float ops) and q16 (16-bit activations)
 * with the named flavour; 0, or -1 when it is unknown, not built or not
 * supported by this processor. The avx512vnni flavour has its own q16
 * matmuls (fi_cpu_q16_avx512.c, with AMX-INT8 for batches where the
 * processor and OS allow it); the other x86 flavours use the AVX2 q16
 * kernels. */
static int s_pick_kernels(fi_cpu_kernels *k, fi_q16_kernels *q16, const char *flavour) {
    unsigned f = s_cpu_x86_features();
    fi_cpu_kernels_portable(k);
    fi_q16_kernels_portable(q16);
    if (strcmp(flavour, "portable") == 0)
        return 0;
    int ok = 0;
#if defined(FI_HAVE_X86) && FI_HAVE_X86
    if (strcmp(flavour, "avx2") == 0 && (f & S_X86_AVX2)) {
        fi_cpu_kernels_avx2(k);
        ok = 1;
    }
#endif
#if defined(FI_HAVE_AVXVNNI) && FI_HAVE_AVXVNNI
    if (strcmp(flavour, "avxvnni") == 0 && (f & S_X86_AVXVNNI)) {
        fi_cpu_kernels_avxvnni(k);
        ok = 1;
    }
#endif
#if defined(FI_HAVE_AVX512) && FI_HAVE_AVX512
    if (strcmp(flavour, "avx512vnni") == 0 && (f & S_X86_AVX512)) {
        fi_cpu_kernels_avx512(k);
        fi_q16_kernels_avx2(q16);
        fi_q16_kernels_avx512(q16);
        (void)fi_q16_kernels_avx512_amx(q16); /* when the tile unit is there */
        return 0;
    }
#endif
#if defined(FI_HAVE_X86) && FI_HAVE_X86
    if (ok)
        fi_q16_kernels_avx2(q16);
#endif
    (void)f;
    return ok ? 0 : -1;
}

/* snprintf into a caller's error buffer, which may be NULL or empty. */
__attribute__((format(printf, 3, 4))) static void s_err(char *err, size_t errlen, const char *fmt, ...) {
    if (!err || errlen == 0)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

fi_backend *fi_cpu_backend_new_flavour(int n_threads, const char *flavour, char *err, size_t errlen) {
    fi_backend *b = NULL;
    s_cpu *c = NULL;
    if (n_threads <= 0) {
        long nc = sysconf(_SC_NPROCESSORS_ONLN);
        n_threads = nc > 0 ? (int)nc : 1;
    }
    c = calloc(1, sizeof *c);
    b = calloc(1, sizeof *b);
    if (!c || !b) {
        s_err(err, errlen, "cpu backend: out of memory");
        goto fail;
    }
    c->kv_bits = FI_KV_ROW_F16;
    if (s_pick_kernels(&c->k, &c->q16, flavour) != 0) {
        s_err(err, errlen, "cpu backend: kernels '%s' not built or not supported by this processor",
                 flavour);
        goto fail;
    }
    /* one scale per token (more exact, and without the per-block multiply
     * faster), except where the tile unit takes 12-bit blocks in one
     * product (fi_cpu_backend_set_act_bits) */
    c->act_bits = c->q16.split ? 12 : 16;
    c->scratch = aligned_alloc(S_ALIGN, S_SCRATCH_MIN);
    c->scratch_bytes = S_SCRATCH_MIN;
    c->pool = fi_pool_new(n_threads);
    size_t rg = s_round_up((size_t)n_threads * sizeof(s_range), S_ALIGN);
    c->rows_rg = aligned_alloc(S_ALIGN, rg);
    c->toks_rg = aligned_alloc(S_ALIGN, rg);
    c->att_rg = aligned_alloc(S_ALIGN, rg);
    if (!c->scratch || !c->pool || !c->rows_rg || !c->toks_rg || !c->att_rg) {
        s_err(err, errlen, "cpu backend: cannot start %d threads or allocate scratch", n_threads);
        goto fail;
    }
    c->n_threads = n_threads;
    b->ops = &s_cpu_ops;
    b->ctx = c;
    return b;
fail:
    s_destroy(c);
    free(b);
    return NULL;
}

/* PORTABLE: plain C. AVX2: exactly the AVX2 kernels. AUTO: the fastest
 * the processor has (measured on Sapphire Rapids: AVX512-VNNI, then
 * AVX-VNNI, then AVX2, then portable). */
fi_backend *fi_cpu_backend_new(int n_threads, fi_simd simd, char *err, size_t errlen) {
    if (simd == FI_SIMD_PORTABLE)
        return fi_cpu_backend_new_flavour(n_threads, "portable", err, errlen);
    if (simd == FI_SIMD_AVX2)
        return fi_cpu_backend_new_flavour(n_threads, "avx2", err, errlen);
    unsigned f = s_cpu_x86_features();
    const char *best = "portable";
    if (f & S_X86_AVX2)
        best = "avx2";
#if defined(FI_HAVE_AVXVNNI) && FI_HAVE_AVXVNNI
    if (f & S_X86_AVXVNNI)
        best = "avxvnni";
#endif
#if defined(FI_HAVE_AVX512) && FI_HAVE_AVX512
    if (f & S_X86_AVX512)
        best = "avx512vnni";
#endif
    return fi_cpu_backend_new_flavour(n_threads, best, err, errlen);
}

const char *fi_cpu_backend_simd(const fi_backend *b) {
    if (!b || b->ops != &s_cpu_ops)
        return NULL;
    return ((const s_cpu *)b->ctx)->k.name;
}

int fi_cpu_backend_set_act_bits(fi_backend *b, int bits) {
    if (!b || b->ops != &s_cpu_ops || (bits != 8 && bits != 12 && bits != 16))
        return -1;
    ((s_cpu *)b->ctx)->act_bits = bits;
    return 0;
}

int fi_cpu_backend_set_kv_bits(fi_backend *b, int bits) {
    if (!b || b->ops != &s_cpu_ops || (bits != FI_KV_ROW_F16 && bits != FI_KV_ROW_Q8))
        return -1;
    ((s_cpu *)b->ctx)->kv_bits = bits;
    return 0;
}

int fi_backend_kv_bits(const fi_backend *b) {
    return b && b->ops == &s_cpu_ops ? ((const s_cpu *)b->ctx)->kv_bits : FI_KV_ROW_F16;
}

size_t fi_kv_row_bytes(fi_kv_row fmt, int n_kv_heads, int head_dim) {
    size_t vals = (size_t)n_kv_heads * (size_t)head_dim;
    if (fmt == FI_KV_ROW_Q8)
        return ((vals + 3) & ~(size_t)3) + 4 * (size_t)n_kv_heads;
    return 2 * vals;
}

size_t fi_backend_kv_row_bytes(const fi_backend *b, int n_kv_heads, int head_dim) {
    return fi_kv_row_bytes((fi_kv_row)fi_backend_kv_bits(b), n_kv_heads, head_dim);
}

const char *fi_backend_describe(const fi_backend *b, char *buf, size_t len) {
    if (b && b->ops == &s_cpu_ops)
        snprintf(buf, len, "cpu %s, %d-bit activations%s", fi_cpu_backend_simd(b), fi_cpu_backend_act_bits(b),
                 fi_backend_kv_bits(b) == FI_KV_ROW_Q8 ? ", 8-bit KV cache" : "");
    else
        snprintf(buf, len, "%s", b ? b->ops->name : "-");
    return buf;
}

int fi_cpu_backend_act_bits(const fi_backend *b) {
    if (!b || b->ops != &s_cpu_ops)
        return 0;
    return ((const s_cpu *)b->ctx)->act_bits;
}

int fi_cpu_backend_tiles(const fi_backend *b) {
    return b && b->ops == &s_cpu_ops && ((const s_cpu *)b->ctx)->q16.split != NULL;
}

int fi_cpu_backend_threads(const fi_backend *b) {
    if (!b || b->ops != &s_cpu_ops)
        return 0;
    return ((const s_cpu *)b->ctx)->n_threads;
}

/* Generic: works for any backend through its destroy member. */
void fi_backend_destroy(fi_backend **bp) {
    if (!bp || !*bp)
        return;
    fi_backend *b = *bp;
    if (b->ops && b->ops->destroy)
        b->ops->destroy(b->ctx);
    free(b);
    *bp = NULL;
}

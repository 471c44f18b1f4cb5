/*
 * fi_cpu.c - the CPU backend: fills fi_backend_ops with host memory and
 * the kernels of the best SIMD flavour, and spreads work over a persistent
 * fi_pool.
 *
 * Work split: matmul by output rows in chunks of 16-row multiples taken
 * from an atomic counter (so a thread slowed by a noisy neighbour takes
 * fewer chunks); attention by (token, head); the element-wise ops by
 * tokens or element ranges, and only when big enough to pay for a dispatch.
 * Activations for quantised weights are quantised once per matmul into a
 * scratch buffer owned by the backend (grown on demand; when growing fails
 * the tokens are processed in groups that fit).
 */
#include "fi_kernels_impl.h"
#include "fi_cpu_q16_impl.h"

#include <assert.h>
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
#if defined(FI_HAVE_X86) && FI_HAVE_X86
#include <cpuid.h>
#endif

#define S_ALIGN 64
#define S_SCRATCH_MIN ((size_t)1 << 20) /* bytes of scratch made at start */
#define S_PAR_ELEMS 32768               /* element-wise ops: go parallel above this */
#define S_ATT_CHUNK 128                 /* positions scored per softmax step */

typedef struct s_cpu {
    fi_pool *pool;          /* workers, caller is worker 0 */
    int n_threads;          /* pool size */
    fi_cpu_kernels k;       /* the chosen kernels */
    fi_q16_kernels q16;     /* the chosen 16-bit-activation kernels */
    int act_bits;           /* activations of quantised matmuls: 16 or 8 */
    uint8_t *scratch;       /* quantised activations, S_ALIGN aligned */
    size_t scratch_bytes;   /* its size */
} s_cpu;

static const fi_backend_ops s_cpu_ops;

/* --- memory ------------------------------------------------------------ */

static size_t s_round_up(size_t n, size_t a) {
    return (n + a - 1) / a * a;
}

static void *s_alloc(void *ctx, size_t bytes) {
    size_t n = s_round_up(bytes ? bytes : 1, S_ALIGN);
    void *p = aligned_alloc(S_ALIGN, n);
    if (p)
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

/* Makes the scratch at least `bytes` long; 0 on success, -1 (old scratch
 * kept) when memory runs out. */
static int s_reserve(s_cpu *c, size_t bytes) {
    if (bytes <= c->scratch_bytes)
        return 0;
    size_t n = s_round_up(bytes + bytes / 4, S_ALIGN);
    uint8_t *p = aligned_alloc(S_ALIGN, n);
    if (!p)
        return -1;
    free(c->scratch);
    c->scratch = p;
    c->scratch_bytes = n;
    return 0;
}

/* --- matmul ------------------------------------------------------------ */

typedef struct s_mm_job {
    const fi_mm_task *task; /* what to compute */
    fi_mm_fn fn;            /* kernel */
    int rows;               /* total rows */
    int chunk;              /* rows per claim, a multiple of 16 */
    atomic_int next;        /* next chunk to claim */
} s_mm_job;

static void s_mm_worker(void *arg, int ith, int nth) {
    s_mm_job *j = arg;
    for (;;) {
        int c = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed);
        long r0 = (long)c * j->chunk;
        if (r0 >= j->rows)
            break;
        long r1 = r0 + j->chunk < j->rows ? r0 + j->chunk : j->rows;
        j->fn(j->task, (int)r0, (int)r1);
    }
}

static void s_run_rows(s_cpu *c, fi_mm_fn fn, const fi_mm_task *t, int rows) {
    if (c->n_threads == 1 || rows < 32) {
        fn(t, 0, rows);
        return;
    }
    s_mm_job j = {.task = t, .fn = fn, .rows = rows};
    /* about four chunks per thread, so a slow thread can hand work over */
    int chunk = (rows + 4 * c->n_threads - 1) / (4 * c->n_threads);
    j.chunk = (chunk + 15) / 16 * 16;
    atomic_init(&j.next, 0);
    fi_pool_run(c->pool, s_mm_worker, &j);
}

typedef struct s_quant_job {
    const fi_cpu_kernels *k;    /* quantiser */
    const float *x;             /* n rows of cols floats */
    uint8_t *xq;                /* n rows of xrow bytes */
    int n, cols;                /* shape */
    size_t xrow;                /* bytes per quantised row */
} s_quant_job;

static void s_quant_worker(void *arg, int ith, int nth) {
    s_quant_job *j = arg;
    int k0 = (int)((long)j->n * ith / nth), k1 = (int)((long)j->n * (ith + 1) / nth);
    for (int k = k0; k < k1; k++)
        j->k->quantize_q8x(j->x + (size_t)k * j->cols, (fi_block_q8x *)(j->xq + (size_t)k * j->xrow),
                           j->cols / FI_QK);
}

static fi_mm_fn s_mm_fn(const s_cpu *c, fi_dtype t) {
    switch (t) {
    case FI_DTYPE_F32: return c->k.mm_f32;
    case FI_DTYPE_F16: return c->k.mm_f16;
    case FI_DTYPE_BF16: return c->k.mm_bf16;
    case FI_DTYPE_Q4_0: return c->k.mm_q4_0;
    case FI_DTYPE_Q4_1: return c->k.mm_q4_1;
    case FI_DTYPE_Q8_0: return c->k.mm_q8_0;
    }
    return NULL;
}

typedef struct s_quant16_job {
    const fi_q16_kernels *k;    /* quantiser */
    const float *x;             /* n rows of cols floats */
    uint8_t *xq;                /* n rows of xrow bytes */
    int n, cols;                /* shape */
    size_t xrow;                /* bytes per quantised row */
} s_quant16_job;

static void s_quant16_worker(void *arg, int ith, int nth) {
    s_quant16_job *j = arg;
    int k0 = (int)((long)j->n * ith / nth), k1 = (int)((long)j->n * (ith + 1) / nth);
    for (int k = k0; k < k1; k++)
        j->k->quantize(j->x + (size_t)k * j->cols, (fi_block_q16x *)(j->xq + (size_t)k * j->xrow),
                       j->cols / FI_QK);
}

static fi_mm_fn s_mm16_fn(const s_cpu *c, fi_dtype t) {
    switch (t) {
    case FI_DTYPE_Q4_0: return c->q16.mm_q4_0;
    case FI_DTYPE_Q4_1: return c->q16.mm_q4_1;
    case FI_DTYPE_Q8_0: return c->q16.mm_q8_0;
    default: return NULL;
    }
}

/* Quantised weights with 16-bit activations (the default: accurate). */
static void s_matmul16(s_cpu *c, float *y, const fi_weight *w, const float *x, int n) {
    fi_mm_fn fn = s_mm16_fn(c, w->type);
    assert(fn);
    size_t xrow = (size_t)(w->cols / FI_QK) * sizeof(fi_block_q16x);
    int group = n;
    if (s_reserve(c, xrow * (size_t)n) != 0)
        group = (int)(c->scratch_bytes / xrow);
    if (group < 1) {
        for (size_t i = 0; i < (size_t)n * (size_t)w->rows; i++)
            y[i] = NAN;
        return;
    }
    for (int k0 = 0; k0 < n; k0 += group) {
        int g = n - k0 < group ? n - k0 : group;
        s_quant16_job q = {.k = &c->q16, .x = x + (size_t)k0 * w->cols, .xq = c->scratch,
                           .n = g, .cols = w->cols, .xrow = xrow};
        if (c->n_threads > 1 && (size_t)g * (size_t)w->cols >= S_PAR_ELEMS && g > 1)
            fi_pool_run(c->pool, s_quant16_worker, &q);
        else
            s_quant16_worker(&q, 0, 1);
        fi_mm_task t = {
            .w = w->data, .w_stride = w->row_bytes, .cols = w->cols,
            .x = c->scratch, .x_stride = xrow, .n = g,
            .y = y + (size_t)k0 * w->rows, .y_stride = w->rows,
        };
        s_run_rows(c, fn, &t, w->rows);
    }
}

static void s_matmul(void *ctx, float *y, const fi_weight *w, const float *x, int n) {
    s_cpu *c = ctx;
    if (c->act_bits == 16 && fi_dtype_block_elems(w->type) != 1) {
        s_matmul16(c, y, w, x, n);
        return;
    }
    fi_mm_fn fn = s_mm_fn(c, w->type);
    assert(fn);
    fi_mm_task t = {
        .w = w->data, .w_stride = w->row_bytes, .cols = w->cols,
        .x = (const uint8_t *)x, .x_stride = (size_t)w->cols * sizeof(float),
        .n = n, .y = y, .y_stride = w->rows,
    };
    if (fi_dtype_block_elems(w->type) == 1) {
        s_run_rows(c, fn, &t, w->rows);
        return;
    }
    size_t xrow = (size_t)(w->cols / FI_QK) * sizeof(fi_block_q8x);
    int group = n;
    if (s_reserve(c, xrow * (size_t)n) != 0)
        group = (int)(c->scratch_bytes / xrow);
    if (group < 1) {
        /* out of memory for even one row: make the failure visible */
        for (size_t i = 0; i < (size_t)n * (size_t)w->rows; i++)
            y[i] = NAN;
        return;
    }
    for (int k0 = 0; k0 < n; k0 += group) {
        int g = n - k0 < group ? n - k0 : group;
        s_quant_job q = {.k = &c->k, .x = x + (size_t)k0 * w->cols, .xq = c->scratch,
                         .n = g, .cols = w->cols, .xrow = xrow};
        if (c->n_threads > 1 && (size_t)g * (size_t)w->cols >= S_PAR_ELEMS && g > 1)
            fi_pool_run(c->pool, s_quant_worker, &q);
        else
            s_quant_worker(&q, 0, 1);
        t.x = c->scratch;
        t.x_stride = xrow;
        t.n = g;
        t.y = y + (size_t)k0 * w->rows;
        s_run_rows(c, fn, &t, w->rows);
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
    float *y;           /* output rows */
    const float *x;     /* input rows (may alias y) */
    const float *g;     /* gain, dim */
    int n, dim;         /* shape */
    float eps;          /* added to the mean square */
} s_norm_job;

static void s_norm_worker(void *arg, int ith, int nth) {
    s_norm_job *j = arg;
    int t0 = (int)((long)j->n * ith / nth), t1 = (int)((long)j->n * (ith + 1) / nth);
    for (int t = t0; t < t1; t++) {
        const float *x = j->x + (size_t)t * j->dim;
        float *y = j->y + (size_t)t * j->dim;
        double ss = 0.0;
        for (int i = 0; i < j->dim; i++)
            ss += (double)x[i] * x[i];
        float scale = (float)(1.0 / sqrt(ss / j->dim + j->eps));
        for (int i = 0; i < j->dim; i++)
            y[i] = x[i] * scale * j->g[i];
    }
}

static void s_rmsnorm(void *ctx, float *y, const float *x, const float *g, int n, int dim,
                      float eps) {
    s_cpu *c = ctx;
    s_norm_job j = {.y = y, .x = x, .g = g, .n = n, .dim = dim, .eps = eps};
    if (c->n_threads > 1 && n > 1 && (size_t)n * dim >= S_PAR_ELEMS)
        fi_pool_run(c->pool, s_norm_worker, &j);
    else
        s_norm_worker(&j, 0, 1);
}

static void s_rope(void *ctx, float *x, int n, int n_heads, int head_dim, const int32_t *pos,
                   float theta) {
    int half = head_dim / 2;
    for (int t = 0; t < n; t++) {
        float *row = x + (size_t)t * n_heads * head_dim;
        for (int i = 0; i < half; i++) {
            double ang = (double)pos[t] * pow((double)theta, -2.0 * i / head_dim);
            float cs = (float)cos(ang), sn = (float)sin(ang);
            for (int h = 0; h < n_heads; h++) {
                float *p = row + (size_t)h * head_dim + 2 * i;
                float a = p[0], b = p[1];
                p[0] = a * cs - b * sn;
                p[1] = a * sn + b * cs;
            }
        }
    }
}

typedef struct s_att_job {
    const fi_cpu_kernels *k;    /* dot / axpy */
    float *out;                 /* n rows of n_heads*head_dim */
    const float *q;             /* queries */
    const uint16_t *kc, *vc;    /* key and value caches, fp16 */
    const int32_t *pos;         /* position of each query token */
    int n, n_heads, n_kv_heads, head_dim;
} s_att_job;

/* One (token, head): online softmax over the visible positions in chunks,
 * accumulating directly in this head's slice of out. */
static void s_att_one(const s_att_job *j, int t, int h) {
    int hd = j->head_dim;
    int kv_dim = j->n_kv_heads * hd;
    int kh = h / (j->n_heads / j->n_kv_heads);
    const float *q = j->q + (size_t)t * j->n_heads * hd + (size_t)h * hd;
    float *o = j->out + (size_t)t * j->n_heads * hd + (size_t)h * hd;
    float scale = 1.0f / sqrtf((float)hd);
    float sc[S_ATT_CHUNK];
    float m = -INFINITY, l = 0.0f;
    int np = j->pos[t] + 1;
    memset(o, 0, (size_t)hd * sizeof *o);
    for (int p0 = 0; p0 < np; p0 += S_ATT_CHUNK) {
        int cn = np - p0 < S_ATT_CHUNK ? np - p0 : S_ATT_CHUNK;
        float cm = -INFINITY;
        for (int i = 0; i < cn; i++) {
            const uint16_t *k = j->kc + (size_t)(p0 + i) * kv_dim + (size_t)kh * hd;
            sc[i] = j->k->dot(q, k, hd) * scale;
            cm = sc[i] > cm ? sc[i] : cm;
        }
        if (cm > m) {
            float r = expf(m - cm); /* 0 on the first chunk */
            l *= r;
            for (int d = 0; d < hd; d++)
                o[d] *= r;
            m = cm;
        }
        for (int i = 0; i < cn; i++) {
            float e = expf(sc[i] - m);
            l += e;
            j->k->axpy(o, e, j->vc + (size_t)(p0 + i) * kv_dim + (size_t)kh * hd, hd);
        }
    }
    float il = 1.0f / l;
    for (int d = 0; d < hd; d++)
        o[d] *= il;
}

static void s_att_worker(void *arg, int ith, int nth) {
    s_att_job *j = arg;
    long items = (long)j->n * j->n_heads;
    long i0 = items * ith / nth, i1 = items * (ith + 1) / nth;
    for (long i = i0; i < i1; i++)
        s_att_one(j, (int)(i / j->n_heads), (int)(i % j->n_heads));
}

static void s_attention(void *ctx, float *out, const float *q, const uint16_t *k,
                        const uint16_t *v, int n, const int32_t *pos, int n_heads, int n_kv_heads,
                        int head_dim) {
    s_cpu *c = ctx;
    s_att_job j = {.k = &c->k, .out = out, .q = q, .kc = k, .vc = v, .pos = pos, .n = n,
                   .n_heads = n_heads, .n_kv_heads = n_kv_heads, .head_dim = head_dim};
    if (c->n_threads > 1 && (long)n * n_heads > 1)
        fi_pool_run(c->pool, s_att_worker, &j);
    else
        s_att_worker(&j, 0, 1);
}

typedef struct s_ew_job {
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
        for (size_t i = i0; i < i1; i++)
            y[i] = y[i] / (1.0f + expf(-y[i])) * x[i];
    } else {
        for (size_t i = i0; i < i1; i++)
            y[i] += x[i];
    }
}

static void s_ew(s_cpu *c, s_ew_job *j) {
    if (c->n_threads > 1 && j->n >= S_PAR_ELEMS)
        fi_pool_run(c->pool, s_ew_worker, j);
    else
        s_ew_worker(j, 0, 1);
}

static void s_store_f16(void *ctx, uint16_t *dst, const float *src, size_t n) {
    s_cpu *c = ctx;
    c->k.to_f16(dst, src, n);
}

static void s_swiglu(void *ctx, float *g, const float *u, size_t n) {
    s_ew_job j = {.y = g, .x = u, .n = n, .swiglu = 1};
    s_ew(ctx, &j);
}

static void s_add(void *ctx, float *y, const float *x, size_t n) {
    s_ew_job j = {.y = y, .x = x, .n = n, .swiglu = 0};
    s_ew(ctx, &j);
}

/* --- backend ------------------------------------------------------------ */

static void s_destroy(void *ctx) {
    s_cpu *c = ctx;
    if (!c)
        return;
    fi_pool_destroy(&c->pool);
    free(c->scratch);
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
    .weight_upload = NULL,
    .weight_release = NULL,
    .sync = s_sync,
    .matmul = s_matmul,
    .get_rows = s_get_rows,
    .rmsnorm = s_rmsnorm,
    .rope = s_rope,
    .attention = s_attention,
    .store_f16 = s_store_f16,
    .swiglu = s_swiglu,
    .add = s_add,
};

/* AVX2 and FMA as the compiler sees them; F16C (which every AVX2 part
 * has, but clang's __builtin_cpu_supports cannot name) from CPUID 1 ECX. */
static int s_cpu_has_avx2(void) {
#if defined(FI_HAVE_X86) && FI_HAVE_X86 && (defined(__GNUC__) || defined(__clang__))
    unsigned a, b, c, d;
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma"))
        return 0;
    if (!__get_cpuid(1, &a, &b, &c, &d))
        return 0;
    return (c >> 29) & 1u;
#else
    return 0;
#endif
}

fi_backend *fi_cpu_backend_new(int n_threads, fi_simd simd, char *err, size_t errlen) {
    fi_backend *b = NULL;
    s_cpu *c = NULL;
    if (n_threads <= 0) {
        long nc = sysconf(_SC_NPROCESSORS_ONLN);
        n_threads = nc > 0 ? (int)nc : 1;
    }
    c = calloc(1, sizeof *c);
    b = calloc(1, sizeof *b);
    if (!c || !b) {
        snprintf(err, errlen, "cpu backend: out of memory");
        goto fail;
    }
    fi_cpu_kernels_portable(&c->k);
    fi_q16_kernels_portable(&c->q16);
    c->act_bits = 16;
    if (simd == FI_SIMD_AVX2 || simd == FI_SIMD_AUTO) {
        if (s_cpu_has_avx2()) {
#if defined(FI_HAVE_X86) && FI_HAVE_X86
            fi_cpu_kernels_avx2(&c->k);
            fi_q16_kernels_avx2(&c->q16);
#endif
        } else if (simd == FI_SIMD_AVX2) {
            snprintf(err, errlen, "cpu backend: AVX2/FMA/F16C requested but not supported here");
            goto fail;
        }
    }
    c->scratch = aligned_alloc(S_ALIGN, S_SCRATCH_MIN);
    c->scratch_bytes = S_SCRATCH_MIN;
    c->pool = fi_pool_new(n_threads);
    if (!c->scratch || !c->pool) {
        snprintf(err, errlen, "cpu backend: cannot start %d threads or allocate scratch", n_threads);
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

const char *fi_cpu_backend_simd(const fi_backend *b) {
    if (!b || b->ops != &s_cpu_ops)
        return NULL;
    return ((const s_cpu *)b->ctx)->k.name;
}

int fi_cpu_backend_set_act_bits(fi_backend *b, int bits) {
    if (!b || b->ops != &s_cpu_ops || (bits != 8 && bits != 16))
        return -1;
    ((s_cpu *)b->ctx)->act_bits = bits;
    return 0;
}

int fi_cpu_backend_act_bits(const fi_backend *b) {
    if (!b || b->ops != &s_cpu_ops)
        return 0;
    return ((const s_cpu *)b->ctx)->act_bits;
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

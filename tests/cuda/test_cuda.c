/*
 * test_cuda.c - the CUDA backend against the CPU backend (the reference).
 *
 * Without a usable device the program prints
 *     SKIPPED: no CUDA device (<cudaGetDeviceCount's message>)
 * and exits 77, which tests/cuda.cmake registers as "skipped".
 *
 * With a device, every operation of the table runs on both backends on
 * fresh random inputs (the seed is printed; FI_TEST_SEED=N repeats a run).
 * Device outputs are poisoned (all bytes 0xff: NaN in fp32 and fp16) before
 * each run, so an element the kernel does not write fails the comparison.
 * Bounds: errors are measured against the largest magnitude of the CPU
 * result; products of fp16 operands get 1e-2, everything else is tighter,
 * and store_f16 must match bit for bit. The fused operations (matmul_n,
 * matmul_add, norm_matmul_n, norm_matmul_swiglu, rope_store) must also
 * give the bits of the GPU's own unfused calls, and leave their inputs and
 * the cache rows they do not write as they were.
 *
 * Graphs: recorded steps give the results of direct calls with each step's
 * new uploads; with graph_begin_sig a step of the signature of its key's
 * last recording is relaunched (counted), and a relaunch that makes other
 * calls than the recording fails the backend.
 *
 * The model end to end, on a small random-weight model written by the test
 * and on the default model when it is present: greedy tokens
 * equal to the CPU backend's up to the first near tie (the CPU's top-2 logit
 * gap below NEAR_TIE), and logits with cosine similarity >= COS_MIN and a
 * top-1 logit within LOGIT_TOL, for the decoded steps and for a prefill
 * with all logits; in both weight modes (fp16 and quantised-read). With
 * graphs on, a few steps of one session alone must be relaunched.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "fi_cuda.h"
#include "fi_kernels.h"
#include "fi_model.h"
#include "gguf_writer.h"

#ifndef FI_TEST_MODEL
#error "FI_TEST_MODEL (the model path) must be defined"
#endif

#define TOL_GEMM 1e-2   /* fp16 operands, fp32 accumulation */
#define TOL_F32 1e-5    /* fp32 element-wise and reductions */
#define TOL_ATT 2e-4    /* attention: fp32 softmax over fp16 rows */
#define TOL_KV 1e-3     /* fp16 cache rows against fp32 (rounding: 2^-11) */
#define NORM_EPS 1e-5f  /* rmsnorm's eps in the fused tests */
#define NEAR_TIE 0.1    /* fp16 products may swap logits this close */
#define COS_MIN 0.999   /* logits cosine similarity floor */
#define LOGIT_TOL 0.25  /* top-1 logit difference allowed */
#define GREEDY_STEPS 24 /* decoded tokens compared per prompt */
#define ALONE_STEPS 4   /* then decoded by one GPU session alone (relaunches) */

/* --- helpers ------------------------------------------------------------ */

typedef struct rng {
    uint64_t s; /* xorshift64* state, never 0 */
} rng;

static uint64_t g_seed;

static uint32_t rng_u32(rng *r) {
    r->s ^= r->s >> 12;
    r->s ^= r->s << 25;
    r->s ^= r->s >> 27;
    return (uint32_t)((r->s * 0x2545F4914F6CDD1DULL) >> 32);
}

static float rng_f(rng *r, float lo, float hi) {
    return lo + (hi - lo) * (float)(rng_u32(r) >> 8) * (1.0f / 16777216.0f);
}

static rng rng_for(const char *test) {
    uint64_t h = g_seed;
    for (const char *p = test; *p; p++)
        h = (h ^ (uint64_t)(unsigned char)*p) * 0x100000001b3ULL;
    rng r = {h ? h : 1};
    return r;
}

typedef struct pair {
    fi_backend *cpu; /* reference */
    fi_backend *gpu; /* under test */
} pair;

static int setup_mode(void **state, fi_cuda_weights mode) {
    char err[256];
    pair *p = calloc(1, sizeof *p);
    if (!p)
        return -1;
    p->cpu = fi_cpu_backend_new(0, FI_SIMD_AUTO, err, sizeof err);
    p->gpu = fi_cuda_backend_new(0, err, sizeof err);
    /* the reference at its most exact: 16-bit quants for every product */
    if (p->cpu && fi_cpu_backend_set_act_bits(p->cpu, 16) != 0)
        fi_backend_destroy(&p->cpu);
    if (!p->cpu || !p->gpu) {
        fprintf(stderr, "backend: %s\n", err);
        fi_backend_destroy(&p->cpu);
        fi_backend_destroy(&p->gpu);
        free(p);
        return -1;
    }
    if (fi_cuda_backend_set_weights(p->gpu, mode) != 0) {
        fi_backend_destroy(&p->cpu);
        fi_backend_destroy(&p->gpu);
        free(p);
        return -1;
    }
    *state = p;
    return 0;
}

static int setup_f16(void **state) {
    return setup_mode(state, FI_CUDA_WEIGHTS_F16);
}

static int setup_quant(void **state) {
    return setup_mode(state, FI_CUDA_WEIGHTS_QUANT);
}

static int teardown(void **state) {
    pair *p = *state;
    if (p) {
        fi_backend_destroy(&p->cpu);
        fi_backend_destroy(&p->gpu);
        free(p);
    }
    return 0;
}

/* Device copy of `bytes` host bytes. */
static void *dev_from(fi_backend *b, const void *host, size_t bytes) {
    void *d = b->ops->alloc(b->ctx, bytes);
    assert_non_null(d);
    assert_int_equal(b->ops->to_backend(b->ctx, d, host, bytes), 0);
    return d;
}

/* A device buffer of `bytes` bytes, every byte 0xff. */
static void *dev_poisoned(fi_backend *b, size_t bytes) {
    uint8_t *h = malloc(bytes);
    assert_non_null(h);
    memset(h, 0xff, bytes);
    void *d = dev_from(b, h, bytes);
    free(h);
    return d;
}

static void to_host(fi_backend *b, void *host, const void *d, size_t bytes) {
    int rc = b->ops->to_host(b->ctx, host, d, bytes);
    if (rc != 0)
        fprintf(stderr, "to_host: %s\n", b->ops->last_error(b->ctx));
    assert_int_equal(rc, 0);
}

/* max |a - b| / max |ref|; NaN anywhere gives +inf. */
static double rel_err(const float *a, const float *ref, size_t n) {
    double mx = 0, mref = 0;
    for (size_t i = 0; i < n; i++) {
        if (isnan(a[i]) || isnan(ref[i]))
            return INFINITY;
        double d = fabs((double)a[i] - ref[i]);
        mx = d > mx ? d : mx;
        mref = fabs(ref[i]) > mref ? fabs(ref[i]) : mref;
    }
    return mx / (mref > 0 ? mref : 1.0);
}

static void check(const char *what, const float *gpu, const float *cpu, size_t n, double tol) {
    double e = rel_err(gpu, cpu, n);
    printf("  %-44s rel err %.3g (bound %.3g)\n", what, e, tol);
    assert_true(e <= tol);
}

static float *fvec(size_t n) {
    float *p = malloc(n * sizeof *p);
    assert_non_null(p);
    return p;
}

static void fill(rng *r, float *x, size_t n, float lo, float hi) {
    for (size_t i = 0; i < n; i++)
        x[i] = rng_f(r, lo, hi);
}

/* A weight of `rows` x `cols` of type t with random contents (host). */
static fi_weight make_weight(rng *r, fi_dtype t, int rows, int cols) {
    fi_weight w = {0};
    w.type = t;
    w.rows = rows;
    w.cols = cols;
    w.row_bytes = fi_dtype_row_bytes(t, cols);
    size_t bytes = (size_t)rows * w.row_bytes;
    uint8_t *d = malloc(bytes);
    assert_non_null(d);
    size_t nblk = bytes / fi_dtype_block_bytes(t);
    for (size_t b = 0; b < nblk; b++) {
        uint8_t *p = d + b * fi_dtype_block_bytes(t);
        uint16_t h;
        float f;
        switch (t) {
        case FI_DTYPE_F32:
            f = rng_f(r, -1, 1);
            memcpy(p, &f, 4);
            break;
        case FI_DTYPE_F16:
            h = fi_fp32_to_fp16(rng_f(r, -1, 1));
            memcpy(p, &h, 2);
            break;
        case FI_DTYPE_BF16:
            h = fi_fp32_to_bf16(rng_f(r, -1, 1));
            memcpy(p, &h, 2);
            break;
        case FI_DTYPE_Q4_0:
        case FI_DTYPE_Q4_1:
        case FI_DTYPE_Q8_0: {
            size_t bb = fi_dtype_block_bytes(t);
            for (size_t i = 0; i < bb; i++)
                p[i] = (uint8_t)rng_u32(r);
            if (t == FI_DTYPE_Q8_0) /* GGML's quants stay within [-127, 127] */
                for (size_t i = 2; i < bb; i++)
                    p[i] = p[i] == 0x80 ? 0x81 : p[i];
            h = fi_fp32_to_fp16(rng_f(r, 0.002f, t == FI_DTYPE_Q8_0 ? 0.01f : 0.1f));
            memcpy(p, &h, 2);
            if (t == FI_DTYPE_Q4_1) {
                h = fi_fp32_to_fp16(rng_f(r, -0.5f, 0.2f));
                memcpy(p + 2, &h, 2);
            }
            break;
        }
        }
    }
    w.data = d;
    return w;
}

/* The GPU's copy of host weight w (weight_upload); the test fails with
 * the backend's message when the upload does. */
static fi_weight gpu_weight(pair *p, const fi_weight *w) {
    fi_weight wg = *w;
    int rc = p->gpu->ops->weight_upload(p->gpu->ctx, &wg);
    if (rc)
        fprintf(stderr, "upload: %s\n", p->gpu->ops->last_error(p->gpu->ctx));
    assert_int_equal(rc, 0);
    return wg;
}

/* got must hold the bits of same (another way to the same result on the
 * GPU, which the contract says gives the same bits) and be within tol of
 * the CPU's ref; n floats each. One line says both. */
static void check_same(const char *what, const float *got, const float *same, const float *ref,
                       size_t n, double tol) {
    size_t bad = 0;
    for (size_t i = 0; i < n; i++)
        bad += memcmp(got + i, same + i, sizeof *got) != 0;
    double e = rel_err(got, ref, n);
    printf("  %-44s %zu of %zu bits differ (must be 0), rel err %.3g (bound %.3g)\n", what, bad,
           n, e, tol);
    assert_int_equal(bad, 0);
    assert_true(e <= tol);
}

/* got and want, n elements of `size` bytes each, must be equal bit for
 * bit; one line says how many elements differ. */
static void check_bits(const char *what, const void *got, const void *want, size_t n,
                       size_t size) {
    const uint8_t *a = got, *b = want;
    size_t bad = 0;
    for (size_t i = 0; i < n; i++)
        bad += memcmp(a + i * size, b + i * size, size) != 0;
    printf("  %-44s %zu of %zu differ (must be 0)\n", what, bad, n);
    assert_int_equal(bad, 0);
}

/* A host copy (malloc'd) of `bytes` bytes of device memory d. */
static void *from_dev(fi_backend *b, const void *d, size_t bytes) {
    void *h = malloc(bytes);
    assert_non_null(h);
    to_host(b, h, d, bytes);
    return h;
}

/* The weights of one matmul_n-like call: random host weights, which the
 * CPU reads, and the GPU's copies. */
typedef struct wset {
    int count;                              /* weights, 1..FI_MATMUL_N_MAX */
    fi_weight host[FI_MATMUL_N_MAX];        /* make_weight's */
    fi_weight dev[FI_MATMUL_N_MAX];         /* gpu_weight of each */
    const fi_weight *devp[FI_MATMUL_N_MAX]; /* &dev[i], as matmul_n takes them */
} wset;

/* Weights of type t, rows[i] x cols each, for the rows up to the first 0
 * (at most FI_MATMUL_N_MAX). s must stay where it is (devp points into
 * it) until wset_release. */
static void wset_make(pair *p, rng *r, wset *s, fi_dtype t, const int *rows, int cols) {
    for (s->count = 0; s->count < FI_MATMUL_N_MAX && rows[s->count]; s->count++) {
        int i = s->count;
        s->host[i] = make_weight(r, t, rows[i], cols);
        s->dev[i] = gpu_weight(p, &s->host[i]);
        s->devp[i] = &s->dev[i];
    }
}

static void wset_release(pair *p, wset *s) {
    for (int i = 0; i < s->count; i++) {
        p->gpu->ops->weight_release(p->gpu->ctx, &s->dev[i]);
        free((void *)s->host[i].data);
    }
    s->count = 0;
}

/* --- operations --------------------------------------------------------- */

static const fi_dtype ALL_TYPES[] = {FI_DTYPE_F32,  FI_DTYPE_F16,  FI_DTYPE_BF16,
                                     FI_DTYPE_Q4_0, FI_DTYPE_Q4_1, FI_DTYPE_Q8_0};

static void run_matmul(pair *p, const char *test) {
    rng r = rng_for(test);
    const int rows = 200, cols = 576;
    const int ns[] = {1, 3, 8, 9, 33, 256};
    for (size_t ti = 0; ti < sizeof ALL_TYPES / sizeof ALL_TYPES[0]; ti++) {
        fi_weight wc = make_weight(&r, ALL_TYPES[ti], rows, cols);
        fi_weight wg = gpu_weight(p, &wc);
        for (size_t k = 0; k < sizeof ns / sizeof ns[0]; k++) {
            int n = ns[k];
            float *x = fvec((size_t)n * cols), *yc = fvec((size_t)n * rows),
                  *yg = fvec((size_t)n * rows);
            fill(&r, x, (size_t)n * cols, -1, 1);
            p->cpu->ops->matmul(p->cpu->ctx, yc, &wc, x, n);
            float *dx = dev_from(p->gpu, x, (size_t)n * cols * sizeof(float));
            float *dy = dev_poisoned(p->gpu, (size_t)n * rows * sizeof(float));
            p->gpu->ops->matmul(p->gpu->ctx, dy, &wg, dx, n);
            to_host(p->gpu, yg, dy, (size_t)n * rows * sizeof(float));
            char what[96];
            snprintf(what, sizeof what, "matmul %s %dx%d n=%d", fi_dtype_name(ALL_TYPES[ti]),
                     rows, cols, n);
            check(what, yg, yc, (size_t)n * rows, TOL_GEMM);
            p->gpu->ops->free(p->gpu->ctx, dx);
            p->gpu->ops->free(p->gpu->ctx, dy);
            free(x);
            free(yc);
            free(yg);
        }
        p->gpu->ops->weight_release(p->gpu->ctx, &wg);
        free((void *)wc.data);
    }
}

static void test_matmul_f16(void **state) {
    run_matmul(*state, "matmul_f16");
}

static void test_matmul_quant(void **state) {
    run_matmul(*state, "matmul_quant");
}

/* Rows of the weights of one matmul_n call, 0 past the last; all have
 * MATMUL_N_COLS columns, as matmul_n requires. */
#define MATMUL_N_COLS 576
static const int MATMUL_N_GROUPS[][FI_MATMUL_N_MAX] = {
    {576, 192, 192}, /* Q, K, V */
    {1536, 1536},    /* gate, up */
    {100},           /* a single product */
};

/* matmul_n gives each product the bits of the GPU's own matmul of that
 * weight, and is within TOL_GEMM of the CPU. matmul_n runs first, so that
 * nothing the reference matmuls leave behind (x prepared for them) can
 * help it. */
static void run_matmul_n(pair *p, const char *test) {
    if (!p->gpu->ops->matmul_n)
        fail_msg("ops->matmul_n is NULL: the CUDA backend must provide it");
    rng r = rng_for(test);
    const int cols = MATMUL_N_COLS;
    const int ns[] = {1, 2, 5, 8, 9, 33};
    const size_t ngroups = sizeof MATMUL_N_GROUPS / sizeof MATMUL_N_GROUPS[0];
    for (size_t ti = 0; ti < sizeof ALL_TYPES / sizeof ALL_TYPES[0]; ti++) {
        for (size_t gi = 0; gi < ngroups; gi++) {
            const int *rows = MATMUL_N_GROUPS[gi];
            wset ws;
            wset_make(p, &r, &ws, ALL_TYPES[ti], rows, cols);
            const int count = ws.count;
            for (size_t k = 0; k < sizeof ns / sizeof ns[0]; k++) {
                int n = ns[k];
                float *x = fvec((size_t)n * cols);
                fill(&r, x, (size_t)n * cols, -1, 1);
                float *dx = dev_from(p->gpu, x, (size_t)n * cols * sizeof(float));
                float *dy[FI_MATMUL_N_MAX], *dref[FI_MATMUL_N_MAX];
                for (int i = 0; i < count; i++) {
                    dy[i] = dev_poisoned(p->gpu, (size_t)n * rows[i] * sizeof(float));
                    dref[i] = dev_poisoned(p->gpu, (size_t)n * rows[i] * sizeof(float));
                }
                p->gpu->ops->matmul_n(p->gpu->ctx, count, dy, ws.devp, dx, n);
                for (int i = 0; i < count; i++)
                    p->gpu->ops->matmul(p->gpu->ctx, dref[i], &ws.dev[i], dx, n);
                for (int i = 0; i < count; i++) {
                    size_t ny = (size_t)n * rows[i];
                    float *yg = fvec(ny), *yref = fvec(ny), *yc = fvec(ny);
                    to_host(p->gpu, yg, dy[i], ny * sizeof(float));
                    to_host(p->gpu, yref, dref[i], ny * sizeof(float));
                    p->cpu->ops->matmul(p->cpu->ctx, yc, &ws.host[i], x, n);
                    char what[96];
                    snprintf(what, sizeof what, "matmul_n %s %dx%d (%d of %d) n=%d",
                             fi_dtype_name(ALL_TYPES[ti]), rows[i], cols, i + 1, count, n);
                    check_same(what, yg, yref, yc, ny, TOL_GEMM);
                    free(yg);
                    free(yref);
                    free(yc);
                    p->gpu->ops->free(p->gpu->ctx, dy[i]);
                    p->gpu->ops->free(p->gpu->ctx, dref[i]);
                }
                p->gpu->ops->free(p->gpu->ctx, dx);
                free(x);
            }
            wset_release(p, &ws);
        }
    }
}

static void test_matmul_n_f16(void **state) {
    run_matmul_n(*state, "matmul_n_f16");
}

static void test_matmul_n_quant(void **state) {
    run_matmul_n(*state, "matmul_n_quant");
}

/* matmul_add leaves in y the bits of the GPU's matmul and in acc those of
 * that matmul then the GPU's add (run after matmul_add, on a second copy
 * of acc), and both are within TOL_GEMM of the CPU's matmul then add. */
static void run_matmul_add(pair *p, const char *test) {
    if (!p->gpu->ops->matmul_add)
        fail_msg("ops->matmul_add is NULL: the CUDA backend must provide it");
    rng r = rng_for(test);
    const int shapes[][2] = {{576, 576}, {576, 1536}}; /* rows x cols: attention out, down */
    const int ns[] = {1, 3, 8, 9, 40};
    for (size_t ti = 0; ti < sizeof ALL_TYPES / sizeof ALL_TYPES[0]; ti++) {
        for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
            const int rows = shapes[si][0], cols = shapes[si][1];
            fi_weight wc = make_weight(&r, ALL_TYPES[ti], rows, cols);
            fi_weight wg = gpu_weight(p, &wc);
            for (size_t k = 0; k < sizeof ns / sizeof ns[0]; k++) {
                int n = ns[k];
                size_t nx = (size_t)n * cols, ny = (size_t)n * rows;
                float *x = fvec(nx), *acc = fvec(ny), *yc = fvec(ny), *accc = fvec(ny);
                fill(&r, x, nx, -1, 1);
                fill(&r, acc, ny, -1, 1);
                memcpy(accc, acc, ny * sizeof(float));
                p->cpu->ops->matmul(p->cpu->ctx, yc, &wc, x, n);
                p->cpu->ops->add(p->cpu->ctx, accc, yc, ny);
                float *dx = dev_from(p->gpu, x, nx * sizeof(float));
                float *dacc = dev_from(p->gpu, acc, ny * sizeof(float));
                float *dacc2 = dev_from(p->gpu, acc, ny * sizeof(float));
                float *dy = dev_poisoned(p->gpu, ny * sizeof(float));
                float *dy2 = dev_poisoned(p->gpu, ny * sizeof(float));
                p->gpu->ops->matmul_add(p->gpu->ctx, dacc, dy, &wg, dx, n);
                p->gpu->ops->matmul(p->gpu->ctx, dy2, &wg, dx, n);
                p->gpu->ops->add(p->gpu->ctx, dacc2, dy2, ny);
                float *yg = fvec(ny), *yg2 = fvec(ny), *ag = fvec(ny), *ag2 = fvec(ny);
                to_host(p->gpu, yg, dy, ny * sizeof(float));
                to_host(p->gpu, yg2, dy2, ny * sizeof(float));
                to_host(p->gpu, ag, dacc, ny * sizeof(float));
                to_host(p->gpu, ag2, dacc2, ny * sizeof(float));
                char what[96];
                snprintf(what, sizeof what, "matmul_add %s %dx%d n=%d: y", fi_dtype_name(wc.type),
                         rows, cols, n);
                check_same(what, yg, yg2, yc, ny, TOL_GEMM);
                snprintf(what, sizeof what, "matmul_add %s %dx%d n=%d: acc",
                         fi_dtype_name(wc.type), rows, cols, n);
                check_same(what, ag, ag2, accc, ny, TOL_GEMM);
                float *bufs[] = {dx, dacc, dacc2, dy, dy2};
                for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
                    p->gpu->ops->free(p->gpu->ctx, bufs[i]);
                float *hbufs[] = {x, acc, yc, accc, yg, yg2, ag, ag2};
                for (size_t i = 0; i < sizeof hbufs / sizeof hbufs[0]; i++)
                    free(hbufs[i]);
            }
            p->gpu->ops->weight_release(p->gpu->ctx, &wg);
            free((void *)wc.data);
        }
    }
}

static void test_matmul_add_f16(void **state) {
    run_matmul_add(*state, "matmul_add_f16");
}

static void test_matmul_add_quant(void **state) {
    run_matmul_add(*state, "matmul_add_quant");
}

/* The inputs of a fused rmsnorm and product: x, n rows of dim in (-3, 3),
 * and g (dim) in (0.5, 1.5), on the host and on the GPU. */
typedef struct norm_in {
    int n, dim;     /* rows of x, and their length */
    float *x, *g;   /* host */
    float *dx, *dg; /* the GPU's copies */
} norm_in;

static norm_in norm_in_new(pair *p, rng *r, int n, int dim) {
    norm_in in = {.n = n, .dim = dim, .x = fvec((size_t)n * dim), .g = fvec((size_t)dim)};
    fill(r, in.x, (size_t)n * dim, -3, 3);
    fill(r, in.g, (size_t)dim, 0.5f, 1.5f);
    in.dx = dev_from(p->gpu, in.x, (size_t)n * dim * sizeof(float));
    in.dg = dev_from(p->gpu, in.g, (size_t)dim * sizeof(float));
    return in;
}

static void norm_in_free(pair *p, norm_in *in) {
    p->gpu->ops->free(p->gpu->ctx, in->dx);
    p->gpu->ops->free(p->gpu->ctx, in->dg);
    free(in->x);
    free(in->g);
}

/* The GPU's rmsnorm of in into a buffer of its own (device memory): the
 * unfused path's xn. */
static float *norm_gpu(pair *p, const norm_in *in) {
    float *dxn = dev_poisoned(p->gpu, (size_t)in->n * in->dim * sizeof(float));
    p->gpu->ops->rmsnorm(p->gpu->ctx, dxn, in->dx, in->dg, in->n, in->dim, NORM_EPS);
    return dxn;
}

/* The CPU's rmsnorm of in (host memory, malloc'd). */
static float *norm_cpu(pair *p, const norm_in *in) {
    float *xn = fvec((size_t)in->n * in->dim);
    p->cpu->ops->rmsnorm(p->cpu->ctx, xn, in->x, in->g, in->n, in->dim, NORM_EPS);
    return xn;
}

/* x on the GPU still holds the bits uploaded (a fused call reads it only). */
static void check_x_kept(pair *p, const char *what, const norm_in *in) {
    size_t nx = (size_t)in->n * in->dim;
    float *xg = from_dev(p->gpu, in->dx, nx * sizeof(float));
    check_bits(what, xg, in->x, nx, sizeof(float));
    free(xg);
}

/* norm_matmul_n gives each product the bits of the GPU's rmsnorm into a
 * buffer of its own then matmul_n on that buffer (run after the fused
 * call, so that nothing they leave behind can help it), is within
 * TOL_GEMM of the CPU's rmsnorm then matmul, and leaves x as it was.
 * Nothing is asserted of xn, which the call may or may not write. */
static void run_norm_matmul_n(pair *p, const char *test) {
    fi_backend *g = p->gpu;
    if (!g->ops->norm_matmul_n)
        fail_msg("ops->norm_matmul_n is NULL: the CUDA backend must provide it");
    rng r = rng_for(test);
    const int cols = MATMUL_N_COLS;
    const int ns[] = {1, 2, 5, 8, 9, 33};
    const size_t ngroups = sizeof MATMUL_N_GROUPS / sizeof MATMUL_N_GROUPS[0];
    for (size_t ti = 0; ti < sizeof ALL_TYPES / sizeof ALL_TYPES[0]; ti++) {
        for (size_t gi = 0; gi < ngroups; gi++) {
            const int *rows = MATMUL_N_GROUPS[gi];
            wset ws;
            wset_make(p, &r, &ws, ALL_TYPES[ti], rows, cols);
            for (size_t k = 0; k < sizeof ns / sizeof ns[0]; k++) {
                int n = ns[k];
                norm_in in = norm_in_new(p, &r, n, cols);
                float *dxn = dev_poisoned(g, (size_t)n * cols * sizeof(float));
                float *dy[FI_MATMUL_N_MAX], *dref[FI_MATMUL_N_MAX];
                for (int i = 0; i < ws.count; i++) {
                    dy[i] = dev_poisoned(g, (size_t)n * rows[i] * sizeof(float));
                    dref[i] = dev_poisoned(g, (size_t)n * rows[i] * sizeof(float));
                }
                g->ops->norm_matmul_n(g->ctx, ws.count, dy, ws.devp, dxn, in.dx, in.dg, NORM_EPS,
                                      n);
                float *dxn2 = norm_gpu(p, &in);
                g->ops->matmul_n(g->ctx, ws.count, dref, ws.devp, dxn2, n);
                char what[96];
                snprintf(what, sizeof what, "norm_matmul_n %s (%d products) n=%d: x kept",
                         fi_dtype_name(ALL_TYPES[ti]), ws.count, n);
                check_x_kept(p, what, &in);
                float *xc = norm_cpu(p, &in);
                for (int i = 0; i < ws.count; i++) {
                    size_t ny = (size_t)n * rows[i];
                    float *yg = from_dev(g, dy[i], ny * sizeof(float));
                    float *yref = from_dev(g, dref[i], ny * sizeof(float)), *yc = fvec(ny);
                    p->cpu->ops->matmul(p->cpu->ctx, yc, &ws.host[i], xc, n);
                    snprintf(what, sizeof what, "norm_matmul_n %s %dx%d (%d of %d) n=%d",
                             fi_dtype_name(ALL_TYPES[ti]), rows[i], cols, i + 1, ws.count, n);
                    check_same(what, yg, yref, yc, ny, TOL_GEMM);
                    free(yg);
                    free(yref);
                    free(yc);
                    g->ops->free(g->ctx, dy[i]);
                    g->ops->free(g->ctx, dref[i]);
                }
                g->ops->free(g->ctx, dxn);
                g->ops->free(g->ctx, dxn2);
                norm_in_free(p, &in);
                free(xc);
            }
            wset_release(p, &ws);
        }
    }
}

static void test_norm_matmul_n_f16(void **state) {
    run_norm_matmul_n(*state, "norm_matmul_n_f16");
}

static void test_norm_matmul_n_quant(void **state) {
    run_norm_matmul_n(*state, "norm_matmul_n_quant");
}

/* norm_matmul_swiglu leaves in h the bits of the GPU's rmsnorm, matmul_n
 * of {gate, up} and swiglu (run after it, on buffers of their own), within
 * TOL_GEMM of the CPU's rmsnorm, two matmuls and swiglu, and leaves x as
 * it was. Nothing is asserted of u or xn, which it may or may not write. */
static void run_norm_matmul_swiglu(pair *p, const char *test) {
    fi_backend *g = p->gpu;
    if (!g->ops->norm_matmul_swiglu)
        fail_msg("ops->norm_matmul_swiglu is NULL: the CUDA backend must provide it");
    rng r = rng_for(test);
    /* rows x cols of gate and up: the default model's, and a narrow one
     * (cols stay a multiple of 32, the quantised types' block) */
    const int shapes[][2] = {{1536, 576}, {192, 64}};
    const int ns[] = {1, 3, 8, 9, 40};
    for (size_t ti = 0; ti < sizeof ALL_TYPES / sizeof ALL_TYPES[0]; ti++) {
        for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
            const int rows = shapes[si][0], cols = shapes[si][1];
            const int gate_up[FI_MATMUL_N_MAX] = {rows, rows};
            wset ws;
            wset_make(p, &r, &ws, ALL_TYPES[ti], gate_up, cols);
            for (size_t k = 0; k < sizeof ns / sizeof ns[0]; k++) {
                int n = ns[k];
                size_t ny = (size_t)n * rows;
                norm_in in = norm_in_new(p, &r, n, cols);
                float *dxn = dev_poisoned(g, (size_t)n * cols * sizeof(float));
                float *dh = dev_poisoned(g, ny * sizeof(float)),
                      *du = dev_poisoned(g, ny * sizeof(float));
                float *dref[2] = {dev_poisoned(g, ny * sizeof(float)),
                                  dev_poisoned(g, ny * sizeof(float))};
                g->ops->norm_matmul_swiglu(g->ctx, dh, du, ws.devp[0], ws.devp[1], dxn, in.dx,
                                           in.dg, NORM_EPS, n);
                float *dxn2 = norm_gpu(p, &in);
                g->ops->matmul_n(g->ctx, 2, dref, ws.devp, dxn2, n);
                g->ops->swiglu(g->ctx, dref[0], dref[1], ny);
                char what[96];
                snprintf(what, sizeof what, "norm_matmul_swiglu %s %dx%d n=%d: x kept",
                         fi_dtype_name(ALL_TYPES[ti]), rows, cols, n);
                check_x_kept(p, what, &in);
                float *xc = norm_cpu(p, &in), *hc = fvec(ny), *uc = fvec(ny);
                p->cpu->ops->matmul(p->cpu->ctx, hc, &ws.host[0], xc, n);
                p->cpu->ops->matmul(p->cpu->ctx, uc, &ws.host[1], xc, n);
                p->cpu->ops->swiglu(p->cpu->ctx, hc, uc, ny);
                float *hg = from_dev(g, dh, ny * sizeof(float));
                float *href = from_dev(g, dref[0], ny * sizeof(float));
                snprintf(what, sizeof what, "norm_matmul_swiglu %s %dx%d n=%d: h",
                         fi_dtype_name(ALL_TYPES[ti]), rows, cols, n);
                check_same(what, hg, href, hc, ny, TOL_GEMM);
                float *bufs[] = {dxn, dh, du, dref[0], dref[1], dxn2};
                for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
                    g->ops->free(g->ctx, bufs[i]);
                float *hbufs[] = {xc, hc, uc, hg, href};
                for (size_t i = 0; i < sizeof hbufs / sizeof hbufs[0]; i++)
                    free(hbufs[i]);
                norm_in_free(p, &in);
            }
            wset_release(p, &ws);
        }
    }
}

static void test_norm_matmul_swiglu_f16(void **state) {
    run_norm_matmul_swiglu(*state, "norm_matmul_swiglu_f16");
}

static void test_norm_matmul_swiglu_quant(void **state) {
    run_norm_matmul_swiglu(*state, "norm_matmul_swiglu_quant");
}

static void run_get_rows(pair *p, const char *test, double tol) {
    rng r = rng_for(test);
    const int rows = 1000, cols = 576, n = 37;
    for (size_t ti = 0; ti < sizeof ALL_TYPES / sizeof ALL_TYPES[0]; ti++) {
        fi_weight wc = make_weight(&r, ALL_TYPES[ti], rows, cols);
        fi_weight wg = gpu_weight(p, &wc);
        int32_t tok[37];
        for (int i = 0; i < n; i++)
            tok[i] = (int32_t)(rng_u32(&r) % rows);
        tok[0] = rows - 1;
        float *yc = fvec((size_t)n * cols), *yg = fvec((size_t)n * cols);
        p->cpu->ops->get_rows(p->cpu->ctx, yc, &wc, tok, n);
        int32_t *dt = dev_from(p->gpu, tok, sizeof tok);
        float *dy = dev_poisoned(p->gpu, (size_t)n * cols * sizeof(float));
        p->gpu->ops->get_rows(p->gpu->ctx, dy, &wg, dt, n);
        to_host(p->gpu, yg, dy, (size_t)n * cols * sizeof(float));
        char what[96];
        snprintf(what, sizeof what, "get_rows %s", fi_dtype_name(ALL_TYPES[ti]));
        /* quantised rows read in place are exact; fp16 tables round */
        int exact = fi_cuda_backend_weights(p->gpu) == FI_CUDA_WEIGHTS_QUANT &&
                    fi_dtype_block_elems(ALL_TYPES[ti]) != 1;
        check(what, yg, yc, (size_t)n * cols, exact ? 0.0 : tol);
        p->gpu->ops->free(p->gpu->ctx, dt);
        p->gpu->ops->free(p->gpu->ctx, dy);
        p->gpu->ops->weight_release(p->gpu->ctx, &wg);
        free((void *)wc.data);
        free(yc);
        free(yg);
    }
}

static void test_get_rows_f16(void **state) {
    run_get_rows(*state, "get_rows_f16", 1e-3);
}

static void test_get_rows_quant(void **state) {
    run_get_rows(*state, "get_rows_quant", 1e-3);
}

static void test_rmsnorm(void **state) {
    pair *p = *state;
    rng r = rng_for("rmsnorm");
    const int dims[] = {576, 2048, 4096};
    for (size_t k = 0; k < 3; k++) {
        int n = 7, dim = dims[k];
        size_t N = (size_t)n * dim;
        float *x = fvec(N), *g = fvec((size_t)dim), *yc = fvec(N), *yg = fvec(N);
        fill(&r, x, N, -3, 3);
        fill(&r, g, (size_t)dim, 0.5f, 1.5f);
        p->cpu->ops->rmsnorm(p->cpu->ctx, yc, x, g, n, dim, 1e-5f);
        float *dx = dev_from(p->gpu, x, N * 4), *dg = dev_from(p->gpu, g, (size_t)dim * 4);
        float *dy = dev_poisoned(p->gpu, N * 4);
        p->gpu->ops->rmsnorm(p->gpu->ctx, dy, dx, dg, n, dim, 1e-5f);
        to_host(p->gpu, yg, dy, N * 4);
        check("rmsnorm", yg, yc, N, TOL_F32);
        /* in place (y aliases x) */
        p->gpu->ops->rmsnorm(p->gpu->ctx, dx, dx, dg, n, dim, 1e-5f);
        to_host(p->gpu, yg, dx, N * 4);
        check("rmsnorm in place", yg, yc, N, TOL_F32);
        p->gpu->ops->free(p->gpu->ctx, dx);
        p->gpu->ops->free(p->gpu->ctx, dg);
        p->gpu->ops->free(p->gpu->ctx, dy);
        free(x);
        free(g);
        free(yc);
        free(yg);
    }
}

static void test_rope(void **state) {
    pair *p = *state;
    rng r = rng_for("rope");
    const int n = 9, heads = 9, hd = 64;
    size_t N = (size_t)n * heads * hd;
    int32_t pos[9];
    for (int i = 0; i < n; i++)
        pos[i] = (int32_t)(rng_u32(&r) % 8192);
    pos[0] = 0;
    float *x = fvec(N), *xg = fvec(N);
    fill(&r, x, N, -2, 2);
    float *dx = dev_from(p->gpu, x, N * 4);
    int32_t *dp = dev_from(p->gpu, pos, sizeof pos);
    p->cpu->ops->rope(p->cpu->ctx, x, n, heads, hd, pos, 100000.0f);
    p->gpu->ops->rope(p->gpu->ctx, dx, n, heads, hd, dp, 100000.0f);
    to_host(p->gpu, xg, dx, N * 4);
    check("rope (positions up to 8191)", xg, x, N, TOL_F32);
    p->gpu->ops->free(p->gpu->ctx, dx);
    p->gpu->ops->free(p->gpu->ctx, dp);
    free(x);
    free(xg);
}

/* rope on both backends, in place: x (host) on the CPU, dx on the GPU
 * (pos host, dpos its device copy); then checks the GPU's against the
 * CPU's (xg: room for the GPU's result). */
static void rope_both(pair *p, const char *what, float *x, float *dx, float *xg, int n, int heads,
                      int hd, const int32_t *pos, const int32_t *dpos, float theta) {
    size_t N = (size_t)n * heads * hd;
    p->cpu->ops->rope(p->cpu->ctx, x, n, heads, hd, pos, theta);
    p->gpu->ops->rope(p->gpu->ctx, dx, n, heads, hd, dpos, theta);
    to_host(p->gpu, xg, dx, N * sizeof(float));
    check(what, xg, x, N, TOL_F32);
}

/* Positions past the GPU's table of angles (8192 positions; computed in
 * double beyond), up to 100000, mixed with positions inside it; then the
 * same rows rotated again with another theta and other positions, then
 * read as twice the heads of half the head_dim with that theta: every
 * call's (theta, head_dim) differs from the one before, so a table made
 * for one and used for another fails the comparison. */
static void test_rope_far(void **state) {
    pair *p = *state;
    rng r = rng_for("rope_far");
    static const struct {
        int heads, hd;       /* shape of the rows */
        float theta, theta2; /* the first call's base, the other calls' */
    } cfg[] = {
        {9, 64, 100000.0f, 10000.0f},
        {3, 64, 100000.0f, 500000.0f},
        {32, 128, 10000.0f, 100000.0f},
        {8, 128, 500000.0f, 10000.0f},
    };
    static const int32_t edges[] = {0, 8191, 8192, 8193, 65535, 100000};
    enum { NE = sizeof edges / sizeof edges[0], N = 16 };
    for (size_t k = 0; k < sizeof cfg / sizeof cfg[0]; k++) {
        const int heads = cfg[k].heads, hd = cfg[k].hd;
        int32_t pos[N], pos2[N];
        for (int i = 0; i < N; i++) {
            /* half inside the table, half anywhere up to 100000 */
            pos[i] = i < NE ? edges[i] : (int32_t)(rng_u32(&r) % (i % 2 ? 8192u : 100001u));
            pos2[i] = (int32_t)(rng_u32(&r) % (i % 2 ? 8192u : 100001u));
        }
        pos2[0] = 8192;
        size_t NN = (size_t)N * heads * hd;
        float *x = fvec(NN), *xg = fvec(NN);
        fill(&r, x, NN, -2, 2);
        float *dx = dev_from(p->gpu, x, NN * sizeof(float));
        int32_t *dp = dev_from(p->gpu, pos, sizeof pos), *dp2 = dev_from(p->gpu, pos2, sizeof pos2);
        char what[96];
        snprintf(what, sizeof what, "rope %d heads hd %d theta %g, to 100000", heads, hd,
                 cfg[k].theta);
        rope_both(p, what, x, dx, xg, N, heads, hd, pos, dp, cfg[k].theta);
        snprintf(what, sizeof what, "  then theta %g, other positions", cfg[k].theta2);
        rope_both(p, what, x, dx, xg, N, heads, hd, pos2, dp2, cfg[k].theta2);
        snprintf(what, sizeof what, "  then as %d heads hd %d, theta %g", 2 * heads, hd / 2,
                 cfg[k].theta2);
        rope_both(p, what, x, dx, xg, N, 2 * heads, hd / 2, pos, dp, cfg[k].theta2);
        p->gpu->ops->free(p->gpu->ctx, dx);
        p->gpu->ops->free(p->gpu->ctx, dp);
        p->gpu->ops->free(p->gpu->ctx, dp2);
        free(x);
        free(xg);
    }
}

/* Over a paged cache: the rows of nblk blocks; with nseq sequences, query
 * token t belongs to t % nseq; sequence 0 reads the blocks in reverse,
 * sequence s > 0 rotated by s, so the block tables are exercised (every
 * sequence's table covers all nblk blocks: max_blocks is nblk). */
static void run_attention(pair *p, rng *r, int n, int first_pos, int heads, int kv_heads, int hd,
                          int nseq) {
    const int bsz = 16;
    int kv_dim = kv_heads * hd, nblk = (first_pos + n + bsz - 1) / bsz, np = nblk * bsz;
    size_t qn = (size_t)n * heads * hd, cn = (size_t)np * kv_dim;
    float *q = fvec(qn), *oc = fvec(qn), *og = fvec(qn), *tmp = fvec(cn);
    uint16_t *kc = malloc(cn * 2), *vc = malloc(cn * 2);
    assert_non_null(kc);
    assert_non_null(vc);
    fill(r, q, qn, -1, 1);
    fill(r, tmp, cn, -1, 1);
    for (size_t i = 0; i < cn; i++)
        kc[i] = fi_fp32_to_fp16(tmp[i]);
    fill(r, tmp, cn, -1, 1);
    for (size_t i = 0; i < cn; i++)
        vc[i] = fi_fp32_to_fp16(tmp[i]);
    int32_t *pos = malloc((size_t)n * sizeof *pos);
    assert_non_null(pos);
    size_t ntbl = (size_t)nseq * nblk;
    int32_t *seq = malloc((size_t)n * sizeof *seq), *tbl = malloc(ntbl * sizeof *tbl);
    assert_non_null(seq);
    assert_non_null(tbl);
    for (int t = 0; t < n; t++) {
        pos[t] = first_pos + t;
        seq[t] = t % nseq;
    }
    for (int b = 0; b < nblk; b++) {
        tbl[b] = nblk - 1 - b;
        for (int s = 1; s < nseq; s++)
            tbl[(size_t)s * nblk + b] = (b + s) % nblk;
    }
    fi_kv_map hmap = {.seq = seq, .tables = tbl, .max_blocks = nblk, .block_size = bsz};
    p->cpu->ops->attention(p->cpu->ctx, oc, q, kc, vc, n, pos, &hmap, heads, kv_heads, hd);
    float *dq = dev_from(p->gpu, q, qn * 4);
    uint16_t *dk = dev_from(p->gpu, kc, cn * 2), *dv = dev_from(p->gpu, vc, cn * 2);
    int32_t *dp = dev_from(p->gpu, pos, (size_t)n * sizeof *pos);
    int32_t *dseq = dev_from(p->gpu, seq, (size_t)n * sizeof *seq);
    int32_t *dtbl = dev_from(p->gpu, tbl, ntbl * sizeof *tbl);
    fi_kv_map dmap = {.seq = dseq, .tables = dtbl, .max_blocks = nblk, .block_size = bsz};
    float *dout = dev_poisoned(p->gpu, qn * 4);
    p->gpu->ops->attention(p->gpu->ctx, dout, dq, dk, dv, n, dp, &dmap, heads, kv_heads, hd);
    to_host(p->gpu, og, dout, qn * 4);
    char what[96];
    snprintf(what, sizeof what, "attention n=%d pos %d.. heads %d/%d hd %d seqs %d", n, first_pos,
             heads, kv_heads, hd, nseq);
    check(what, og, oc, qn, TOL_ATT);
    void *bufs[] = {dq, dk, dv, dp, dout, dseq, dtbl};
    for (size_t i = 0; i < 7; i++)
        p->gpu->ops->free(p->gpu->ctx, bufs[i]);
    free(q);
    free(oc);
    free(og);
    free(tmp);
    free(kc);
    free(vc);
    free(pos);
    free(seq);
    free(tbl);
}

static void test_attention(void **state) {
    pair *p = *state;
    rng r = rng_for("attention");
    run_attention(p, &r, 1, 0, 9, 3, 64, 1);      /* first token */
    run_attention(p, &r, 1, 130, 9, 3, 64, 1);    /* decode, split */
    run_attention(p, &r, 1, 4095, 9, 3, 64, 1);   /* decode, long context */
    run_attention(p, &r, 37, 0, 9, 3, 64, 1);     /* prefill */
    run_attention(p, &r, 256, 300, 9, 3, 64, 1);  /* prefill chunk after a prompt */
    run_attention(p, &r, 5, 77, 32, 8, 128, 1);   /* a Llama-3-8B-like shape */
    run_attention(p, &r, 2, 50, 4, 4, 80, 1);     /* head_dim not a multiple of 32 */
    run_attention(p, &r, 8, 200, 9, 3, 64, 2);    /* two sequences in one batch */
    run_attention(p, &r, 64, 1000, 9, 3, 64, 2);  /* batched decode-like, long */
}

/* The shapes the grouped kernel (one block per token and KV head, head_dim
 * 32, 64 or 128, up to 8 query heads per KV head) and the old one divide
 * between them: decode around the block boundaries and far out, a group of
 * 8, groups of 1, a long prefill, and a batch of 32 sequences. */
static void test_attention_shapes(void **state) {
    pair *p = *state;
    rng r = rng_for("attention_shapes");
    const int decode_pos[] = {0, 17, 127, 128, 129, 5000};
    for (size_t i = 0; i < sizeof decode_pos / sizeof decode_pos[0]; i++)
        run_attention(p, &r, 1, decode_pos[i], 9, 3, 64, 1);
    run_attention(p, &r, 1, 5000, 32, 4, 128, 1); /* group of 8, decode */
    run_attention(p, &r, 3, 40, 32, 4, 128, 1);   /* group of 8, a few tokens */
    run_attention(p, &r, 2, 300, 4, 4, 32, 1);    /* hd 32, group of 1 */
    run_attention(p, &r, 300, 0, 8, 2, 128, 1);   /* hd 128 prefill */
    run_attention(p, &r, 32, 700, 9, 3, 64, 32);  /* one token of each of 32 sequences */
}

static void test_store_f16(void **state) {
    pair *p = *state;
    rng r = rng_for("store_f16");
    size_t n = 100003;
    float *x = fvec(n);
    fill(&r, x, n, -70000, 70000); /* beyond fp16's range too */
    for (size_t i = 0; i < 1000; i++)
        x[i] = rng_f(&r, -1e-6f, 1e-6f); /* subnormals */
    uint16_t *hc = malloc(n * 2), *hg = malloc(n * 2);
    assert_non_null(hc);
    assert_non_null(hg);
    p->cpu->ops->store_f16(p->cpu->ctx, hc, x, n);
    float *dx = dev_from(p->gpu, x, n * 4);
    uint16_t *dh = dev_poisoned(p->gpu, n * 2);
    p->gpu->ops->store_f16(p->gpu->ctx, dh, dx, n);
    to_host(p->gpu, hg, dh, n * 2);
    size_t bad = 0;
    for (size_t i = 0; i < n; i++)
        bad += hc[i] != hg[i];
    printf("  store_f16: %zu of %zu differ (must be 0)\n", bad, n);
    assert_int_equal(bad, 0);
    p->gpu->ops->free(p->gpu->ctx, dx);
    p->gpu->ops->free(p->gpu->ctx, dh);
    free(x);
    free(hc);
    free(hg);
}

/* The shape of one layer's RoPE and KV cache rows. */
typedef struct rope_shape {
    int heads, kv_heads, hd; /* query heads, KV heads, head_dim */
    float theta;             /* RoPE base */
} rope_shape;

/* One rope_store call of n tokens, at the positions pos, into caches of
 * 2n + 16 rows filled with random bits first, at slots the first n of a
 * random permutation of the rows, checked as test_rope_store says. */
static void run_rope_store(pair *p, rng *r, const rope_shape *s, int n, const int32_t *pos) {
    fi_backend *g = p->gpu;
    const int kv_dim = s->kv_heads * s->hd, nrows = 2 * n + 16;
    const size_t qn = (size_t)n * s->heads * s->hd, kn = (size_t)n * kv_dim;
    const size_t cn = (size_t)nrows * kv_dim;
    float *q = fvec(qn), *k = fvec(kn), *v = fvec(kn);
    fill(r, q, qn, -2, 2);
    fill(r, k, kn, -2, 2);
    fill(r, v, kn, -2, 2);
    int32_t *slot = malloc((size_t)nrows * sizeof *slot);
    uint16_t *poison = malloc(cn * sizeof *poison);
    assert_non_null(slot);
    assert_non_null(poison);
    for (int i = 0; i < nrows; i++)
        slot[i] = i;
    for (int i = nrows - 1; i > 0; i--) {
        int j = (int)(rng_u32(r) % (uint32_t)(i + 1));
        int32_t t = slot[i];
        slot[i] = slot[j];
        slot[j] = t;
    }
    for (size_t i = 0; i < cn; i++)
        poison[i] = (uint16_t)rng_u32(r);
    /* the fused call's operands, and copies for the unfused calls */
    const size_t fb = sizeof(float), hb = sizeof(uint16_t);
    float *dq = dev_from(g, q, qn * fb), *dk = dev_from(g, k, kn * fb);
    float *dq2 = dev_from(g, q, qn * fb), *dk2 = dev_from(g, k, kn * fb);
    float *dv = dev_from(g, v, kn * fb);
    int32_t *dpos = dev_from(g, pos, (size_t)n * sizeof *pos);
    int32_t *dslot = dev_from(g, slot, (size_t)n * sizeof *slot);
    uint16_t *dkc = dev_from(g, poison, cn * hb), *dvc = dev_from(g, poison, cn * hb);
    uint16_t *dkc2 = dev_from(g, poison, cn * hb), *dvc2 = dev_from(g, poison, cn * hb);
    g->ops->rope_store(g->ctx, dq, dk, dv, dkc, dvc, n, s->heads, s->kv_heads, s->hd, dpos,
                       s->theta, dslot);
    g->ops->rope(g->ctx, dq2, n, s->heads, s->hd, dpos, s->theta);
    g->ops->rope(g->ctx, dk2, n, s->kv_heads, s->hd, dpos, s->theta);
    g->ops->kv_store(g->ctx, dkc2, dk2, n, dslot, kv_dim, s->hd);
    g->ops->kv_store(g->ctx, dvc2, dv, n, dslot, kv_dim, s->hd);
    float *qg = from_dev(g, dq, qn * fb), *qg2 = from_dev(g, dq2, qn * fb);
    float *kg = from_dev(g, dk, kn * fb), *kg2 = from_dev(g, dk2, kn * fb);
    float *vg = from_dev(g, dv, kn * fb);
    uint16_t *kcg = from_dev(g, dkc, cn * hb), *kcg2 = from_dev(g, dkc2, cn * hb);
    uint16_t *vcg = from_dev(g, dvc, cn * hb), *vcg2 = from_dev(g, dvc2, cn * hb);
    p->cpu->ops->rope(p->cpu->ctx, q, n, s->heads, s->hd, pos, s->theta);
    p->cpu->ops->rope(p->cpu->ctx, k, n, s->kv_heads, s->hd, pos, s->theta);
    char what[96];
    printf("  rope_store heads %d/%d hd %d theta %g n=%d\n", s->heads, s->kv_heads, s->hd,
           s->theta, n);
    check_same("  q", qg, qg2, q, qn, TOL_F32);
    check_same("  k", kg, kg2, k, kn, TOL_F32);
    check_bits("  v kept", vg, v, kn, fb);
    check_bits("  k cache, as rope then kv_store", kcg, kcg2, cn, hb);
    check_bits("  v cache, as kv_store", vcg, vcg2, cn, hb);
    /* the slot rows hold fp16 of the GPU's roped k and of v, the other
     * rows the poison still. Against the CPU's roped k, only within
     * TOL_KV: it is within TOL_F32 of the GPU's, and near a rounding
     * boundary may round to the neighbouring fp16 value. */
    uint16_t *wk = malloc(cn * hb), *wv = malloc(cn * hb);
    assert_non_null(wk);
    assert_non_null(wv);
    memcpy(wk, poison, cn * hb);
    memcpy(wv, poison, cn * hb);
    float *kcf = fvec(kn);
    for (int t = 0; t < n; t++)
        for (int e = 0; e < kv_dim; e++) {
            size_t src = (size_t)t * kv_dim + e, dst = (size_t)slot[t] * kv_dim + e;
            wk[dst] = fi_fp32_to_fp16(kg[src]);
            wv[dst] = fi_fp32_to_fp16(v[src]);
            kcf[src] = fi_fp16_to_fp32(kcg[dst]);
        }
    snprintf(what, sizeof what, "  k cache: fp16(k) at %d slots of %d rows", n, nrows);
    check_bits(what, kcg, wk, cn, hb);
    snprintf(what, sizeof what, "  v cache: fp16(v) at %d slots of %d rows", n, nrows);
    check_bits(what, vcg, wv, cn, hb);
    check("  k cache rows against the CPU's k", kcf, k, kn, TOL_KV);
    void *bufs[] = {dq, dk, dv, dq2, dk2, dpos, dslot, dkc, dvc, dkc2, dvc2};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        g->ops->free(g->ctx, bufs[i]);
    void *hbufs[] = {q, k, v, slot, poison, qg, qg2, kg, kg2,
                     vg, kcg, kcg2, vcg, vcg2, wk, wv, kcf};
    for (size_t i = 0; i < sizeof hbufs / sizeof hbufs[0]; i++)
        free(hbufs[i]);
}

/* rope_store leaves in q and k the bits of the GPU's rope of each (run
 * after it, on copies), within TOL_F32 of the CPU's; in the caches the
 * bits of the GPU's kv_store of the roped k and of v (on a second pair of
 * caches), which are fp16 of those values at the slot rows, the rows
 * outside slot untouched; and v as it was. Positions go up to 20000:
 * among them 0 and one past the GPU's table of angles (8192 positions);
 * a single token is at one or the other, by shape. */
static void test_rope_store(void **state) {
    pair *p = *state;
    if (!p->gpu->ops->rope_store)
        fail_msg("ops->rope_store is NULL: the CUDA backend must provide it");
    rng r = rng_for("rope_store");
    static const rope_shape shapes[] = {
        {9, 3, 64, 100000.0f},   /* the default model */
        {32, 8, 128, 500000.0f}, /* Llama-3-8B-like */
        {4, 4, 32, 10000.0f},    /* no grouping, head_dim 32 */
    };
    static const int ns[] = {1, 7, 33};
    enum { NMAX = 33, FAR = 8192, POS_MAX = 20000 };
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        for (size_t k = 0; k < sizeof ns / sizeof ns[0]; k++) {
            const int n = ns[k];
            int32_t pos[NMAX];
            for (int t = 0; t < n; t++)
                pos[t] = (int32_t)(rng_u32(&r) % (POS_MAX + 1u));
            int32_t far = FAR + (int32_t)(rng_u32(&r) % (uint32_t)(POS_MAX - FAR + 1));
            if (n > 1) {
                pos[0] = 0;
                pos[n - 1] = far;
            } else {
                pos[0] = si % 2 ? far : 0;
            }
            run_rope_store(p, &r, &shapes[si], n, pos);
        }
    }
}

static void test_swiglu_add(void **state) {
    pair *p = *state;
    rng r = rng_for("swiglu_add");
    size_t n = 3 * 1536 + 5;
    float *g = fvec(n), *u = fvec(n), *out = fvec(n);
    fill(&r, g, n, -8, 8);
    fill(&r, u, n, -2, 2);
    float *dg = dev_from(p->gpu, g, n * 4), *du = dev_from(p->gpu, u, n * 4);
    p->cpu->ops->swiglu(p->cpu->ctx, g, u, n);
    p->gpu->ops->swiglu(p->gpu->ctx, dg, du, n);
    to_host(p->gpu, out, dg, n * 4);
    check("swiglu", out, g, n, TOL_F32);
    p->cpu->ops->add(p->cpu->ctx, g, u, n);
    p->gpu->ops->add(p->gpu->ctx, dg, du, n);
    to_host(p->gpu, out, dg, n * 4);
    check("add", out, g, n, TOL_F32);
    p->gpu->ops->free(p->gpu->ctx, dg);
    p->gpu->ops->free(p->gpu->ctx, du);
    free(g);
    free(u);
    free(out);
}

static void test_argmax(void **state) {
    pair *p = *state;
    rng r = rng_for("argmax");
    const int sizes[] = {1, 31, 1024, 49152, 128256};
    for (size_t k = 0; k < 5; k++) {
        int n = sizes[k];
        float *x = fvec((size_t)n);
        fill(&r, x, (size_t)n, -10, 10);
        int want = (int)(rng_u32(&r) % (uint32_t)n);
        x[want] = 11.0f;
        if (n > 10) {
            x[n - 1] = 11.0f; /* a tie: the first index wins */
            x[0] = NAN;       /* NaN never wins */
            if (want == 0 || want == n - 1)
                want = n - 1, x[0] = -INFINITY;
        }
        float *dx = dev_from(p->gpu, x, (size_t)n * 4);
        int32_t got = -1;
        int rc = p->gpu->ops->argmax(p->gpu->ctx, &got, dx, n);
        assert_int_equal(rc, 0);
        printf("  argmax n=%d: %d (want %d)\n", n, got, want);
        assert_int_equal(got, want);
        p->gpu->ops->free(p->gpu->ctx, dx);
        free(x);
    }
}

/* An error inside an operation comes back from sync and to_host with the
 * backend's message, and the backend stays failed. */
static void test_error_reported(void **state) {
    pair *p = *state;
    fi_weight w = {0};
    w.type = FI_DTYPE_F16;
    w.rows = 4;
    w.cols = 32;
    w.row_bytes = 64;
    float *dx = p->gpu->ops->alloc(p->gpu->ctx, 32 * 4), *dy = p->gpu->ops->alloc(p->gpu->ctx, 16);
    assert_non_null(dx);
    assert_non_null(dy);
    assert_null(p->gpu->ops->last_error(p->gpu->ctx));
    p->gpu->ops->matmul(p->gpu->ctx, dy, &w, dx, 1); /* never uploaded */
    assert_int_equal(p->gpu->ops->sync(p->gpu->ctx), -1);
    const char *e = p->gpu->ops->last_error(p->gpu->ctx);
    assert_non_null(e);
    printf("  error: %s\n", e);
    float y[4];
    assert_int_equal(p->gpu->ops->to_host(p->gpu->ctx, y, dy, sizeof y), -1);
    p->gpu->ops->free(p->gpu->ctx, dx);
    p->gpu->ops->free(p->gpu->ctx, dy);
}

/* Recorded steps give the same results as direct calls, with new inputs
 * each time: the first step of a key runs directly (graph_begin -1), the
 * next is instantiated, later ones update it in place, and each key keeps
 * its own graph (key 2 in between does not cost key 1 a new one). */
static void test_graph(void **state) {
    pair *p = *state;
    fi_backend *g = p->gpu;
    assert_int_equal(fi_cuda_backend_set_graphs(g, 1), 0);
    rng r = rng_for("graph");
    const size_t n = 4096;
    float *x = fvec(n), *y = fvec(n), *want = fvec(n), *got = fvec(n);
    float *dx = g->ops->alloc(g->ctx, n * 4), *dy = g->ops->alloc(g->ctx, n * 4);
    assert_non_null(dx);
    assert_non_null(dy);
    static const int keys[] = {1, 1, 1, 2, 2, 1, 2, 1};
    const int direct[] = {1, 0, 0, 1, 0, 0, 0, 0}; /* the first step of each key */
    for (int step = 0; step < 8; step++) {
        fill(&r, x, n, -1, 1);
        fill(&r, y, n, -1, 1);
        for (size_t i = 0; i < n; i++)
            want[i] = y[i];
        p->cpu->ops->add(p->cpu->ctx, want, x, n);
        p->cpu->ops->swiglu(p->cpu->ctx, want, x, n);
        assert_int_equal(g->ops->to_backend(g->ctx, dy, y, n * 4), 0); /* outside */
        int rec = g->ops->graph_begin(g->ctx, keys[step], n * 4) == 0;
        assert_int_equal(rec, !direct[step]);
        assert_int_equal(g->ops->to_backend(g->ctx, dx, x, n * 4), 0); /* staged when recording */
        memset(x, 0, n * 4); /* the staged copy must not read x later */
        g->ops->add(g->ctx, dy, dx, n);
        g->ops->swiglu(g->ctx, dy, dx, n);
        if (rec)
            assert_int_equal(g->ops->graph_end(g->ctx), 0);
        to_host(g, got, dy, n * 4);
        check("graph step: add, swiglu", got, want, n, TOL_F32);
    }
    long launched, inst;
    fi_cuda_backend_graph_stats(g, &launched, &inst);
    printf("  graphs: %ld launched, %ld instantiated\n", launched, inst);
    assert_int_equal(launched, 6);
    assert_int_equal(inst, 2);
    /* declined without a failure: more upload than is staged, a key out of
     * range, graphs off */
    assert_int_equal(g->ops->graph_begin(g->ctx, 1, (size_t)1 << 20), -1);
    assert_int_equal(g->ops->graph_begin(g->ctx, 0, 16), -1);
    assert_int_equal(g->ops->graph_begin(g->ctx, 65, 16), -1);
    assert_int_equal(fi_cuda_backend_set_graphs(g, 0), 0);
    assert_int_equal(g->ops->graph_begin(g->ctx, 1, 16), -1); /* off: the caller goes on without */
    assert_int_equal(g->ops->sync(g->ctx), 0);
    g->ops->free(g->ctx, dx);
    g->ops->free(g->ctx, dy);
    free(x);
    free(y);
    free(want);
    free(got);
}

/* A call that cannot be recorded fails the backend with a message rather
 * than running out of order. */
static void test_graph_misuse(void **state) {
    pair *p = *state;
    fi_backend *g = p->gpu;
    float *d = g->ops->alloc(g->ctx, 64), h[16];
    assert_non_null(d);
    assert_int_equal(g->ops->graph_begin(g->ctx, 7, 0), -1); /* the first step of key 7 */
    assert_int_equal(g->ops->graph_begin(g->ctx, 7, 0), 0);
    assert_int_equal(g->ops->to_host(g->ctx, h, d, sizeof h), -1);
    assert_int_equal(g->ops->graph_end(g->ctx), -1);
    printf("  error: %s\n", g->ops->last_error(g->ctx));
    assert_non_null(strstr(g->ops->last_error(g->ctx), "graph"));
    assert_int_equal(g->ops->sync(g->ctx), -1);
}

/* What a step of test_graph's shape depends on: its buffers and size.
 * Its signature for graph_begin_sig is these as integers (no padding). */
typedef struct sig_args {
    float *dx; /* device: x, uploaded inside the step */
    float *dy; /* device: y, uploaded before it, then y += x; y = silu(y) * x */
    size_t n;  /* floats in each */
} sig_args;

/* One step as in test_graph under graph_begin_sig(key, a's signature),
 * with fresh x and y, checked against the CPU: a relaunched step must
 * have used this step's upload of x. Returns graph_begin_sig's result. */
static int sig_step(pair *p, rng *r, int key, const sig_args *a, const char *what) {
    fi_backend *g = p->gpu;
    const size_t n = a->n;
    const uint64_t sig[3] = {(uint64_t)(uintptr_t)a->dx, (uint64_t)(uintptr_t)a->dy, n};
    float *x = fvec(n), *y = fvec(n), *want = fvec(n), *got = fvec(n);
    fill(r, x, n, -1, 1);
    fill(r, y, n, -1, 1);
    memcpy(want, y, n * sizeof(float));
    p->cpu->ops->add(p->cpu->ctx, want, x, n);
    p->cpu->ops->swiglu(p->cpu->ctx, want, x, n);
    assert_int_equal(g->ops->to_backend(g->ctx, a->dy, y, n * 4), 0); /* outside */
    int rc = g->ops->graph_begin_sig(g->ctx, key, n * 4, sig, sizeof sig);
    assert_int_equal(g->ops->to_backend(g->ctx, a->dx, x, n * 4), 0); /* staged */
    memset(x, 0, n * 4); /* the staged copy must not read x later */
    g->ops->add(g->ctx, a->dy, a->dx, n);
    g->ops->swiglu(g->ctx, a->dy, a->dx, n);
    if (rc == 0) {
        int e = g->ops->graph_end(g->ctx);
        if (e)
            fprintf(stderr, "graph_end: %s\n", g->ops->last_error(g->ctx));
        assert_int_equal(e, 0);
    }
    to_host(g, got, a->dy, n * 4);
    check(what, got, want, n, TOL_F32);
    free(x);
    free(y);
    free(want);
    free(got);
    return rc;
}

/* sig_step, expecting graph_begin_sig to return begin and the counters
 * to grow by one launch when it records or relaunches, and by `replayed`
 * relaunches. */
static void sig_step_expect(pair *p, rng *r, int key, const sig_args *a, const char *what,
                            int begin, int replayed) {
    long l0, l1, i0, i1, r0 = fi_cuda_backend_graph_replays(p->gpu);
    fi_cuda_backend_graph_stats(p->gpu, &l0, &i0);
    int rc = sig_step(p, r, key, a, what);
    long r1 = fi_cuda_backend_graph_replays(p->gpu);
    fi_cuda_backend_graph_stats(p->gpu, &l1, &i1);
    printf("    graph_begin_sig %d (want %d); launched +%ld, instantiated +%ld, relaunched +%ld "
           "(want %d)\n", rc, begin, l1 - l0, i1 - i0, r1 - r0, replayed);
    assert_int_equal(rc, begin);
    assert_int_equal(l1 - l0, begin == 0);
    assert_int_equal(r1 - r0, replayed);
}

/* A graph-capable GPU backend with graphs on, and graph_begin_sig. */
static fi_backend *sig_backend(pair *p) {
    fi_backend *g = p->gpu;
    if (!g->ops->graph_begin_sig)
        fail_msg("ops->graph_begin_sig is NULL: the CUDA backend must provide it");
    assert_int_equal(fi_cuda_backend_set_graphs(g, 1), 0);
    return g;
}

/* Steps with the signature of their key's last recording are relaunched
 * (the replay counter grows by one each), with each step's new upload; a
 * step whose signature differs from its key's last recording records again
 * (one recording per key is kept: so does the old signature after it); and
 * key 4's steps leave key 3's recording in place. */
static void test_graph_sig(void **state) {
    pair *p = *state;
    fi_backend *g = sig_backend(p);
    rng r = rng_for("graph_sig");
    const size_t n = 4096;
    float *dx = g->ops->alloc(g->ctx, n * 4), *dy = g->ops->alloc(g->ctx, n * 4),
          *dy2 = g->ops->alloc(g->ctx, n * 4), *dy4 = g->ops->alloc(g->ctx, n * 4);
    assert_non_null(dx);
    assert_non_null(dy);
    assert_non_null(dy2);
    assert_non_null(dy4);
    const sig_args a = {dx, dy, n}, b = {dx, dy2, n}, c = {dx, dy4, n / 2};
    static const struct {
        int key;          /* graph key */
        char which;       /* 'a', 'b' (key 3's), 'c' (key 4's) */
        int begin;        /* graph_begin_sig's result */
        int replayed;     /* relaunches it adds */
        const char *what; /* what the step shows */
    } plan[] = {
        {3, 'a', -1, 0, "key 3 sig a: first step, direct"},
        {3, 'a', 0, 0, "key 3 sig a: recorded"},
        {3, 'a', 0, 1, "key 3 sig a: relaunched"},
        {3, 'a', 0, 1, "key 3 sig a: relaunched"},
        {3, 'a', 0, 1, "key 3 sig a: relaunched"},
        {3, 'a', 0, 1, "key 3 sig a: relaunched"},
        {3, 'a', 0, 1, "key 3 sig a: relaunched"},
        {3, 'a', 0, 1, "key 3 sig a: relaunched"},
        {3, 'b', 0, 0, "key 3 sig b (other y): recorded"},
        {3, 'a', 0, 0, "key 3 sig a after b: recorded"},
        {3, 'a', 0, 1, "key 3 sig a: relaunched"},
        {4, 'c', -1, 0, "key 4 sig c: first step, direct"},
        {4, 'c', 0, 0, "key 4 sig c: recorded"},
        {3, 'a', 0, 1, "key 3 sig a after key 4: relaunched"},
        {4, 'c', 0, 1, "key 4 sig c: relaunched"},
        {3, 'a', 0, 1, "key 3 sig a: relaunched"},
    };
    for (size_t i = 0; i < sizeof plan / sizeof plan[0]; i++) {
        const sig_args *s = plan[i].which == 'a' ? &a : plan[i].which == 'b' ? &b : &c;
        sig_step_expect(p, &r, plan[i].key, s, plan[i].what, plan[i].begin, plan[i].replayed);
    }
    long launched, inst, replays = fi_cuda_backend_graph_replays(g);
    fi_cuda_backend_graph_stats(g, &launched, &inst);
    printf("  graphs: %ld launched, %ld instantiated, %ld relaunched\n", launched, inst, replays);
    /* graphs off: declined, as graph_begin is, and nothing relaunched */
    assert_int_equal(fi_cuda_backend_set_graphs(g, 0), 0);
    sig_step_expect(p, &r, 3, &a, "key 3 sig a, graphs off: direct", -1, 0);
    assert_int_equal(g->ops->sync(g->ctx), 0);
    assert_null(g->ops->last_error(g->ctx));
    float *bufs[] = {dx, dy, dy2, dy4};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        g->ops->free(g->ctx, bufs[i]);
}

/* A relaunched step whose calls differ from the recording's (another
 * output pointer for add, or swiglu left out) fails the backend: graph_end
 * returns -1 with a message that says "replay", and the backend stays
 * failed. */
static void run_graph_sig_mismatch(pair *p, const char *test, int leave_out) {
    fi_backend *g = sig_backend(p);
    rng r = rng_for(test);
    const size_t n = 1024;
    float *dx = g->ops->alloc(g->ctx, n * 4), *dy = g->ops->alloc(g->ctx, n * 4),
          *dother = g->ops->alloc(g->ctx, n * 4), *x = fvec(n);
    assert_non_null(dx);
    assert_non_null(dy);
    assert_non_null(dother);
    const sig_args a = {dx, dy, n};
    sig_step_expect(p, &r, 5, &a, "key 5: first step, direct", -1, 0);
    sig_step_expect(p, &r, 5, &a, "key 5: recorded", 0, 0);
    sig_step_expect(p, &r, 5, &a, "key 5: relaunched", 0, 1);
    /* the same signature, other calls */
    const uint64_t sig[3] = {(uint64_t)(uintptr_t)dx, (uint64_t)(uintptr_t)dy, n};
    fill(&r, x, n, -1, 1);
    assert_int_equal(g->ops->graph_begin_sig(g->ctx, 5, n * 4, sig, sizeof sig), 0);
    assert_int_equal(g->ops->to_backend(g->ctx, dx, x, n * 4), 0);
    g->ops->add(g->ctx, leave_out ? dy : dother, dx, n);
    if (!leave_out)
        g->ops->swiglu(g->ctx, dy, dx, n);
    assert_int_equal(g->ops->graph_end(g->ctx), -1);
    const char *e = g->ops->last_error(g->ctx);
    assert_non_null(e);
    printf("  %s: %s\n", leave_out ? "swiglu left out" : "add to another buffer", e);
    assert_non_null(strstr(e, "replay"));
    assert_int_equal(g->ops->sync(g->ctx), -1);
    g->ops->free(g->ctx, dx);
    g->ops->free(g->ctx, dy);
    g->ops->free(g->ctx, dother);
    free(x);
}

static void test_graph_sig_mismatch(void **state) {
    run_graph_sig_mismatch(*state, "graph_sig_mismatch", 0);
}

static void test_graph_sig_missing_call(void **state) {
    run_graph_sig_mismatch(*state, "graph_sig_missing_call", 1);
}

/* --- the model end to end ------------------------------------------------ */

static double cosine(const float *a, const float *b, int n) {
    double ab = 0, aa = 0, bb = 0;
    for (int i = 0; i < n; i++) {
        ab += (double)a[i] * b[i];
        aa += (double)a[i] * a[i];
        bb += (double)b[i] * b[i];
    }
    return ab / (sqrt(aa) * sqrt(bb) + 1e-30);
}

static int argmax2(const float *x, int n, double *gap) {
    int b = 0, s = -1;
    for (int i = 1; i < n; i++)
        if (x[i] > x[b])
            b = i;
    for (int i = 0; i < n; i++)
        if (i != b && (s < 0 || x[i] > x[s]))
            s = i;
    *gap = s < 0 ? INFINITY : (double)x[b] - x[s];
    return b;
}

static void check_logits(const char *what, const float *g, const float *c, int V) {
    double gap, gapg;
    int bc = argmax2(c, V, &gap), bg = argmax2(g, V, &gapg);
    double cs = cosine(g, c, V), d1 = fabs((double)g[bc] - c[bc]);
    printf("  %-28s cos %.6f, top-1 logit diff %.4f, argmax %d/%d\n", what, cs, d1, bg, bc);
    assert_true(cs >= COS_MIN);
    assert_true(d1 <= LOGIT_TOL);
    assert_true(bg == bc || gap < NEAR_TIE);
}

/* ALONE_STEPS more decode steps of the GPU session sg with no other
 * session of its model in between, so that its steps have one signature
 * and the backend relaunches them (graph_begin_sig). lc and lg hold the
 * logits of the same tokens on entry; both sessions take the CPU's choice
 * each step, so that they stay on the same tokens past a near tie
 * (check_logits allows the GPU's argmax to differ there). */
static void decode_alone(fi_session *sc, fi_session *sg, float *lc, float *lg, int V, size_t k) {
    char err[512], what[64];
    for (int step = 0;; step++) {
        double gap;
        int32_t tc = argmax2(lc, V, &gap);
        snprintf(what, sizeof what, "prompt %zu, alone %d", k, step);
        check_logits(what, lg, lc, V);
        if (step == ALONE_STEPS)
            break;
        assert_int_equal(fi_session_eval(sc, &tc, 1, lc, NULL, err, sizeof err), 0);
        if (fi_session_eval(sg, &tc, 1, lg, NULL, err, sizeof err) != 0)
            fail_msg("cuda eval: %s", err);
    }
}

static void run_model(const char *path, fi_cuda_weights mode, int graphs) {
    char err[512];
    if (setenv("FEDINFER_CUDA_WEIGHTS", mode == FI_CUDA_WEIGHTS_QUANT ? "quant" : "f16", 1) ||
        setenv("FEDINFER_CUDA_GRAPHS", graphs ? "1" : "0", 1))
        fail_msg("setenv");
    printf("  weights %s, graphs %s\n", mode == FI_CUDA_WEIGHTS_QUANT ? "quant" : "f16",
           graphs ? "on" : "off");
    fi_model_opts oc = {.simd = FI_SIMD_AUTO, .act_bits = 16, .device = FI_DEVICE_CPU},
                  og = {.simd = FI_SIMD_AUTO, .device = FI_DEVICE_CUDA};
    fi_model *mc = fi_model_load(path, &oc, err, sizeof err);
    assert_non_null(mc);
    fi_model *mg = fi_model_load(path, &og, err, sizeof err);
    if (!mg)
        fail_msg("cuda model: %s", err);
    assert_true(fi_cuda_backend_is(fi_model_backend(mg)));
    assert_int_equal(fi_cuda_backend_weights(fi_model_backend(mg)), mode);
    int V = fi_model_config(mc)->n_vocab;
    const char *prompts[] = {
        "The capital of France is",
        "def fibonacci(n):\n    ",
        "Federated inference keeps regulated data where the law says it must stay, while "
        "still letting every site use a capable language model. Hospitals, banks and "
        "factories each run a local engine and send work elsewhere only when policy allows. "
        "In short,",
    };
    float *lc = fvec((size_t)V), *lg = fvec((size_t)V);
    for (size_t k = 0; k < sizeof prompts / sizeof prompts[0]; k++) {
        int32_t toks[512];
        int n = fi_tok_encode(fi_model_tok(mc), prompts[k], strlen(prompts[k]), 0, toks, 512);
        assert_true(n > 0);
        fi_session *sc = fi_session_new(mc, 512, err, sizeof err);
        fi_session *sg = fi_session_new(mg, 512, err, sizeof err);
        assert_non_null(sc);
        assert_non_null(sg);
        /* prefill with every row of logits */
        float *ac = fvec((size_t)n * V), *ag = fvec((size_t)n * V);
        assert_int_equal(fi_session_eval(sc, toks, n, lc, ac, err, sizeof err), 0);
        if (fi_session_eval(sg, toks, n, lg, ag, err, sizeof err) != 0)
            fail_msg("cuda eval: %s", err);
        char what[64];
        for (int t = 0; t < n; t += n > 4 ? n / 4 : 1) {
            snprintf(what, sizeof what, "prompt %zu, position %d", k, t);
            check_logits(what, ag + (size_t)t * V, ac + (size_t)t * V, V);
        }
        free(ac);
        free(ag);
        /* greedy decode, one token per call; a third session decodes with
         * the argmax on the device and must pick the GPU's own tokens */
        fi_session *s2 = fi_session_new(mg, 512, err, sizeof err);
        assert_non_null(s2);
        int32_t t2 = -1;
        if (fi_session_eval_greedy(s2, toks, n, &t2, err, sizeof err) != 0)
            fail_msg("cuda eval_greedy: %s", err);
        int same = 0, tie_stop = 0;
        for (int step = 0; step < GREEDY_STEPS; step++) {
            double gap, gapg;
            int32_t tc = argmax2(lc, V, &gap), tg = argmax2(lg, V, &gapg);
            /* same device, same kernels: equal, except that the first step's
             * logits came from a differently shaped product: all n rows of
             * the output against the last one only, which in quant mode is
             * another kernel (fp16 GEMM against the block-reading one), so
             * a near tie of the fp16 products' size (NEAR_TIE) */
            if (t2 != tg) {
                printf("  eval_greedy picked %d, logits %d (gap %.2g)\n", t2, tg, gapg);
                assert_true(step == 0 && gapg < NEAR_TIE);
                t2 = tg;
            }
            snprintf(what, sizeof what, "prompt %zu, step %d", k, step);
            check_logits(what, lg, lc, V);
            if (tc != tg) {
                printf("  near tie at step %d (gap %.4f): comparison stops\n", step, gap);
                tie_stop = 1;
                break;
            }
            same++;
            assert_int_equal(fi_session_eval(sc, &tc, 1, lc, NULL, err, sizeof err), 0);
            if (fi_session_eval(sg, &tg, 1, lg, NULL, err, sizeof err) != 0)
                fail_msg("cuda eval: %s", err);
            if (fi_session_eval_greedy(s2, &tg, 1, &t2, err, sizeof err) != 0)
                fail_msg("cuda eval_greedy: %s", err);
        }
        fi_session_destroy(&s2);
        printf("  prompt %zu: %d greedy tokens identical\n", k, same);
        assert_true(same >= 8 || tie_stop);
        decode_alone(sc, sg, lc, lg, V, k);
        fi_session_destroy(&sc);
        fi_session_destroy(&sg);
    }
    free(lc);
    free(lg);
    long launched, inst, replays = fi_cuda_backend_graph_replays(fi_model_backend(mg));
    fi_cuda_backend_graph_stats(fi_model_backend(mg), &launched, &inst);
    printf("  graphs: %ld launched, %ld instantiated, %ld relaunched\n", launched, inst, replays);
    if (graphs)
        assert_true(launched >= 8 && inst <= launched && replays > 0 && replays <= launched);
    else
        assert_true(launched == 0 && replays == 0);
    fi_model_destroy(&mg);
    fi_model_destroy(&mc);
}

/* The default model; skipped when absent (it is not in the repository). */
static const char *real_model(void) {
    /* FEDINFER_MODEL first: gpu-check.sh runs binaries built elsewhere */
    const char *path = getenv("FEDINFER_MODEL");
    if (!path || !*path)
        path = FI_TEST_MODEL;
    if (access(path, R_OK) != 0) {
        printf("  model %s is absent: run examples/setup.sh\n", path);
        skip();
    }
    return path;
}

static void test_model_f16(void **state) {
    run_model(real_model(), FI_CUDA_WEIGHTS_F16, 1);
}

static void test_model_f16_no_graphs(void **state) {
    run_model(real_model(), FI_CUDA_WEIGHTS_F16, 0);
}

static void test_model_quant(void **state) {
    run_model(real_model(), FI_CUDA_WEIGHTS_QUANT, 1);
}

/* A small random-weight model written here (tests/support), so the engine
 * runs end to end on the GPU even where the default model cannot be
 * copied: 4 layers, dim 256, 8/2 heads (head_dim 32), Q4_1 matrices,
 * Q8_0 embeddings, untied output. */
static void run_synthetic(fi_cuda_weights mode, int graphs) {
    fi_gw_llama_opts o;
    fi_gw_llama_defaults(&o);
    o.n_layers = 4;
    o.dim = 256;
    o.n_heads = 8;
    o.n_kv_heads = 2;
    o.ffn_dim = 512;
    o.n_vocab = 1024;
    o.ctx = 1024;
    o.wtype = FI_DTYPE_Q4_1;
    o.embd_type = FI_DTYPE_Q8_0;
    o.tied = 0;
    o.seed = g_seed;
    char path[128];
    snprintf(path, sizeof path, "/tmp/fi_test_cuda_%d.gguf", (int)getpid());
    assert_int_equal(fi_gw_tiny_llama_file(&o, path), 0);
    run_model(path, mode, graphs);
    unlink(path);
}

static void test_synthetic_f16(void **state) {
    run_synthetic(FI_CUDA_WEIGHTS_F16, 1);
}

static void test_synthetic_quant_no_graphs(void **state) {
    run_synthetic(FI_CUDA_WEIGHTS_QUANT, 0);
}

int main(void) {
    char why[256];
    int n = fi_cuda_device_count(why, sizeof why);
    if (n < 0) {
        printf("SKIPPED: no CUDA device (%s)\n", why);
        return 77;
    }
    const char *s = getenv("FI_TEST_SEED");
    g_seed = s && *s ? strtoull(s, NULL, 10) : (uint64_t)time(NULL);
    printf("test_cuda: %d device(s); seed %llu (FI_TEST_SEED=%llu repeats this run)\n", n,
           (unsigned long long)g_seed, (unsigned long long)g_seed);
    /* FI_TEST_FILTER=PATTERN (cmocka's * and ?) runs only the matching
     * tests: for the slow runs under compute-sanitizer */
    const char *filter = getenv("FI_TEST_FILTER");
    if (filter && *filter)
        cmocka_set_test_filter(filter);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_matmul_f16, setup_f16, teardown),
        cmocka_unit_test_setup_teardown(test_matmul_quant, setup_quant, teardown),
        cmocka_unit_test_setup_teardown(test_matmul_n_f16, setup_f16, teardown),
        cmocka_unit_test_setup_teardown(test_matmul_n_quant, setup_quant, teardown),
        cmocka_unit_test_setup_teardown(test_matmul_add_f16, setup_f16, teardown),
        cmocka_unit_test_setup_teardown(test_matmul_add_quant, setup_quant, teardown),
        cmocka_unit_test_setup_teardown(test_norm_matmul_n_f16, setup_f16, teardown),
        cmocka_unit_test_setup_teardown(test_norm_matmul_n_quant, setup_quant, teardown),
        cmocka_unit_test_setup_teardown(test_norm_matmul_swiglu_f16, setup_f16, teardown),
        cmocka_unit_test_setup_teardown(test_norm_matmul_swiglu_quant, setup_quant, teardown),
        cmocka_unit_test_setup_teardown(test_get_rows_f16, setup_f16, teardown),
        cmocka_unit_test_setup_teardown(test_get_rows_quant, setup_quant, teardown),
        cmocka_unit_test_setup_teardown(test_rmsnorm, setup_f16, teardown),
        cmocka_unit_test_setup_teardown(test_rope, setup_f16, teardown),
        cmocka_unit_test_setup_teardown(test_rope_far, setup_f16, teardown),
        cmocka_unit_test_setup_teardown(test_attention, setup_f16, teardown),
        cmocka_unit_test_setup_teardown(test_attention_shapes, setup_f16, teardown),
        cmocka_unit_test_setup_teardown(test_store_f16, setup_f16, teardown),
        cmocka_unit_test_setup_teardown(test_rope_store, setup_f16, teardown),
        cmocka_unit_test_setup_teardown(test_swiglu_add, setup_f16, teardown),
        cmocka_unit_test_setup_teardown(test_argmax, setup_f16, teardown),
        cmocka_unit_test_setup_teardown(test_error_reported, setup_f16, teardown),
        cmocka_unit_test_setup_teardown(test_graph, setup_f16, teardown),
        cmocka_unit_test_setup_teardown(test_graph_misuse, setup_f16, teardown),
        cmocka_unit_test_setup_teardown(test_graph_sig, setup_f16, teardown),
        cmocka_unit_test_setup_teardown(test_graph_sig_mismatch, setup_f16, teardown),
        cmocka_unit_test_setup_teardown(test_graph_sig_missing_call, setup_f16, teardown),
        cmocka_unit_test(test_synthetic_f16),
        cmocka_unit_test(test_synthetic_quant_no_graphs),
        cmocka_unit_test(test_model_f16),
        cmocka_unit_test(test_model_f16_no_graphs),
        cmocka_unit_test(test_model_quant),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

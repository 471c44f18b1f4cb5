/*
 * bench_kernels.c - micro-benchmark of the CPU backend (not a test).
 *
 *   bench_kernels [threads...]      default: 1 2
 *   environment: BENCH_CPUTIME=1 (thread CPU time instead of wall time),
 *                BENCH_DECODE_ONLY=1 (only the decode-shaped sequence),
 *                BENCH_SIMD=avx2 (only that flavour: portable, avx2, avxvnni,
 *                avx512vnni; default all, or with BENCH_DECODE_ONLY the one
 *                FI_SIMD_AUTO picks),
 *                BENCH_ACT_BITS=8 (activations of quantised matmuls; default
 *                12, the backend's default; or 16),
 *                BENCH_N=64 (tokens of the batched column, 2..64; default 16:
 *                16 sequences decoding together; 64 is close to prefill)
 *
 * Prints, per SIMD flavour and thread count: ns per matvec and GFLOP/s
 * (2 flops per weight) for the SmolLM2-135M shapes, prefill cost per token,
 * attention (one long context; 16 short paged ones, as batched decode
 * meets them, cold and warm, with fp16 and with 8-bit cache rows), a decode-shaped sequence (30 layers of q,k,v,o,gate,up,down plus the
 * 49152-row Q8_0 output, with distinct weights so they come from L3/DRAM
 * as in a real run), the read bandwidth of the same bytes, and the pool's
 * dispatch overhead for an empty job. Runs are short; on a shared machine
 * the figures are noisy, so each is the best of several repetitions.
 */
#include "fi_kernels.h"
#include "fi_kernels_impl.h" /* fi_cpu_backend_new_flavour */

#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct bench_rng {
    uint64_t s; /* xorshift64 state */
} bench_rng;

static uint32_t s_rand(bench_rng *r) {
    r->s ^= r->s << 13;
    r->s ^= r->s >> 7;
    r->s ^= r->s << 17;
    return (uint32_t)r->s;
}

/* Wall clock, or this thread's CPU time when the BENCH_CPUTIME
 * environment variable is set (steadier on a loaded machine, but only
 * meaningful for one thread). */
static volatile unsigned s_sink; /* keeps reads the compiler would drop */

static double s_now(void) {
    static const clockid_t clocks[2] = {CLOCK_MONOTONIC, CLOCK_THREAD_CPUTIME_ID};
    struct timespec ts;
    clock_gettime(clocks[getenv("BENCH_CPUTIME") != NULL], &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Random weights with sane fp16 scales. */
static fi_weight s_weight(bench_rng *r, fi_dtype t, int rows, int cols) {
    fi_weight w = {.type = t, .rows = rows, .cols = cols, .row_bytes = fi_dtype_row_bytes(t, cols)};
    size_t bytes = w.row_bytes * (size_t)rows;
    uint8_t *p = malloc(bytes);
    if (!p) {
        fprintf(stderr, "bench_kernels: out of memory\n");
        exit(1);
    }
    for (size_t i = 0; i < bytes; i++)
        p[i] = (uint8_t)s_rand(r);
    size_t bb = fi_dtype_block_bytes(t);
    if (fi_dtype_block_elems(t) == 32) {
        uint16_t d = fi_fp32_to_fp16(0.01f), m = fi_fp32_to_fp16(-0.08f);
        for (size_t b = 0; b < bytes / bb; b++) {
            memcpy(p + b * bb, &d, 2);
            if (t == FI_DTYPE_Q4_1)
                memcpy(p + b * bb + 2, &m, 2);
        }
    } else if (t == FI_DTYPE_F32) {
        for (size_t i = 0; i < bytes / 4; i++) {
            float f = (float)(s_rand(r) % 2001) * 1e-3f - 1.0f;
            memcpy(p + 4 * i, &f, 4);
        }
    } else {
        for (size_t i = 0; i < bytes / 2; i++) {
            float f = (float)(s_rand(r) % 2001) * 1e-3f - 1.0f;
            uint16_t h = t == FI_DTYPE_F16 ? fi_fp32_to_fp16(f) : fi_fp32_to_bf16(f);
            memcpy(p + 2 * i, &h, 2);
        }
    }
    w.data = p;
    return w;
}

static void s_release(fi_weight *w) {
    free((void *)w->data);
    w->data = NULL;
}

/* Best time of `reps` repetitions of `iters` matmuls, per matmul, seconds. */
static double s_time_matmul(fi_backend *b, const fi_weight *w, const float *x, float *y, int n,
                            int iters, int reps) {
    double best = 1e30;
    for (int r = 0; r < reps; r++) {
        double t0 = s_now();
        for (int i = 0; i < iters; i++)
            b->ops->matmul(b->ctx, y, w, x, n);
        double dt = (s_now() - t0) / iters;
        best = dt < best ? dt : best;
    }
    return best;
}

typedef struct s_layer {
    fi_weight w[7]; /* q, k, v, o, gate, up, down */
} s_layer;

/* Hands w to the backend as the engine does (weight_upload, where the
 * backend has one), and takes it back. */
static void s_upload(fi_backend *b, fi_weight *w) {
    if (b->ops->weight_upload && b->ops->weight_upload(b->ctx, w) != 0) {
        fprintf(stderr, "bench_kernels: weight_upload failed\n");
        exit(1);
    }
}

static void s_unload(fi_backend *b, fi_weight *w) {
    if (w->dev && b->ops->weight_release)
        b->ops->weight_release(b->ctx, w);
}

/* One layer's products as the engine makes them: q, k, v of one input in
 * one call, o, gate and up of one input in one call, down. */
static void s_layer_matmuls(fi_backend *b, const s_layer *L, const float *x, float *y, int n) {
    const fi_backend_ops *o = b->ops;
    if (!o->matmul_n) {
        for (int k = 0; k < 7; k++)
            o->matmul(b->ctx, y, &L->w[k], x, n);
        return;
    }
    size_t big = (size_t)64 * 1536; /* y holds 64 x 49152 floats: room for three outputs */
    float *const y3[3] = {y, y + big, y + 2 * big};
    const fi_weight *const qkv[3] = {&L->w[0], &L->w[1], &L->w[2]};
    const fi_weight *const gu[2] = {&L->w[4], &L->w[5]};
    o->matmul_n(b->ctx, 3, y3, qkv, x, n);
    o->matmul(b->ctx, y, &L->w[3], x, n);
    o->matmul_n(b->ctx, 2, y3, gu, x, n);
    o->matmul(b->ctx, y, &L->w[6], x, n);
}

static void s_noop(void *arg, int ith, int nth) {
    (void)arg;
    (void)ith;
    (void)nth;
}

/* A job part of fixed cost (about 2 us); counts which indices ran. */
typedef struct s_spin_job {
    int iters;              /* loop trips per part */
    atomic_uint sink;       /* keeps the loop */
} s_spin_job;

static void s_spin_part(void *arg, int ith, int nth) {
    s_spin_job *j = arg;
    unsigned v = (unsigned)ith;
    for (int i = 0; i < j->iters; i++)
        v = v * 1664525u + 1013904223u;
    atomic_fetch_add_explicit(&j->sink, v, memory_order_relaxed);
    (void)nth;
}

/* Sums the ith share of n 64-bit words at p (the read floor). */
typedef struct s_read_job {
    const uint64_t *p;      /* words */
    size_t n;               /* how many */
    _Atomic uint64_t sink;  /* keeps the sums */
} s_read_job;

static void s_read_part(void *arg, int ith, int nth) {
    s_read_job *j = arg;
    size_t i0 = j->n * (size_t)ith / (size_t)nth, i1 = j->n * (size_t)(ith + 1) / (size_t)nth;
    const uint64_t *p = j->p;
    uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
    size_t i = i0;
    for (; i + 4 <= i1; i += 4) {
        a0 += p[i];
        a1 += p[i + 1];
        a2 += p[i + 2];
        a3 += p[i + 3];
    }
    for (; i < i1; i++)
        a0 += p[i];
    atomic_fetch_add_explicit(&j->sink, a0 + a1 + a2 + a3, memory_order_relaxed);
}

int main(int argc, char **argv) {
    int threads[8] = {1, 2};
    int nthreads = 2;
    if (argc > 1 && (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h"))) {
        printf("usage: bench_kernels [THREADS...]\n\n"
               "Times the CPU kernels at the default model's shapes for each kernel flavour and\n"
               "activation precision, at each thread count given (default: 1 2). Set\n"
               "BENCH_CPUTIME=1 to time with thread CPU time. Not a test: run by hand.\n");
        return 0;
    }
    if (argc > 1) {
        nthreads = 0;
        for (int i = 1; i < argc && nthreads < 8; i++)
            threads[nthreads++] = atoi(argv[i]);
    }
    bench_rng r = {0x9e3779b97f4a7c15ULL};
    float *x = malloc(sizeof(float) * 64 * 1536);
    float *y = malloc(sizeof(float) * 64 * 49152);
    if (!x || !y)
        return 1;
    for (int i = 0; i < 64 * 1536; i++)
        x[i] = (float)(s_rand(&r) % 2001) * 1e-3f - 1.0f;

    struct {
        const char *name;
        fi_dtype t;
        int rows, cols;
    } shapes[] = {
        {"q4_1 1536x576 (gate/up)", FI_DTYPE_Q4_1, 1536, 576},
        {"q4_1 576x1536 (down)", FI_DTYPE_Q4_1, 576, 1536},
        {"q4_1 576x576 (q/o)", FI_DTYPE_Q4_1, 576, 576},
        {"q8_0 49152x576 (output)", FI_DTYPE_Q8_0, 49152, 576},
        {"q4_0 1536x576", FI_DTYPE_Q4_0, 1536, 576},
        {"f32 1536x576", FI_DTYPE_F32, 1536, 576},
        {"f16 1536x576", FI_DTYPE_F16, 1536, 576},
        {"bf16 1536x576", FI_DTYPE_BF16, 1536, 576},
    };
    const int nshapes = (int)(sizeof shapes / sizeof shapes[0]);

    /* decode-shaped model: 30 layers + output, distinct weights */
    s_layer *layers = calloc(30, sizeof *layers);
    if (!layers)
        return 1;
    size_t model_bytes = 0;
    static const int lr[7] = {576, 192, 192, 576, 1536, 1536, 576};
    static const int lc[7] = {576, 576, 576, 576, 576, 576, 1536};
    for (int l = 0; l < 30; l++)
        for (int k = 0; k < 7; k++) {
            layers[l].w[k] = s_weight(&r, FI_DTYPE_Q4_1, lr[k], lc[k]);
            model_bytes += layers[l].w[k].row_bytes * (size_t)lr[k];
        }
    fi_weight out = s_weight(&r, FI_DTYPE_Q8_0, 49152, 576);
    model_bytes += out.row_bytes * 49152;

    /* The floor: reading the same bytes (a 64-bit sum, which the compiler
     * vectorises), matrix by matrix with each split over the threads as
     * matmul splits them; best of 5, per thread count. */
    double floor_s[8];
    for (int ti = 0; ti < nthreads; ti++) {
        fi_pool *p = fi_pool_new(threads[ti]);
        floor_s[ti] = 0;
        if (!p)
            continue;
        s_read_job rj = {0};
        double best = 1e30;
        for (int rep = 0; rep < 5; rep++) {
            double t0 = s_now();
            for (int l = 0; l < 30; l++)
                for (int k = 0; k < 7; k++) {
                    rj.p = layers[l].w[k].data;
                    rj.n = layers[l].w[k].row_bytes * (size_t)lr[k] / 8;
                    fi_pool_run(p, s_read_part, &rj);
                }
            rj.p = out.data;
            rj.n = out.row_bytes * 49152 / 8;
            fi_pool_run(p, s_read_part, &rj);
            double dt = s_now() - t0;
            best = dt < best ? dt : best;
        }
        floor_s[ti] = best;
        printf("model bytes %.1f MB; read by %d thread(s): %.2f ms (%.1f GB/s) [%u]\n",
               (double)model_bytes / 1e6, threads[ti], best * 1e3, (double)model_bytes / best / 1e9,
               (unsigned)(atomic_load(&rj.sink) & 1u));
        fi_pool_destroy(&p);
    }

    /* BENCH_DECODE_ONLY: just the decode-shaped sequence, best flavour */
    int decode_only = getenv("BENCH_DECODE_ONLY") != NULL;
    /* every flavour built and supported here; BENCH_SIMD picks one */
    static const char *const flavours[4] = {"portable", "avx2", "avxvnni", "avx512vnni"};
    const char *only = getenv("BENCH_SIMD");
    int act_bits = getenv("BENCH_ACT_BITS") ? atoi(getenv("BENCH_ACT_BITS")) : 0; /* 0: the default */
    int nbatch = getenv("BENCH_N") ? atoi(getenv("BENCH_N")) : 16; /* x and y hold 64 tokens */
    if (nbatch < 2 || nbatch > 64) {
        fprintf(stderr, "bench_kernels: BENCH_N must be 2..64\n");
        return 1;
    }
    char auto_name[32];
    {
        char err[256];
        fi_backend *b = fi_cpu_backend_new(1, FI_SIMD_AUTO, err, sizeof err);
        snprintf(auto_name, sizeof auto_name, "%s", b ? fi_cpu_backend_simd(b) : "?");
        fi_backend_destroy(&b);
        printf("FI_SIMD_AUTO picks %s\n", auto_name);
    }
    for (int fl = 0; fl < 4; fl++) {
        if (only ? strcmp(only, flavours[fl]) != 0 : decode_only && strcmp(auto_name, flavours[fl]) != 0)
            continue;
        for (int ti = 0; ti < nthreads; ti++) {
            char err[256];
            fi_backend *b = fi_cpu_backend_new_flavour(threads[ti], flavours[fl], err, sizeof err);
            if (!b)
                continue;
            const char *sname = fi_cpu_backend_simd(b);
            int simd = fl > 0;
            if (act_bits && fi_cpu_backend_set_act_bits(b, act_bits) != 0) {
                fi_backend_destroy(&b);
                continue;
            }
            printf("\n== %s, %d thread(s), %d-bit activations ==\n", sname, threads[ti], fi_cpu_backend_act_bits(b));
            for (int s = 0; s < nshapes && !decode_only; s++) {
                fi_weight w = s_weight(&r, shapes[s].t, shapes[s].rows, shapes[s].cols);
                s_upload(b, &w);
                double flops = 2.0 * shapes[s].rows * shapes[s].cols;
                int iters = (int)(2e8 / flops / (simd ? 1 : 8)) + 1;
                double t1 = s_time_matmul(b, &w, x, y, 1, iters, 5);
                double tn = s_time_matmul(b, &w, x, y, nbatch, iters / nbatch + 1, 3);
                printf("%-26s matvec %9.0f ns  %6.1f GFLOP/s | n=%d %8.0f ns/token %6.1f GFLOP/s\n",
                       shapes[s].name, t1 * 1e9, flops / t1 / 1e9, nbatch, tn / nbatch * 1e9,
                       flops * nbatch / tn / 1e9);
                s_unload(b, &w);
                s_release(&w);
            }
            {
                /* attention, SmolLM2 heads (9 q, 3 kv, 64 wide), one token
                 * at position 1023 and at 127 (one segment: its KV heads
                 * shared between threads), and 64 prefill tokens at 0..63 */
                const int ctx = 1024, kv_dim = 3 * 64;
                uint16_t *kc = malloc(sizeof(uint16_t) * ctx * kv_dim), *vc = malloc(sizeof(uint16_t) * ctx * kv_dim);
                float *q = malloc(sizeof(float) * 64 * 576), *o = malloc(sizeof(float) * 64 * 576);
                int32_t pos[64], seq[64] = {0}, tbl[1024 / 16];
                for (int i = 0; i < ctx / 16; i++)
                    tbl[i] = i; /* contiguous: one sequence, blocks in order */
                fi_kv_map map = {.seq = seq, .tables = tbl, .max_blocks = ctx / 16, .block_size = 16};
                for (int i = 0; i < ctx * kv_dim; i++) {
                    kc[i] = fi_fp32_to_fp16((float)(s_rand(&r) % 2001) * 1e-3f - 1.0f);
                    vc[i] = fi_fp32_to_fp16((float)(s_rand(&r) % 2001) * 1e-3f - 1.0f);
                }
                for (int i = 0; i < 64 * 576; i++)
                    q[i] = (float)(s_rand(&r) % 2001) * 1e-3f - 1.0f;
                double best1 = 1e30, best127 = 1e30, best64 = 1e30;
                for (int rep = 0; rep < 5; rep++) {
                    pos[0] = ctx - 1;
                    double t0 = s_now();
                    for (int i = 0; i < 20; i++)
                        b->ops->attention(b->ctx, o, q, kc, vc, 1, pos, &map, 9, 3, 64);
                    double dt = (s_now() - t0) / 20;
                    best1 = dt < best1 ? dt : best1;
                    pos[0] = 127;
                    t0 = s_now();
                    for (int i = 0; i < 20; i++)
                        b->ops->attention(b->ctx, o, q, kc, vc, 1, pos, &map, 9, 3, 64);
                    dt = (s_now() - t0) / 20;
                    best127 = dt < best127 ? dt : best127;
                    for (int i = 0; i < 64; i++)
                        pos[i] = i;
                    t0 = s_now();
                    for (int i = 0; i < 20; i++)
                        b->ops->attention(b->ctx, o, q, kc, vc, 64, pos, &map, 9, 3, 64);
                    dt = (s_now() - t0) / 20;
                    best64 = dt < best64 ? dt : best64;
                }
                printf("attention: 1 token at pos 1023 %.1f us, at pos 127 %.1f us; 64 tokens at 0..63 %.1f us\n",
                       best1 * 1e6, best127 * 1e6, best64 * 1e6);
                free(kc);
                free(vc);
                free(q);
                free(o);
            }
            {
                /* attention as batched decode meets it: 16 sequences, each
                 * one token at position 79 (5 blocks of 16 rows), blocks
                 * scattered over a pool; warm (the same call again) and cold
                 * (64 MiB streamed between calls, as a step's weights do);
                 * fp16 rows, then the 8-bit rows of kv_bits = 8 (written
                 * by kv_store, as the engine writes them) */
                enum { NS = 16, NP = 80, BS = 16, NBLK = NS * NP / BS, POOL = 8 * NBLK };
                const int kv_dim = 3 * 64;
                const size_t rows = (size_t)POOL * BS, rb16 = fi_kv_row_bytes(FI_KV_ROW_F16, 3, 64);
                /* from the backend, as the engine's cache (huge pages where the
                 * kernel grants them) */
                uint8_t *kc = b->ops->alloc(b->ctx, rb16 * rows), *vc = b->ops->alloc(b->ctx, rb16 * rows);
                float *kf = malloc(sizeof(float) * rows * kv_dim), *vf = malloc(sizeof(float) * rows * kv_dim);
                float *q = malloc(sizeof(float) * NS * 576), *o = malloc(sizeof(float) * NS * 576);
                size_t big = (size_t)64 << 20;
                volatile uint8_t *flush = malloc(big);
                int32_t pos[NS], seq[NS], tbl[NBLK], perm[POOL], *slot = malloc(sizeof(int32_t) * rows);
                if (!kc || !vc || !kf || !vf || !q || !o || !flush || !slot) {
                    fprintf(stderr, "bench_kernels: out of memory\n");
                    return 1;
                }
                for (size_t i = 0; i < big; i += 4096)
                    flush[i] = (uint8_t)i; /* its pages made once */
                for (size_t i = 0; i < rows * kv_dim; i++) {
                    kf[i] = (float)(s_rand(&r) % 2001) * 1e-3f - 1.0f;
                    vf[i] = (float)(s_rand(&r) % 2001) * 1e-3f - 1.0f;
                }
                for (size_t i = 0; i < rows; i++)
                    slot[i] = (int32_t)i;
                for (int i = 0; i < NS * 576; i++)
                    q[i] = (float)(s_rand(&r) % 2001) * 1e-3f - 1.0f;
                for (int i = 0; i < POOL; i++)
                    perm[i] = i;
                for (int i = POOL - 1; i > 0; i--) {
                    int j = (int)(s_rand(&r) % (uint32_t)(i + 1)), tmp = perm[i];
                    perm[i] = perm[j];
                    perm[j] = tmp;
                }
                for (int i = 0; i < NBLK; i++)
                    tbl[i] = perm[i];
                for (int i = 0; i < NS; i++) {
                    pos[i] = NP - 1;
                    seq[i] = i;
                }
                fi_kv_map map = {.seq = seq, .tables = tbl, .max_blocks = NP / BS, .block_size = BS};
                for (int bits = 16; bits >= 8; bits -= 8) {
                    if (fi_cpu_backend_set_kv_bits(b, bits) != 0)
                        return 1;
                    const size_t rb = fi_backend_kv_row_bytes(b, 3, 64);
                    b->ops->kv_store(b->ctx, kc, kf, (int)rows, slot, kv_dim, 64);
                    b->ops->kv_store(b->ctx, vc, vf, (int)rows, slot, kv_dim, 64);
                    double warm = 1e30, cold = 1e30;
                    for (int rep = 0; rep < 7; rep++) {
                        unsigned sum = 0; /* read, not written: clean lines, as weights are */
                        for (size_t i = 0; i < big; i += 64)
                            sum += flush[i];
                        s_sink += sum;
                        double t0 = s_now();
                        b->ops->attention(b->ctx, o, q, kc, vc, NS, pos, &map, 9, 3, 64);
                        double dt = s_now() - t0;
                        cold = dt < cold ? dt : cold;
                        t0 = s_now();
                        b->ops->attention(b->ctx, o, q, kc, vc, NS, pos, &map, 9, 3, 64);
                        dt = s_now() - t0;
                        warm = dt < warm ? dt : warm;
                    }
                    printf("attention: 16 sequences at pos 79, paged, %2d-bit rows: %.1f us cold, %.1f us warm "
                           "(%.2f GB/s of cache rows cold)\n", bits, cold * 1e6, warm * 1e6,
                           (double)NS * NP * 2 * rb / cold / 1e9);
                }
                if (fi_cpu_backend_set_kv_bits(b, 16) != 0)
                    return 1;
                b->ops->free(b->ctx, kc);
                b->ops->free(b->ctx, vc);
                free(kf);
                free(vf);
                free(slot);
                free(q);
                free(o);
                free((void *)flush);
            }
            if (simd) {
                /* decode-shaped: 7 matmuls x 30 layers + output; best of 5
                 * tokens; the weights as the engine gives them to the
                 * backend (weight_upload: a packed copy where it makes one) */
                for (int l = 0; l < 30; l++)
                    for (int k = 0; k < 7; k++)
                        s_upload(b, &layers[l].w[k]);
                s_upload(b, &out);
                double best = 1e30;
                for (int rep = 0; rep < 5; rep++) {
                    double t0 = s_now();
                    for (int l = 0; l < 30; l++)
                        s_layer_matmuls(b, &layers[l], x, y, 1);
                    b->ops->matmul(b->ctx, y, &out, x, 1);
                    double dt = s_now() - t0;
                    best = dt < best ? dt : best;
                }
                printf("decode-shaped matmuls: %.2f ms/token (%.1f GB/s of weights; "
                       "%.2f of the read floor)\n", best * 1e3, (double)model_bytes / best / 1e9,
                       floor_s[ti] / best);
                /* the same step for nbatch sequences decoding together:
                 * what continuous batching costs against one sequence */
                double bestn = 1e30;
                for (int rep = 0; rep < 5; rep++) {
                    double t0 = s_now();
                    for (int l = 0; l < 30; l++)
                        s_layer_matmuls(b, &layers[l], x, y, nbatch);
                    b->ops->matmul(b->ctx, y, &out, x, nbatch);
                    double dt = s_now() - t0;
                    bestn = dt < bestn ? dt : bestn;
                }
                printf("decode-shaped matmuls, %d tokens: %.2f ms/step (%.2f x one token's step, "
                       "%.1f x its tokens/s)\n", nbatch, bestn * 1e3, bestn / best,
                       nbatch * best / bestn);
                for (int l = 0; l < 30; l++)
                    for (int k = 0; k < 7; k++)
                        s_unload(b, &layers[l].w[k]);
                s_unload(b, &out);
            }
            fi_backend_destroy(&b);
        }
    }

    /* pool dispatch: empty jobs back to back (the caller may run every
     * part itself when the workers are late), then jobs whose parts cost
     * about 2 us each: overhead = time per job - time of one part. */
    s_spin_job sj = {.iters = 1000};
    fi_pool_fn volatile part_fn = s_spin_part; /* called like the pool calls it */
    {
        double t0 = s_now();
        for (int i = 0; i < 1000; i++)
            part_fn(&sj, 0, 1);
        double part = (s_now() - t0) / 1000;
        sj.iters = (int)(1000 * 2e-6 / part) + 1;
    }
    for (int ti = 0; ti < nthreads; ti++) {
        fi_pool *p = fi_pool_new(threads[ti]);
        if (!p)
            continue;
        double best = 1e30, bestw = 1e30, part = 1e30;
        for (int rep = 0; rep < 5; rep++) {
            const int iters = 20000;
            double t0 = s_now();
            for (int i = 0; i < iters; i++)
                fi_pool_run(p, s_noop, NULL);
            double dt = (s_now() - t0) / iters;
            best = dt < best ? dt : best;
            t0 = s_now();
            for (int i = 0; i < 2000; i++)
                part_fn(&sj, 0, 1);
            dt = (s_now() - t0) / 2000;
            part = dt < part ? dt : part;
            t0 = s_now();
            for (int i = 0; i < 2000; i++)
                fi_pool_run(p, s_spin_part, &sj);
            dt = (s_now() - t0) / 2000;
            bestw = dt < bestw ? dt : bestw;
        }
        printf("pool %d thread(s): %.0f ns per empty job; %d x %.0f ns parts: %.0f ns per job "
               "(overhead %.0f ns)\n", threads[ti], best * 1e9, threads[ti], part * 1e9,
               bestw * 1e9, (bestw - part) * 1e9);
        fi_pool_destroy(&p);
    }

    for (int l = 0; l < 30; l++)
        for (int k = 0; k < 7; k++)
            s_release(&layers[l].w[k]);
    s_release(&out);
    free(layers);
    free(x);
    free(y);
    return 0;
}

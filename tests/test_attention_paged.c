/*
 * test_attention_paged.c - ops->attention of the CPU backend on the shapes
 * that continuous batching gives it, against a naive double-precision
 * reference: many short sequences decoding together, each in its own
 * scattered cache blocks, and head shapes whose group or head_dim take the
 * kernels' less common paths (groups of 4 and 10 query heads per KV head,
 * head_dim 128, 48 and 24). Every SIMD flavour, 1 to 3 threads; each
 * token's output must also be bit-identical to the token computed alone.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "fi_kernels.h"
#include "fi_kernels_impl.h" /* fi_cpu_backend_new_flavour */

#define S_BLOCK 16 /* cache rows per block */

static uint64_t s_rng = 88172645463325252ull;

/* uniform in [-1, 1) (xorshift64) */
static float s_rand(void) {
    s_rng ^= s_rng << 13;
    s_rng ^= s_rng >> 7;
    s_rng ^= s_rng << 17;
    return (float)(s_rng >> 40) * (2.0f / 16777216.0f) - 1.0f;
}

/* One attention call's inputs: n tokens, token t alone in sequence t, at
 * pos[t]; sequence t's blocks are scattered over a shared pool. */
typedef struct s_case {
    int n, nh, nkv, hd;
    const int32_t *pos;
    int max_blocks;      /* blocks per sequence */
    int32_t *tables;     /* n * max_blocks block ids */
    int32_t *seq;        /* n: t */
    uint16_t *k, *v;     /* the pool: n * max_blocks * S_BLOCK rows */
    float *q;            /* n * nh * hd */
} s_case;

static void s_case_make(s_case *c, int n, int nh, int nkv, int hd, const int32_t *pos) {
    int maxp = 0;
    for (int t = 0; t < n; t++)
        maxp = pos[t] > maxp ? pos[t] : maxp;
    *c = (s_case){.n = n, .nh = nh, .nkv = nkv, .hd = hd, .pos = pos,
                  .max_blocks = maxp / S_BLOCK + 1};
    int blocks = n * c->max_blocks;
    size_t elems = (size_t)blocks * S_BLOCK * nkv * hd;
    c->tables = malloc(sizeof(int32_t) * blocks);
    c->seq = malloc(sizeof(int32_t) * n);
    c->k = malloc(sizeof(uint16_t) * elems);
    c->v = malloc(sizeof(uint16_t) * elems);
    c->q = malloc(sizeof(float) * n * nh * hd);
    assert_true(c->tables && c->seq && c->k && c->v && c->q);
    for (int i = 0; i < blocks; i++) /* a permutation that interleaves sequences */
        c->tables[i] = (int32_t)(((size_t)i * 7 + 3) % (size_t)blocks);
    assert_int_equal(blocks % 7 == 0, 0);
    for (int t = 0; t < n; t++)
        c->seq[t] = t;
    for (size_t i = 0; i < elems; i++) {
        c->k[i] = fi_fp32_to_fp16(s_rand());
        c->v[i] = fi_fp32_to_fp16(s_rand());
    }
    for (int i = 0; i < n * nh * hd; i++)
        c->q[i] = 2.0f * s_rand();
}

static void s_case_free(s_case *c) {
    free(c->tables);
    free(c->seq);
    free(c->k);
    free(c->v);
    free(c->q);
}

/* Row of position p of token t's sequence, head kh, element i. */
static double s_at(const s_case *c, const uint16_t *cache, int t, int p, int kh, int i) {
    size_t row = (size_t)c->tables[t * c->max_blocks + p / S_BLOCK] * S_BLOCK + p % S_BLOCK;
    return fi_fp16_to_fp32(cache[(row * c->nkv + kh) * c->hd + i]);
}

/* Naive softmax(q.k / sqrt(hd)) . v of token t, head h, into o[hd]. */
static void s_reference(const s_case *c, int t, int h, double *o) {
    int kh = h / (c->nh / c->nkv), np = c->pos[t] + 1;
    const float *q = c->q + ((size_t)t * c->nh + h) * c->hd;
    double *s = malloc(sizeof(double) * np), mx = -INFINITY, sum = 0.0;
    assert_non_null(s);
    for (int p = 0; p < np; p++) {
        double d = 0.0;
        for (int i = 0; i < c->hd; i++)
            d += q[i] * s_at(c, c->k, t, p, kh, i);
        s[p] = d / sqrt(c->hd);
        mx = fmax(mx, s[p]);
    }
    for (int p = 0; p < np; p++)
        sum += s[p] = exp(s[p] - mx);
    for (int i = 0; i < c->hd; i++) {
        double a = 0.0;
        for (int p = 0; p < np; p++)
            a += s[p] * s_at(c, c->v, t, p, kh, i);
        o[i] = a / sum;
    }
    free(s);
}

static void s_check(int n, int nh, int nkv, int hd, const int32_t *pos) {
    static const char *const flavours[] = {"portable", "avx2", "avxvnni", "avx512vnni"};
    s_case c;
    s_case_make(&c, n, nh, nkv, hd, pos);
    size_t qd = (size_t)nh * hd;
    double *ref = malloc(sizeof(double) * n * qd);
    float *all = malloc(sizeof(float) * n * qd), *one = malloc(sizeof(float) * qd);
    assert_true(ref && all && one);
    for (int t = 0; t < n; t++)
        for (int h = 0; h < nh; h++)
            s_reference(&c, t, h, ref + t * qd + (size_t)h * hd);
    fi_kv_map map = {.seq = c.seq, .tables = c.tables, .max_blocks = c.max_blocks,
                     .block_size = S_BLOCK};
    for (size_t f = 0; f < sizeof flavours / sizeof flavours[0]; f++)
        for (int threads = 1; threads <= 3; threads++) {
            char err[256];
            fi_backend *b = fi_cpu_backend_new_flavour(threads, flavours[f], err, sizeof err);
            if (!b)
                continue; /* not built or not supported here */
            for (size_t i = 0; i < n * qd; i++)
                all[i] = NAN;
            b->ops->attention(b->ctx, all, c.q, c.k, c.v, n, pos, &map, nh, nkv, hd);
            for (size_t i = 0; i < n * qd; i++)
                if (!(fabs(all[i] - ref[i]) <= 2e-5 * (1.0 + fabs(ref[i]))))
                    fail_msg("%s %dt, %d heads / %d kv x %d: token %zu (pos %d) out[%zu] = %g, want %g",
                             flavours[f], threads, nh, nkv, hd, i / qd, pos[i / qd], i % qd,
                             (double)all[i], ref[i]);
            for (int t = 0; t < n; t++) {
                b->ops->attention(b->ctx, one, c.q + t * qd, c.k, c.v, 1, pos + t,
                                  &(fi_kv_map){.seq = c.seq + t, .tables = c.tables,
                                               .max_blocks = c.max_blocks, .block_size = S_BLOCK},
                                  nh, nkv, hd);
                if (memcmp(one, all + t * qd, qd * sizeof *one))
                    fail_msg("%s %dt: token %d (pos %d) alone differs from batched", flavours[f],
                             threads, t, pos[t]);
            }
            fi_backend_destroy(&b);
        }
    free(ref);
    free(all);
    free(one);
    s_case_free(&c);
}

/* 16 sequences decoding together at 16..144 (the serving benchmark's
 * shape: SmolLM2's 9 query heads on 3 KV heads of 64), plus the edges of a
 * block and of the 8-row score tiles. */
static void test_decode_many_sequences(void **state) {
    (void)state;
    int32_t pos[20];
    for (int t = 0; t < 16; t++)
        pos[t] = 16 + t * 128 / 15;
    int32_t edge[] = {0, 1, 7, 8, 9, 15, 16, 17};
    memcpy(pos + 16, edge, 4 * sizeof *pos);
    s_check(20, 9, 3, 64, pos);
    s_check(8, 9, 3, 64, edge);
}

/* Head shapes off SmolLM2's: groups of 4 (Llama 3) and 10 (more than one
 * set of heads per pass) with wide, odd-sized and narrow heads, and a
 * token past one position segment next to short ones. */
static void test_head_shapes(void **state) {
    (void)state;
    int32_t pos[] = {5, 40, 300, 17};
    s_check(4, 8, 2, 128, pos);
    s_check(4, 20, 2, 48, pos);
    s_check(4, 6, 1, 24, pos);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_decode_many_sequences),
        cmocka_unit_test(test_head_shapes),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

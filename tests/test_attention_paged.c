/*
 * test_attention_paged.c - ops->attention of the CPU backend on the shapes
 * that continuous batching gives it, against a naive double-precision
 * reference: many short sequences decoding together, each in its own
 * scattered cache blocks, and head shapes whose group or head_dim take the
 * kernels' less common paths (groups of 4 and 10 query heads per KV head,
 * head_dim 128, 48 and 24). Every SIMD flavour, 1 to 3 threads; each
 * token's output must also be bit-identical to the token computed alone.
 * Both cache-row formats: fp16, and int8 with a scale per head (the 8-bit
 * KV cache, fi_cpu_backend_set_kv_bits), whose rows every flavour's
 * kv_store must write as fi_kv_quant_ref does, and whose reference sees
 * the values the quants and scales stand for.
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
 * pos[t]; sequence t's blocks are scattered over a shared pool, whose rows
 * are in the format fmt. */
typedef struct s_case {
    int n, nh, nkv, hd;
    fi_kv_row fmt;
    size_t rb;           /* bytes per cache row */
    const int32_t *pos;
    int max_blocks;      /* blocks per sequence */
    int rows;            /* pool rows: n * max_blocks * S_BLOCK */
    int32_t *tables;     /* n * max_blocks block ids */
    int32_t *seq;        /* n: t */
    int32_t *slot;       /* rows: the pool row of (sequence t, position p) at t * span + p */
    float *kf, *vf;      /* the values stored, in slot order */
    uint8_t *k, *v;      /* the pool, rows rb bytes */
    float *q;            /* n * nh * hd */
} s_case;

/* A row of nkv heads of hd values in format fmt, as the reference
 * quantiser and fp16 conversion make it. */
static void s_row_ref(const s_case *c, uint8_t *dst, const float *x) {
    size_t kv_dim = (size_t)c->nkv * c->hd;
    if (c->fmt == FI_KV_ROW_F16) {
        for (size_t i = 0; i < kv_dim; i++) {
            uint16_t h = fi_fp32_to_fp16(x[i]);
            memcpy(dst + 2 * i, &h, 2);
        }
        return;
    }
    memset(dst, 0, c->rb); /* the padding too */
    for (int h = 0; h < c->nkv; h++) {
        float sc = fi_kv_quant_ref((int8_t *)dst + (size_t)h * c->hd, x + (size_t)h * c->hd, c->hd);
        memcpy(dst + c->rb - 4 * (size_t)c->nkv + 4 * (size_t)h, &sc, 4);
    }
}

static void s_case_make(s_case *c, int n, int nh, int nkv, int hd, const int32_t *pos,
                        fi_kv_row fmt) {
    int maxp = 0;
    for (int t = 0; t < n; t++)
        maxp = pos[t] > maxp ? pos[t] : maxp;
    *c = (s_case){.n = n, .nh = nh, .nkv = nkv, .hd = hd, .fmt = fmt,
                  .rb = fi_kv_row_bytes(fmt, nkv, hd), .pos = pos,
                  .max_blocks = maxp / S_BLOCK + 1};
    int blocks = n * c->max_blocks;
    size_t kv_dim = (size_t)nkv * hd;
    c->rows = blocks * S_BLOCK;
    c->tables = malloc(sizeof(int32_t) * blocks);
    c->seq = malloc(sizeof(int32_t) * n);
    c->slot = malloc(sizeof(int32_t) * c->rows);
    c->kf = malloc(sizeof(float) * c->rows * kv_dim);
    c->vf = malloc(sizeof(float) * c->rows * kv_dim);
    c->k = malloc(c->rb * c->rows);
    c->v = malloc(c->rb * c->rows);
    c->q = malloc(sizeof(float) * n * nh * hd);
    assert_true(c->tables && c->seq && c->slot && c->kf && c->vf && c->k && c->v && c->q);
    for (int i = 0; i < blocks; i++) /* a permutation that interleaves sequences */
        c->tables[i] = (int32_t)(((size_t)i * 7 + 3) % (size_t)blocks);
    assert_int_equal(blocks % 7 == 0, 0);
    const int span = c->max_blocks * S_BLOCK;
    for (int t = 0; t < n; t++) {
        c->seq[t] = t;
        for (int p = 0; p < span; p++)
            c->slot[t * span + p] = c->tables[t * c->max_blocks + p / S_BLOCK] * S_BLOCK + p % S_BLOCK;
    }
    /* heads of different magnitudes (the int8 scales differ per head) */
    for (int i = 0; i < c->rows; i++)
        for (size_t e = 0; e < kv_dim; e++) {
            float mag = 0.25f + (float)((e / (size_t)hd + (size_t)i) % 4);
            c->kf[(size_t)i * kv_dim + e] = mag * s_rand();
            c->vf[(size_t)i * kv_dim + e] = mag * s_rand();
        }
    for (int i = 0; i < c->rows; i++) {
        s_row_ref(c, c->k + (size_t)c->slot[i] * c->rb, c->kf + (size_t)i * kv_dim);
        s_row_ref(c, c->v + (size_t)c->slot[i] * c->rb, c->vf + (size_t)i * kv_dim);
    }
    for (int i = 0; i < n * nh * hd; i++)
        c->q[i] = 2.0f * s_rand();
}

static void s_case_free(s_case *c) {
    free(c->tables);
    free(c->seq);
    free(c->slot);
    free(c->kf);
    free(c->vf);
    free(c->k);
    free(c->v);
    free(c->q);
}

/* The value that position p of token t's sequence, head kh, element i
 * stands for in the cache. */
static double s_at(const s_case *c, const uint8_t *cache, int t, int p, int kh, int i) {
    size_t row = (size_t)c->tables[t * c->max_blocks + p / S_BLOCK] * S_BLOCK + p % S_BLOCK;
    const uint8_t *r = cache + row * c->rb;
    if (c->fmt == FI_KV_ROW_F16) {
        uint16_t h;
        memcpy(&h, r + 2 * ((size_t)kh * c->hd + i), 2);
        return fi_fp16_to_fp32(h);
    }
    float sc;
    memcpy(&sc, r + c->rb - 4 * (size_t)c->nkv + 4 * (size_t)kh, 4);
    return (double)((const int8_t *)r)[(size_t)kh * c->hd + i] * sc;
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

static void s_check(int n, int nh, int nkv, int hd, const int32_t *pos, fi_kv_row fmt) {
    static const char *const flavours[] = {"portable", "avx2", "avxvnni", "avx512vnni"};
    s_case c;
    s_case_make(&c, n, nh, nkv, hd, pos, fmt);
    uint8_t *store = malloc(c.rb * c.rows);
    assert_non_null(store);
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
            if (fmt == FI_KV_ROW_Q8)
                assert_int_equal(fi_cpu_backend_set_kv_bits(b, 8), 0);
            assert_int_equal(fi_backend_kv_row_bytes(b, nkv, hd), c.rb);
            /* kv_store writes the reference's bytes, in the rows slot names */
            memset(store, 0, c.rb * c.rows);
            b->ops->kv_store(b->ctx, store, c.kf, c.rows, c.slot, nkv * hd, hd);
            if (memcmp(store, c.k, c.rb * c.rows))
                fail_msg("%s, %d-bit rows of %d x %d: kv_store differs from the reference", flavours[f],
                         (int)fmt, nkv, hd);
            for (size_t i = 0; i < n * qd; i++)
                all[i] = NAN;
            b->ops->attention(b->ctx, all, c.q, c.k, c.v, n, pos, &map, nh, nkv, hd);
            for (size_t i = 0; i < n * qd; i++)
                if (!(fabs(all[i] - ref[i]) <= 2e-5 * (1.0 + fabs(ref[i]))))
                    fail_msg("%s %dt, %d-bit rows, %d heads / %d kv x %d: token %zu (pos %d) out[%zu] = %g, "
                             "want %g", flavours[f], threads, (int)fmt, nh, nkv, hd, i / qd, pos[i / qd],
                             i % qd, (double)all[i], ref[i]);
            for (int t = 0; t < n; t++) {
                b->ops->attention(b->ctx, one, c.q + t * qd, c.k, c.v, 1, pos + t,
                                  &(fi_kv_map){.seq = c.seq + t, .tables = c.tables,
                                               .max_blocks = c.max_blocks, .block_size = S_BLOCK},
                                  nh, nkv, hd);
                if (memcmp(one, all + t * qd, qd * sizeof *one))
                    fail_msg("%s %dt, %d-bit rows: token %d (pos %d) alone differs from batched",
                             flavours[f], threads, (int)fmt, t, pos[t]);
            }
            fi_backend_destroy(&b);
        }
    free(ref);
    free(all);
    free(one);
    free(store);
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
    for (int f = 0; f < 2; f++) {
        fi_kv_row fmt = f ? FI_KV_ROW_Q8 : FI_KV_ROW_F16;
        s_check(20, 9, 3, 64, pos, fmt);
        s_check(8, 9, 3, 64, edge, fmt);
    }
}

/* Head shapes off SmolLM2's: groups of 4 (Llama 3) and 10 (more than one
 * set of heads per pass) with wide, odd-sized and narrow heads, and a
 * token past one position segment next to short ones. */
static void test_head_shapes(void **state) {
    (void)state;
    int32_t pos[] = {5, 40, 300, 17};
    for (int f = 0; f < 2; f++) {
        fi_kv_row fmt = f ? FI_KV_ROW_Q8 : FI_KV_ROW_F16;
        s_check(4, 8, 2, 128, pos, fmt);
        s_check(4, 20, 2, 48, pos, fmt);
        s_check(4, 6, 1, 24, pos, fmt);
    }
    /* heads not a multiple of 8 wide (the kernels' scalar path), and int8
     * quants padded to a multiple of 4 bytes before the scales (3 x 6) */
    s_check(4, 6, 3, 6, pos, FI_KV_ROW_Q8);
    s_check(4, 4, 2, 20, pos, FI_KV_ROW_Q8);
    s_check(4, 4, 2, 20, pos, FI_KV_ROW_F16);
}

/* The 8-bit cache's quantiser (every flavour's kv_store against
 * fi_kv_quant_ref above) on the values it must treat with care: a head of
 * zeros (scale 0, quants 0), one too small for a normal scale (the same),
 * and one holding an infinity or a NaN (scale NaN, quants 0, so that the
 * attention that reads it gives NaN, as an fp16 cache would); and the
 * rounding: quants within half a step of value / scale, never -128. */
static void test_q8_quantiser(void **state) {
    (void)state;
    enum { HD = 64 };
    float x[HD];
    int8_t q[HD];
    for (int i = 0; i < HD; i++)
        x[i] = 0.0f;
    assert_true(fi_kv_quant_ref(q, x, HD) == 0.0f);
    for (int i = 0; i < HD; i++)
        assert_int_equal(q[i], 0);
    x[5] = 1e-37f;
    assert_true(fi_kv_quant_ref(q, x, HD) == 0.0f && q[5] == 0);
    for (int bad = 0; bad < 2; bad++) {
        for (int i = 0; i < HD; i++)
            x[i] = (float)i - 30.0f;
        x[17] = bad ? NAN : -INFINITY;
        assert_true(isnan(fi_kv_quant_ref(q, x, HD)));
        for (int i = 0; i < HD; i++)
            assert_int_equal(q[i], 0);
    }
    for (int i = 0; i < HD; i++)
        x[i] = 3.0f * s_rand();
    x[9] = -4.0f; /* the largest magnitude: quant -127 */
    float sc = fi_kv_quant_ref(q, x, HD);
    assert_true(sc == 4.0f / 127.0f);
    assert_int_equal(q[9], -127);
    for (int i = 0; i < HD; i++)
        if (fabs((double)x[i] / sc - q[i]) > 0.5 + 1e-5 || q[i] == -128)
            fail_msg("quant %d = %d for %g (scale %g)", i, q[i], (double)x[i], (double)sc);
    /* a backend's kv_store, and the NaN through attention */
    const char *const flavours[] = {"portable", "avx2", "avxvnni", "avx512vnni"};
    for (size_t f = 0; f < sizeof flavours / sizeof flavours[0]; f++) {
        char err[256];
        fi_backend *b = fi_cpu_backend_new_flavour(1, flavours[f], err, sizeof err);
        if (!b)
            continue;
        char desc[128];
        assert_null(strstr(fi_backend_describe(b, desc, sizeof desc), "KV cache"));
        assert_int_equal(fi_cpu_backend_set_kv_bits(b, 8), 0);
        assert_int_equal(fi_backend_kv_bits(b), 8);
        assert_non_null(strstr(fi_backend_describe(b, desc, sizeof desc), ", 8-bit KV cache")); /* start-up lines */
        assert_int_not_equal(fi_cpu_backend_set_kv_bits(b, 12), 0);
        size_t rb = fi_kv_row_bytes(FI_KV_ROW_Q8, 1, HD);
        assert_int_equal(rb, HD + 4);
        uint8_t row[2][HD + 4];
        int32_t slot[2] = {1, 0};
        float two[2 * HD];
        for (int i = 0; i < HD; i++) {
            two[i] = x[i];
            two[HD + i] = i == 3 ? NAN : x[i];
        }
        b->ops->kv_store(b->ctx, row, two, 2, slot, HD, HD); /* token 0 into row 1 */
        float s0, s1;
        memcpy(&s0, row[1] + HD, 4);
        memcpy(&s1, row[0] + HD, 4);
        if (s0 != sc || memcmp(row[1], q, HD) || !isnan(s1))
            fail_msg("%s: kv_store rows differ from fi_kv_quant_ref", flavours[f]);
        float qv[HD], out[HD];
        for (int i = 0; i < HD; i++)
            qv[i] = s_rand();
        int32_t pos = 1, seq = 0, tbl = 0;
        fi_kv_map map = {.seq = &seq, .tables = &tbl, .max_blocks = 1, .block_size = 2};
        b->ops->attention(b->ctx, out, qv, row, row, 1, &pos, &map, 1, 1, HD);
        for (int i = 0; i < HD; i++)
            if (!isnan(out[i]))
                fail_msg("%s: attention over a NaN row gives %g, want NaN", flavours[f], (double)out[i]);
        fi_backend_destroy(&b);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_decode_many_sequences),
        cmocka_unit_test(test_head_shapes),
        cmocka_unit_test(test_q8_quantiser),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

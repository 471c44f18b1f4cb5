/*
 * test_kernels.c - the CPU backend of fi_kernels.h against references
 * written here, independently of the kernels: block dequantisers from the
 * GGML layouts, double-precision matmul on dequantised weights, naive
 * attention, explicit RoPE. Every SIMD flavour the processor has is run,
 * with 1, 2 and 3 threads; outputs are poisoned with NaN before each run.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fi_kernels.h"

/* --- helpers -------------------------------------------------------------- */

typedef struct rng {
    uint64_t s; /* xorshift64* state, never 0 */
} rng;

static uint32_t rng_u32(rng *r) {
    r->s ^= r->s >> 12;
    r->s ^= r->s << 25;
    r->s ^= r->s >> 27;
    return (uint32_t)((r->s * 0x2545F4914F6CDD1DULL) >> 32);
}

/* uniform in [lo, hi) */
static float rng_f(rng *r, float lo, float hi) {
    return lo + (hi - lo) * (float)(rng_u32(r) >> 8) * (1.0f / 16777216.0f);
}

static float *fvec(size_t n) {
    float *p = malloc(n * sizeof *p);
    assert_non_null(p);
    return p;
}

static void poison(float *p, size_t n) {
    for (size_t i = 0; i < n; i++)
        p[i] = NAN;
}

static uint16_t le16(const uint8_t *p) {
    return (uint16_t)(p[0] | (p[1] << 8));
}

/* Independent fp16 decoder: sign * 2^(e-15) * (1 + m/1024), ldexp based. */
static double ref_h2d(uint16_t h) {
    int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
    double v;
    if (e == 0)
        v = ldexp(m, -24);
    else if (e == 31)
        v = m ? NAN : INFINITY;
    else
        v = ldexp(1024 + m, e - 25);
    return s ? -v : v;
}

/* Scalar reference dequantiser written from the GGML block layouts. */
static void ref_dequant(fi_dtype t, const uint8_t *src, double *dst, int n) {
    for (int i = 0; i < n; i++) {
        switch (t) {
        case FI_DTYPE_F32: {
            float f;
            memcpy(&f, src + 4 * i, 4);
            dst[i] = f;
            break;
        }
        case FI_DTYPE_F16:
            dst[i] = ref_h2d(le16(src + 2 * i));
            break;
        case FI_DTYPE_BF16: {
            uint32_t b = (uint32_t)le16(src + 2 * i) << 16;
            float f;
            memcpy(&f, &b, 4);
            dst[i] = f;
            break;
        }
        case FI_DTYPE_Q8_0: {
            const uint8_t *blk = src + (i / 32) * 34;
            dst[i] = ref_h2d(le16(blk)) * (int8_t)blk[2 + i % 32];
            break;
        }
        case FI_DTYPE_Q4_0: {
            const uint8_t *blk = src + (i / 32) * 18;
            int j = i % 32;
            int q = j < 16 ? (blk[2 + j] & 15) : (blk[2 + j - 16] >> 4);
            dst[i] = ref_h2d(le16(blk)) * (q - 8);
            break;
        }
        case FI_DTYPE_Q4_1: {
            const uint8_t *blk = src + (i / 32) * 20;
            int j = i % 32;
            int q = j < 16 ? (blk[4 + j] & 15) : (blk[4 + j - 16] >> 4);
            dst[i] = ref_h2d(le16(blk)) * q + ref_h2d(le16(blk + 2));
            break;
        }
        }
    }
}

/* Random bytes of `rows` rows of type t with sane scales. */
static uint8_t *make_weight(rng *r, fi_dtype t, int rows, int cols, size_t *row_bytes) {
    size_t rb = fi_dtype_row_bytes(t, cols);
    assert_true(rb > 0);
    uint8_t *w = malloc(rb * rows);
    assert_non_null(w);
    for (size_t i = 0; i < rb * rows; i++)
        w[i] = (uint8_t)rng_u32(r);
    for (int row = 0; row < rows; row++) {
        uint8_t *p = w + row * rb;
        for (int c = 0; c < cols; c++) {
            float v = rng_f(r, -1.0f, 1.0f);
            if (t == FI_DTYPE_F32) {
                memcpy(p + 4 * c, &v, 4);
            } else if (t == FI_DTYPE_F16) {
                uint16_t h = fi_fp32_to_fp16(v);
                memcpy(p + 2 * c, &h, 2);
            } else if (t == FI_DTYPE_BF16) {
                uint16_t h = fi_fp32_to_bf16(v);
                memcpy(p + 2 * c, &h, 2);
            }
        }
        size_t bb = fi_dtype_block_bytes(t);
        if (fi_dtype_block_elems(t) == 32) {
            for (int b = 0; b < cols / 32; b++) {
                uint16_t d = fi_fp32_to_fp16(rng_f(r, 0.001f, 0.05f));
                memcpy(p + b * bb, &d, 2);
                if (t == FI_DTYPE_Q4_1) {
                    uint16_t m = fi_fp32_to_fp16(rng_f(r, -0.4f, 0.1f));
                    memcpy(p + b * bb + 2, &m, 2);
                }
            }
        }
    }
    *row_bytes = rb;
    return w;
}

static const fi_dtype all_types[] = {FI_DTYPE_F32, FI_DTYPE_F16, FI_DTYPE_BF16,
                                     FI_DTYPE_Q8_0, FI_DTYPE_Q4_0, FI_DTYPE_Q4_1};
#define N_TYPES (sizeof all_types / sizeof all_types[0])

/* Activation precision of quantised matmuls in the backends made below
 * (16 or 8); the matmul tests run with both. */
static int s_act_bits = 16;

/* Backends to compare: portable, and AVX2 when the processor has it. */
static int make_backends(fi_backend **out, int n_threads) {
    char err[256];
    int n = 0;
    out[n] = fi_cpu_backend_new(n_threads, FI_SIMD_PORTABLE, err, sizeof err);
    assert_non_null(out[n]);
    assert_int_equal(fi_cpu_backend_act_bits(out[n]), 16); /* the default */
    assert_int_equal(fi_cpu_backend_set_act_bits(out[n], s_act_bits), 0);
    n++;
    fi_backend *b = fi_cpu_backend_new(n_threads, FI_SIMD_AVX2, err, sizeof err);
    if (b) {
        assert_int_equal(fi_cpu_backend_set_act_bits(b, s_act_bits), 0);
        out[n++] = b;
    } else {
        fprintf(stderr, "note: no AVX2 here, portable only (%s)\n", err);
    }
    return n;
}

/* --- dtypes and conversions --------------------------------------------- */

static void test_dtype_table(void **state) {
    (void)state;
    assert_int_equal(fi_dtype_row_bytes(FI_DTYPE_Q4_1, 576), 18 * 20);
    assert_int_equal(fi_dtype_row_bytes(FI_DTYPE_Q8_0, 576), 18 * 34);
    assert_int_equal(fi_dtype_row_bytes(FI_DTYPE_Q4_0, 64), 2 * 18);
    assert_int_equal(fi_dtype_row_bytes(FI_DTYPE_F16, 3), 6);
    assert_int_equal(fi_dtype_row_bytes(FI_DTYPE_BF16, 5), 10);
    assert_int_equal(fi_dtype_row_bytes(FI_DTYPE_F32, 7), 28);
    assert_int_equal(fi_dtype_row_bytes(FI_DTYPE_Q4_1, 33), 0);
    assert_int_equal(fi_dtype_row_bytes(99, 32), 0);
    assert_int_equal(fi_dtype_block_elems(FI_DTYPE_Q8_0), 32);
    assert_int_equal(fi_dtype_block_elems(FI_DTYPE_F16), 1);
    assert_int_equal(fi_dtype_block_elems(12), 0);
    assert_true(fi_dtype_supported(FI_DTYPE_BF16));
    assert_false(fi_dtype_supported(12));
    assert_string_equal(fi_dtype_name(FI_DTYPE_Q4_1), "q4_1");
    assert_string_equal(fi_dtype_name(1234), "unknown");
}

static void test_fp16_all_values(void **state) {
    (void)state;
    for (uint32_t h = 0; h < 65536; h++) {
        double ref = ref_h2d((uint16_t)h);
        float f = fi_fp16_to_fp32((uint16_t)h);
        if (isnan(ref)) {
            assert_true(isnan(f));
            assert_true(isnan(fi_fp16_to_fp32(fi_fp32_to_fp16(f))));
            continue;
        }
        assert_true((double)f == ref);
        assert_true(!signbit(f) == !signbit(ref));
        assert_int_equal(fi_fp32_to_fp16(f), h); /* exact round trip */
    }
}

/* Nearest fp16 by search in double, ties to even mantissa. */
static uint16_t ref_f2h(float f) {
    if (isnan(f))
        return 0x7e00;
    uint16_t sign = signbit(f) ? 0x8000 : 0;
    double a = fabs((double)f);
    uint16_t best;
    /* magnitudes are monotonic in the encoding; binary search the bracket */
    uint16_t lo = 0, hi = 0x7c00; /* 0x7c00 is inf */
    while (hi - lo > 1) {
        uint16_t mid = (uint16_t)((lo + hi) / 2);
        if (ref_h2d(mid) <= a)
            lo = mid;
        else
            hi = mid;
    }
    double vlo = ref_h2d(lo);
    double vhi = hi == 0x7c00 ? 65536.0 : ref_h2d(hi); /* inf sits where 2^16 would */
    if (a - vlo < vhi - a)
        best = lo;
    else if (a - vlo > vhi - a)
        best = hi;
    else
        best = (lo & 1) ? hi : lo;
    return (uint16_t)(sign | best);
}

static void test_fp16_rounding(void **state) {
    (void)state;
    static const struct {
        float f;
        uint16_t h;
    } cases[] = {
        {0.0f, 0x0000}, {-0.0f, 0x8000}, {1.0f, 0x3c00}, {-2.0f, 0xc000},
        {65504.0f, 0x7bff}, {65519.996f, 0x7bff}, {65520.0f, 0x7c00}, {1e10f, 0x7c00},
        {-1e10f, 0xfc00}, {INFINITY, 0x7c00}, {-INFINITY, 0xfc00},
        {1.0f + 0x1p-11f, 0x3c00},          /* tie, to even (down) */
        {1.0f + 3 * 0x1p-11f, 0x3c02},      /* tie, to even (up) */
        {0x1p-24f, 0x0001}, {0x1p-25f, 0x0000}, /* tie to even zero */
        {0x1.8p-24f, 0x0002}, {0x1.000002p-25f, 0x0001}, {0x1p-14f, 0x0400},
        {0x1.ff8p-15f, 0x03ff}, {0x1.ffcp-15f, 0x0400}, /* largest subnormal; tie up to the smallest normal */
        {-0x1p-24f, 0x8001}, {1e-30f, 0x0000}, {0x1p-149f, 0x0000},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        uint16_t got = fi_fp32_to_fp16(cases[i].f);
        if (got != cases[i].h)
            fail_msg("fp16(%a) = 0x%04x, want 0x%04x", (double)cases[i].f, got, cases[i].h);
    }
    uint16_t nan_h = fi_fp32_to_fp16(NAN);
    assert_true((nan_h & 0x7c00) == 0x7c00 && (nan_h & 0x3ff) != 0);
    rng r = {0x1234567};
    for (int i = 0; i < 200000; i++) {
        uint32_t bits = rng_u32(&r);
        /* focus on the fp16 range, but cover everything */
        if (i % 4 != 0)
            bits = (bits & 0x807fffffu) | ((uint32_t)(96 + rng_u32(&r) % 50) << 23);
        float f;
        memcpy(&f, &bits, 4);
        if (isnan(f))
            continue;
        uint16_t got = fi_fp32_to_fp16(f), want = ref_f2h(f);
        if (got != want)
            fail_msg("fp16(%a) = 0x%04x, want 0x%04x", (double)f, got, want);
    }
}

static void test_bf16(void **state) {
    (void)state;
    assert_int_equal(fi_fp32_to_bf16(1.0f), 0x3f80);
    assert_int_equal(fi_fp32_to_bf16(-0.0f), 0x8000);
    assert_int_equal(fi_fp32_to_bf16(INFINITY), 0x7f80);
    assert_int_equal(fi_fp32_to_bf16(-INFINITY), 0xff80);
    assert_int_equal(fi_fp32_to_bf16(0x1.01p0f), 0x3f80);   /* tie, to even (down) */
    assert_int_equal(fi_fp32_to_bf16(0x1.03p0f), 0x3f82);   /* tie, to even (up) */
    assert_int_equal(fi_fp32_to_bf16(0x1.0101p0f), 0x3f81); /* above tie */
    assert_int_equal(fi_fp32_to_bf16(3.4028235e38f), 0x7f80); /* rounds to inf */
    assert_int_equal(fi_fp32_to_bf16(0x1p-149f), 0x0000);   /* tiny subnormal */
    assert_int_equal(fi_fp32_to_bf16(0x1p-133f), 0x0001);   /* bf16 subnormal */
    uint16_t nb = fi_fp32_to_bf16(NAN);
    assert_true((nb & 0x7f80) == 0x7f80 && (nb & 0x7f) != 0);
    /* a NaN whose payload sits only in the low bits must stay NaN */
    uint32_t snan = 0x7f800001u;
    float fs;
    memcpy(&fs, &snan, 4);
    assert_true(isnan(fi_bf16_to_fp32(fi_fp32_to_bf16(fs))));
    for (uint32_t h = 0; h < 65536; h++) {
        float f = fi_bf16_to_fp32((uint16_t)h);
        uint32_t b;
        memcpy(&b, &f, 4);
        assert_int_equal(b, h << 16);
        if (!isnan(f))
            assert_int_equal(fi_fp32_to_bf16(f), h);
    }
    rng r = {99};
    for (int i = 0; i < 100000; i++) {
        uint32_t bits = rng_u32(&r);
        float f;
        memcpy(&f, &bits, 4);
        if (isnan(f) || isinf(f))
            continue;
        uint16_t got = fi_fp32_to_bf16(f);
        /* nearest of the two neighbours, ties to even */
        uint32_t lo = bits & 0xffff0000u, hi = lo + 0x10000u;
        float flo, fhi;
        memcpy(&flo, &lo, 4);
        memcpy(&fhi, &hi, 4);
        /* past the largest finite value, inf sits where 2^128 would */
        double dl = fabs((double)f - flo);
        double dh = isinf(fhi) ? ldexp(1, 128) - fabs((double)f) : fabs((double)fhi - f);
        uint16_t want = (uint16_t)((dl < dh || (dl == dh && !((lo >> 16) & 1))) ? lo >> 16 : hi >> 16);
        if (got != want)
            fail_msg("bf16(%a) = 0x%04x, want 0x%04x", (double)f, got, want);
    }
}

static void test_dequantize(void **state) {
    (void)state;
    rng r = {42};
    const int n = 256;
    float *out = fvec(n);
    double *ref = malloc(n * sizeof *ref);
    assert_non_null(ref);
    for (size_t ti = 0; ti < N_TYPES; ti++) {
        size_t rb;
        uint8_t *w = make_weight(&r, all_types[ti], 1, n, &rb);
        /* arbitrary bytes too, including extreme nibbles and int8 values */
        if (fi_dtype_block_elems(all_types[ti]) == 32)
            for (size_t i = 0; i < rb; i++)
                if (i % fi_dtype_block_bytes(all_types[ti]) >= (all_types[ti] == FI_DTYPE_Q4_1 ? 4u : 2u))
                    w[i] = (uint8_t)rng_u32(&r);
        poison(out, n);
        fi_dequantize_row(all_types[ti], w, out, n);
        ref_dequant(all_types[ti], w, ref, n);
        for (int i = 0; i < n; i++)
            if (!((double)out[i] == (double)(float)ref[i]))
                fail_msg("%s: element %d = %g, want %g", fi_dtype_name(all_types[ti]), i,
                         (double)out[i], ref[i]);
        free(w);
    }
    free(ref);
    free(out);
}

/* --- matmul ------------------------------------------------------------- */

/* Checks y (n x rows) against double references; for quantised weights
 * the tolerance is the bound of activation rounding: each x[i] moves by at
 * most half its block's step, amax/127 (8 bits) or amax/32767 (16 bits). */
static void check_matmul(const char *what, fi_dtype t, const float *y, const double *wd,
                         const float *x, int rows, int cols, int n) {
    int quant = fi_dtype_block_elems(t) == 32;
    for (int k = 0; k < n; k++) {
        const float *xk = x + (size_t)k * cols;
        for (int r = 0; r < rows; r++) {
            const double *wr = wd + (size_t)r * cols;
            double ref = 0, mag = 0, qerr = 0;
            for (int b = 0; b < cols; b += 32) {
                double amax = 0;
                int e = b + 32 < cols ? b + 32 : cols;
                for (int c = b; c < e; c++)
                    amax = fmax(amax, fabs(xk[c]));
                for (int c = b; c < e; c++) {
                    ref += wr[c] * xk[c];
                    mag += fabs(wr[c] * xk[c]);
                    qerr += fabs(wr[c]) * amax / (s_act_bits == 16 ? 65534.0 : 254.0);
                }
            }
            double tol = 1e-5 * mag + 1e-6 + (quant ? 1.01 * qerr + 1e-5 * mag : 0.0);
            double got = y[(size_t)k * rows + r];
            if (!(fabs(got - ref) <= tol))
                fail_msg("%s %s: y[%d][%d] = %.9g, want %.9g (tol %.3g)", what, fi_dtype_name(t), k,
                         r, got, ref, tol);
        }
    }
}

static void run_matmul_case(fi_dtype t, int rows, int cols, const int *ns, int nns, uint64_t seed) {
    rng r = {seed};
    size_t rb;
    uint8_t *wbytes = make_weight(&r, t, rows, cols, &rb);
    double *wd = malloc((size_t)rows * cols * sizeof *wd);
    assert_non_null(wd);
    for (int i = 0; i < rows; i++)
        ref_dequant(t, wbytes + i * rb, wd + (size_t)i * cols, cols);
    fi_weight w = {.data = wbytes, .type = t, .rows = rows, .cols = cols, .row_bytes = rb};
    int nmax = 0;
    for (int i = 0; i < nns; i++)
        nmax = ns[i] > nmax ? ns[i] : nmax;
    float *x = fvec((size_t)nmax * cols);
    for (size_t i = 0; i < (size_t)nmax * cols; i++)
        x[i] = rng_f(&r, -2.0f, 2.0f) * (i % 7 == 0 ? 3.0f : 1.0f);
    /* one all-zero block: amax 0 must not divide by zero */
    if (cols >= 64)
        memset(x + 32, 0, 32 * sizeof *x);
    size_t ny = (size_t)nmax * rows;
    float *y1 = fvec(ny), *yt = fvec(ny), *yp = fvec(ny);
    for (int threads = 1; threads <= 3; threads++) {
        fi_backend *bs[2];
        int nb = make_backends(bs, threads);
        for (int ni = 0; ni < nns; ni++) {
            int n = ns[ni];
            for (int bi = 0; bi < nb; bi++) {
                fi_backend *b = bs[bi];
                char what[96];
                snprintf(what, sizeof what, "%s/%dt rows=%d cols=%d n=%d", fi_cpu_backend_simd(b),
                         threads, rows, cols, n);
                poison(yt, ny);
                b->ops->matmul(b->ctx, yt, &w, x, n);
                check_matmul(what, t, yt, wd, x, rows, cols, n);
                /* thread counts give bit-identical results per flavour */
                if (threads == 1) {
                    if (bi == 1)
                        memcpy(y1, yt, (size_t)n * rows * sizeof *yt);
                    else
                        memcpy(yp, yt, (size_t)n * rows * sizeof *yt);
                } else {
                    const float *want = bi == 1 ? y1 : yp;
                    if (memcmp(want, yt, (size_t)n * rows * sizeof *yt) != 0)
                        fail_msg("%s: differs from the 1-thread result", what);
                }
                /* flavours agree closely: same quantised x, different order */
                if (bi == 1) {
                    b->ops->matmul(b->ctx, yt, &w, x, n);
                    for (size_t i = 0; i < (size_t)n * rows; i++) {
                        double tol = 2e-5 * (fabs(yp[i]) + 1.0) + 1e-4;
                        if (threads == 1 && !(fabs((double)yt[i] - yp[i]) <= tol))
                            fail_msg("%s: avx2 %g vs portable %g at %zu", what, (double)yt[i],
                                     (double)yp[i], i);
                    }
                }
            }
        }
        for (int bi = 0; bi < nb; bi++)
            fi_backend_destroy(&bs[bi]);
    }
    free(y1);
    free(yt);
    free(yp);
    free(x);
    free(wd);
    free(wbytes);
}

static void s_matmul_small(void) {
    static const int ns[] = {1, 3, 4, 5, 17};
    for (size_t ti = 0; ti < N_TYPES; ti++) {
        run_matmul_case(all_types[ti], 37, 160, ns, 5, 1000 + ti);
        run_matmul_case(all_types[ti], 5, 64, ns, 5, 2000 + ti);
    }
    /* float types: columns that are not a multiple of the vector width */
    run_matmul_case(FI_DTYPE_F32, 19, 37, ns, 5, 3000);
    run_matmul_case(FI_DTYPE_F16, 21, 13, ns, 5, 3001);
    run_matmul_case(FI_DTYPE_BF16, 3, 45, ns, 5, 3002);
}

static void s_matmul_model_shapes(void) {
    static const int ns[] = {1, 6};
    run_matmul_case(FI_DTYPE_Q4_1, 200, 576, ns, 2, 4000);
    run_matmul_case(FI_DTYPE_Q4_1, 67, 1536, ns, 2, 4001);
    run_matmul_case(FI_DTYPE_Q8_0, 301, 576, ns, 2, 4002);
    run_matmul_case(FI_DTYPE_Q4_0, 99, 576, ns, 2, 4003);
    run_matmul_case(FI_DTYPE_F16, 70, 576, ns, 2, 4004);
}

static void test_matmul_small(void **state) {
    (void)state;
    for (int bits = 16; bits >= 8; bits -= 8) {
        s_act_bits = bits;
        s_matmul_small();
    }
    s_act_bits = 16;
}

static void test_matmul_model_shapes(void **state) {
    (void)state;
    for (int bits = 16; bits >= 8; bits -= 8) {
        s_act_bits = bits;
        s_matmul_model_shapes();
    }
    s_act_bits = 16;
}

static void test_act_bits_setting(void **state) {
    (void)state;
    char err[128];
    fi_backend *b = fi_cpu_backend_new(1, FI_SIMD_AUTO, err, sizeof err);
    assert_non_null(b);
    assert_int_equal(fi_cpu_backend_set_act_bits(b, 12), -1);
    assert_int_equal(fi_cpu_backend_act_bits(b), 16);
    assert_int_equal(fi_cpu_backend_set_act_bits(b, 8), 0);
    assert_int_equal(fi_cpu_backend_act_bits(b), 8);
    assert_int_equal(fi_cpu_backend_set_act_bits(NULL, 8), -1);
    fi_backend_destroy(&b);
}

/* --- other ops ------------------------------------------------------------ */

static void test_get_rows(void **state) {
    (void)state;
    rng r = {7};
    for (size_t ti = 0; ti < N_TYPES; ti++) {
        fi_dtype t = all_types[ti];
        int rows = 11, cols = 96;
        size_t rb;
        uint8_t *wb = make_weight(&r, t, rows, cols, &rb);
        fi_weight w = {.data = wb, .type = t, .rows = rows, .cols = cols, .row_bytes = rb};
        int32_t tok[4] = {3, 0, 10, 3};
        float *y = fvec(4 * cols);
        double ref[96];
        fi_backend *bs[2];
        int nb = make_backends(bs, 2);
        for (int bi = 0; bi < nb; bi++) {
            poison(y, 4 * cols);
            bs[bi]->ops->get_rows(bs[bi]->ctx, y, &w, tok, 4);
            for (int k = 0; k < 4; k++) {
                ref_dequant(t, wb + tok[k] * rb, ref, cols);
                for (int c = 0; c < cols; c++)
                    assert_true((double)y[k * cols + c] == (double)(float)ref[c]);
            }
            fi_backend_destroy(&bs[bi]);
        }
        free(y);
        free(wb);
    }
}

static void test_rmsnorm(void **state) {
    (void)state;
    rng r = {11};
    int n = 3, dim = 576;
    float *x = fvec(n * dim), *g = fvec(dim), *y = fvec(n * dim);
    for (int i = 0; i < n * dim; i++)
        x[i] = rng_f(&r, -3, 3);
    for (int i = 0; i < dim; i++)
        g[i] = rng_f(&r, 0.5f, 1.5f);
    fi_backend *bs[2];
    int nb = make_backends(bs, 2);
    for (int bi = 0; bi < nb; bi++) {
        fi_backend *b = bs[bi];
        poison(y, n * dim);
        b->ops->rmsnorm(b->ctx, y, x, g, n, dim, 1e-5f);
        for (int t = 0; t < n; t++) {
            double ss = 0;
            for (int i = 0; i < dim; i++)
                ss += (double)x[t * dim + i] * x[t * dim + i];
            double s = 1.0 / sqrt(ss / dim + 1e-5);
            for (int i = 0; i < dim; i++) {
                double want = x[t * dim + i] * s * g[i];
                assert_true(fabs(y[t * dim + i] - want) <= 1e-5 * fabs(want) + 1e-6);
            }
        }
        /* in place */
        memcpy(y, x, n * dim * sizeof *y);
        float *y2 = fvec(n * dim);
        b->ops->rmsnorm(b->ctx, y2, x, g, n, dim, 1e-5f);
        b->ops->rmsnorm(b->ctx, y, y, g, n, dim, 1e-5f);
        assert_memory_equal(y, y2, n * dim * sizeof *y);
        free(y2);
        fi_backend_destroy(&bs[bi]);
    }
    free(x);
    free(g);
    free(y);
}

static void test_rope(void **state) {
    (void)state;
    rng r = {13};
    int n = 4, nh = 3, hd = 64, w = nh * hd;
    int32_t pos[4] = {0, 1, 17, 4000};
    float theta = 10000.0f;
    float *x = fvec(n * w), *y = fvec(n * w);
    for (int i = 0; i < n * w; i++)
        x[i] = rng_f(&r, -2, 2);
    fi_backend *bs[2];
    int nb = make_backends(bs, 1);
    for (int bi = 0; bi < nb; bi++) {
        fi_backend *b = bs[bi];
        memcpy(y, x, n * w * sizeof *y);
        b->ops->rope(b->ctx, y, n, nh, hd, pos, theta);
        for (int t = 0; t < n; t++)
            for (int h = 0; h < nh; h++)
                for (int i = 0; i < hd / 2; i++) {
                    size_t o = (size_t)t * w + h * hd + 2 * i;
                    double ang = pos[t] * pow(theta, -2.0 * i / hd);
                    double a = x[o], c = x[o + 1];
                    double wa = a * cos(ang) - c * sin(ang), wc = a * sin(ang) + c * cos(ang);
                    assert_true(fabs(y[o] - wa) <= 1e-5 * (fabs(a) + fabs(c)) + 1e-6);
                    assert_true(fabs(y[o + 1] - wc) <= 1e-5 * (fabs(a) + fabs(c)) + 1e-6);
                    double n0 = hypot(a, c), n1 = hypot(y[o], y[o + 1]);
                    assert_true(fabs(n0 - n1) <= 1e-5 * n0 + 1e-7);
                    if (pos[t] == 0) /* identity at position 0 */
                        assert_true(y[o] == x[o] && y[o + 1] == x[o + 1]);
                }
        fi_backend_destroy(&bs[bi]);
    }
    free(x);
    free(y);
}

/* Naive attention in double: full softmax over 0..pos[t]. */
static void ref_attention(double *out, const float *q, const float *k, const float *v, int n,
                          const int32_t *pos, int nh, int nkv, int hd) {
    int kv_dim = nkv * hd;
    for (int t = 0; t < n; t++)
        for (int h = 0; h < nh; h++) {
            int kh = h / (nh / nkv);
            const float *qh = q + (size_t)t * nh * hd + h * hd;
            int np = pos[t] + 1;
            double *s = malloc(np * sizeof *s);
            double mx = -INFINITY, sum = 0;
            for (int p = 0; p < np; p++) {
                double d = 0;
                for (int i = 0; i < hd; i++)
                    d += (double)qh[i] * k[(size_t)p * kv_dim + kh * hd + i];
                s[p] = d / sqrt(hd);
                mx = fmax(mx, s[p]);
            }
            for (int p = 0; p < np; p++) {
                s[p] = exp(s[p] - mx);
                sum += s[p];
            }
            double *o = out + (size_t)t * nh * hd + h * hd;
            for (int i = 0; i < hd; i++) {
                double a = 0;
                for (int p = 0; p < np; p++)
                    a += s[p] * v[(size_t)p * kv_dim + kh * hd + i];
                o[i] = a / sum;
            }
            free(s);
        }
}

static void run_attention(const int32_t *pos, int n, int nh, int nkv, int hd, float qscale) {
    rng r = {17 + (uint64_t)n * 31 + (uint64_t)pos[0]};
    int maxp = 0;
    for (int t = 0; t < n; t++)
        maxp = pos[t] > maxp ? pos[t] : maxp;
    int kv_dim = nkv * hd, qd = nh * hd;
    float *q = fvec(n * qd), *k = fvec((size_t)(maxp + 1) * kv_dim), *v = fvec((size_t)(maxp + 1) * kv_dim);
    float *out = fvec(n * qd);
    double *ref = malloc(n * qd * sizeof *ref);
    for (int i = 0; i < n * qd; i++)
        q[i] = rng_f(&r, -1, 1) * qscale;
    /* the cache holds fp16: the reference sees the same rounded values */
    size_t nkvv = (size_t)(maxp + 1) * kv_dim;
    uint16_t *kh = malloc(nkvv * sizeof *kh), *vh = malloc(nkvv * sizeof *vh);
    for (size_t i = 0; i < nkvv; i++) {
        k[i] = fi_fp16_to_fp32(fi_fp32_to_fp16(rng_f(&r, -1, 1)));
        v[i] = fi_fp16_to_fp32(fi_fp32_to_fp16(rng_f(&r, -1, 1)));
    }
    ref_attention(ref, q, k, v, n, pos, nh, nkv, hd);
    for (int threads = 1; threads <= 3; threads++) {
        fi_backend *bs[2];
        int nb = make_backends(bs, threads);
        for (int bi = 0; bi < nb; bi++) {
            poison(out, n * qd);
            memset(kh, 0xff, nkvv * sizeof *kh);
            memset(vh, 0xff, nkvv * sizeof *vh);
            bs[bi]->ops->store_f16(bs[bi]->ctx, kh, k, nkvv);
            bs[bi]->ops->store_f16(bs[bi]->ctx, vh, v, nkvv);
            for (size_t i = 0; i < nkvv; i++)
                if (kh[i] != fi_fp32_to_fp16(k[i]) || vh[i] != fi_fp32_to_fp16(v[i]))
                    fail_msg("store_f16 %s: element %zu differs", fi_cpu_backend_simd(bs[bi]), i);
            bs[bi]->ops->attention(bs[bi]->ctx, out, q, kh, vh, n, pos, nh, nkv, hd);
            for (int i = 0; i < n * qd; i++)
                if (!(fabs(out[i] - ref[i]) <= 2e-5 * (1 + fabs(ref[i]))))
                    fail_msg("attention %s %dt n=%d: out[%d] = %g, want %g", fi_cpu_backend_simd(bs[bi]),
                             threads, n, i, (double)out[i], ref[i]);
            fi_backend_destroy(&bs[bi]);
        }
    }
    free(q);
    free(k);
    free(v);
    free(kh);
    free(vh);
    free(out);
    free(ref);
}

static void test_attention(void **state) {
    (void)state;
    int32_t p1[] = {0};
    int32_t p2[] = {7};
    int32_t p3[] = {0, 1, 2, 3, 4};
    int32_t p4[] = {5, 6, 7, 8};
    int32_t p5[] = {300};
    int32_t p6[] = {250, 251, 252};
    int32_t p7[] = {3, 0, 9}; /* order need not be increasing */
    run_attention(p1, 1, 9, 3, 64, 1);
    run_attention(p2, 1, 9, 3, 64, 1);
    run_attention(p3, 5, 9, 3, 64, 1);
    run_attention(p4, 4, 4, 2, 32, 1);
    run_attention(p5, 1, 9, 3, 64, 8);  /* peaked scores over several chunks */
    run_attention(p6, 3, 6, 6, 16, 20); /* no grouping, very peaked */
    run_attention(p7, 3, 4, 1, 8, 1);   /* one kv head for all */
}

static void test_swiglu_add(void **state) {
    (void)state;
    rng r = {23};
    size_t sizes[] = {1, 1536, 40000};
    for (size_t si = 0; si < 3; si++) {
        size_t n = sizes[si];
        float *g = fvec(n), *u = fvec(n), *y = fvec(n);
        for (size_t i = 0; i < n; i++) {
            g[i] = rng_f(&r, -10, 10);
            u[i] = rng_f(&r, -3, 3);
        }
        fi_backend *bs[2];
        int nb = make_backends(bs, 2);
        for (int bi = 0; bi < nb; bi++) {
            fi_backend *b = bs[bi];
            memcpy(y, g, n * sizeof *y);
            b->ops->swiglu(b->ctx, y, u, n);
            for (size_t i = 0; i < n; i++) {
                double want = g[i] / (1.0 + exp(-(double)g[i])) * u[i];
                assert_true(fabs(y[i] - want) <= 1e-5 * fabs(want) + 1e-6);
            }
            memcpy(y, g, n * sizeof *y);
            b->ops->add(b->ctx, y, u, n);
            for (size_t i = 0; i < n; i++)
                assert_true(y[i] == g[i] + u[i]);
            fi_backend_destroy(&bs[bi]);
        }
        free(g);
        free(u);
        free(y);
    }
}

static void test_backend_memory(void **state) {
    (void)state;
    char err[128];
    fi_backend *b = fi_cpu_backend_new(2, FI_SIMD_AUTO, err, sizeof err);
    assert_non_null(b);
    assert_string_equal(b->ops->name, "cpu");
    assert_int_equal(fi_cpu_backend_threads(b), 2);
    assert_non_null(fi_cpu_backend_simd(b));
    uint8_t *p = b->ops->alloc(b->ctx, 1000);
    assert_non_null(p);
    assert_int_equal((uintptr_t)p % 64, 0);
    for (int i = 0; i < 1000; i++)
        assert_int_equal(p[i], 0);
    uint8_t host[1000], back[1000];
    for (int i = 0; i < 1000; i++)
        host[i] = (uint8_t)(i * 7);
    assert_int_equal(b->ops->to_backend(b->ctx, p, host, 1000), 0);
    uint8_t *q = b->ops->alloc(b->ctx, 1000);
    assert_int_equal(b->ops->copy(b->ctx, q, p, 1000), 0);
    assert_int_equal(b->ops->to_host(b->ctx, back, q, 1000), 0);
    assert_memory_equal(host, back, 1000);
    assert_int_equal(b->ops->sync(b->ctx), 0);
    b->ops->free(b->ctx, p);
    b->ops->free(b->ctx, q);
    fi_backend_destroy(&b);
    assert_null(b);
    fi_backend_destroy(&b);
    fi_backend_destroy(NULL);
    b = fi_cpu_backend_new(0, FI_SIMD_PORTABLE, err, sizeof err);
    assert_non_null(b);
    assert_string_equal(fi_cpu_backend_simd(b), "portable");
    assert_true(fi_cpu_backend_threads(b) >= 1);
    fi_backend_destroy(&b);
    fi_backend other = {0};
    assert_null(fi_cpu_backend_simd(&other));
    assert_int_equal(fi_cpu_backend_threads(&other), 0);
}

/* --- pool ----------------------------------------------------------------- */

typedef struct pool_probe {
    atomic_int count[8];    /* runs seen per worker index */
    atomic_int bad_nth;     /* calls with the wrong nth */
    int nth;                /* expected */
} pool_probe;

static void pool_fn(void *arg, int ith, int nth) {
    pool_probe *pp = arg;
    if (nth != pp->nth || ith < 0 || ith >= nth)
        atomic_fetch_add(&pp->bad_nth, 1);
    else
        atomic_fetch_add(&pp->count[ith], 1);
}

static void test_pool(void **state) {
    (void)state;
    for (int nt = 1; nt <= 4; nt++) {
        fi_pool *p = fi_pool_new(nt);
        assert_non_null(p);
        assert_int_equal(fi_pool_threads(p), nt);
        pool_probe pr = {.nth = nt};
        const int runs = nt <= 2 ? 20000 : 2000; /* 3-4 threads oversubscribe 2 cores */
        for (int i = 0; i < runs; i++)
            fi_pool_run(p, pool_fn, &pr);
        for (int i = 0; i < nt; i++)
            assert_int_equal(atomic_load(&pr.count[i]), runs);
        assert_int_equal(atomic_load(&pr.bad_nth), 0);
        fi_pool_destroy(&p);
        assert_null(p);
        fi_pool_destroy(&p);
    }
}

/* Jobs separated by pauses longer than the spin, so workers go to sleep
 * and must be woken. */
static void test_pool_sleep_wake(void **state) {
    (void)state;
    fi_pool *p = fi_pool_new(3);
    assert_non_null(p);
    pool_probe pr = {.nth = 3};
    for (int i = 0; i < 5; i++) {
        struct timespec ts = {0, 2000000}; /* 2 ms */
        nanosleep(&ts, NULL);
        fi_pool_run(p, pool_fn, &pr);
    }
    for (int i = 0; i < 3; i++)
        assert_int_equal(atomic_load(&pr.count[i]), 5);
    fi_pool_destroy(&p);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_dtype_table),
        cmocka_unit_test(test_fp16_all_values),
        cmocka_unit_test(test_fp16_rounding),
        cmocka_unit_test(test_bf16),
        cmocka_unit_test(test_dequantize),
        cmocka_unit_test(test_matmul_small),
        cmocka_unit_test(test_matmul_model_shapes),
        cmocka_unit_test(test_act_bits_setting),
        cmocka_unit_test(test_get_rows),
        cmocka_unit_test(test_rmsnorm),
        cmocka_unit_test(test_rope),
        cmocka_unit_test(test_attention),
        cmocka_unit_test(test_swiglu_add),
        cmocka_unit_test(test_backend_memory),
        cmocka_unit_test(test_pool),
        cmocka_unit_test(test_pool_sleep_wake),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

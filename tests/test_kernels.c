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

#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fi_kernels.h"
#include "fi_kernels_impl.h" /* fi_cpu_backend_new_flavour */
#include "fi_cpu_q16_impl.h" /* the 16-bit-activation kernel tables */

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

/* Backends to compare: every flavour built and supported here (portable
 * first, always there). Also checks that FI_SIMD_AUTO and FI_SIMD_AVX2
 * choose one of them. Returns how many were made (at most S_FLAVOURS). */
#define S_FLAVOURS 4
static int make_backends_bits(fi_backend **out, int n_threads, int act_bits) {
    static const char *const names[S_FLAVOURS] = {"portable", "avx2", "avxvnni", "avx512vnni"};
    char err[256];
    int n = 0;
    for (int i = 0; i < S_FLAVOURS; i++) {
        fi_backend *b = fi_cpu_backend_new_flavour(n_threads, names[i], err, sizeof err);
        if (b) {
            assert_string_equal(fi_cpu_backend_simd(b), names[i]);
            assert_int_equal(fi_cpu_backend_threads(b), n_threads);
            /* the default: 12 where the tile unit serves the products */
            assert_int_equal(fi_cpu_backend_act_bits(b), fi_cpu_backend_tiles(b) ? 12 : 16);
            assert_int_equal(fi_cpu_backend_set_act_bits(b, act_bits), 0);
            out[n++] = b;
        } else {
            assert_true(i > 0); /* portable always exists */
        }
    }
    fi_backend *b = fi_cpu_backend_new(n_threads, FI_SIMD_AUTO, err, sizeof err);
    assert_non_null(b);
    int found = 0;
    for (int i = 0; i < n; i++)
        found |= strcmp(fi_cpu_backend_simd(b), fi_cpu_backend_simd(out[i])) == 0;
    assert_true(found);
    fi_backend_destroy(&b);
    b = fi_cpu_backend_new(n_threads, FI_SIMD_AVX2, err, sizeof err);
    if (b)
        assert_string_equal(fi_cpu_backend_simd(b), "avx2");
    fi_backend_destroy(&b);
    return n;
}

/* The same with the default activations (12: 16-bit quants, within 2039
 * for Q4 weights). */
static int make_backends(fi_backend **out, int n_threads) {
    return make_backends_bits(out, n_threads, 12);
}

/* Every flavour with 1 and 2 threads at every activation precision (16,
 * 12 and 8 bits); out holds S_ALL_BACKENDS. Returns how many were made. */
#define S_ALL_BACKENDS (S_FLAVOURS * 2 * 3)
static int make_backends_all(fi_backend **out) {
    int n = 0;
    for (int threads = 1; threads <= 2; threads++)
        for (int bits = 16; bits >= 8; bits -= 4)
            n += make_backends_bits(out + n, threads, bits);
    return n;
}

/* "avx2/2t 12-bit": a backend's flavour, threads and precision. */
static const char *backend_tag(const fi_backend *b, char *buf, size_t len) {
    snprintf(buf, len, "%s/%dt %d-bit", fi_cpu_backend_simd(b), fi_cpu_backend_threads(b),
             fi_cpu_backend_act_bits(b));
    return buf;
}

/* w as the engine hands it to backend b (weight_upload: a packed copy
 * where the kernels read one), and its release. */
static fi_weight upload(fi_backend *b, const fi_weight *w) {
    fi_weight wu = *w;
    if (b->ops->weight_upload)
        assert_int_equal(b->ops->weight_upload(b->ctx, &wu), 0);
    return wu;
}

static void release(fi_backend *b, fi_weight *wu) {
    if (wu->dev)
        b->ops->weight_release(b->ctx, wu);
    assert_null(wu->dev);
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
 * most half its step, amax/127 (8 bits) or amax/qmax (12 and 16 bits:
 * fi_q16_qmax, 2039 for Q4 at 12 bits, else 32767), amax that of its
 * block, or at 16 bits (one scale per token) that of its row. */
static void check_matmul(const char *what, fi_dtype t, int act_bits, const float *y,
                         const double *wd, const float *x, int rows, int cols, int n) {
    int quant = fi_dtype_block_elems(t) == 32;
    for (int k = 0; k < n; k++) {
        const float *xk = x + (size_t)k * cols;
        for (int r = 0; r < rows; r++) {
            const double *wr = wd + (size_t)r * cols;
            double ref = 0, mag = 0, qerr = 0, rmax = 0;
            for (int c = 0; c < cols; c++)
                rmax = fmax(rmax, fabs(xk[c]));
            for (int b = 0; b < cols; b += 32) {
                double amax = 0;
                int e = b + 32 < cols ? b + 32 : cols;
                for (int c = b; c < e; c++)
                    amax = fmax(amax, fabs(xk[c]));
                if (act_bits == 16)
                    amax = rmax;
                for (int c = b; c < e; c++) {
                    ref += wr[c] * xk[c];
                    mag += fabs(wr[c] * xk[c]);
                    qerr += fabs(wr[c]) * amax / (act_bits != 8 ? 2.0 * fi_q16_qmax(t, act_bits) : 254.0);
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

static void run_matmul_case(fi_dtype t, int act_bits, int rows, int cols, const int *ns, int nns,
                            uint64_t seed) {
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
    float *yt = fvec(ny);
    float *y1[S_FLAVOURS] = {fvec(ny), fvec(ny), fvec(ny), fvec(ny)}; /* 1-thread result per flavour */
    for (int ni = 0; ni < nns; ni++) {
        int n = ns[ni];
        for (int threads = 1; threads <= 3; threads++) {
            fi_backend *bs[S_FLAVOURS];
            int nb = make_backends_bits(bs, threads, act_bits);
            for (int bi = 0; bi < nb; bi++) {
                fi_backend *b = bs[bi];
                char what[112];
                snprintf(what, sizeof what, "%s/%dt/%d-bit rows=%d cols=%d n=%d", fi_cpu_backend_simd(b),
                         threads, act_bits, rows, cols, n);
                poison(yt, ny);
                b->ops->matmul(b->ctx, yt, &w, x, n);
                check_matmul(what, t, act_bits, yt, wd, x, rows, cols, n);
                /* thread counts give bit-identical results per flavour */
                if (threads == 1)
                    memcpy(y1[bi], yt, (size_t)n * rows * sizeof *yt);
                else if (memcmp(y1[bi], yt, (size_t)n * rows * sizeof *yt) != 0)
                    fail_msg("%s %s: differs from the 1-thread result", what, fi_dtype_name(t));
                /* flavours agree with portable closely: same quantised x,
                 * different summation order */
                for (size_t i = 0; bi > 0 && i < (size_t)n * rows; i++) {
                    double tol = 2e-5 * (fabs(y1[0][i]) + 1.0) + 1e-4;
                    if (!(fabs((double)yt[i] - y1[0][i]) <= tol))
                        fail_msg("%s: %g vs portable %g at %zu", what, (double)yt[i],
                                 (double)y1[0][i], i);
                }
            }
            for (int bi = 0; bi < nb; bi++)
                fi_backend_destroy(&bs[bi]);
        }
    }
    for (int i = 0; i < S_FLAVOURS; i++)
        free(y1[i]);
    free(yt);
    free(x);
    free(wd);
    free(wbytes);
}

static void s_matmul_small(int bits) {
    /* token counts that take every tile shape of the kernels */
    static const int ns[] = {1, 2, 3, 4, 5, 8, 16, 17};
    for (size_t ti = 0; ti < N_TYPES; ti++) {
        run_matmul_case(all_types[ti], bits, 37, 160, ns, 8, 1000 + ti);
        run_matmul_case(all_types[ti], bits, 5, 64, ns, 5, 2000 + ti);
    }
    /* float types: columns that are not a multiple of the vector width */
    run_matmul_case(FI_DTYPE_F32, bits, 19, 37, ns, 5, 3000);
    run_matmul_case(FI_DTYPE_F16, bits, 21, 13, ns, 5, 3001);
    run_matmul_case(FI_DTYPE_BF16, bits, 3, 45, ns, 5, 3002);
}

static void s_matmul_model_shapes(int bits) {
    static const int ns[] = {1, 6};
    run_matmul_case(FI_DTYPE_Q4_1, bits, 200, 576, ns, 2, 4000);
    run_matmul_case(FI_DTYPE_Q4_1, bits, 67, 1536, ns, 2, 4001);
    run_matmul_case(FI_DTYPE_Q8_0, bits, 301, 576, ns, 2, 4002);
    run_matmul_case(FI_DTYPE_Q4_0, bits, 99, 576, ns, 2, 4003);
    run_matmul_case(FI_DTYPE_F16, bits, 70, 576, ns, 2, 4004);
    /* more quantised activations than the backend's first scratch holds */
    static const int big[] = {560}; /* 560 x 48 blocks x 40 (72) bytes > 1 MiB */
    run_matmul_case(FI_DTYPE_Q4_1, bits, 32, 1536, big, 1, 4005);
}

/* Every activation precision: 12 (the default), 16 and 8. */
static void test_matmul_small(void **state) {
    (void)state;
    s_matmul_small(12);
    s_matmul_small(16);
    s_matmul_small(8);
}

static void test_matmul_model_shapes(void **state) {
    (void)state;
    s_matmul_model_shapes(12);
    s_matmul_model_shapes(16);
    s_matmul_model_shapes(8);
}

/* With 16-bit quants (act_bits 12, the default, here) a token's result does not depend
 * on the batch it comes in: n tokens at once equal each token alone, bit
 * for bit, in every flavour, for batches of every tile shape the kernels
 * have (2 to 20 tokens: vector tiles, full and partial AMX tiles; a token
 * at different places in the batch) and 1 or 2 threads (different row
 * splits); with 8-bit activations too. The scheduler
 * relies on it: batched decode gives the same logits as one sequence
 * alone, and prefill the same as decode. */
static void test_matmul16_batch_invariant(void **state) {
    (void)state;
    static const fi_dtype types[] = {FI_DTYPE_Q4_0, FI_DTYPE_Q4_1, FI_DTYPE_Q8_0};
    static const int ns[] = {2, 3, 4, 5, 7, 8, 15, 16, 17, 20};
    enum { ROWS = 75, COLS = 192, NT = 20 };
    rng r = {555};
    float *x = fvec((size_t)NT * COLS), *yb = fvec((size_t)NT * ROWS), *y1 = fvec((size_t)NT * ROWS);
    for (int i = 0; i < NT * COLS; i++)
        x[i] = rng_f(&r, -2, 2) * (i % 11 == 0 ? 4.0f : 1.0f);
    /* tokens too small for a normal activation scale: 1e-37 and subnormal;
     * token 5 mixes tiny blocks with normal ones */
    for (int i = 0; i < COLS; i++) {
        x[3 * COLS + i] *= 1e-37f;
        x[11 * COLS + i] *= 1e-41f;
        if (i / FI_QK % 2) x[5 * COLS + i] *= 1e-38f;
    }
    for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++) {
        size_t rb;
        uint8_t *wb = make_weight(&r, types[ti], ROWS, COLS, &rb);
        fi_weight w = {.data = wb, .type = types[ti], .rows = ROWS, .cols = COLS, .row_bytes = rb};
        for (int tb = 0; tb < 4; tb++) {
            const int threads = 1 + tb % 2, bits = tb < 2 ? 12 : 8;
            fi_backend *bs[S_FLAVOURS];
            int nb = make_backends_bits(bs, threads, bits);
            for (int bi = 0; bi < nb; bi++) {
                fi_backend *b = bs[bi];
                /* each token alone */
                for (int k = 0; k < NT; k++) {
                    poison(y1 + (size_t)k * ROWS, ROWS);
                    b->ops->matmul(b->ctx, y1 + (size_t)k * ROWS, &w, x + (size_t)k * COLS, 1);
                }
                /* the tiny tokens give (next to) nothing, not garbage */
                for (int i = 0; i < ROWS; i++)
                    if (!(fabsf(y1[3 * ROWS + i]) <= 1e-33f && fabsf(y1[11 * ROWS + i]) <= 1e-33f))
                        fail_msg("%s %s: row %d of a token of magnitude 1e-37 is %g, of 1e-41 %g",
                                 fi_cpu_backend_simd(b), fi_dtype_name(types[ti]), i,
                                 (double)y1[3 * ROWS + i], (double)y1[11 * ROWS + i]);
                for (size_t ni = 0; ni < sizeof ns / sizeof ns[0]; ni++) {
                    int n = ns[ni];
                    /* the first n tokens, then the last n (other places) */
                    for (int off = 0; off <= NT - n; off += NT - n) {
                        poison(yb, (size_t)n * ROWS);
                        b->ops->matmul(b->ctx, yb, &w, x + (size_t)off * COLS, n);
                        for (int k = 0; k < n; k++)
                            if (memcmp(y1 + (size_t)(off + k) * ROWS, yb + (size_t)k * ROWS,
                                       ROWS * sizeof *yb) != 0)
                                fail_msg("%s/%dt %d-bit %s: token %d alone differs from place %d in a batch of %d",
                                         fi_cpu_backend_simd(b), threads, bits, fi_dtype_name(types[ti]),
                                         off + k, k, n);
                        if (n == NT)
                            break;
                    }
                }
            }
            for (int bi = 0; bi < nb; bi++)
                fi_backend_destroy(&bs[bi]);
        }
        free(wb);
    }
    free(x);
    free(yb);
    free(y1);
}

/* The 16-bit kernel tables themselves, called on row ranges that the
 * backend's thread split never makes (single rows, ranges not starting at
 * a multiple of 4 or 16): a (row, token) result is the same bits whatever
 * range and token batch it is computed in. Flavour tables are reached
 * through weak references, present when fi_kernels built them (the
 * processor check is this test's). */
#if defined(__x86_64__) || defined(__i386__)
void fi_q16_kernels_avx2(fi_q16_kernels *k) __attribute__((weak));
void fi_cpu_kernels_avx2(fi_cpu_kernels *k) __attribute__((weak));
void fi_cpu_kernels_avxvnni(fi_cpu_kernels *k) __attribute__((weak));
void fi_cpu_kernels_avx512(fi_cpu_kernels *k) __attribute__((weak));
void fi_q16_kernels_avx512(fi_q16_kernels *k) __attribute__((weak));
int fi_q16_kernels_avx512_amx(fi_q16_kernels *k) __attribute__((weak));
#endif

/* matmul_n (several products of one input in one call: Q, K and V; gate
 * and up) gives each product the same bits as its own matmul call: every
 * flavour, 1 and 2 threads, 16- and 8-bit activations, batches below, at
 * and past the tile of 16 tokens, mixed weight types and row counts, and a
 * float weight among quantised ones. */
static void test_matmul_n(void **state) {
    (void)state;
    enum { COLS = 192, NT = 35, MAXN = 4 };
    static const int rows[MAXN] = {75, 16, 48, 40};
    static const fi_dtype types[MAXN] = {FI_DTYPE_Q4_1, FI_DTYPE_Q8_0, FI_DTYPE_Q4_0, FI_DTYPE_F32};
    static const int ns[] = {1, 5, 16, 17, 35};
    rng r = {909};
    float *x = fvec((size_t)NT * COLS);
    for (int i = 0; i < NT * COLS; i++)
        x[i] = rng_f(&r, -2, 2) * (i % 7 == 0 ? 4.0f : 1.0f);
    fi_weight w[MAXN], wu[MAXN];
    const fi_weight *wp[MAXN], *wup[MAXN];
    float *ref[MAXN], *got[MAXN];
    for (int i = 0; i < MAXN; i++) {
        size_t rb;
        uint8_t *wb = make_weight(&r, types[i], rows[i], COLS, &rb);
        w[i] = (fi_weight){.data = wb, .type = types[i], .rows = rows[i], .cols = COLS, .row_bytes = rb};
        wp[i] = &w[i];
        wup[i] = &wu[i];
        ref[i] = fvec((size_t)NT * rows[i]);
        got[i] = fvec((size_t)NT * rows[i]);
    }
    fi_backend *bs[S_ALL_BACKENDS];
    int nb = make_backends_all(bs);
    for (int bi = 0; bi < nb; bi++) {
        fi_backend *b = bs[bi];
        char tag[64];
        assert_non_null(b->ops->matmul_n);
        for (int count = 1; count <= MAXN; count++)
            for (size_t ni = 0; ni < sizeof ns / sizeof ns[0]; ni++) {
                int n = ns[ni];
                for (int i = 0; i < count; i++) {
                    poison(ref[i], (size_t)n * rows[i]);
                    poison(got[i], (size_t)n * rows[i]);
                    b->ops->matmul(b->ctx, ref[i], &w[i], x, n);
                }
                b->ops->matmul_n(b->ctx, count, got, wp, x, n);
                for (int i = 0; i < count; i++)
                    if (memcmp(ref[i], got[i], (size_t)n * rows[i] * sizeof(float)) != 0)
                        fail_msg("%s: product %d of %d (%s), %d tokens: matmul_n differs from "
                                 "matmul", backend_tag(b, tag, sizeof tag), i, count,
                                 fi_dtype_name(types[i]), n);
                /* and from the weights as the engine hands them over
                 * (weight_upload: a packed copy where the kernels read one) */
                for (int i = 0; i < count; i++) {
                    wu[i] = upload(b, &w[i]);
                    poison(got[i], (size_t)n * rows[i]);
                }
                b->ops->matmul_n(b->ctx, count, got, wup, x, n);
                for (int i = 0; i < count; i++) {
                    if (memcmp(ref[i], got[i], (size_t)n * rows[i] * sizeof(float)) != 0)
                        fail_msg("%s: product %d of %d (%s), %d tokens: uploaded weights differ",
                                 backend_tag(b, tag, sizeof tag), i, count,
                                 fi_dtype_name(types[i]), n);
                    release(b, &wu[i]);
                }
            }
        fi_backend_destroy(&bs[bi]);
    }
    for (int i = 0; i < MAXN; i++) {
        free((void *)w[i].data);
        free(ref[i]);
        free(got[i]);
    }
    free(x);
}

/* matmul_add (acc += W x through y) gives the same bits as matmul then
 * add, in y and in acc: every flavour, activation precision and thread
 * count, batches of every tile shape, weights as given and as uploaded
 * (packed). */
static void test_matmul_add(void **state) {
    (void)state;
    enum { COLS = 96, ROWS = 80, NT = 35 };
    static const fi_dtype types[] = {FI_DTYPE_Q4_1, FI_DTYPE_Q8_0, FI_DTYPE_F32};
    static const int ns[] = {1, 5, 16, 17, 35};
    rng r = {4242};
    float *x = fvec((size_t)NT * COLS), *acc0 = fvec((size_t)NT * ROWS);
    float *want = fvec((size_t)NT * ROWS), *ywant = fvec((size_t)NT * ROWS);
    float *got = fvec((size_t)NT * ROWS), *ygot = fvec((size_t)NT * ROWS);
    for (int i = 0; i < NT * COLS; i++)
        x[i] = rng_f(&r, -2, 2);
    for (int i = 0; i < NT * ROWS; i++)
        acc0[i] = rng_f(&r, -3, 3);
    fi_backend *bs[S_ALL_BACKENDS];
    int nb = make_backends_all(bs);
    for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++) {
        size_t rb;
        uint8_t *wb = make_weight(&r, types[ti], ROWS, COLS, &rb);
        fi_weight w = {.data = wb, .type = types[ti], .rows = ROWS, .cols = COLS, .row_bytes = rb};
        for (int bi = 0; bi < nb; bi++) {
            fi_backend *b = bs[bi];
            char tag[64];
            assert_non_null(b->ops->matmul_add);
            fi_weight wu = upload(b, &w);
            for (size_t ni = 0; ni < sizeof ns / sizeof ns[0]; ni++) {
                const int n = ns[ni];
                const size_t ny = (size_t)n * ROWS;
                memcpy(want, acc0, ny * sizeof *want);
                b->ops->matmul(b->ctx, ywant, &w, x, n);
                b->ops->add(b->ctx, want, ywant, ny);
                for (int up = 0; up < 2; up++) {
                    memcpy(got, acc0, ny * sizeof *got);
                    poison(ygot, ny);
                    b->ops->matmul_add(b->ctx, got, ygot, up ? &wu : &w, x, n);
                    if (memcmp(got, want, ny * sizeof *got) != 0 ||
                        memcmp(ygot, ywant, ny * sizeof *ygot) != 0)
                        fail_msg("%s %s, %d tokens%s: matmul_add differs from matmul then add",
                                 backend_tag(b, tag, sizeof tag), fi_dtype_name(types[ti]), n,
                                 up ? ", uploaded" : "");
                }
            }
            release(b, &wu);
        }
        free(wb);
    }
    for (int bi = 0; bi < nb; bi++)
        fi_backend_destroy(&bs[bi]);
    free(x);
    free(acc0);
    free(want);
    free(ywant);
    free(got);
    free(ygot);
}

/* matmul_argmax: the same rows as matmul, and each row's argmax as
 * fi_argmax_f32 finds it, on every backend, thread count and precision.
 * The weight rows repeat with a period of 37, so every maximum is tied
 * further on, often in another thread's claim: the first must win. A
 * token of zeros gives rows of zeros (of both signs): index 0. Float
 * weights add rows of NaNs and of infinities. */
static void test_matmul_argmax(void **state) {
    (void)state;
    enum { COLS = 96, ROWS = 400, NT = 35, PERIOD = 37 };
    static const fi_dtype types[] = {FI_DTYPE_Q4_1, FI_DTYPE_Q8_0, FI_DTYPE_F32};
    static const int ns[] = {1, 5, 16, 17, 35};
    rng r = {4343};
    float *x = fvec((size_t)NT * COLS), *ywant = fvec((size_t)NT * ROWS), *ygot = fvec((size_t)NT * ROWS);
    int32_t idx[NT];
    for (int i = 0; i < NT * COLS; i++)
        x[i] = rng_f(&r, -2, 2);
    for (int i = 0; i < COLS; i++)
        x[3 * COLS + i] = 0.0f; /* token 3 */
    fi_backend *bs[S_ALL_BACKENDS];
    int nb = make_backends_all(bs);
    for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++) {
        size_t rb;
        uint8_t *wb = make_weight(&r, types[ti], ROWS, COLS, &rb);
        if (types[ti] == FI_DTYPE_F32) {
            /* row 5 all NaN (never wins), row 10 an infinity at column 0
             * (+inf or -inf by the sign of x[t][0]; NaN for the zero token) */
            float *w5 = (float *)(void *)(wb + 5 * rb), *w10 = (float *)(void *)(wb + 10 * rb);
            for (int c = 0; c < COLS; c++)
                w5[c] = NAN;
            w10[0] = INFINITY;
        }
        for (int row = PERIOD; row < ROWS; row++)
            memcpy(wb + (size_t)row * rb, wb + (size_t)(row % PERIOD) * rb, rb);
        fi_weight w = {.data = wb, .type = types[ti], .rows = ROWS, .cols = COLS, .row_bytes = rb};
        for (int bi = 0; bi < nb; bi++) {
            fi_backend *b = bs[bi];
            char tag[64];
            assert_non_null(b->ops->matmul_argmax);
            fi_weight wu = upload(b, &w);
            for (size_t ni = 0; ni < sizeof ns / sizeof ns[0]; ni++) {
                const int n = ns[ni];
                b->ops->matmul(b->ctx, ywant, &wu, x, n);
                poison(ygot, (size_t)n * ROWS);
                for (int t = 0; t < n; t++)
                    idx[t] = -7;
                b->ops->matmul_argmax(b->ctx, ygot, idx, &wu, x, n);
                if (memcmp(ygot, ywant, (size_t)n * ROWS * sizeof *ygot) != 0)
                    fail_msg("%s %s, %d tokens: matmul_argmax's rows differ from matmul's",
                             backend_tag(b, tag, sizeof tag), fi_dtype_name(types[ti]), n);
                for (int t = 0; t < n; t++) {
                    int32_t want = fi_argmax_f32(ywant + (size_t)t * ROWS, ROWS);
                    if (idx[t] != want)
                        fail_msg("%s %s, %d tokens: token %d argmax %d, want %d",
                                 backend_tag(b, tag, sizeof tag), fi_dtype_name(types[ti]), n, t,
                                 idx[t], want);
                    assert_true(want < PERIOD);
                    if (t == 3)
                        assert_int_equal(idx[t], 0);
                    else if (types[ti] == FI_DTYPE_F32 && x[(size_t)t * COLS] > 0)
                        assert_int_equal(idx[t], 10);
                }
            }
            release(b, &wu);
        }
        free(wb);
    }
    for (int bi = 0; bi < nb; bi++)
        fi_backend_destroy(&bs[bi]);
    free(x);
    free(ywant);
    free(ygot);
}

#if defined(__x86_64__) || defined(__i386__)
void fi_cpu_kernels_avx2(fi_cpu_kernels *k) __attribute__((weak));
#endif

/* The 8-bit activation quantisers (portable, AVX2 where the processor has
 * it) against fi_quantize_q8x_ref: the same bits (d, s, quants), every
 * quant within 127, and a block too small for a normal scale (1e-37,
 * subnormal) quantised to zeros with d = 0 (127 / amax would overflow). */
static void test_q8x_quantize(void **state) {
    (void)state;
    enum { NB = 6 };
    static const float scale[NB] = {1.0f, 1e-30f, 1e-37f, 1e-41f, 1e30f, 0.0f};
    float x[NB * FI_QK];
    fi_block_q8x ref[NB], got[NB];
    rng r = {8088};
    for (int b = 0; b < NB; b++)
        for (int i = 0; i < FI_QK; i++) x[b * FI_QK + i] = rng_f(&r, -2, 2) * scale[b];
    fi_quantize_q8x_ref(x, ref, NB);
    for (int b = 0; b < NB; b++) {
        for (int i = 0; i < FI_QK; i++) assert_true(ref[b].qs[i] >= -127 && ref[b].qs[i] <= 127);
        if (b == 2 || b == 3 || b == 5) {
            assert_true(ref[b].d == 0.0f && ref[b].s == 0.0f);
            for (int i = 0; i < FI_QK; i++) assert_int_equal(ref[b].qs[i], 0);
        } else {
            assert_true(ref[b].d > 0.0f);
        }
    }
    fi_cpu_kernels k[2];
    const char *names[2] = {"portable", "avx2"};
    int nk = 0;
    memset(k, 0, sizeof k);
    fi_cpu_kernels_portable(&k[nk++]);
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    if (fi_cpu_kernels_avx2 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        fi_cpu_kernels_avx2(&k[nk++]);
#endif
    for (int ki = 0; ki < nk; ki++) {
        if (!k[ki].quantize_q8x) continue;
        memset(got, 0x5a, sizeof got);
        k[ki].quantize_q8x(x, got, NB);
        for (int b = 0; b < NB; b++)
            if (memcmp(&got[b], &ref[b], sizeof ref[b]) != 0)
                fail_msg("q8x %s quantiser, block %d (scale %g): d %a s %a q0 %d, reference d %a s "
                         "%a q0 %d", names[ki], b, (double)scale[b], (double)got[b].d,
                         (double)got[b].s, got[b].qs[0], (double)ref[b].d, (double)ref[b].s,
                         ref[b].qs[0]);
    }
}

static int q16_tables(fi_q16_kernels *out, const char **names) {
    int n = 0;
    fi_q16_kernels_portable(&out[n]);
    names[n++] = "portable";
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (avx2 && fi_q16_kernels_avx2) {
        fi_q16_kernels_avx2(&out[n]);
        names[n++] = "avx2";
    }
    if (avx2 && fi_q16_kernels_avx2 && fi_q16_kernels_avx512 && __builtin_cpu_supports("avx512f") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512vnni")) {
        fi_q16_kernels_avx2(&out[n]);
        fi_q16_kernels_avx512(&out[n]);
        names[n++] = "avx512vnni";
        /* the tile-unit variant, where there is one */
        out[n] = out[n - 1];
        if (fi_q16_kernels_avx512_amx && fi_q16_kernels_avx512_amx(&out[n]) == 0)
            names[n++] = "avx512amx";
    }
#endif
    return n;
}

/* x's nt rows of cols quantised as the backend does at act_bits: one
 * scale per block within fi_q16_qmax (12), or one per token (16). */
static void q16_quantize_rows(const float *x, fi_block_q16x *xq, int nt, int cols, fi_dtype t, int act_bits) {
    if (act_bits != 16) {
        fi_quantize_q16x_ref(x, xq, nt * cols / 32, fi_q16_qmax(t, act_bits));
        return;
    }
    for (int k = 0; k < nt; k++)
        fi_quantize_q16x_tok_ref(x + (size_t)k * cols, xq + (size_t)k * (cols / 32), cols / 32);
}

/* The 16-bit-activation kernels at act_bits 12 (one scale per block, the
 * quants' bound fi_q16_qmax) or 16 (one scale per token, fi_mm_task.xtok),
 * every flavour against the portable one and against itself on other
 * tilings. */
static void run_q16_tiling(int act_bits) {
    static const fi_dtype types[] = {FI_DTYPE_Q4_0, FI_DTYPE_Q4_1, FI_DTYPE_Q8_0};
    static const int ns[] = {1, 2, 3, 4, 5, 7, 8, 15, 16, 17, 19};
    static const int cuts[] = {0, 1, 6, 7, 10, 23, 37}; /* row ranges [cuts[i], cuts[i+1]) */
    enum { ROWS = 37, COLS = 160, NT = 19, NCUT = sizeof cuts / sizeof cuts[0] };
    fi_q16_kernels tab[4];
    const char *names[4];
    int ntab = q16_tables(tab, names);
    rng r = {777};
    float *x = fvec((size_t)NT * COLS);
    for (int i = 0; i < NT * COLS; i++)
        x[i] = rng_f(&r, -2, 2) * (i % 5 == 0 ? 8.0f : 1.0f);
    size_t xrow = (size_t)(COLS / 32) * sizeof(fi_block_q16x);
    fi_block_q16x *xq = malloc(xrow * NT);
    assert_non_null(xq);
    uint8_t *xs = malloc(FI_Q16_TILE_BYTES(COLS / 32) * ((NT + 15) / 16));
    uint8_t *wpk = malloc(fi_dtype_row_bytes(FI_DTYPE_Q8_0, COLS) * ROWS); /* the widest type */
    assert_non_null(xs);
    assert_non_null(wpk);
    float *y1 = fvec((size_t)NT * ROWS), *yb = fvec((size_t)NT * ROWS), *yp = fvec((size_t)NT * ROWS);
    double *wd = malloc((size_t)ROWS * COLS * sizeof *wd);
    assert_non_null(wd);
    for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++) {
        size_t rb;
        uint8_t *wb = make_weight(&r, types[ti], ROWS, COLS, &rb);
        for (int i = 0; i < ROWS; i++)
            ref_dequant(types[ti], wb + i * rb, wd + (size_t)i * COLS, COLS);
        q16_quantize_rows(x, xq, NT, COLS, types[ti], act_bits);
        for (int ki = 0; ki < ntab; ki++) {
            fi_mm_fn fn = types[ti] == FI_DTYPE_Q4_0 ? tab[ki].mm_q4_0
                        : types[ti] == FI_DTYPE_Q4_1 ? tab[ki].mm_q4_1 : tab[ki].mm_q8_0;
            fi_mm_task t = {.w = wb, .w_stride = rb, .cols = COLS, .x_stride = xrow, .y_stride = ROWS,
                            .qmax = fi_q16_qmax(types[ti], act_bits), .xtok = act_bits == 16};
            /* each token alone, all rows in one call */
            poison(y1, (size_t)NT * ROWS);
            for (int k = 0; k < NT; k++) {
                t.x = (const uint8_t *)xq + (size_t)k * xrow;
                t.n = 1;
                t.y = y1 + (size_t)k * ROWS;
                fn(&t, 0, ROWS);
            }
            char what[96];
            snprintf(what, sizeof what, "q16 %s kernels, %d-bit", names[ki], act_bits);
            check_matmul(what, types[ti], act_bits, y1, wd, x, ROWS, COLS, NT);
            /* close to the portable kernels on the same quantised x */
            if (ki == 0)
                memcpy(yp, y1, (size_t)NT * ROWS * sizeof *yp);
            for (size_t i = 0; i < (size_t)NT * ROWS; i++)
                if (!(fabs((double)y1[i] - yp[i]) <= 2e-5 * (fabs(yp[i]) + 1.0) + 1e-4))
                    fail_msg("%s %s: %g vs portable %g at %zu", what, fi_dtype_name(types[ti]),
                             (double)y1[i], (double)yp[i], i);
            if (tab[ki].pack)
                tab[ki].pack(types[ti], wb, rb, ROWS, COLS, wpk);
            /* batches of n at every offset, rows in uneven ranges */
            for (size_t ni = 0; ni < sizeof ns / sizeof ns[0]; ni++) {
                int n = ns[ni];
                for (int off = 0; off + n <= NT; off += (n < 5 ? 3 : 2)) {
                    poison(yb, (size_t)n * ROWS);
                    t.x = (const uint8_t *)xq + (size_t)off * xrow;
                    t.n = n;
                    t.y = yb;
                    for (int c = 0; c + 1 < NCUT; c++)
                        fn(&t, cuts[c], cuts[c + 1]);
                    for (int k = 0; k < n; k++)
                        if (memcmp(y1 + (size_t)(off + k) * ROWS, yb + (size_t)k * ROWS,
                                   ROWS * sizeof *yb) != 0)
                            fail_msg("%s %s: token %d alone differs from place %d of %d in split rows",
                                     what, fi_dtype_name(types[ti]), off + k, k, n);
                    if (tab[ki].pack) {
                        /* the same from the packed weights (two full groups
                         * of 16 rows packed, the last 5 rows read in place),
                         * in whole groups and in uneven row ranges */
                        static const int pcuts[] = {0, 16, 32, 37};
                        t.wp = wpk;
                        for (int uneven = 0; uneven < 2; uneven++) {
                            const int *cv = uneven ? cuts : pcuts;
                            int ncv = uneven ? NCUT : 4;
                            poison(yb, (size_t)n * ROWS);
                            for (int c = 0; c + 1 < ncv; c++)
                                fn(&t, cv[c], cv[c + 1]);
                            for (int k = 0; k < n; k++)
                                if (memcmp(y1 + (size_t)(off + k) * ROWS, yb + (size_t)k * ROWS,
                                           ROWS * sizeof *yb) != 0)
                                    fail_msg("%s %s: token %d alone differs from place %d of %d, "
                                             "packed weights%s", what, fi_dtype_name(types[ti]),
                                             off + k, k, n, uneven ? ", uneven row ranges" : "");
                        }
                        t.wp = NULL;
                    }
                    if (!tab[ki].split || n < FI_Q16_AMX_MIN || act_bits == 16)
                        continue; /* one scale per token: never the tile unit's */
                    /* the same with the input split by the caller (fi_mm_task.xs) */
                    for (int k = 0; k < n; k++)
                        tab[ki].split((const fi_block_q16x *)(const void *)((const uint8_t *)xq +
                                                                             (size_t)(off + k) * xrow),
                                      COLS / 32, xs + (size_t)(k / 16) * FI_Q16_TILE_BYTES(COLS / 32),
                                      k % 16, fi_q16_qmax(types[ti], act_bits));
                    poison(yb, (size_t)n * ROWS);
                    t.xs = xs;
                    t.wp = tab[ki].pack ? wpk : NULL;
                    for (int c = 0; c + 1 < NCUT; c++)
                        fn(&t, cuts[c], cuts[c + 1]);
                    t.xs = NULL;
                    t.wp = NULL;
                    for (int k = 0; k < n; k++)
                        if (memcmp(y1 + (size_t)(off + k) * ROWS, yb + (size_t)k * ROWS,
                                   ROWS * sizeof *yb) != 0)
                            fail_msg("%s %s: token %d alone differs from place %d of %d, input split by "
                                     "the caller", what, fi_dtype_name(types[ti]), off + k, k, n);
                }
            }
        }
        free(wb);
    }
    /* extremes: every activation quant at +-qmax and every weight at its
     * largest magnitude (nibble 15, Q8_0 -128): no 32-bit overflow, and
     * the split of the input for the tile unit holds its ends */
    for (int i = 0; i < NT * COLS; i++)
        x[i] = (i / COLS) % 2 ? -3.0f : 3.0f;
    for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++) {
        q16_quantize_rows(x, xq, NT, COLS, types[ti], act_bits);
        size_t rb;
        uint8_t *wb = make_weight(&r, types[ti], ROWS, COLS, &rb);
        size_t bb = fi_dtype_block_bytes(types[ti]), qo = types[ti] == FI_DTYPE_Q4_1 ? 4 : 2;
        for (size_t blk = 0; blk < rb * ROWS / bb; blk++)
            memset(wb + blk * bb + qo, types[ti] == FI_DTYPE_Q8_0 ? 0x80 : 0xff, bb - qo);
        for (int i = 0; i < ROWS; i++)
            ref_dequant(types[ti], wb + i * rb, wd + (size_t)i * COLS, COLS);
        for (int ki = 0; ki < ntab; ki++) {
            fi_mm_fn fn = types[ti] == FI_DTYPE_Q4_0 ? tab[ki].mm_q4_0
                        : types[ti] == FI_DTYPE_Q4_1 ? tab[ki].mm_q4_1 : tab[ki].mm_q8_0;
            fi_mm_task t = {.w = wb, .w_stride = rb, .cols = COLS, .x = (const uint8_t *)xq,
                            .x_stride = xrow, .n = NT, .y = y1, .y_stride = ROWS,
                            .qmax = fi_q16_qmax(types[ti], act_bits), .xtok = act_bits == 16};
            poison(y1, (size_t)NT * ROWS);
            fn(&t, 0, ROWS);
            char what[96];
            snprintf(what, sizeof what, "q16 %s kernels, %d-bit, extreme values", names[ki], act_bits);
            check_matmul(what, types[ti], act_bits, y1, wd, x, ROWS, COLS, NT);
        }
        free(wb);
    }
    for (int ki = 0; ki < ntab; ki++)
        print_message("q16 kernel table tested: %s\n", names[ki]);
    free(wd);
    free(xq);
    free(xs);
    free(wpk);
    free(x);
    free(y1);
    free(yb);
    free(yp);
}

/* The 8-bit-activation kernels (fi_block_q8x) of every flavour, called on
 * row ranges the backend never makes (single rows, starts off multiples
 * of 16; of 4 for the AVX2 ones), from the weights as
 * given and as packed (fi_q16_pack, which the AVX512 ones read): every
 * (row, token) result is the same bits as the token alone over all rows,
 * close to the portable kernels, and within the quantisation bound of the
 * exact product; weights at their extremes (nibble 15, Q8_0 quants -128
 * and 127) against activations at +-127 included, where the integer sums
 * are largest. */
static void test_q8x_kernels_tiling(void **state) {
    (void)state;
    static const fi_dtype types[] = {FI_DTYPE_Q4_0, FI_DTYPE_Q4_1, FI_DTYPE_Q8_0};
    static const int ns[] = {1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 19};
    static const int cuts[] = {0, 1, 6, 7, 10, 23, 37}; /* row ranges [cuts[i], cuts[i+1]) */
    static const int pcuts[] = {0, 16, 32, 37};          /* whole groups, then the rest */
    enum { ROWS = 37, COLS = 160, NT = 19, NCUT = sizeof cuts / sizeof cuts[0] };
    fi_cpu_kernels tab[4];
    const char *names[4];
    int ntab = 0;
    fi_cpu_kernels_portable(&tab[ntab]);
    names[ntab++] = "portable";
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (avx2 && fi_cpu_kernels_avx2) {
        fi_cpu_kernels_avx2(&tab[ntab]);
        names[ntab++] = "avx2";
    }
    /* AVX-VNNI as the backend checks it (CPUID; not every compiler's
     * __builtin_cpu_supports names it) */
    char err[128];
    fi_backend *vnni = fi_cpu_backend_new_flavour(1, "avxvnni", err, sizeof err);
    if (avx2 && fi_cpu_kernels_avxvnni && vnni) {
        fi_cpu_kernels_avxvnni(&tab[ntab]);
        names[ntab++] = "avxvnni";
    }
    fi_backend_destroy(&vnni);
    if (avx2 && fi_cpu_kernels_avx512 && __builtin_cpu_supports("avx512f") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512vnni")) {
        fi_cpu_kernels_avx512(&tab[ntab]);
        names[ntab++] = "avx512vnni";
    }
#endif
    printf("  8-bit kernel tables tested:");
    for (int i = 0; i < ntab; i++)
        printf(" %s", names[i]);
    printf("\n");
    rng r = {8088};
    float *x = fvec((size_t)NT * COLS);
    for (int i = 0; i < NT * COLS; i++)
        x[i] = rng_f(&r, -2, 2) * (i % 5 == 0 ? 8.0f : 1.0f);
    /* token 4: every block's quants at +-127 (a block of equal magnitudes) */
    for (int i = 0; i < COLS; i++)
        x[4 * COLS + i] = i % 3 ? 1.5f : -1.5f;
    const size_t xrow = (size_t)(COLS / 32) * sizeof(fi_block_q8x);
    fi_block_q8x *xq = malloc(xrow * NT);
    uint8_t *wpk = malloc(fi_dtype_row_bytes(FI_DTYPE_Q8_0, COLS) * ROWS); /* the widest type */
    float *y1 = fvec((size_t)NT * ROWS), *yb = fvec((size_t)NT * ROWS), *yp = fvec((size_t)NT * ROWS);
    double *wd = malloc((size_t)ROWS * COLS * sizeof *wd);
    assert_non_null(xq);
    assert_non_null(wpk);
    assert_non_null(wd);
    fi_quantize_q8x_ref(x, xq, NT * COLS / 32);
    for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++) {
        size_t rb;
        uint8_t *wb = make_weight(&r, types[ti], ROWS, COLS, &rb);
        /* rows 16..19: quants at their extremes */
        for (int row = 16; row < 20; row++)
            for (int b = 0; b < COLS / 32; b++) {
                uint8_t *blk = wb + (size_t)row * rb + (size_t)b * fi_dtype_block_bytes(types[ti]);
                if (types[ti] == FI_DTYPE_Q8_0)
                    memset(blk + 2, row % 2 ? 0x80 : 0x7f, 32); /* -128 or 127 */
                else
                    memset(blk + (types[ti] == FI_DTYPE_Q4_1 ? 4 : 2), row % 2 ? 0xff : 0x00, 16);
            }
        for (int i = 0; i < ROWS; i++)
            ref_dequant(types[ti], wb + i * rb, wd + (size_t)i * COLS, COLS);
        fi_q16_pack(types[ti], wb, rb, ROWS, COLS, wpk);
        for (int ki = 0; ki < ntab; ki++) {
            fi_mm_fn fn = types[ti] == FI_DTYPE_Q4_0 ? tab[ki].mm_q4_0
                        : types[ti] == FI_DTYPE_Q4_1 ? tab[ki].mm_q4_1 : tab[ki].mm_q8_0;
            fi_mm_task t = {.w = wb, .w_stride = rb, .cols = COLS, .x_stride = xrow, .y_stride = ROWS};
            char what[96];
            snprintf(what, sizeof what, "8-bit %s kernels, %s", names[ki], fi_dtype_name(types[ti]));
            /* each token alone, all rows in one call */
            poison(y1, (size_t)NT * ROWS);
            for (int k = 0; k < NT; k++) {
                t.x = (const uint8_t *)xq + (size_t)k * xrow;
                t.n = 1;
                t.y = y1 + (size_t)k * ROWS;
                fn(&t, 0, ROWS);
            }
            check_matmul(what, types[ti], 8, y1, wd, x, ROWS, COLS, NT);
            if (ki == 0)
                memcpy(yp, y1, (size_t)NT * ROWS * sizeof *yp);
            for (size_t i = 0; i < (size_t)NT * ROWS; i++)
                if (!(fabs((double)y1[i] - yp[i]) <= 2e-5 * (fabs(yp[i]) + 1.0) + 1e-4))
                    fail_msg("%s: %g vs portable %g at %zu", what, (double)y1[i], (double)yp[i], i);
            /* batches of n at every offset; rows in uneven ranges, then
             * from the packed copy in whole groups and in uneven ranges */
            for (size_t ni = 0; ni < sizeof ns / sizeof ns[0]; ni++) {
                int n = ns[ni];
                for (int off = 0; off + n <= NT; off += (n < 5 ? 3 : 2))
                    for (int way = 0; way < 3; way++) {
                        const int *cv = way == 1 ? pcuts : cuts;
                        int ncv = way == 1 ? 4 : NCUT;
                        t.wp = way ? wpk : NULL;
                        t.x = (const uint8_t *)xq + (size_t)off * xrow;
                        t.n = n;
                        t.y = yb;
                        poison(yb, (size_t)n * ROWS);
                        for (int c = 0; c + 1 < ncv; c++)
                            fn(&t, cv[c], cv[c + 1]);
                        for (int k = 0; k < n; k++)
                            if (memcmp(y1 + (size_t)(off + k) * ROWS, yb + (size_t)k * ROWS,
                                       ROWS * sizeof *yb) != 0)
                                fail_msg("%s: token %d alone differs from place %d of %d (%s)", what,
                                         off + k, k, n,
                                         way == 0 ? "uneven row ranges"
                                         : way == 1 ? "packed weights" : "packed, uneven row ranges");
                    }
            }
        }
        free(wb);
    }
    free(x);
    free(xq);
    free(wpk);
    free(y1);
    free(yb);
    free(yp);
    free(wd);
}

static void test_q16_kernels_tiling(void **state) {
    (void)state;
    run_q16_tiling(12);
}

static void test_q16_kernels_tiling_16(void **state) {
    (void)state;
    run_q16_tiling(16);
}

static void test_act_bits_setting(void **state) {
    (void)state;
    char err[128];
    fi_backend *b = fi_cpu_backend_new(1, FI_SIMD_AUTO, err, sizeof err);
    assert_non_null(b);
    const int def = fi_cpu_backend_tiles(b) ? 12 : 16;
    assert_int_equal(fi_cpu_backend_act_bits(b), def);
    assert_int_equal(fi_cpu_backend_set_act_bits(b, 10), -1);
    assert_int_equal(fi_cpu_backend_act_bits(b), def);
    assert_int_equal(fi_cpu_backend_set_act_bits(b, 12), 0);
    assert_int_equal(fi_cpu_backend_act_bits(b), 12);
    assert_int_equal(fi_cpu_backend_set_act_bits(b, 16), 0);
    assert_int_equal(fi_cpu_backend_act_bits(b), 16);
    assert_int_equal(fi_cpu_backend_set_act_bits(b, 8), 0);
    assert_int_equal(fi_cpu_backend_act_bits(b), 8);
    assert_int_equal(fi_cpu_backend_set_act_bits(NULL, 8), -1);
    fi_backend other = {0};
    assert_int_equal(fi_cpu_backend_set_act_bits(&other, 8), -1);
    assert_int_equal(fi_cpu_backend_act_bits(&other), 0);
    fi_backend_destroy(&b);
}

/* The activation quantisers of every 16-bit flavour against
 * fi_quantize_q16x_ref: d and qs the same bits, s the same sum up to
 * reassociation (|s - s_ref| <= 1e-6 sum |x|), and the AVX512 ones the
 * same bits as the AVX2 one (so the engine's output does not depend on
 * which quantiser runs). Rows of 1 to 49 blocks (groups of 16, short and
 * padded tails), at both bounds, every block kind at every place: plain,
 * an outlier, zeros (of both signs), tiny and huge magnitudes, and exact
 * ties (amax = qmax, so id = 1 and x * id ends in .5: rounding to nearest
 * even), and blocks too small for a normal scale (1e-37, subnormal), which
 * quantise to zeros with d = 0. Also: every quant is within qmax, nothing
 * is written past the row, and a block alone quantises to the same bits
 * as in its row. */
static void test_q16_quantize(void **state) {
    (void)state;
    static const int nbs[] = {1, 2, 15, 16, 17, 18, 48, 49};
    enum { NNB = sizeof nbs / sizeof nbs[0], MAXNB = 49, KINDS = 8 };
    fi_q16_kernels tab[4];
    const char *names[4];
    int ntab = q16_tables(tab, names), avx512 = 0;
    float *x = fvec((size_t)MAXNB * FI_QK);
    fi_block_q16x *ref = malloc(MAXNB * sizeof *ref), *got = malloc((MAXNB + 1) * sizeof *got);
    fi_block_q16x *avx2 = malloc(MAXNB * sizeof *avx2), one, canary;
    assert_non_null(ref);
    assert_non_null(got);
    assert_non_null(avx2);
    memset(&canary, 0xa5, sizeof canary);
    rng r = {4242};
    /* case c: row length, bound, and which kind block 0 is */
    for (int c = 0; c < NNB * 2 * KINDS; c++) {
        int nb = nbs[c / (2 * KINDS)], qmax = c / KINDS % 2 ? FI_Q16_QMAX : FI_Q16_QMAX_Q4;
        for (int b = 0; b < nb; b++) {
            float *xb = x + (size_t)b * FI_QK;
            int kind = (b + c) % KINDS;
            for (int i = 0; i < FI_QK; i++) {
                float v = rng_f(&r, -2, 2);
                xb[i] = kind == 2 ? (i % 2 ? -0.0f : 0.0f)
                      : kind == 3 ? v * 1e-30f
                      : kind == 4 ? v * 1e35f
                      : kind == 5 ? (float)(int)rng_f(&r, 1 - qmax, qmax - 1) + 0.5f
                      : kind == 6 ? v * 1e-37f
                      : kind == 7 ? v * 1e-41f
                      : v;
            }
            if (kind == 1)
                xb[rng_u32(&r) % FI_QK] *= 1000.0f; /* an outlier */
            if (kind == 5)
                xb[rng_u32(&r) % FI_QK] = rng_u32(&r) % 2 ? (float)qmax : (float)-qmax;
        }
        fi_quantize_q16x_ref(x, ref, nb, qmax);
        for (int b = 0; b < nb; b++) {
            const int kind = (b + c) % KINDS;
            for (int i = 0; i < FI_QK; i++)
                if (ref[b].qs[i] > qmax || ref[b].qs[i] < -qmax)
                    fail_msg("q16 reference quantiser, qmax %d, block %d (kind %d): quant %d", qmax,
                             b, kind, ref[b].qs[i]);
            if (kind >= 6 && (ref[b].d != 0.0f || memcmp(ref[b].qs, (int16_t[FI_QK]){0}, sizeof ref[b].qs)))
                fail_msg("q16 reference quantiser, qmax %d, block %d: a block of magnitude %g "
                         "quantised to d %a, quant 0 %d (expected zeros)", qmax, b,
                         (double)x[(size_t)b * FI_QK], (double)ref[b].d, ref[b].qs[0]);
        }
        for (int ki = 0; ki < ntab; ki++) {
            for (int b = 0; b <= nb; b++)
                got[b] = canary;
            tab[ki].quantize(x, got, nb, qmax);
            if (memcmp(&got[nb], &canary, sizeof canary) != 0)
                fail_msg("q16 %s quantiser, %d blocks: wrote past the row", names[ki], nb);
            for (int b = 0; b < nb; b++) {
                double sabs = 0.0;
                for (int i = 0; i < FI_QK; i++)
                    sabs += fabs((double)x[(size_t)b * FI_QK + i]);
                if (memcmp(&got[b].d, &ref[b].d, sizeof ref[b].d) != 0 ||
                    memcmp(got[b].qs, ref[b].qs, sizeof ref[b].qs) != 0 ||
                    !(fabs((double)got[b].s - ref[b].s) <= 1e-6 * sabs + 1e-38))
                    fail_msg("q16 %s quantiser, qmax %d, block %d (kind %d) of %d: d %a s %a vs "
                             "reference d %a s %a, or the quants differ", names[ki], qmax, b,
                             (b + c) % KINDS, nb, (double)got[b].d, (double)got[b].s,
                             (double)ref[b].d, (double)ref[b].s);
                tab[ki].quantize(x + (size_t)b * FI_QK, &one, 1, qmax);
                if (memcmp(&one, &got[b], sizeof one) != 0)
                    fail_msg("q16 %s quantiser, qmax %d: block %d of %d differs alone", names[ki],
                             qmax, b, nb);
            }
            /* q16_tables lists avx2 before the avx512 tables */
            if (strcmp(names[ki], "avx2") == 0)
                memcpy(avx2, got, (size_t)nb * sizeof *avx2);
            if (strncmp(names[ki], "avx512", 6) == 0) {
                avx512 = 1;
                if (memcmp(got, avx2, (size_t)nb * sizeof *avx2) != 0)
                    fail_msg("q16 %s quantiser, qmax %d, %d blocks: not the avx2 one's bits",
                             names[ki], qmax, nb);
            }
        }
    }
    for (int ki = 0; ki < ntab; ki++)
        print_message("q16 quantiser tested: %s\n", names[ki]);
    if (!avx512)
        print_message("note: no AVX512 16-bit kernels here: their quantiser untested\n");
    free(x);
    free(ref);
    free(got);
    free(avx2);
}

/* fi_q16_kernels.quantize_tok of every flavour against
 * fi_quantize_q16x_tok_ref: one scale for the whole row (every block's d
 * the same bits, amax / 32767 over the row), the same quants, s the
 * block's sum over d up to the order of its additions; a row too small
 * for a normal d quantises to zeros, a NaN makes d NaN; nothing written
 * past the row. */
static void test_q16_quantize_tok(void **state) {
    (void)state;
    static const int nbs[] = {1, 2, 17, 18, 48, 49};
    enum { NNB = sizeof nbs / sizeof nbs[0], MAXNB = 49, KINDS = 6 };
    fi_q16_kernels tab[4];
    const char *names[4];
    int ntab = q16_tables(tab, names);
    float *x = fvec((size_t)MAXNB * FI_QK);
    fi_block_q16x *ref = malloc(MAXNB * sizeof *ref), *got = malloc((MAXNB + 1) * sizeof *got), canary;
    assert_non_null(ref);
    assert_non_null(got);
    memset(&canary, 0xa5, sizeof canary);
    rng r = {977};
    for (int c = 0; c < NNB * KINDS; c++) {
        const int nb = nbs[c / KINDS], kind = c % KINDS;
        for (int i = 0; i < nb * FI_QK; i++) {
            float v = rng_f(&r, -2, 2);
            x[i] = kind == 1 ? 0.0f : kind == 2 ? v * 1e-41f : kind == 3 ? v * 1e35f : v;
        }
        if (kind == 4)
            x[rng_u32(&r) % (uint32_t)(nb * FI_QK)] = 1000.0f; /* an outlier sets the row's scale */
        if (kind == 5)
            x[rng_u32(&r) % (uint32_t)(nb * FI_QK)] = NAN;
        fi_quantize_q16x_tok_ref(x, ref, nb);
        double amax = 0.0;
        for (int i = 0; i < nb * FI_QK; i++)
            amax = fmax(amax, fabs((double)x[i]));
        for (int b = 0; b < nb; b++) {
            if (kind == 5 ? !isnan(ref[b].d) : memcmp(&ref[b].d, &ref[0].d, sizeof ref[b].d) != 0)
                fail_msg("q16 per-token reference quantiser, %d blocks (kind %d): block %d's d %a, "
                         "block 0's %a", nb, kind, b, (double)ref[b].d, (double)ref[0].d);
            for (int i = 0; i < FI_QK; i++) {
                int q = ref[b].qs[i];
                double want = kind >= 5 || amax < FI_Q16_QMAX * (double)FLT_MIN
                                  ? 0.0 : x[(size_t)b * FI_QK + i] * (FI_Q16_QMAX / amax);
                if (q > FI_Q16_QMAX || q < -FI_Q16_QMAX || fabs(q - want) > 0.5 + 4e-7 * fabs(want) + 1e-3) /* float rounding of x * id */
                    fail_msg("q16 per-token reference quantiser, %d blocks (kind %d): block %d quant %d "
                             "is %d, want %.3f", nb, kind, b, i, q, want);
            }
        }
        for (int ki = 0; ki < ntab; ki++) {
            for (int b = 0; b <= nb; b++)
                got[b] = canary;
            tab[ki].quantize_tok(x, got, nb);
            if (memcmp(&got[nb], &canary, sizeof canary) != 0)
                fail_msg("q16 %s per-token quantiser, %d blocks: wrote past the row", names[ki], nb);
            for (int b = 0; b < nb; b++) {
                double sabs = 0.0;
                for (int i = 0; i < FI_QK; i++)
                    sabs += fabs((double)x[(size_t)b * FI_QK + i]);
                sabs *= kind == 5 || !(amax > 0) ? 0.0 : FI_Q16_QMAX / amax;
                int same_d = kind == 5 ? isnan(got[b].d) : memcmp(&got[b].d, &ref[b].d, sizeof ref[b].d) == 0;
                int same_s = kind == 5 ? 1 : fabs((double)got[b].s - ref[b].s) <= 1e-6 * sabs + 1e-30;
                if (!same_d || !same_s || (kind != 5 && memcmp(got[b].qs, ref[b].qs, sizeof ref[b].qs) != 0))
                    fail_msg("q16 %s per-token quantiser, %d blocks (kind %d), block %d: d %a s %a vs "
                             "reference d %a s %a, or the quants differ", names[ki], nb, kind, b,
                             (double)got[b].d, (double)got[b].s, (double)ref[b].d, (double)ref[b].s);
            }
        }
    }
    for (int ki = 0; ki < ntab; ki++)
        print_message("q16 per-token quantiser tested: %s\n", names[ki]);
    free(x);
    free(ref);
    free(got);
}

/* --- real weights ---------------------------------------------------------- */

/* A minimal GGUF v3 reader, just enough to find tensors for the test below
 * (the engine's own parser lives in core/ and is tested there). Returns
 * the tensor's bytes or NULL, and its type and shape. */
typedef struct mini_gguf {
    uint8_t *buf;   /* whole file */
    size_t len;     /* its length */
    size_t off;     /* read cursor */
    int bad;        /* 1 after reading past the end */
} mini_gguf;

static uint64_t mg_u(mini_gguf *g, size_t n) {
    uint64_t v = 0;
    if (g->off + n > g->len) {
        g->bad = 1;
        return 0;
    }
    memcpy(&v, g->buf + g->off, n); /* little-endian host assumed (x86, arm64) */
    g->off += n;
    return v;
}

static void mg_skip_value(mini_gguf *g, uint32_t type) {
    static const size_t sizes[] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};
    if (type == 8) { /* string */
        uint64_t n = mg_u(g, 8);
        g->off += n;
    } else if (type == 9) { /* array */
        uint32_t et = (uint32_t)mg_u(g, 4);
        uint64_t n = mg_u(g, 8);
        for (uint64_t i = 0; i < n && !g->bad && g->off <= g->len; i++)
            mg_skip_value(g, et);
    } else if (type < 13) {
        g->off += sizes[type];
    } else {
        g->bad = 1;
    }
    if (g->off > g->len)
        g->bad = 1;
}

static const uint8_t *mg_find(mini_gguf *g, const char *want, uint32_t *type, int64_t *ne0, int64_t *ne1) {
    g->off = 0;
    g->bad = 0;
    if (mg_u(g, 4) != 0x46554747u || mg_u(g, 4) != 3)
        return NULL;
    uint64_t nt = mg_u(g, 8), nkv = mg_u(g, 8);
    uint64_t align = 32;
    for (uint64_t i = 0; i < nkv && !g->bad; i++) {
        uint64_t kl = mg_u(g, 8);
        int is_align = kl == 17 && g->off + kl <= g->len && memcmp(g->buf + g->off, "general.alignment", 17) == 0;
        g->off += kl;
        uint32_t t = (uint32_t)mg_u(g, 4);
        if (is_align && t == 4) {
            align = mg_u(g, 4);
            continue;
        }
        mg_skip_value(g, t);
    }
    const uint8_t *found = NULL;
    uint64_t found_off = 0;
    for (uint64_t i = 0; i < nt && !g->bad; i++) {
        uint64_t nl = mg_u(g, 8);
        int match = nl == strlen(want) && g->off + nl <= g->len && memcmp(g->buf + g->off, want, nl) == 0;
        g->off += nl;
        uint32_t nd = (uint32_t)mg_u(g, 4);
        int64_t ne[4] = {1, 1, 1, 1};
        for (uint32_t d = 0; d < nd && d < 4; d++)
            ne[d] = (int64_t)mg_u(g, 8);
        uint32_t t = (uint32_t)mg_u(g, 4);
        uint64_t off = mg_u(g, 8);
        if (match) {
            *type = t;
            *ne0 = ne[0];
            *ne1 = ne[1];
            found = g->buf;
            found_off = off;
        }
    }
    if (!found || g->bad || align == 0)
        return NULL;
    size_t data = (g->off + align - 1) / align * align;
    if (data + found_off >= g->len)
        return NULL;
    return g->buf + data + found_off;
}

/* Real weights and a realistic activation: the matmul of the model's own
 * Q4_1 and Q8_0 tensors against the double reference, all flavours. */
static void test_matmul_model_weights(void **state) {
    (void)state;
    FILE *f = fopen(FI_TEST_MODEL, "rb");
    if (!f) {
        fprintf(stderr, "note: %s not found, skipping\n", FI_TEST_MODEL);
        skip();
    }
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    mini_gguf g = {.buf = malloc((size_t)len), .len = (size_t)len};
    assert_non_null(g.buf);
    assert_int_equal(fread(g.buf, 1, (size_t)len, f), (size_t)len);
    fclose(f);
    static const struct {
        const char *name;
        uint32_t type;
        int rows; /* rows to test (a prefix of the tensor) */
    } cases[] = {
        {"blk.0.ffn_gate.weight", FI_DTYPE_Q4_1, 1536},
        {"blk.5.ffn_down.weight", FI_DTYPE_Q4_1, 576},
        {"blk.29.attn_k.weight", FI_DTYPE_Q4_1, 192},
        {"token_embd.weight", FI_DTYPE_Q8_0, 2000},
    };
    rng r = {77};
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        uint32_t type = 0;
        int64_t cols = 0, rows = 0;
        const uint8_t *data = mg_find(&g, cases[ci].name, &type, &cols, &rows);
        if (!data)
            fail_msg("%s: not found in %s", cases[ci].name, FI_TEST_MODEL);
        assert_int_equal(type, cases[ci].type);
        assert_true(rows >= cases[ci].rows);
        int nr = cases[ci].rows, nc = (int)cols;
        size_t rb = fi_dtype_row_bytes(type, nc);
        double *wd = malloc((size_t)nr * nc * sizeof *wd);
        assert_non_null(wd);
        for (int i = 0; i < nr; i++)
            ref_dequant((fi_dtype)type, data + i * rb, wd + (size_t)i * nc, nc);
        fi_weight w = {.data = data, .type = (fi_dtype)type, .rows = nr, .cols = nc, .row_bytes = rb};
        const int n = 5;
        float *x = fvec((size_t)n * nc), *y = fvec((size_t)n * nr);
        /* rmsnorm-scaled activations with a few outliers, as in the model */
        for (int i = 0; i < n * nc; i++)
            x[i] = rng_f(&r, -1, 1) * (rng_u32(&r) % 64 == 0 ? 20.0f : 1.0f);
        for (int bits = 16; bits >= 8; bits -= 4) {
            fi_backend *bs[S_FLAVOURS];
            int nb = make_backends_bits(bs, 2, bits);
            for (int bi = 0; bi < nb; bi++) {
                for (int nn = 1; nn <= n; nn += n - 1) {
                    char what[128];
                    snprintf(what, sizeof what, "%s %s %d-bit n=%d", cases[ci].name,
                             fi_cpu_backend_simd(bs[bi]), bits, nn);
                    poison(y, (size_t)n * nr);
                    bs[bi]->ops->matmul(bs[bi]->ctx, y, &w, x, nn);
                    check_matmul(what, (fi_dtype)type, bits, y, wd, x, nr, nc, nn);
                }
                fi_backend_destroy(&bs[bi]);
            }
        }
        free(x);
        free(y);
        free(wd);
    }
    free(g.buf);
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
        fi_backend *bs[S_FLAVOURS];
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

/* Against a double reference; every flavour the same bits as the
 * portable one (the engine's results do not depend on the flavour's
 * vector width here), rows of every length class (a multiple of 8 or
 * not), in place too. */
static void test_rmsnorm(void **state) {
    (void)state;
    static const int dims[] = {576, 45, 5};
    rng r = {11};
    const int n = 16;
    for (size_t di = 0; di < sizeof dims / sizeof dims[0]; di++) {
        const int dim = dims[di];
        float *x = fvec(n * dim), *g = fvec(dim), *y = fvec(n * dim), *y0 = fvec(n * dim);
        for (int i = 0; i < n * dim; i++)
            x[i] = rng_f(&r, -3, 3) * (i % 13 == 0 ? 30.0f : 1.0f);
        for (int i = 0; i < dim; i++)
            g[i] = rng_f(&r, 0.5f, 1.5f);
        fi_backend *bs[S_FLAVOURS];
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
            if (bi == 0)
                memcpy(y0, y, n * dim * sizeof *y);
            else if (memcmp(y0, y, n * dim * sizeof *y) != 0)
                fail_msg("rmsnorm dim %d: %s differs from portable", dim, fi_cpu_backend_simd(b));
            /* in place */
            memcpy(y, x, n * dim * sizeof *y);
            b->ops->rmsnorm(b->ctx, y, y, g, n, dim, 1e-5f);
            assert_memory_equal(y, y0, n * dim * sizeof *y);
            fi_backend_destroy(&bs[bi]);
        }
        free(x);
        free(g);
        free(y);
        free(y0);
    }
}

static void test_rope(void **state) {
    (void)state;
    rng r = {13};
    /* several settings on one backend: the angle table it may cache must
     * follow theta, head_dim and growing positions */
    static const struct {
        int hd;
        float theta;
        int32_t pos[4];
    } cases[] = {
        {64, 10000.0f, {0, 1, 17, 4000}},
        {64, 500000.0f, {3, 2, 1, 0}},
        {32, 10000.0f, {9000, 5, 0, 77}},
        {64, 10000.0f, {12, 0, 4000, 4001}},
        {40, 10000.0f, {7, 300, 0, 1}}, /* vector steps and a tail of pairs */
        {6, 10000.0f, {2, 1, 0, 99}},   /* the tail alone */
    };
    int n = 4, nh = 3;
    float *x = fvec(n * nh * 64), *y = fvec(n * nh * 64);
    fi_backend *bs[S_FLAVOURS];
    int nb = make_backends(bs, 1);
    for (int bi = 0; bi < nb; bi++) {
        fi_backend *b = bs[bi];
        for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
            int hd = cases[ci].hd, w = nh * hd;
            const int32_t *pos = cases[ci].pos;
            float theta = cases[ci].theta;
            for (int i = 0; i < n * w; i++)
                x[i] = rng_f(&r, -2, 2);
            memcpy(y, x, n * w * sizeof *y);
            b->ops->rope(b->ctx, y, n, nh, hd, pos, theta);
            for (int t = 0; t < n; t++)
                for (int h = 0; h < nh; h++)
                    for (int i = 0; i < hd / 2; i++) {
                        size_t o = (size_t)t * w + h * hd + 2 * i;
                        double ang = pos[t] * pow(theta, -2.0 * i / hd);
                        double a = x[o], c = x[o + 1];
                        double wa = a * cos(ang) - c * sin(ang), wc = a * sin(ang) + c * cos(ang);
                        if (!(fabs(y[o] - wa) <= 1e-5 * (fabs(a) + fabs(c)) + 1e-6) ||
                            !(fabs(y[o + 1] - wc) <= 1e-5 * (fabs(a) + fabs(c)) + 1e-6))
                            fail_msg("rope %s case %zu t=%d h=%d i=%d: (%g, %g), want (%g, %g)",
                                     fi_cpu_backend_simd(b), ci, t, h, i, (double)y[o],
                                     (double)y[o + 1], wa, wc);
                        double n0 = hypot(a, c), n1 = hypot(y[o], y[o + 1]);
                        assert_true(fabs(n0 - n1) <= 1e-5 * n0 + 1e-7);
                        if (pos[t] == 0) /* identity at position 0 */
                            assert_true(y[o] == x[o] && y[o + 1] == x[o + 1]);
                    }
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

/* Attention over a paged cache: query token t belongs to sequence
 * t % nseq; every sequence has its own random K/V rows for positions
 * 0..maxp, stored in blocks placed in a shuffled pool (with unused blocks
 * in between, poisoned) through kv_store. The reference sees each
 * sequence's rows in order. */
static void run_attention(const int32_t *pos, int n, int nh, int nkv, int hd, float qscale,
                          int nseq) {
    rng r = {17 + (uint64_t)n * 31 + (uint64_t)pos[0] + (uint64_t)nseq * 7};
    int maxp = 0;
    for (int t = 0; t < n; t++)
        maxp = pos[t] > maxp ? pos[t] : maxp;
    const int bsz = 16;
    int kv_dim = nkv * hd, qd = nh * hd, np = maxp + 1;
    int nblk = (np + bsz - 1) / bsz, pool = nseq * nblk * 2 + 1;
    size_t nkvv = (size_t)np * kv_dim;
    float *q = fvec(n * qd), *k = fvec(nseq * nkvv), *v = fvec(nseq * nkvv);
    float *out = fvec(n * qd);
    double *ref = malloc(n * qd * sizeof *ref);
    float *qt = fvec(qd);
    for (int i = 0; i < n * qd; i++)
        q[i] = rng_f(&r, -1, 1) * qscale;
    /* the cache holds fp16: the reference sees the same rounded values */
    for (size_t i = 0; i < nseq * nkvv; i++) {
        k[i] = fi_fp16_to_fp32(fi_fp32_to_fp16(rng_f(&r, -1, 1)));
        v[i] = fi_fp16_to_fp32(fi_fp32_to_fp16(rng_f(&r, -1, 1)));
    }
    for (int t = 0; t < n; t++) {
        int sq = t % nseq;
        ref_attention(ref + (size_t)t * qd, q + (size_t)t * qd, k + sq * nkvv, v + sq * nkvv, 1,
                      pos + t, nh, nkv, hd);
    }
    /* shuffled block ids: sequence s, block b -> perm[s*nblk + b] */
    int32_t *perm = malloc(pool * sizeof *perm), *seq = malloc(n * sizeof *seq);
    int32_t *slot = malloc(nseq * np * sizeof *slot);
    for (int i = 0; i < pool; i++)
        perm[i] = i;
    for (int i = pool - 1; i > 0; i--) {
        int j = (int)(rng_u32(&r) % (uint32_t)(i + 1)), tmp = perm[i];
        perm[i] = perm[j];
        perm[j] = tmp;
    }
    for (int t = 0; t < n; t++)
        seq[t] = t % nseq;
    for (int sq = 0; sq < nseq; sq++)
        for (int p = 0; p < np; p++)
            slot[sq * np + p] = perm[sq * nblk + p / bsz] * bsz + p % bsz;
    fi_kv_map map = {.seq = seq, .tables = perm, .max_blocks = nblk, .block_size = bsz};
    size_t cache_elems = (size_t)pool * bsz * kv_dim;
    uint16_t *kh = malloc(cache_elems * sizeof *kh), *vh = malloc(cache_elems * sizeof *vh);
    uint16_t *flat = malloc(nkvv * sizeof *flat);
    assert_true(kh && vh && flat && perm && seq && slot && qt);
    for (int threads = 1; threads <= 3; threads++) {
        fi_backend *bs[S_FLAVOURS];
        int nb = make_backends(bs, threads);
        for (int bi = 0; bi < nb; bi++) {
            poison(out, n * qd);
            memset(kh, 0xff, cache_elems * sizeof *kh); /* NaN: a stray read shows */
            memset(vh, 0xff, cache_elems * sizeof *vh);
            memset(flat, 0xff, nkvv * sizeof *flat);
            bs[bi]->ops->store_f16(bs[bi]->ctx, flat, k, nkvv);
            for (size_t i = 0; i < nkvv; i++)
                if (flat[i] != fi_fp32_to_fp16(k[i]))
                    fail_msg("store_f16 %s: element %zu differs", fi_cpu_backend_simd(bs[bi]), i);
            for (int sq = 0; sq < nseq; sq++) {
                bs[bi]->ops->kv_store(bs[bi]->ctx, kh, k + sq * nkvv, np, slot + sq * np, kv_dim, hd);
                bs[bi]->ops->kv_store(bs[bi]->ctx, vh, v + sq * nkvv, np, slot + sq * np, kv_dim, hd);
            }
            for (int sq = 0; sq < nseq; sq++)
                for (int p = 0; p < np; p++)
                    for (int e = 0; e < kv_dim; e++) {
                        size_t at = (size_t)slot[sq * np + p] * kv_dim + e;
                        size_t from = sq * nkvv + (size_t)p * kv_dim + e;
                        if (kh[at] != fi_fp32_to_fp16(k[from]) || vh[at] != fi_fp32_to_fp16(v[from]))
                            fail_msg("kv_store %s: seq %d pos %d elem %d differs",
                                     fi_cpu_backend_simd(bs[bi]), sq, p, e);
                    }
            bs[bi]->ops->attention(bs[bi]->ctx, out, q, kh, vh, n, pos, &map, nh, nkv, hd);
            for (int i = 0; i < n * qd; i++)
                if (!(fabs(out[i] - ref[i]) <= 2e-5 * (1 + fabs(ref[i]))))
                    fail_msg("attention %s %dt n=%d seqs=%d: out[%d] = %g, want %g",
                             fi_cpu_backend_simd(bs[bi]), threads, n, nseq, i, (double)out[i],
                             ref[i]);
            fi_backend_destroy(&bs[bi]);
        }
    }
    free(q);
    free(k);
    free(v);
    free(kh);
    free(vh);
    free(flat);
    free(out);
    free(ref);
    free(qt);
    free(perm);
    free(seq);
    free(slot);
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
    int32_t p8[] = {10, 400}; /* with 2+ threads positions are split; t0 has an empty segment */
    int32_t p9[] = {1000};
    run_attention(p1, 1, 9, 3, 64, 1, 1);
    run_attention(p2, 1, 9, 3, 64, 1, 1);
    run_attention(p3, 5, 9, 3, 64, 1, 1);
    run_attention(p4, 4, 4, 2, 32, 1, 1);
    run_attention(p5, 1, 9, 3, 64, 8, 1);  /* peaked scores over several chunks */
    run_attention(p6, 3, 6, 6, 16, 20, 1); /* no grouping, very peaked */
    run_attention(p7, 3, 4, 1, 8, 1, 1);   /* one kv head for all */
    run_attention(p8, 2, 4, 1, 12, 2, 1);  /* head_dim not a multiple of 8 */
    run_attention(p9, 1, 9, 3, 64, 4, 1);  /* decode, long context: segments */
    /* several sequences in one call (continuous batching) */
    int32_t q1[] = {40, 17, 0, 33};           /* 4 sequences decoding */
    int32_t q2[] = {5, 6, 7, 8, 300, 301};    /* 2 sequences, prefill chunks */
    int32_t q3[] = {15, 16, 31, 32, 47, 700}; /* block edges, 3 sequences */
    run_attention(q1, 4, 9, 3, 64, 1, 4);
    run_attention(q2, 6, 9, 3, 64, 2, 2);
    run_attention(q3, 6, 4, 1, 12, 1, 3);
}

static void test_swiglu_add(void **state) {
    (void)state;
    rng r = {23};
    size_t sizes[] = {1, 33, 1007, 1536, 40000}; /* tails of every kind */
    for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
        size_t n = sizes[si];
        float *g = fvec(n), *u = fvec(n), *y = fvec(n);
        for (size_t i = 0; i < n; i++) {
            g[i] = rng_f(&r, -10, 10);
            u[i] = rng_f(&r, -3, 3);
        }
        if (n > 16) { /* extremes, inside a vector */
            g[3] = 100.0f;
            g[4] = -100.0f;
            g[5] = 0.0f;
            g[6] = -1e30f;
            g[7] = 1e30f;
        }
        fi_backend *bs[S_FLAVOURS];
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
    assert_null(fi_cpu_backend_new_flavour(1, "no-such-kernels", NULL, 0));
    assert_null(fi_cpu_backend_new_flavour(1, "no-such-kernels", err, sizeof err));
    assert_non_null(strstr(err, "no-such-kernels"));
    fi_backend other = {0};
    assert_null(fi_cpu_backend_simd(&other));
    assert_int_equal(fi_cpu_backend_threads(&other), 0);
}

/* --- pool ----------------------------------------------------------------- */

typedef struct pool_probe {
    atomic_int count[8];    /* runs seen per worker index */
    atomic_int bad_nth;     /* calls with the wrong nth */
    atomic_int moved0;      /* index 0 run by a thread other than the caller */
    int nth;                /* expected */
    pthread_t caller;       /* the thread that calls fi_pool_run */
} pool_probe;

static void pool_fn(void *arg, int ith, int nth) {
    pool_probe *pp = arg;
    if (nth != pp->nth || ith < 0 || ith >= nth)
        atomic_fetch_add(&pp->bad_nth, 1);
    else
        atomic_fetch_add(&pp->count[ith], 1);
    if (ith == 0 && !pthread_equal(pthread_self(), pp->caller))
        atomic_fetch_add(&pp->moved0, 1);
}

static void test_pool(void **state) {
    (void)state;
    for (int nt = 1; nt <= 4; nt++) {
        fi_pool *p = fi_pool_new(nt);
        assert_non_null(p);
        assert_int_equal(fi_pool_threads(p), nt);
        pool_probe pr = {.nth = nt, .caller = pthread_self()};
        const int runs = nt <= 2 ? 20000 : 2000; /* 3-4 threads oversubscribe 2 cores */
        for (int i = 0; i < runs; i++)
            fi_pool_run(p, pool_fn, &pr);
        for (int i = 0; i < nt; i++)
            assert_int_equal(atomic_load(&pr.count[i]), runs);
        assert_int_equal(atomic_load(&pr.bad_nth), 0);
        /* index 0 is the caller's, every time (work split by ith stays put) */
        assert_int_equal(atomic_load(&pr.moved0), 0);
        fi_pool_destroy(&p);
        assert_null(p);
        fi_pool_destroy(&p);
    }
}

/* Every index waits until all have started: passes only if the pool runs
 * them on nth threads at once (a serial pool would time out). */
typedef struct pool_meet {
    atomic_int started;     /* indices that have begun */
    atomic_int timed_out;   /* set when one gave up waiting */
} pool_meet;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void pool_meet_fn(void *arg, int ith, int nth) {
    pool_meet *m = arg;
    (void)ith;
    atomic_fetch_add(&m->started, 1);
    double t0 = now_s();
    while (atomic_load(&m->started) < nth)
        if (now_s() - t0 > 10.0) {
            atomic_store(&m->timed_out, 1);
            return;
        }
}

static void test_pool_concurrent(void **state) {
    (void)state;
    for (int nt = 2; nt <= 3; nt++) {
        fi_pool *p = fi_pool_new(nt);
        assert_non_null(p);
        for (int i = 0; i < 50; i++) {
            pool_meet m = {0};
            fi_pool_run(p, pool_meet_fn, &m);
            assert_int_equal(atomic_load(&m.timed_out), 0);
            assert_int_equal(atomic_load(&m.started), nt);
        }
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

/* A token's attention result is bit-identical whether it is computed alone
 * or with other tokens of other sequences (continuous batching relies on
 * it), for every thread count. */
static void test_attention_batch_invariant(void **state) {
    (void)state;
    const int nh = 9, nkv = 3, hd = 64, bsz = 16, nblk = 64, n = 5;
    int32_t pos[5] = {700, 30, 300, 1000, 255}, seq[5] = {0, 1, 0, 1, 1};
    int32_t tbl[2 * 64];
    for (int b = 0; b < 2 * nblk; b++) tbl[b] = (b * 37) % (2 * nblk); /* a permutation */
    size_t rows = (size_t)2 * nblk * bsz, kv_dim = (size_t)nkv * hd;
    uint16_t *kc = malloc(rows * kv_dim * 2), *vc = malloc(rows * kv_dim * 2);
    float *q = fvec((size_t)n * nh * hd), *all = fvec((size_t)n * nh * hd), *one = fvec((size_t)nh * hd);
    rng r = {99};
    for (size_t i = 0; i < rows * kv_dim; i++) {
        kc[i] = fi_fp32_to_fp16(rng_f(&r, -1, 1));
        vc[i] = fi_fp32_to_fp16(rng_f(&r, -1, 1));
    }
    for (int i = 0; i < n * nh * hd; i++) q[i] = rng_f(&r, -2, 2);
    for (int threads = 1; threads <= 3; threads++) {
        fi_backend *bs[S_FLAVOURS];
        int nb = make_backends(bs, threads);
        for (int bi = 0; bi < nb; bi++) {
            fi_kv_map map = {.seq = seq, .tables = tbl, .max_blocks = nblk, .block_size = bsz};
            bs[bi]->ops->attention(bs[bi]->ctx, all, q, kc, vc, n, pos, &map, nh, nkv, hd);
            for (int t = 0; t < n; t++) {
                fi_kv_map m1 = {.seq = seq + t, .tables = tbl, .max_blocks = nblk, .block_size = bsz};
                bs[bi]->ops->attention(bs[bi]->ctx, one, q + (size_t)t * nh * hd, kc, vc, 1, pos + t,
                                       &m1, nh, nkv, hd);
                if (memcmp(one, all + (size_t)t * nh * hd, (size_t)nh * hd * sizeof(float)))
                    fail_msg("attention %s %dt: token %d (pos %d) alone differs from batched",
                             fi_cpu_backend_simd(bs[bi]), threads, t, pos[t]);
            }
            fi_backend_destroy(&bs[bi]);
        }
    }
    free(kc);
    free(vc);
    free(q);
    free(all);
    free(one);
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
        cmocka_unit_test(test_matmul_model_weights),
        cmocka_unit_test(test_act_bits_setting),
        cmocka_unit_test(test_matmul16_batch_invariant),
        cmocka_unit_test(test_q16_kernels_tiling),
        cmocka_unit_test(test_q8x_kernels_tiling),
        cmocka_unit_test(test_q16_kernels_tiling_16),
        cmocka_unit_test(test_q16_quantize),
        cmocka_unit_test(test_q16_quantize_tok),
        cmocka_unit_test(test_q8x_quantize),
        cmocka_unit_test(test_matmul_n),
        cmocka_unit_test(test_matmul_add),
        cmocka_unit_test(test_matmul_argmax),
        cmocka_unit_test(test_get_rows),
        cmocka_unit_test(test_rmsnorm),
        cmocka_unit_test(test_rope),
        cmocka_unit_test(test_attention),
        cmocka_unit_test(test_attention_batch_invariant),
        cmocka_unit_test(test_swiglu_add),
        cmocka_unit_test(test_backend_memory),
        cmocka_unit_test(test_pool),
        cmocka_unit_test(test_pool_concurrent),
        cmocka_unit_test(test_pool_sleep_wake),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

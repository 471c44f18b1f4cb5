/*
 * fi_kernels_impl.h - private to kernels/: GGML block layouts, the
 * activation block the integer dot products use, and the table of CPU
 * kernels that each SIMD flavour (portable, AVX2, ...) fills in.
 *
 * A matmul kernel computes a range of output rows for every token of a
 * task; how it tiles rows and tokens inside that range is its own business.
 * The caller (fi_cpu.c) splits rows across threads and quantises the
 * activations once per call.
 */
#ifndef FI_KERNELS_IMPL_H
#define FI_KERNELS_IMPL_H

#include "fi_kernels.h"

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define FI_QK 32 /* elements per quantised block */

/* GGML Q8_0: value = qs[i] * d. 34 bytes. */
typedef struct fi_block_q8_0 {
    uint16_t d;         /* fp16 scale */
    int8_t qs[FI_QK];   /* quants */
} fi_block_q8_0;

/* GGML Q4_0: value = (q - 8) * d; low nibbles of qs[] are elements 0..15,
 * high nibbles elements 16..31. 18 bytes. */
typedef struct fi_block_q4_0 {
    uint16_t d;             /* fp16 scale */
    uint8_t qs[FI_QK / 2];  /* nibbles */
} fi_block_q4_0;

/* GGML Q4_1: value = q * d + m; nibbles as Q4_0. 20 bytes. */
typedef struct fi_block_q4_1 {
    uint16_t d;             /* fp16 scale */
    uint16_t m;             /* fp16 minimum */
    uint8_t qs[FI_QK / 2];  /* nibbles */
} fi_block_q4_1;

/* One 32-element block of a quantised activation row (Q8_1-like, with
 * float scale): x[i] ~= qs[i] * d, |qs[i]| <= 127, and s = d * sum(qs[i]).
 * s lets Q4_1's minimum term be m * s and lets Q4_0 subtract its offset 8
 * as 8 * d_w * s after an unsigned nibble dot product. 40 bytes. */
typedef struct fi_block_q8x {
    float d;            /* scale */
    float s;            /* d * sum(qs) */
    int8_t qs[FI_QK];   /* quants */
} fi_block_q8x;

_Static_assert(sizeof(fi_block_q8_0) == 34, "q8_0 block is 34 bytes");
_Static_assert(sizeof(fi_block_q4_0) == 18, "q4_0 block is 18 bytes");
_Static_assert(sizeof(fi_block_q4_1) == 20, "q4_1 block is 20 bytes");
_Static_assert(sizeof(fi_block_q8x) == 40, "q8x block is 40 bytes");

/* One matmul: y[t*y_stride + r] = dot(row r of w, activation row t).
 * For quantised weights x holds fi_block_q8x rows (cols/32 blocks each),
 * for float weights plain float rows. */
typedef struct fi_mm_task {
    const uint8_t *w;   /* first weight row */
    size_t w_stride;    /* bytes per weight row */
    int cols;           /* elements per row */
    const uint8_t *x;   /* first activation row (float or fi_block_q8x) */
    size_t x_stride;    /* bytes per activation row */
    int n;              /* tokens */
    float *y;           /* output, token-major */
    int y_stride;       /* floats per output row (the weight's rows) */
    const uint8_t *wp;  /* NULL, or w's rows in the packed layout of the
                           kernels that have one (fi_q16_kernels.pack);
                           they still read partial groups from w */
    const uint8_t *xs;  /* NULL, or x already split for the AMX kernels:
                           fi_q16_kernels.split's layout, one tile per 16
                           tokens (the kernels split x themselves if NULL) */
    int qmax;           /* 16-bit activations (fi_block_q16x): the bound x
                           was quantised with (fi_q16_qmax) */
    int xtok;           /* 16-bit activations: 1 if x has one scale per
                           token (fi_block_q16x), 0 one per block */
} fi_mm_task;

/* Computes rows [r0, r1) of task t for all its tokens. */
typedef void (*fi_mm_fn)(const fi_mm_task *t, int r0, int r1);

/* The kernels of one SIMD flavour. */
typedef struct fi_cpu_kernels {
    const char *name;                                          /* "avx2" */
    /* Quantises nb blocks of x (32*nb floats) into y. */
    void (*quantize_q8x)(const float *x, fi_block_q8x *y, int nb);
    fi_mm_fn mm_f32;                                           /* float weights */
    fi_mm_fn mm_f16;
    fi_mm_fn mm_bf16;
    fi_mm_fn mm_q4_0;                                          /* quantised weights */
    fi_mm_fn mm_q4_1;
    fi_mm_fn mm_q8_0;
    /* Attention helpers for gn query heads that share one KV head, over
     * np >= 1 fp16 cache rows of length hd spaced `stride` elements.
     * Head g's query is q + g*hd and its scores or weights are s + g*ss.
     * att_dots: s[g*ss + i] = scale * dot(q + g*hd, k + i*stride).
     * att_wsum: o[g*hd + d] += sum_i s[g*ss + i] * v[i*stride + d].
     * Each row is converted from fp16 once for all gn heads. A score
     * depends only on its row and query, never on np or the other rows,
     * and att_wsum adds the rows in order (callers rely on both for batch
     * invariance). */
    void (*att_dots)(float *s, size_t ss, const float *q, int gn, const uint16_t *k,
                     size_t stride, int np, int hd, float scale);
    void (*att_wsum)(float *o, const float *s, size_t ss, int gn, const uint16_t *v,
                     size_t stride, int np, int hd);
    /* The same over FI_KV_ROW_Q8 rows (fi_kernels.h): k (v) points at
     * the KV head's int8 quants in the first row, rows are `stride` bytes
     * apart, and each row's scale for this head is the float soff bytes
     * after its quants. att_dots_q8: s = (dot(q, quants) * row scale) *
     * scale; att_wsum_q8: o += (s * row scale) * quants. The same
     * guarantees as above. */
    void (*att_dots_q8)(float *s, size_t ss, const float *q, int gn, const int8_t *k,
                        size_t stride, size_t soff, int np, int hd, float scale);
    void (*att_wsum_q8)(float *o, const float *s, size_t ss, int gn, const int8_t *v,
                        size_t stride, size_t soff, int np, int hd);
    /* *m = max s[i]; s[i] = exp(s[i] - *m) for i < n (n >= 1); returns
     * their sum. */
    float (*exp_sum)(float *s, int n, float *m);
    /* y[i] = x[i] * scale * g[i] for i < dim, scale = 1 / sqrt(ss / dim +
     * eps): ss the sum of x[i]^2 in double, as eight partial sums (element
     * i into sum i % 8, in order) added pairwise, then the dim % 8 last
     * elements in order. Every flavour gives the same bits. y may be x. */
    void (*rmsnorm)(float *y, const float *x, const float *g, int dim, float eps);
    /* g[i] = silu(g[i]) * u[i] for i < n. */
    void (*swiglu)(float *g, const float *u, size_t n);
    /* fi_kv_quant_ref, the same bits (stores into an 8-bit KV cache). */
    float (*kv_quant)(int8_t *q, const float *x, int n);
    /* fp32 -> fp16, round to nearest even (stores into the KV cache). */
    void (*to_f16)(uint16_t *dst, const float *src, size_t n);
    /* Rotary embedding of one token's n_heads heads (head_dim apart, even)
     * by the angle table row tab: pair i of each head, (a, b) at 2i and
     * 2i + 1, becomes (a c - b s, a s + b c) with (c, s) = tab[2i], tab[2i
     * + 1]. A pair's result depends only on its values and tab. */
    void (*rope)(float *row, int n_heads, int head_dim, const float *tab);
    /* fi_argmax_f32(x, n): the same index (the rows of matmul_argmax). */
    int32_t (*argmax)(const float *x, int n);
} fi_cpu_kernels;

/* Fills k with the portable kernels. Cannot fail. */
void fi_cpu_kernels_portable(fi_cpu_kernels *k);
#if defined(FI_HAVE_X86) && FI_HAVE_X86
/* Overwrites the members of k that have AVX2+FMA+F16C versions. Only call
 * after checking that the processor has them. */
void fi_cpu_kernels_avx2(fi_cpu_kernels *k);
#endif
#if defined(FI_HAVE_AVXVNNI) && FI_HAVE_AVXVNNI
/* The same with AVX-VNNI dot products; only call after checking for
 * AVX2, FMA, F16C and AVX-VNNI. */
void fi_cpu_kernels_avxvnni(fi_cpu_kernels *k);
#endif
#if defined(FI_HAVE_AVX512) && FI_HAVE_AVX512
/* The same with 512-bit AVX512-VNNI quantised matmul; only call after
 * checking for AVX2, FMA, F16C, AVX512 F/BW/VL/VNNI and ZMM OS support. */
void fi_cpu_kernels_avx512(fi_cpu_kernels *k);
#endif

/* A CPU backend with the named kernels: "portable", "avx2", "avxvnni" or
 * "avx512vnni" (for tests and benchmarks that compare flavours; the engine
 * uses fi_cpu_backend_new). NULL with a message in err when the flavour is
 * unknown, not built, or not supported by this processor. */
fi_backend *fi_cpu_backend_new_flavour(int n_threads, const char *flavour, char *err, size_t errlen);

/* Portable quantiser, also the reference for the SIMD ones: d = amax/127,
 * qs = round-to-nearest-even(x * 127/amax). */
void fi_quantize_q8x_ref(const float *x, fi_block_q8x *y, int nb);
/* One head of a FI_KV_ROW_Q8 cache row: q[j] = x[j] * 127 / amax rounded
 * to nearest even (amax = max |x[j]|; all 0 when amax < 127 FLT_MIN);
 * returns the scale, amax / 127 (0 then). A NaN or an infinity among the
 * n values gives the scale NaN and q all 0. fi_cpu_kernels.kv_quant. */
float fi_kv_quant_ref(int8_t *q, const float *x, int n);

/* fp16 -> fp32 for hot loops, exact for every encoding and branch-free
 * (so loops of it vectorise). Normal numbers, inf and NaN: shift the
 * exponent and mantissa into place, add 224 to the exponent and multiply
 * by 2^-112, a net rebias of 112 = 127 - 15 that leaves exponent 31 at
 * 255 (inf/NaN). Subnormals m * 2^-24: put m under the exponent of 0.5
 * and subtract 0.5. */
static inline float fi_h2f(uint16_t h) {
    uint32_t w = (uint32_t)h << 16;
    uint32_t sign = w & 0x80000000u;
    uint32_t two_w = w + w; /* exponent and mantissa, sign shifted out */
    uint32_t nb = (two_w >> 4) + (224u << 23), db = (two_w >> 17) | (126u << 23);
    float nf, df;
    memcpy(&nf, &nb, sizeof nf);
    memcpy(&df, &db, sizeof df);
    nf *= 0x1p-112f;
    df -= 0.5f;
    uint32_t nbits, dbits;
    memcpy(&nbits, &nf, sizeof nbits);
    memcpy(&dbits, &df, sizeof dbits);
    uint32_t sub = 0u - (uint32_t)(two_w < (1u << 27)); /* all ones: subnormal */
    uint32_t bits = sign | (dbits & sub) | (nbits & ~sub);
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* bf16 -> fp32 for hot loops: the top half of the fp32 bits. */
static inline float fi_bf2f(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

#endif /* FI_KERNELS_IMPL_H */

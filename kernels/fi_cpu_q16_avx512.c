/*
 * fi_cpu_q16_avx512.c - AVX512-VNNI 16-bit-activation matmul kernels (see
 * fi_cpu_q16_impl.h). Compiled with -mavx512f -mavx512bw -mavx512vl
 * -mavx512vnni (plus AVX2/FMA/F16C) when the compiler knows them, and
 * entered only after fi_cpu.c has checked the processor and that the OS
 * saves the ZMM state.
 *
 * Why: the AVX2 kernel spends about three cycles per 32-element block and
 * (row, token) on this core, most of them not on the products: every
 * block's 8 partial sums are converted to float and scaled on their own.
 *
 * Q4_0 / Q4_1, sixteen rows per register: a block of sixteen rows is
 * transposed once (four 16-byte loads per four rows, two-source dword
 * permutes, vpshufb into 16-bit pairs) so that lane r of W[c] holds row
 * r's elements 2c and 2c+1. Sixteen vpdpwssd, each with one element pair
 * of the token broadcast from memory, then leave lane r with row r's whole
 * integer dot product for the block: one conversion, one multiply by d_x,
 * one FMA by the rows' d_w and one FMA of a * s (a = m for Q4_1, -8 d for
 * Q4_0, the offset of the unsigned nibbles) serve sixteen (row, token)
 * pairs, and the result needs no horizontal sum. The transposed block is
 * reused for up to eight tokens.
 *
 * Q8_0, four rows per register (one 128-bit lane each): W_c lane i holds
 * elements 8c..8c+7 of row i, the token's chunk c is broadcast to all four
 * lanes, four vpdpwssd leave four partial sums per lane, and y = (acc0 +
 * acc1) + (acc2 + acc3) at the end.
 *
 * No overflow: |w| <= 15 (Q4, unsigned nibbles) or 128 (Q8_0) times
 * |x| <= 32767, at most 32 products per 32-bit lane: below 2^28.
 *
 * Batch invariance: every (row, token) result is formed by the same
 * sequence of floating-point operations whatever the tile: per block, in
 * the row's lane(s), v = float(isum) * d_x, acc = fma(v, d_w, acc), then
 * (Q4) acc = fma(a, s, acc) (Q8_0's four-row layout has no a * s term),
 * and the integer sums are exact in any order. Vector operations work
 * lane by lane, so neither the other rows sharing a register (a partial
 * group of rows repeats its last row) nor the number of tokens in the
 * tile changes a lane's value; the one-token path is the same code with a
 * tile of one token plus prefetches. All intrinsics: no compiler
 * contraction can tell the shapes apart. So a token's result is the same
 * bits alone, in a batch of any size, and on any thread split
 * (tests/test_kernels.c checks all three).
 */
#include "fi_cpu_q16_impl.h"

#include <immintrin.h>
#include <string.h>

#define S_INLINE static inline __attribute__((always_inline))
#ifndef S_RB
#define S_RB 32      /* rows per sub-block when several tokens share a call */
#endif
#ifndef S_PT
#define S_PT 8       /* tokens per tile */
#endif
#define S_PF_TILES 4 /* one token: prefetch this many 4-row groups ahead */
#ifndef S_CH
#define S_CH 4 /* dot-product chains per token and block */
#endif
#ifndef S_PF_GROUPS
#define S_PF_GROUPS 2 /* the same for 16-row groups */
#endif

enum { S_Q4_0, S_Q4_1, S_Q8_0 };

S_INLINE uint32_t s_ld32(const void *p) {
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

S_INLINE int s_ld16(const void *p) {
    uint16_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* Chunk c of an activation block broadcast to the four 128-bit lanes. */
S_INLINE __m512i s_xchunk(const fi_block_q16x *x, int c) {
    return _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(const void *)(x->qs + 8 * c)));
}

/* Block b of rows p[0..3] (block pointers): the weights widened to 16 bits
 * as W[c] (lane i: elements 8c..8c+7 of row i), the scales dw = [d0 x4 |
 * d1 x4 | d2 x4 | d3 x4] and the offsets aw = [a0 0 0 0 | a1 0 0 0 | ...]
 * (a = m for Q4_1, -8 d for Q4_0; unused for Q8_0). */
S_INLINE void s_wblock(int kind, const uint8_t *const p[4], __m512i W[4], __m512 *dw, __m512 *aw) {
    const __m512i bcast4 = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    if (kind == S_Q4_1) {
        __m128i h = _mm_cvtsi32_si128((int)s_ld32(p[0]));
        h = _mm_insert_epi32(h, (int)s_ld32(p[1]), 1);
        h = _mm_insert_epi32(h, (int)s_ld32(p[2]), 2);
        h = _mm_insert_epi32(h, (int)s_ld32(p[3]), 3);
        __m512 dm = _mm512_castps256_ps512(_mm256_cvtph_ps(h)); /* d0 m0 d1 m1 .. */
        *dw = _mm512_permutexvar_ps(_mm512_add_epi32(bcast4, bcast4), dm);
        *aw = _mm512_maskz_permutexvar_ps(0x1111, _mm512_setr_epi32(1, 0, 0, 0, 3, 0, 0, 0, 5, 0, 0, 0, 7, 0, 0, 0),
                                          dm);
    } else {
        __m128i h = _mm_cvtsi32_si128(s_ld16(p[0]));
        h = _mm_insert_epi16(h, s_ld16(p[1]), 1);
        h = _mm_insert_epi16(h, s_ld16(p[2]), 2);
        h = _mm_insert_epi16(h, s_ld16(p[3]), 3);
        *dw = _mm512_permutexvar_ps(bcast4, _mm512_castps128_ps512(_mm_cvtph_ps(h)));
        /* (q - 8) d = q d + (-8 d); exact, a power-of-two multiple */
        *aw = kind == S_Q4_0 ? _mm512_maskz_mul_ps(0x1111, *dw, _mm512_set1_ps(-8.0f)) : _mm512_setzero_ps();
    }
    if (kind == S_Q8_0) {
        /* qwords of A: r0c0..r0c3 r1c0..r1c3, of B: rows 2 and 3; regroup
         * chunk-major, then sign-extend 32 bytes (one chunk of four rows) */
        __m512i A = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(const void *)(p[0] + 2))),
            _mm256_loadu_si256((const __m256i *)(const void *)(p[1] + 2)), 1);
        __m512i B = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(const void *)(p[2] + 2))),
            _mm256_loadu_si256((const __m256i *)(const void *)(p[3] + 2)), 1);
        __m512i c01 = _mm512_permutex2var_epi64(A, _mm512_setr_epi64(0, 4, 8, 12, 1, 5, 9, 13), B);
        __m512i c23 = _mm512_permutex2var_epi64(A, _mm512_setr_epi64(2, 6, 10, 14, 3, 7, 11, 15), B);
        W[0] = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(c01));
        W[1] = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(c01, 1));
        W[2] = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(c23));
        W[3] = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(c23, 1));
        return;
    }
    const size_t qoff = kind == S_Q4_1 ? 4 : 2;
    __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(const void *)(p[0] + qoff)));
    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(const void *)(p[1] + qoff)), 1);
    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(const void *)(p[2] + qoff)), 2);
    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(const void *)(p[3] + qoff)), 3);
    /* bytes 0..7 and 8..15 of each lane as 16 bits: lo nibble = elements
     * 0..15, hi nibble = elements 16..31 */
    const __m512i zero = _mm512_setzero_si512(), m4 = _mm512_set1_epi16(0x0f);
    __m512i u0 = _mm512_unpacklo_epi8(v, zero), u1 = _mm512_unpackhi_epi8(v, zero);
    W[0] = _mm512_and_si512(u0, m4);
    W[1] = _mm512_and_si512(u1, m4);
    W[2] = _mm512_srli_epi16(u0, 4);
    W[3] = _mm512_srli_epi16(u1, 4);
}

/* Sum of each 128-bit lane of v into y[0..nr-1] (nr <= 4), as (e0 + e1) +
 * (e2 + e3). */
S_INLINE void s_store4(__m512 v, float *y, int nr) {
    __m256 a = _mm512_castps512_ps256(v);
    __m256 b = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    __m256 h = _mm256_hadd_ps(a, b); /* A01 A23 C01 C23 | B01 B23 D01 D23 */
    h = _mm256_hadd_ps(h, h);        /* A C A C | B D B D */
    __m128 lo = _mm256_castps256_ps128(h), hi = _mm256_extractf128_ps(h, 1);
    float s[4] = {_mm_cvtss_f32(lo), _mm_cvtss_f32(hi), _mm_cvtss_f32(_mm_movehdup_ps(lo)),
                  _mm_cvtss_f32(_mm_movehdup_ps(hi))};
    for (int i = 0; i < nr; i++)
        y[i] = s[i];
}

/* Rows r..r+nr-1 (1 <= nr <= 4) times tokens k..k+T-1 (T <= S_PT). pf:
 * the one-token tile, which prefetches the row groups ahead. */
S_INLINE void s_tile(int kind, size_t bsz, const fi_mm_task *t, int r, int nr, int k, int T, int pf) {
    const size_t stride = t->w_stride;
    const uint8_t *w0 = t->w + (size_t)r * stride;
    const int nb = t->cols / FI_QK;
    const uint8_t *p[4];
    for (int i = 0; i < 4; i++)
        p[i] = w0 + (size_t)(i < nr ? i : nr - 1) * stride;
    const fi_block_q16x *xr[S_PT];
    __m512 acc[S_PT];
    for (int j = 0; j < T; j++) {
        xr[j] = (const fi_block_q16x *)(const void *)(t->x + (size_t)(k + j) * t->x_stride);
        acc[j] = _mm512_setzero_ps();
    }
    for (int b = 0; b < nb; b++) {
        if (pf) {
            /* this step's share of the group S_PF_TILES ahead: 4*bsz bytes */
            const char *q = (const char *)w0 + S_PF_TILES * 4 * stride + (size_t)b * 4 * bsz;
            _mm_prefetch(q, _MM_HINT_T1);
            _mm_prefetch(q + 64, _MM_HINT_T1);
            if (4 * bsz > 128)
                _mm_prefetch(q + 128, _MM_HINT_T1);
        }
        __m512i W[4];
        __m512 dw, aw;
        s_wblock(kind, p, W, &dw, &aw);
        for (int i = 0; i < 4; i++)
            p[i] += bsz;
        for (int j = 0; j < T; j++) {
            const fi_block_q16x *x = xr[j] + b;
            __m512i is = _mm512_dpwssd_epi32(_mm512_setzero_si512(), W[0], s_xchunk(x, 0));
            is = _mm512_dpwssd_epi32(is, W[1], s_xchunk(x, 1));
            is = _mm512_dpwssd_epi32(is, W[2], s_xchunk(x, 2));
            is = _mm512_dpwssd_epi32(is, W[3], s_xchunk(x, 3));
            __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(is), _mm512_set1_ps(x->d));
            acc[j] = _mm512_fmadd_ps(v, dw, acc[j]);
            if (kind != S_Q8_0)
                acc[j] = _mm512_fmadd_ps(aw, _mm512_set1_ps(x->s), acc[j]);
        }
    }
    for (int j = 0; j < T; j++)
        s_store4(acc[j], t->y + (size_t)(k + j) * t->y_stride + r, nr);
}

/* Q4 block b of rows p[0..15] (block pointers, qoff: where the nibbles
 * start), transposed so that lane r of W[c] holds row r's elements 2c and
 * 2c+1 as 16-bit integers (c < 8: low nibbles of bytes 2c, 2c+1; c >= 8:
 * high nibbles of bytes 2c-16, 2c-15). */
S_INLINE void s_q4_w16(const uint8_t *const p[16], size_t qoff, __m512i W[16]) {
    __m512i Z[4]; /* Z[g] lane m: row 4g+m's 16 nibble bytes */
    for (int g = 0; g < 4; g++) {
        __m512i z = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(const void *)(p[4 * g] + qoff)));
        z = _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i *)(const void *)(p[4 * g + 1] + qoff)), 1);
        z = _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i *)(const void *)(p[4 * g + 2] + qoff)), 2);
        Z[g] = _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i *)(const void *)(p[4 * g + 3] + qoff)), 3);
    }
    /* dword k of rows 0..7 (lanes 0..7) and k+1 (lanes 8..15); likewise
     * rows 8..15; then D[k] lane r = bytes 4k..4k+3 of row r */
    const __m512i ia = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 1, 5, 9, 13, 17, 21, 25, 29);
    const __m512i ib = _mm512_setr_epi32(2, 6, 10, 14, 18, 22, 26, 30, 3, 7, 11, 15, 19, 23, 27, 31);
    __m512i P0 = _mm512_permutex2var_epi32(Z[0], ia, Z[1]), P1 = _mm512_permutex2var_epi32(Z[0], ib, Z[1]);
    __m512i Q0 = _mm512_permutex2var_epi32(Z[2], ia, Z[3]), Q1 = _mm512_permutex2var_epi32(Z[2], ib, Z[3]);
    __m512i D[4] = {_mm512_shuffle_i64x2(P0, Q0, 0x44), _mm512_shuffle_i64x2(P0, Q0, 0xEE),
                    _mm512_shuffle_i64x2(P1, Q1, 0x44), _mm512_shuffle_i64x2(P1, Q1, 0xEE)};
    /* bytes 0,1 (s0) and 2,3 (s1) of each dword zero-extended to 16 bits */
    const __m512i s0 = _mm512_set4_epi32((int)0x800D800Cu, (int)0x80098008u, (int)0x80058004u, (int)0x80018000u);
    const __m512i s1 = _mm512_set4_epi32((int)0x800F800Eu, (int)0x800B800Au, (int)0x80078006u, (int)0x80038002u);
    const __m512i m4 = _mm512_set1_epi16(0x0f);
    for (int k = 0; k < 4; k++) {
        __m512i u0 = _mm512_shuffle_epi8(D[k], s0);
        __m512i u1 = _mm512_shuffle_epi8(D[k], s1);
        W[2 * k] = _mm512_and_si512(u0, m4);
        W[2 * k + 1] = _mm512_and_si512(u1, m4);
        W[8 + 2 * k] = _mm512_srli_epi16(u0, 4);
        W[8 + 2 * k + 1] = _mm512_srli_epi16(u1, 4);
    }
}

/* Q4: rows r..r+nr-1 (1 <= nr <= 16; a partial group repeats its last
 * row) times tokens k..k+T-1 (T <= S_PT), one row per lane: per block and
 * token sixteen vpdpwssd with the token's element pair broadcast, then
 * v = float(isum) * d_x, acc = fma(v, d_w, acc), acc = fma(a, s, acc).
 * pf: the one-token tile, which prefetches the groups ahead. */
S_INLINE void s_q4_tile16(int kind, size_t bsz, const fi_mm_task *t, int r, int nr, int k, int T, int pf) {
    const size_t stride = t->w_stride;
    const uint8_t *w0 = t->w + (size_t)r * stride;
    const int nb = t->cols / FI_QK;
    const size_t qoff = kind == S_Q4_1 ? 4 : 2;
    const uint8_t *p[16];
    int off[16];
    for (int i = 0; i < 16; i++) {
        off[i] = (i < nr ? i : nr - 1) * (int)stride;
        p[i] = w0 + off[i];
    }
    const __m512i vidx = _mm512_loadu_si512(off);
    const fi_block_q16x *xr[S_PT];
    __m512 acc[S_PT];
    for (int j = 0; j < T; j++) {
        xr[j] = (const fi_block_q16x *)(const void *)(t->x + (size_t)(k + j) * t->x_stride);
        acc[j] = _mm512_setzero_ps();
    }
    for (int b = 0; b < nb; b++) {
        if (pf) {
            /* this step's share of the group S_PF_GROUPS ahead */
            const char *q = (const char *)w0 + S_PF_GROUPS * 16 * stride + (size_t)b * 16 * bsz;
            for (size_t o = 0; o < 16 * bsz; o += 64)
                _mm_prefetch(q + o, _MM_HINT_T1);
        }
        /* scales: the first dword of each row's block (d, and m for Q4_1) */
        __m512i g = _mm512_i32gather_epi32(vidx, (const void *)(w0 + (size_t)b * bsz), 1);
        __m512 dw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g)), aw;
        if (kind == S_Q4_1)
            aw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(g, 16)));
        else
            aw = _mm512_mul_ps(dw, _mm512_set1_ps(-8.0f)); /* (q - 8) d = q d + (-8 d) */
        __m512i W[16];
        s_q4_w16(p, qoff, W);
        for (int i = 0; i < 16; i++)
            p[i] += bsz;
#pragma GCC unroll 8
        for (int j = 0; j < T; j++) {
            const fi_block_q16x *x = xr[j] + b;
            const int32_t *xq = (const int32_t *)(const void *)x->qs;
            /* S_CH independent chains (integer sums: any order gives the
             * same value) so that one token's products overlap */
            __m512i ch[S_CH];
            for (int c = 0; c < S_CH; c++)
                ch[c] = _mm512_dpwssd_epi32(_mm512_setzero_si512(), W[c], _mm512_set1_epi32(xq[c]));
            for (int c = S_CH; c < 16; c++)
                ch[c % S_CH] = _mm512_dpwssd_epi32(ch[c % S_CH], W[c], _mm512_set1_epi32(xq[c]));
            for (int c = 1; c < S_CH; c++)
                ch[0] = _mm512_add_epi32(ch[0], ch[c]);
            __m512i is = ch[0];
            __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(is), _mm512_set1_ps(x->d));
            acc[j] = _mm512_fmadd_ps(v, dw, acc[j]);
            acc[j] = _mm512_fmadd_ps(aw, _mm512_set1_ps(x->s), acc[j]);
        }
    }
    const __mmask16 m = (__mmask16)((1u << nr) - 1);
    for (int j = 0; j < T; j++)
        _mm512_mask_storeu_ps(t->y + (size_t)(k + j) * t->y_stride + r, m, acc[j]);
}

/* One tile of G = 16 (Q4) or 4 (Q8_0) rows. */
S_INLINE void s_gtile(int kind, size_t bsz, const fi_mm_task *t, int r, int nr, int k, int T, int pf) {
    if (kind == S_Q8_0)
        s_tile(kind, bsz, t, r, nr, k, T, pf);
    else
        s_q4_tile16(kind, bsz, t, r, nr, k, T, pf);
}

/* Tokens k..n-1 of rows r..r+nr-1 in tiles of S_PT, then 4, 2, 1 (each a
 * compile-time size, so the tile's loops unroll). */
S_INLINE void s_tokens(int kind, size_t bsz, const fi_mm_task *t, int r, int nr, int k) {
    for (; k + S_PT <= t->n; k += S_PT)
        s_gtile(kind, bsz, t, r, nr, k, S_PT, 0);
    if (k + 4 <= t->n) {
        s_gtile(kind, bsz, t, r, nr, k, 4, 0);
        k += 4;
    }
    if (k + 2 <= t->n) {
        s_gtile(kind, bsz, t, r, nr, k, 2, 0);
        k += 2;
    }
    if (k < t->n)
        s_gtile(kind, bsz, t, r, nr, k, 1, 0);
}

/* One token: rows in groups, prefetching. Several: sub-blocks of S_RB
 * rows (their weights stay in L1 while the token tiles pass over them),
 * groups of rows times tiles of tokens. */
S_INLINE void s_mm(int kind, size_t bsz, const fi_mm_task *t, int r0, int r1) {
    const int G = kind == S_Q8_0 ? 4 : 16;
    if (t->n == 1) {
        for (int r = r0; r < r1; r += G)
            s_gtile(kind, bsz, t, r, r1 - r < G ? r1 - r : G, 0, 1, 1);
        return;
    }
    for (int rb = r0; rb < r1; rb += S_RB) {
        int re = rb + S_RB < r1 ? rb + S_RB : r1;
        int k = 0;
        for (; k + S_PT <= t->n; k += S_PT)
            for (int r = rb; r < re; r += G)
                s_gtile(kind, bsz, t, r, re - r < G ? re - r : G, k, S_PT, 0);
        if (k < t->n)
            for (int r = rb; r < re; r += G)
                s_tokens(kind, bsz, t, r, re - r < G ? re - r : G, k);
    }
}

static void s_mm_q4_0(const fi_mm_task *t, int r0, int r1) {
    s_mm(S_Q4_0, sizeof(fi_block_q4_0), t, r0, r1);
}
static void s_mm_q4_1(const fi_mm_task *t, int r0, int r1) {
    s_mm(S_Q4_1, sizeof(fi_block_q4_1), t, r0, r1);
}
static void s_mm_q8_0(const fi_mm_task *t, int r0, int r1) {
    s_mm(S_Q8_0, sizeof(fi_block_q8_0), t, r0, r1);
}

void fi_q16_kernels_avx512(fi_q16_kernels *k) {
    k->mm_q4_0 = s_mm_q4_0;
    k->mm_q4_1 = s_mm_q4_1;
    k->mm_q8_0 = s_mm_q8_0;
}

/*
 * fi_cpu_avx512_impl.h - private to kernels/: what the AVX512 matmul
 * kernels that hold one row per 32-bit lane share (fi_cpu_q16_avx512.c,
 * 16-bit activations; fi_cpu_avx512.c, 8-bit): a group of sixteen rows'
 * block scales as one vector each and its quants transposed by dwords
 * (lane r of D[k] holds quant bytes 4k..4k+3 of row r), read from the
 * packed copy (fi_q16_pack) or transposed in registers from GGUF's
 * layout, the same bytes either way. Include after immintrin.h in a file
 * compiled with the AVX512 flags (kernels/CMakeLists.txt).
 */
#ifndef FI_CPU_AVX512_IMPL_H
#define FI_CPU_AVX512_IMPL_H

#include "fi_kernels_impl.h"

#include <immintrin.h>

#ifndef S_INLINE
#define S_INLINE static inline __attribute__((always_inline))
#endif

enum { S_Q4_0, S_Q4_1, S_Q8_0 }; /* the quantised weight types, as kernels' template argument */

/* Sixteen bytes at offset off of each of the 16 rows p[0..15], transposed
 * by dwords: lane r of D[k] holds bytes 4k..4k+3 of row r. */
S_INLINE void s_t16(const uint8_t *const p[16], size_t off, __m512i D[4]) {
    __m512i Z[4]; /* Z[g] lane m: row 4g+m's 16 bytes */
    for (int g = 0; g < 4; g++) {
        __m512i z = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(const void *)(p[4 * g] + off)));
        z = _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i *)(const void *)(p[4 * g + 1] + off)), 1);
        z = _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i *)(const void *)(p[4 * g + 2] + off)), 2);
        Z[g] = _mm512_inserti32x4(z, _mm_loadu_si128((const __m128i *)(const void *)(p[4 * g + 3] + off)), 3);
    }
    /* dword k of rows 0..7 (lanes 0..7) and k+1 (lanes 8..15); likewise
     * rows 8..15; then halves joined */
    const __m512i ia = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 1, 5, 9, 13, 17, 21, 25, 29);
    const __m512i ib = _mm512_setr_epi32(2, 6, 10, 14, 18, 22, 26, 30, 3, 7, 11, 15, 19, 23, 27, 31);
    __m512i P0 = _mm512_permutex2var_epi32(Z[0], ia, Z[1]), P1 = _mm512_permutex2var_epi32(Z[0], ib, Z[1]);
    __m512i Q0 = _mm512_permutex2var_epi32(Z[2], ia, Z[3]), Q1 = _mm512_permutex2var_epi32(Z[2], ib, Z[3]);
    D[0] = _mm512_shuffle_i64x2(P0, Q0, 0x44);
    D[1] = _mm512_shuffle_i64x2(P0, Q0, 0xEE);
    D[2] = _mm512_shuffle_i64x2(P1, Q1, 0x44);
    D[3] = _mm512_shuffle_i64x2(P1, Q1, 0xEE);
}

/* Q8_0's 32 quant bytes (offset 2) of each of the 16 rows p[0..15],
 * transposed by dwords: lane r of D[k] (k = 0..7) holds quants 4k..4k+3
 * of row r. Two rows per 32-byte load pair, then four rows per 128-bit
 * lane, then a 4 x 4 transpose of lanes. */
S_INLINE void s_t16x32(const uint8_t *const p[16], __m512i D[8]) {
    __m512i Z[8]; /* Z[g]: rows 2g and 2g+1 */
    for (int g = 0; g < 8; g++)
        Z[g] = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(const void *)(p[2 * g] + 2))),
            _mm256_loadu_si256((const __m256i *)(const void *)(p[2 * g + 1] + 2)), 1);
    /* T[q] lane k: dword k (lo) or 4+k (hi) of rows 4q..4q+3 */
    const __m512i il = _mm512_setr_epi32(0, 8, 16, 24, 1, 9, 17, 25, 2, 10, 18, 26, 3, 11, 19, 27);
    const __m512i ih = _mm512_setr_epi32(4, 12, 20, 28, 5, 13, 21, 29, 6, 14, 22, 30, 7, 15, 23, 31);
    for (int h = 0; h < 2; h++) {
        __m512i T[4];
        for (int q = 0; q < 4; q++)
            T[q] = _mm512_permutex2var_epi32(Z[2 * q], h ? ih : il, Z[2 * q + 1]);
        __m512i A01 = _mm512_shuffle_i64x2(T[0], T[1], 0x44), A23 = _mm512_shuffle_i64x2(T[2], T[3], 0x44);
        __m512i B01 = _mm512_shuffle_i64x2(T[0], T[1], 0xEE), B23 = _mm512_shuffle_i64x2(T[2], T[3], 0xEE);
        D[4 * h + 0] = _mm512_shuffle_i64x2(A01, A23, 0x88);
        D[4 * h + 1] = _mm512_shuffle_i64x2(A01, A23, 0xDD);
        D[4 * h + 2] = _mm512_shuffle_i64x2(B01, B23, 0x88);
        D[4 * h + 3] = _mm512_shuffle_i64x2(B01, B23, 0xDD);
    }
}

/* The transposed quants of a block: from the 16 rows p[0..15] in GGUF's
 * layout (s_t16, s_t16x32), or ready in the packed layout at q. */
S_INLINE void s_quants(int kind, const uint8_t *const p[16], const uint8_t *q, __m512i D[8]) {
    if (q) {
        for (int k = 0; k < (kind == S_Q8_0 ? 8 : 4); k++)
            D[k] = _mm512_loadu_si512(q + 64 * k);
    } else if (kind == S_Q8_0) {
        s_t16x32(p, D);
    } else {
        s_t16(p, kind == S_Q4_1 ? 4 : 2, D);
    }
}

/* Block b's scales of the 16 rows: d in dw, and in aw the offset that
 * multiplies the token's block sum (Q4_1: m; Q4_0: -8 d; Q8_0: none), from
 * the rows (one gather of each row's first dword) or the packed block q. */
S_INLINE void s_scales(int kind, __m512i vidx, const uint8_t *rowblk, const uint8_t *q, __m512 *dw,
                       __m512 *aw) {
    if (q) {
        *dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)q));
        *aw = kind == S_Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)(q + 32)))
                             : _mm512_setzero_ps();
    } else {
        __m512i g = _mm512_i32gather_epi32(vidx, (const void *)rowblk, 1);
        *dw = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g));
        *aw = kind == S_Q4_1 ? _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(g, 16)))
                             : _mm512_setzero_ps();
    }
    if (kind == S_Q4_0)
        *aw = _mm512_mul_ps(*dw, _mm512_set1_ps(-8.0f)); /* (q - 8) d = q d + (-8 d), exact */
}

/* The packed layout (fi_q16_pack): each full group of 16 rows keeps its
 * bytes, [16 r * stride, 16 (r + 1) * stride), reordered block by block:
 * the 16 rows' d (fp16), Q4_1's 16 m, then the quants transposed by dwords
 * as s_t16 / s_t16x32 make them. Where group rows r..r+15 are packed, or
 * NULL (not packed, or a partial or unaligned group: GGUF's layout). */
S_INLINE const uint8_t *s_packed(const fi_mm_task *t, int r, int nr) {
    return t->wp && nr == 16 && r % 16 == 0 ? t->wp + (size_t)r * t->w_stride : NULL;
}
#define S_QOFF(kind) ((kind) == S_Q4_1 ? 64 : 32) /* quants' offset in a packed block */

/* The 16 lanes' rows of a group starting at w0 (a partial group of nr
 * rows repeats its last row): their pointers in p, and their byte offsets
 * as a vector (for gathers of the rows' scales). The offsets are made in
 * a register: written to an int array and loaded as one vector, they cost
 * a failed store-to-load forward on every tile (the load waits until the
 * 16 scalar stores, and the tile's stores of y before them, reach the
 * cache): on the Zen 5 machine that one load held 17-21% of the Q8_0
 * product's perf samples, and 16-token decode steps ran 4-7% faster
 * without it. */
S_INLINE __m512i s_rows(const uint8_t *w0, size_t stride, int nr, const uint8_t *p[16]) {
    for (int i = 0; i < 16; i++)
        p[i] = w0 + (size_t)(i < nr ? i : nr - 1) * stride;
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return _mm512_mullo_epi32(_mm512_min_epi32(lane, _mm512_set1_epi32(nr - 1)), _mm512_set1_epi32((int)stride));
}

/* Defines NAME(kind, bsz, t, r, nr, k, pf): tokens k..t->n-1 of rows
 * r..r+nr-1 through TILE(kind, bsz, t, r, nr, k, T, pf) in tiles of PT,
 * then 4, 2 and 1 (each T a compile-time size, so that the tile's loops
 * unroll); pf goes to the first tile only (the one that prefetches). */
#define S_DEFINE_TOKEN_TILES(NAME, TILE, PT)                                                      \
    S_INLINE void NAME(int kind, size_t bsz, const fi_mm_task *t, int r, int nr, int k, int pf) { \
        for (; k + (PT) <= t->n; k += (PT), pf = 0)                                               \
            TILE(kind, bsz, t, r, nr, k, (PT), pf);                                               \
        if (k + 4 <= t->n) {                                                                      \
            TILE(kind, bsz, t, r, nr, k, 4, pf);                                                  \
            k += 4;                                                                               \
            pf = 0;                                                                               \
        }                                                                                         \
        if (k + 2 <= t->n) {                                                                      \
            TILE(kind, bsz, t, r, nr, k, 2, pf);                                                  \
            k += 2;                                                                               \
            pf = 0;                                                                               \
        }                                                                                         \
        if (k < t->n)                                                                             \
            TILE(kind, bsz, t, r, nr, k, 1, pf);                                                  \
    }

#endif /* FI_CPU_AVX512_IMPL_H */

/*
 * fi_cpu_q16_avx2.c - AVX2 16-bit-activation kernels (see
 * fi_cpu_q16_impl.h). Compiled with -mavx2 -mfma -mf16c and entered only
 * after a run-time check.
 *
 * Eight rows per register, as the AVX512 kernels have sixteen: from the
 * backend's packed copy (fi_q16_pack: per block, the 16 rows' scales, then
 * their quants transposed by dwords), lane r of a register holds two
 * 16-bit weights of row r; vpmaddwd with one pair of the token's quants
 * broadcast from memory and vpaddd (no VNNI here) leave lane r with row
 * r's whole integer dot product for the block after 16 pairs. One
 * conversion, one multiply by d_x and one or two FMAs then serve eight
 * (row, token) pairs, and no lane is summed across. Each block's widened
 * weights serve S_PT tokens. Rows outside a packed group are gathered
 * into the same layout, block by block.
 *
 * Why: the kernel this replaced (four rows, each row's block widened and
 * multiplied on its own, its eight partial sums converted and scaled in
 * float) spent six instructions per 32 products, and its 4 x 4 tile of
 * float accumulators did not fit AVX2's 16 registers. On the 2-core AMD
 * EPYC (Zen 3) machine the default model's decode-shaped products for 16
 * tokens took 23.5-24.5 ms at 2 threads, against 42.5 (build/tests/
 * bench_kernels 2, BENCH_DECODE_ONLY=1), and one token's 3.84-3.91 ms
 * against 4.45.
 *
 * No overflow: |w| <= 15 (Q4, unsigned nibbles) or 128 (Q8_0) times |x| <=
 * 32767, 32 products per 32-bit lane: below 2^28.
 */
#include "fi_cpu_q16_impl.h"
#include "fi_cpu_lanes8_impl.h"

#include <float.h>
#include <math.h>
#include <immintrin.h>
#include <stddef.h>
#include <string.h>


static inline float s_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float s_hmax(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* One block of x (v[0..3]) quantised with scale id into qs, rounded to
 * nearest even (the default MXCSR). */
static inline void s_quant_block(const __m256 v[4], float id, int16_t *qs) {
    const __m256 vid = _mm256_set1_ps(id);
    __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v[0], vid));
    __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v[1], vid));
    __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v[2], vid));
    __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v[3], vid));
    /* packs works within 128-bit lanes; the permute restores order */
    __m256i p0 = _mm256_permute4x64_epi64(_mm256_packs_epi32(i0, i1), 0xD8);
    __m256i p1 = _mm256_permute4x64_epi64(_mm256_packs_epi32(i2, i3), 0xD8);
    _mm256_storeu_si256((__m256i *)(void *)qs, p0);
    _mm256_storeu_si256((__m256i *)(void *)(qs + 16), p1);
}

/* A block's four vectors from x, and their sum (v0 + v1) + (v2 + v3),
 * the order every AVX quantiser keeps (fi_cpu_q16_avx512.c). */
static inline float s_load_block(const float *x, __m256 v[4]) {
    for (int k = 0; k < 4; k++)
        v[k] = _mm256_loadu_ps(x + 8 * k);
    return s_hsum(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
}

static void s_quantize(const float *x, fi_block_q16x *y, int nb, int qmax) {
    const float fq = (float)qmax;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int b = 0; b < nb; b++, x += FI_QK) {
        __m256 v[4];
        const float sum = s_load_block(x, v);
        __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                  _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
        float amax = s_hmax(mx);
        const float lo = fq * FLT_MIN; /* as fi_quantize_q16x_ref */
        float id = amax >= lo ? fq / amax : 0.0f;
        y[b].d = !(amax < lo) ? amax / fq : 0.0f;
        y[b].s = sum;
        s_quant_block(v, id, y[b].qs);
    }
}

/* One scale for the row (fi_quantize_q16x_tok_ref, the same bits but for
 * s, which is the sum above, times 1 / d): a pass for the row's max, then
 * the blocks as above. */
static void s_quantize_tok(const float *x, fi_block_q16x *y, int nb) {
    const float fq = (float)FI_Q16_QMAX;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 mx = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
    for (int i = 0; i < nb * FI_QK; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        mx = _mm256_max_ps(_mm256_andnot_ps(sign, v), mx);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    /* a NaN in x makes amax NaN, as in the reference (vmaxps drops it) */
    float amax = _mm256_movemask_ps(nan) ? NAN : s_hmax(mx);
    const float lo = fq * FLT_MIN;
    const float d = !(amax < lo) ? amax / fq : 0.0f, id = amax >= lo ? fq / amax : 0.0f;
    for (int b = 0; b < nb; b++, x += FI_QK) {
        __m256 v[4];
        y[b].d = d;
        y[b].s = s_load_block(x, v) * id;
        s_quant_block(v, id, y[b].qs);
    }
}

#define S_INLINE static inline __attribute__((always_inline))
#ifndef S_RB
#define S_RB 32       /* rows per sub-block when several tokens share a call */
#endif
#ifndef S_PT
#define S_PT 8        /* tokens per tile of eight rows */
#endif
#ifndef S_PF_GROUPS
#define S_PF_GROUPS 2 /* prefetch this many 16-row groups ahead */
#endif

/* A token's element pair c of a block (quants 2c, 2c+1) in every lane. */
_Static_assert(offsetof(fi_block_q16x, qs) % 4 == 0, "q16x quants start on a dword");
S_INLINE __m256i s_pair(const fi_block_q16x *x, int c) {
    return fi_l8_bcast32(x->qs + 2 * c);
}

/* Pair c (0..3) of 16-bit weights in each lane from D, the lanes' Q4
 * quant dword: low nibbles of bytes 0, 1 (c = 0) and 2, 3 (c = 1), high
 * nibbles of bytes 0, 1 (c = 2) and 2, 3 (c = 3). */
S_INLINE __m256i s_q4_pair(__m256i D, int c) {
    const __m256i e0 = _mm256_setr_epi32((int)0x80018000u, (int)0x80058004u, (int)0x80098008u, (int)0x800D800Cu,
                                         (int)0x80018000u, (int)0x80058004u, (int)0x80098008u, (int)0x800D800Cu);
    const __m256i e1 = _mm256_setr_epi32((int)0x80038002u, (int)0x80078006u, (int)0x800B800Au, (int)0x800F800Eu,
                                         (int)0x80038002u, (int)0x80078006u, (int)0x800B800Au, (int)0x800F800Eu);
    const __m256i u = _mm256_shuffle_epi8(D, c & 1 ? e1 : e0);
    return c & 2 ? _mm256_srli_epi16(u, 4) : _mm256_and_si256(u, _mm256_set1_epi16(0x0f));
}

/* Pair c (0, 1) of 16-bit weights in each lane from D, the lanes' Q8_0
 * quant dword: bytes 0, 1 or 2, 3, each into the high byte of a 16-bit
 * lane, then an arithmetic shift sign-extends it. */
S_INLINE __m256i s_q8_pair(__m256i D, int c) {
    const __m256i h0 = _mm256_setr_epi32((int)0x01800080u, (int)0x05800480u, (int)0x09800880u, (int)0x0D800C80u,
                                         (int)0x01800080u, (int)0x05800480u, (int)0x09800880u, (int)0x0D800C80u);
    const __m256i h1 = _mm256_setr_epi32((int)0x03800280u, (int)0x07800680u, (int)0x0B800A80u, (int)0x0F800E80u,
                                         (int)0x03800280u, (int)0x07800680u, (int)0x0B800A80u, (int)0x0F800E80u);
    return _mm256_srai_epi16(_mm256_shuffle_epi8(D, c ? h1 : h0), 8);
}

/* Q4: dword k of the quants of H halves of eight rows (s[h]) against
 * tokens x[0..T-1] (block b), added to isum[h][j] (see s_dots); each
 * broadcast pair of the token serves every half. */
S_INLINE void s_dots4(const fi_l8_block *s, int H, const fi_block_q16x *const *x, int b, int T, int k,
                      __m256i isum[2][S_PT]) {
    __m256i W[2][4]; /* pairs 2k, 2k+1, 8+2k, 9+2k */
    for (int h = 0; h < H; h++) {
        __m256i D = _mm256_loadu_si256((const __m256i *)(const void *)(s[h].q + k * s[h].qstep));
        for (int c = 0; c < 4; c++)
            W[h][c] = s_q4_pair(D, c);
    }
    for (int j = 0; j < T; j++) {
        const fi_block_q16x *xb = x[j] + b;
        for (int c = 0; c < 4; c++) {
            __m256i xp = s_pair(xb, (c & 2) * 4 + 2 * k + (c & 1));
            for (int h = 0; h < H; h++)
                isum[h][j] = _mm256_add_epi32(isum[h][j], _mm256_madd_epi16(W[h][c], xp));
        }
    }
}

/* Q8_0: dword k of the quants (signed bytes 4k..4k+3) of H halves against
 * tokens x[0..T-1] (block b), added to isum[h][j]: each byte into the
 * high byte of a 16-bit lane, then an arithmetic shift, sign-extends it. */
S_INLINE void s_dots8(const fi_l8_block *s, int H, const fi_block_q16x *const *x, int b, int T, int k,
                      __m256i isum[2][S_PT]) {
    __m256i W[2][2];
    for (int h = 0; h < H; h++) {
        __m256i D = _mm256_loadu_si256((const __m256i *)(const void *)(s[h].q + k * s[h].qstep));
        W[h][0] = s_q8_pair(D, 0);
        W[h][1] = s_q8_pair(D, 1);
    }
    for (int j = 0; j < T; j++) {
        const fi_block_q16x *xb = x[j] + b;
        for (int c = 0; c < 2; c++) {
            __m256i xp = s_pair(xb, 2 * k + c);
            for (int h = 0; h < H; h++)
                isum[h][j] = _mm256_add_epi32(isum[h][j], _mm256_madd_epi16(W[h][c], xp));
        }
    }
}

/* The integer dot products of H halves of eight rows (s[h]) with tokens
 * x[0..T-1] (block b) in isum[h][j], lane r for row r. Each dword k of
 * quants gives the 16-bit pairs of lane r's row: Q4, low nibbles of bytes
 * 4k, 4k+1 (pair 2k) and 4k+2, 4k+3 (pair 2k+1), their high nibbles pairs
 * 8+2k and 9+2k; Q8_0, the signed bytes, pairs 2k and 2k+1. vpmaddwd of a
 * pair of weights with the token's pair broadcast, then vpaddd: without
 * VNNI, two instructions per 16 products. */
S_INLINE void s_dots(fi_dtype kind, const fi_l8_block *s, int H, const fi_block_q16x *const *x, int b, int T,
                     __m256i isum[2][S_PT]) {
    for (int h = 0; h < H; h++)
        for (int j = 0; j < T; j++)
            isum[h][j] = _mm256_setzero_si256();
    if (kind == FI_DTYPE_Q8_0)
        FI_L8_STEPS(8, T, k, s_dots8(s, H, x, b, T, k, isum));
    else
        FI_L8_STEPS(4, T, k, s_dots4(s, H, x, b, T, k, isum));
}

/* Rows r..r+nr-1 (nr <= 8 H; a partial half repeats its last row) times
 * tokens k..k+T-1, H halves of eight rows (one row per lane) sharing each
 * token's loads. pf: prefetch the group S_PF_GROUPS ahead (the first pass
 * over these rows; only from packed weights, where a block's 16 rows are
 * one run of bytes).
 *
 * Batch invariance: every (row, token) result is formed by the same
 * sequence of floating-point operations whatever the tile: per block, in
 * the row's lane, v = float(isum) * d_x, acc = fma(v, d_w, acc), then (Q4)
 * acc = fma(a, s, acc); y = acc (one scale per token, fi_mm_task.xtok:
 * fi_l8_accum_tok, and y = acc * d_x). The integer sum isum is exact whatever
 * the order of its products, and vector operations work lane by lane, so
 * neither the other rows sharing a register nor the number of tokens
 * changes a lane's value. All intrinsics: no compiler contraction can
 * tell the shapes apart. (The AVX512 kernels take the same steps.) */
S_INLINE void s_tile(fi_dtype kind, size_t bsz, const fi_mm_task *t, int r, int nr, int r1, int k, int H, int T,
                     int pf, int xtok) {
    const int nb = t->cols / FI_QK;
    const fi_block_q16x *xr[S_PT];
    fi_l8_rows rw;
    __m256 acc[2][S_PT];
    fi_l8_rows_of(t, r, nr, r1, H, &rw);
    for (int j = 0; j < T; j++) {
        xr[j] = (const fi_block_q16x *)(const void *)(t->x + (size_t)(k + j) * t->x_stride);
        for (int h = 0; h < H; h++)
            acc[h][j] = _mm256_setzero_ps();
    }
    const uint8_t *ahead = pf && r % 16 == 0 && rw.pk[0] ? rw.pk[0] + S_PF_GROUPS * 16 * t->w_stride : NULL;
    _Alignas(32) uint8_t buf[2][FI_L8_GATHER_BYTES];
    for (int b = 0; b < nb; b++) {
        fi_l8_prefetch(ahead, bsz, b);
        fi_l8_block s[2];
        __m256 dw[2], aw[2];
        for (int h = 0; h < H; h++) {
            s[h] = fi_l8_block_of(kind, bsz, &rw, r, h, b, buf[h]);
            fi_l8_scales(kind, s[h], &dw[h], &aw[h]);
        }
        __m256i isum[2][S_PT];
        s_dots(kind, s, H, xr, b, T, isum);
        for (int h = 0; h < H; h++)
            for (int j = 0; j < T; j++)
                acc[h][j] = xtok ? fi_l8_accum_tok(acc[h][j], isum[h][j], xr[j][b].s, dw[h], aw[h],
                                                   kind != FI_DTYPE_Q8_0)
                                 : fi_l8_accum(acc[h][j], isum[h][j], xr[j][b].d, xr[j][b].s, dw[h], aw[h],
                                               kind != FI_DTYPE_Q8_0);
    }
    for (int h = 0; h < H; h++)
        for (int j = 0; j < T; j++)
            fi_l8_store(t->y + (size_t)(k + j) * t->y_stride + r + 8 * h,
                        xtok ? _mm256_mul_ps(acc[h][j], _mm256_set1_ps(xr[j]->d)) : acc[h][j], rw.nh[h]);
}

/* s_tile for several tokens where the eight rows are a packed half (all
 * full groups of a call's rows): the block's pointers step by a constant,
 * nothing is gathered, the weights are unpacked one pair at a time (few
 * live registers) and each token's sum stays in a register as one chain
 * of adds, which the empty asm statements pin (GCC otherwise reassociates
 * the adds, hoists the products and spills them). The same integer sums
 * and float steps (fi_l8_accum) as s_tile, so the same bits. Sixteen
 * tokens' products (one thread, weights in cache, the default model's
 * shapes): Q4_1 1.12-1.17x s_tile, Q8_0 1.12-1.23x, on the 2-core AMD
 * EPYC (Zen 3) machine, alternated in one process. */
S_INLINE void s_tile_pk(fi_dtype kind, size_t bsz, const fi_mm_task *t, int r, int k, int T, int pf, int xtok) {
    const int nb = t->cols / FI_QK;
    const uint8_t *pk = t->wp + (size_t)(r & ~15) * t->w_stride; /* the packed group */
    const int half = (r >> 3) & 1;
    const uint8_t *ahead = pf && half == 0 ? pk + S_PF_GROUPS * 16 * t->w_stride : NULL;
    const fi_block_q16x *xr[S_PT];
    __m256 acc[S_PT];
    for (int j = 0; j < T; j++) {
        xr[j] = (const fi_block_q16x *)(const void *)(t->x + (size_t)(k + j) * t->x_stride);
        acc[j] = _mm256_setzero_ps();
    }
    for (int b = 0; b < nb; b++) {
        fi_l8_prefetch(ahead, bsz, b);
        const fi_l8_block blk = fi_l8_half(kind, pk, bsz, b, half);
        const uint8_t *pq = blk.q;
        __m256 dw, aw;
        fi_l8_scales(kind, blk, &dw, &aw);
        __m256i isum[S_PT];
        for (int j = 0; j < T; j++)
            isum[j] = _mm256_setzero_si256();
        if (kind == FI_DTYPE_Q8_0) {
            _Pragma("GCC unroll 1") for (int kk = 0; kk < 8; kk++) {
                const __m256i D = _mm256_loadu_si256((const __m256i *)(const void *)(pq + 64 * kk));
                for (int c = 0; c < 2; c++) {
                    const __m256i W = s_q8_pair(D, c);
                    for (int j = 0; j < T; j++) {
                        isum[j] = _mm256_add_epi32(isum[j], _mm256_madd_epi16(W, s_pair(xr[j] + b, 2 * kk + c)));
                        __asm__("" : "+x"(isum[j]));
                    }
                }
            }
        } else {
            _Pragma("GCC unroll 1") for (int kk = 0; kk < 4; kk++) {
                const __m256i D = _mm256_loadu_si256((const __m256i *)(const void *)(pq + 64 * kk));
                for (int c = 0; c < 4; c++) {
                    const __m256i W = s_q4_pair(D, c);
                    for (int j = 0; j < T; j++) {
                        __m256i xp = s_pair(xr[j] + b, (c & 2) * 4 + 2 * kk + (c & 1));
                        isum[j] = _mm256_add_epi32(isum[j], _mm256_madd_epi16(W, xp));
                        __asm__("" : "+x"(isum[j]));
                    }
                }
            }
        }
        for (int j = 0; j < T; j++)
            acc[j] = xtok ? fi_l8_accum_tok(acc[j], isum[j], xr[j][b].s, dw, aw, kind != FI_DTYPE_Q8_0)
                          : fi_l8_accum(acc[j], isum[j], xr[j][b].d, xr[j][b].s, dw, aw, kind != FI_DTYPE_Q8_0);
    }
    for (int j = 0; j < T; j++)
        _mm256_storeu_ps(t->y + (size_t)(k + j) * t->y_stride + r,
                         xtok ? _mm256_mul_ps(acc[j], _mm256_set1_ps(xr[j]->d)) : acc[j]);
}

/* s_tile, or s_tile_pk where it applies; xtok a constant in each, so
 * that their block loops carry no test of it (with the test there, 16
 * tokens' 12-bit products took 21.7-23.4 ms against 21.1-22.5 before
 * xtok; made constant, 19.9-20.5 against 20.1-21.1: BENCH_SIMD=avx2
 * bench_kernels 2 on a 2-core Intel Xeon, alternated). */
S_INLINE void s_tile_any(fi_dtype kind, size_t bsz, const fi_mm_task *t, int r, int nr, int r1, int k, int H,
                         int T, int pf) {
    const int pk = FI_L8_PACKED_TILES && H == 1 && T > 1 && fi_l8_packed(t, r, nr, r1);
    if (pk && t->xtok)
        s_tile_pk(kind, bsz, t, r, k, T, pf, 1);
    else if (pk)
        s_tile_pk(kind, bsz, t, r, k, T, pf, 0);
    else if (t->xtok)
        s_tile(kind, bsz, t, r, nr, r1, k, H, T, pf, 1);
    else
        s_tile(kind, bsz, t, r, nr, r1, k, H, T, pf, 0);
}

FI_L8_DEFINE_MM(s_mm, s_tile_any, S_PT, S_RB)

static void s_mm_q4_0(const fi_mm_task *t, int r0, int r1) {
    s_mm(FI_DTYPE_Q4_0, sizeof(fi_block_q4_0), t, r0, r1);
}
static void s_mm_q4_1(const fi_mm_task *t, int r0, int r1) {
    s_mm(FI_DTYPE_Q4_1, sizeof(fi_block_q4_1), t, r0, r1);
}
static void s_mm_q8_0(const fi_mm_task *t, int r0, int r1) {
    s_mm(FI_DTYPE_Q8_0, sizeof(fi_block_q8_0), t, r0, r1);
}

void fi_q16_kernels_avx2(fi_q16_kernels *k) {
    k->quantize = s_quantize;
    k->quantize_tok = s_quantize_tok;
    k->mm_q4_0 = s_mm_q4_0;
    k->mm_q4_1 = s_mm_q4_1;
    k->mm_q8_0 = s_mm_q8_0;
    k->split = NULL;
    k->pack = fi_q16_pack;
}

/*
 * fi_cpu_q16_avx512.c - AVX512-VNNI 16-bit-activation matmul kernels (see
 * fi_cpu_q16_impl.h), an AMX-INT8 variant for batches, and the
 * activations' quantiser (see "activation quantiser" below). Compiled with
 * -mavx512f -mavx512bw -mavx512vl -mavx512vnni (plus AVX2/FMA/F16C) when
 * the compiler knows them, and entered only after fi_cpu.c has checked the
 * processor and that the OS saves the ZMM state; the AMX functions carry
 * their own target attributes and are chosen only after a CPUID check and
 * the OS's grant of the tile state (fi_q16_kernels_avx512_amx).
 *
 * Why: the AVX2 kernel of the time (four rows, since replaced by eight
 * per register, fi_cpu_q16_avx2.c) spent about three cycles per
 * 32-element block and (row, token) on this core, most of them not on the
 * products: every block's 8 partial sums were converted to float and
 * scaled on their own.
 *
 * Sixteen rows per register: a block of sixteen rows is transposed once
 * (row loads, two-source dword permutes, vpshufb into 16-bit pairs)
 * so that lane r of W[c] holds row r's elements 2c and 2c+1. Sixteen
 * vpdpwssd, each with one element pair of the token broadcast from
 * memory, then leave lane r with row r's whole integer dot product for the
 * block: one conversion, one multiply by d_x, one FMA by the rows' d_w
 * and (Q4) one FMA of a * s (a = m for Q4_1, -8 d for Q4_0, the offset of
 * the unsigned nibbles) serve sixteen (row, token) pairs, and the result
 * needs no horizontal sum. The transposed block is reused for up to eight
 * tokens. The products are the bound: vpdpwssd on 512 bits issues about
 * once per cycle here (on 256 bits twice, the same 32 products), and a
 * tile of eight tokens runs near that rate (about 180 GFLOP/s per thread
 * on Sapphire Rapids, against 65 for that AVX2 kernel). Tiles of sixteen
 * tokens, and a last tile of FI_Q16_AMX_MIN or more, go to the AMX tile
 * unit where there is one (see below: about 270).
 *
 * Packed weights: where the backend made a packed copy (fi_q16_pack,
 * fi_mm_task.wp) a full group of 16 rows is read from it: the block's 16
 * d (and m) are one vector load instead of a gather, and its quants are
 * already the dword transpose, four (Q4) or eight (Q8_0) loads instead of
 * sixteen loads and a permute network; the same bytes, so the same
 * results. Partial groups are read in GGUF's layout. The weights stream
 * from memory: each tile prefetches the group of rows ahead.
 *
 * No overflow: |w| <= 15 (Q4, unsigned nibbles) or 128 (Q8_0) times
 * |x| <= 32767 (fi_q16_qmax: Q4 inputs are within 2039 by default), 32
 * products per 32-bit lane: below 2^28.
 *
 * Batch invariance: every (row, token) result is formed by the same
 * sequence of floating-point operations whatever the tile: per block, in
 * the row's lane, v = float(isum) * d_x, acc = fma(v, d_w, acc), then (Q4)
 * acc = fma(a, s, acc); y = acc (with one scale per token, xtok: v =
 * float(isum), and y = acc * d_x). The integer sum isum is exact whatever
 * the order of its products. Vector operations work lane by lane, so
 * neither the other rows sharing a register (a partial group of rows
 * repeats its last row) nor the number of tokens in the tile changes a
 * lane's value; the one-token path is the same code with a
 * tile of one token plus prefetches. All intrinsics: no compiler
 * contraction can tell the shapes apart. So a token's result is the same
 * bits alone, in a batch of any size, and on any thread split
 * (tests/test_kernels.c checks all three).
 */
#include "fi_cpu_q16_impl.h"
#include "fi_cpu_avx512_impl.h"

#include <cpuid.h>
#include <float.h>
#include <immintrin.h>
#include <stddef.h>
#include <string.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#define S_INLINE static inline __attribute__((always_inline))
#ifndef S_RB
#define S_RB 32       /* rows per sub-block when several tokens share a call */
#endif
#ifndef S_PT
#define S_PT 8        /* tokens per tile */
#endif
#ifndef S_CH
#define S_CH 4        /* dot-product chains per token and block */
#endif
#ifndef S_PF_GROUPS
#define S_PF_GROUPS 2 /* one token: prefetch this many 16-row groups ahead */
#endif

/* A block of 16 rows, its quants transposed by dwords in D (s_quants),
 * as W[c], c = 0..15: lane r
 * holds row r's elements 2c and 2c+1 as 16-bit integers (Q4: the
 * unsigned nibbles, c < 8 low nibbles of bytes 2c and 2c+1, c >= 8 high
 * nibbles of bytes 2c-16 and 2c-15; Q8_0: the signed quants). */
S_INLINE void s_w16_of(int kind, const __m512i *D, __m512i W[16]) {
    /* vpshufb patterns, per dword: bytes 0,1 (e0) or 2,3 (e1) into the low
     * (Q4) or high (Q8_0) byte of two 16-bit lanes, the other byte zero */
    const __m512i e0 = _mm512_set4_epi32((int)0x800D800Cu, (int)0x80098008u, (int)0x80058004u, (int)0x80018000u);
    const __m512i e1 = _mm512_set4_epi32((int)0x800F800Eu, (int)0x800B800Au, (int)0x80078006u, (int)0x80038002u);
    const __m512i h0 = _mm512_set4_epi32((int)0x0D800C80u, (int)0x09800880u, (int)0x05800480u, (int)0x01800080u);
    const __m512i h1 = _mm512_set4_epi32((int)0x0F800E80u, (int)0x0B800A80u, (int)0x07800680u, (int)0x03800280u);
    if (kind == S_Q8_0) {
        /* quants 4k..4k+3 in D[k], sign-extended from the high byte */
        for (int k = 0; k < 8; k++) {
            W[2 * k] = _mm512_srai_epi16(_mm512_shuffle_epi8(D[k], h0), 8);
            W[2 * k + 1] = _mm512_srai_epi16(_mm512_shuffle_epi8(D[k], h1), 8);
        }
        return;
    }
    const __m512i m4 = _mm512_set1_epi16(0x0f);
    for (int k = 0; k < 4; k++) {
        __m512i u0 = _mm512_shuffle_epi8(D[k], e0), u1 = _mm512_shuffle_epi8(D[k], e1);
        W[2 * k] = _mm512_and_si512(u0, m4);
        W[2 * k + 1] = _mm512_and_si512(u1, m4);
        W[8 + 2 * k] = _mm512_srli_epi16(u0, 4);
        W[8 + 2 * k + 1] = _mm512_srli_epi16(u1, 4);
    }
}

/* Rows r..r+nr-1 (1 <= nr <= 16; a partial group repeats its last row)
 * times tokens k..k+T-1 (T <= S_PT), one row per lane. pf: the one-token
 * tile, which prefetches the groups ahead. */
S_INLINE void s_tile(int kind, size_t bsz, const fi_mm_task *t, int r, int nr, int k, int T, int pf,
                     int xtok) {
    const size_t stride = t->w_stride;
    const uint8_t *w0 = t->w + (size_t)r * stride;
    const int nb = t->cols / FI_QK;
    /* a packed group is read from wp alone; other rows need their
     * pointers and offsets */
    const uint8_t *pk = s_packed(t, r, nr), *p[16] = {0};
    const __m512i vidx = pk ? _mm512_setzero_si512() : s_rows(w0, stride, nr, p);
    const fi_block_q16x *xr[S_PT];
    __m512 acc[S_PT];
    for (int j = 0; j < T; j++) {
        xr[j] = (const fi_block_q16x *)(const void *)(t->x + (size_t)(k + j) * t->x_stride);
        acc[j] = _mm512_setzero_ps();
    }
    for (int b = 0; b < nb; b++) {
        if (pf) {
            /* this step's share of the group S_PF_GROUPS ahead */
            const char *q = (const char *)(pk ? pk : w0) + S_PF_GROUPS * 16 * stride + (size_t)b * 16 * bsz;
            for (size_t o = 0; o < 16 * bsz; o += 64)
                _mm_prefetch(q + o, _MM_HINT_T0); /* T1 (L2 only): 16-token decode
                                                     steps 2-4% slower on Zen 5, one
                                                     token's the same */
        }
        const uint8_t *pb = pk ? pk + (size_t)b * 16 * bsz : NULL;
        __m512 dw, aw;
        s_scales(kind, vidx, w0 + (size_t)b * bsz, pb, &dw, &aw);
        __m512i D[8], W[16];
        s_quants(kind, p, pb ? pb + S_QOFF(kind) : NULL, D);
        s_w16_of(kind, D, W);
        if (!pb)
            for (int i = 0; i < 16; i++)
                p[i] += bsz;
#pragma GCC unroll 8
        for (int j = 0; j < T; j++) {
            const fi_block_q16x *x = xr[j] + b;
            const int32_t *xq = (const int32_t *)(const void *)x->qs;
            /* S_CH independent chains, so that one token's products
             * overlap (on Zen 5, in full tiles of 8 tokens, 2 or 8 chains
             * made 16-sequence decode steps 2-4% slower than 4, 1 chain
             * 7%); integer sums: any order gives the same value */
            __m512i ch[S_CH];
            for (int c = 0; c < S_CH; c++)
                ch[c] = _mm512_madd_epi16(W[c], _mm512_set1_epi32(xq[c])); /* dpwssd(0, ...) */
            for (int c = S_CH; c < 16; c++)
                ch[c % S_CH] = _mm512_dpwssd_epi32(ch[c % S_CH], W[c], _mm512_set1_epi32(xq[c]));
            for (int c = 1; c < S_CH; c++)
                ch[0] = _mm512_add_epi32(ch[0], ch[c]);
            __m512 v = _mm512_cvtepi32_ps(ch[0]);
            if (!xtok)
                v = _mm512_mul_ps(v, _mm512_set1_ps(x->d));
            acc[j] = _mm512_fmadd_ps(v, dw, acc[j]);
            if (kind != S_Q8_0)
                acc[j] = _mm512_fmadd_ps(aw, _mm512_set1_ps(x->s), acc[j]);
        }
    }
    const __mmask16 m = (__mmask16)((1u << nr) - 1);
    for (int j = 0; j < T; j++) {
        if (xtok)
            acc[j] = _mm512_mul_ps(acc[j], _mm512_set1_ps(xr[j]->d));
        _mm512_mask_storeu_ps(t->y + (size_t)(k + j) * t->y_stride + r, m, acc[j]);
    }
}

/* Tokens k..n-1 of rows r..r+nr-1: tiles of S_PT, then one tile of the
 * rest (a tile of each size, so that its loops unroll). One tile for the
 * rest rather than tiles of 4, 2 and 1: each tile unpacks the rows'
 * weights again, and a step of 13-15 sequences (a closed loop of 16 whose
 * requests end at different steps) paid four unpackings a block instead
 * of two; such steps are 3-5% faster this way on Zen 5 (in-process A/B). */
S_INLINE void s_tokens(int kind, size_t bsz, const fi_mm_task *t, int r, int nr, int k, int pf, int xtok) {
    for (; k + S_PT <= t->n; k += S_PT, pf = 0)
        s_tile(kind, bsz, t, r, nr, k, S_PT, pf, xtok);
    _Static_assert(S_PT == 8, "one case per size of the rest");
    switch (t->n - k) {
    case 7: s_tile(kind, bsz, t, r, nr, k, 7, pf, xtok); break;
    case 6: s_tile(kind, bsz, t, r, nr, k, 6, pf, xtok); break;
    case 5: s_tile(kind, bsz, t, r, nr, k, 5, pf, xtok); break;
    case 4: s_tile(kind, bsz, t, r, nr, k, 4, pf, xtok); break;
    case 3: s_tile(kind, bsz, t, r, nr, k, 3, pf, xtok); break;
    case 2: s_tile(kind, bsz, t, r, nr, k, 2, pf, xtok); break;
    case 1: s_tile(kind, bsz, t, r, nr, k, 1, pf, xtok); break;
    default: break;
    }
}

/* One token: groups of 16 rows, prefetching. Several: sub-blocks of S_RB
 * rows (their weights stay in L1 while the token tiles pass over them),
 * groups of 16 rows times tiles of tokens. */
S_INLINE void s_mm_scaled(int kind, size_t bsz, const fi_mm_task *t, int r0, int r1, int xtok) {
    if (t->n == 1) {
        for (int r = r0; r < r1; r += 16)
            s_tile(kind, bsz, t, r, r1 - r < 16 ? r1 - r : 16, 0, 1, 1, xtok);
        return;
    }
    /* the first pass over a sub-block prefetches the rows ahead */
    for (int rb = r0; rb < r1; rb += S_RB) {
        int re = rb + S_RB < r1 ? rb + S_RB : r1;
        int k = 0;
        for (; k + S_PT <= t->n; k += S_PT)
            for (int r = rb; r < re; r += 16)
                s_tile(kind, bsz, t, r, re - r < 16 ? re - r : 16, k, S_PT, k == 0, xtok);
        if (k < t->n)
            for (int r = rb; r < re; r += 16)
                s_tokens(kind, bsz, t, r, re - r < 16 ? re - r : 16, k, k == 0, xtok);
    }
}

/* s_mm_scaled with its loops made for one scale per token or per block. */
S_INLINE void s_mm(int kind, size_t bsz, const fi_mm_task *t, int r0, int r1) {
    if (t->xtok)
        s_mm_scaled(kind, bsz, t, r0, r1, 1);
    else
        s_mm_scaled(kind, bsz, t, r0, r1, 0);
}

/* --- activation quantiser --------------------------------------------------
 *
 * fi_q16_kernels.quantize for this flavour (the AVX2 one where the
 * processor lacks AVX512DQ). Why: the AVX2 quantiser reduces each block on
 * its own (six shuffles for its max and sum, two scalar divisions, about
 * 50 instructions a block). Here up to sixteen blocks are reduced
 * together: pairs of blocks are loaded half and half into zmm, which
 * gives each block's 8 partial maxima and sums without a shuffle
 * (s_act_pair), and a butterfly (s_fold) folds them into lane b of one
 * vector for block b, about one shuffle per block and reduction; one
 * vector division per group gives the scales. The quants follow in a
 * second pass over the blocks (still in L1), after every group's
 * reductions, so that a group's quants, which wait on its division, do
 * not hold up the next group's reductions. About 1.6 times the AVX2
 * quantiser's speed on rows of 48 blocks, 1.45 on rows of 18 (a group
 * and a short tail; every call waits once on a division).
 *
 * Results: d and qs are the bits of fi_quantize_q16x_ref: d = amax / qmax
 * and id = qmax / amax are correctly rounded divisions, qs = x * id
 * rounded to nearest even (the default MXCSR), within qmax so the
 * saturating packs never clip. s is the AVX2 quantiser's sum, bit for bit
 * (same additions in the same order), so the engine's output does not
 * depend on which of the two runs. Each step of the butterfly combines
 * lanes l and l ^ w of one block's partials, with a partner block's
 * (s_fold) or with itself (s_fold_self) where a short group has no
 * partner, and the lanes of a group's missing blocks are filler, never
 * stored: a block's max and sum come from the same tree wherever it sits
 * (+ and max commute), so it quantises to the same bits whatever its row
 * and its place in it. */

/* vrangeps (s_act_pair) is AVX512DQ, which the file's flags leave out:
 * these functions carry it, and fi_q16_kernels_avx512 installs the
 * quantiser only where the processor has it (s_dq_usable). */
#define S_DQ __attribute__((target("avx512dq")))
#define S_DQ_INLINE static inline __attribute__((always_inline, target("avx512dq")))

/* Lane numbers 0..15, for the butterfly's permutation indices. */
S_INLINE __m512i s_lanes(void) {
    return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}

/* The lane pattern of butterfly step w (8, 4, 2, 1), in which each block's
 * partials fill an aligned chunk of 2w lanes: *from_d marks the lanes
 * whose bit w is set, which take the second vector's block, and idx[l] is
 * the partner lane l ^ w in permutex2var's numbering (16 + (l ^ w) in
 * the second vector). */
S_INLINE void s_fold_pattern(int w, __m512i *idx, __mmask16 *from_d) {
    const __m512i lane = s_lanes();
    const __m512i vw = _mm512_set1_epi32(w), partner = _mm512_xor_si512(lane, vw);
    *from_d = _mm512_test_epi32_mask(lane, vw);
    *idx = _mm512_mask_or_epi32(partner, *from_d, partner, _mm512_set1_epi32(16));
}

/* Step w of the max (is_max) or the sum on two vectors of blocks' partials
 * c and d: lanes with bit w clear fold c's chunk halves, the others d's. */
S_INLINE __m512 s_fold(int is_max, __m512 c, __m512 d, __m512i idx, __mmask16 from_d) {
    __m512 own = _mm512_mask_blend_ps(from_d, c, d);
    __m512 partner = _mm512_permutex2var_ps(c, idx, d);
    return is_max ? _mm512_max_ps(own, partner) : _mm512_add_ps(own, partner);
}

/* Step w on one vector's chunks, no partner: the folded value lands in
 * both halves of each chunk. */
S_INLINE __m512 s_fold_self(int is_max, __m512 c, int w) {
    const __m512i lane = s_lanes();
    __m512 partner = _mm512_permutexvar_ps(_mm512_xor_si512(lane, _mm512_set1_epi32(w)), c);
    return is_max ? _mm512_max_ps(c, partner) : _mm512_add_ps(c, partner);
}

/* Chunk k (x[8k..8k+7]) of block b0 in lanes 0..7 and of block b1 in
 * lanes 8..15 (b0 <= b1): a ymm load and an insert from memory, no
 * shuffle. Where b1 is b0 or padding (b1 >= n) its lanes repeat b0's;
 * where b0 is padding too, zero. */
S_INLINE __m512 s_act_chunks(const float *x, int b0, int b1, int n, int k) {
    if (b0 >= n)
        return _mm512_setzero_ps();
    const double *p0 = (const double *)(const void *)(x + FI_QK * b0 + 8 * k);
    if (b1 == b0 || b1 >= n)
        return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_loadu_pd(p0)));
    const double *p1 = (const double *)(const void *)(x + FI_QK * b1 + 8 * k);
    __m512d lo = _mm512_castpd256_pd512(_mm256_loadu_pd(p0));
    return _mm512_castpd_ps(_mm512_insertf64x4(lo, _mm256_loadu_pd(p1), 1));
}

/* Step 8 of both reductions of blocks b0 and b1 straight from memory:
 * lanes 0..7 of *mx and *sm hold b0's 8 partial maxima of |x| and sums,
 * lanes 8..15 b1's (see s_act_chunks). The sums are the AVX2 quantiser's,
 * (x[j] + x[j+8]) + (x[j+16] + x[j+24]). */
S_DQ_INLINE void s_act_pair(const float *x, int b0, int b1, int n, __m512 *mx, __m512 *sm) {
    __m512 c[4];
    for (int k = 0; k < 4; k++)
        c[k] = s_act_chunks(x, b0, b1, n, k);
    *sm = _mm512_add_ps(_mm512_add_ps(c[0], c[1]), _mm512_add_ps(c[2], c[3]));
    /* vrangeps 0x0b: the larger magnitude with its sign cleared, max(|a|, |b|) */
    *mx = _mm512_max_ps(_mm512_range_ps(c[0], c[1], 0x0b), _mm512_range_ps(c[2], c[3], 0x0b));
}

/* The bit-reversed 4-bit v. */
S_INLINE int s_bitrev4(int v) {
    return ((v & 1) << 3) | ((v & 2) << 1) | ((v & 4) >> 1) | ((v & 8) >> 3);
}

/* Max |x| and sum of x of blocks 0..n-1 (n <= m) in lane b of *amax and
 * *sum; m (16, 8, 4, 2 or 1, a constant) vectors, one per block, blocks
 * n..m-1 padding. Vector v holds block bitrev(v) (over log2 m bits): the
 * steps w = 8 .. 16/m pair vectors (2v, 2v + 1), step 8 as they are
 * loaded (s_act_pair), which leaves chunk k of 16/m lanes with block k;
 * self-folds finish each chunk. The sum takes the AVX2 quantiser's order
 * (s_act_pair, then halves), so its s is the same bits, and so is the
 * engine's output whichever quantiser runs. */
S_DQ_INLINE void s_act_reduce(const float *x, int n, int m, __m512 *amax, __m512 *sum) {
    /* the loops' bounds as plain constants, so that the unroll pragmas hold
     * (under -fsanitize=undefined too); m = 1: one pair, the block in both
     * halves, whose step 8 s_act_pair does */
    const int pairs = (m + 1) / 2, w_cross = 16 / m, w_self = m == 1 ? 4 : 8 / m;
    __m512 mx[8], sm[8];
#pragma GCC unroll 8
    for (int v = 0; v < pairs; v++)
        s_act_pair(x, s_bitrev4(2 * v) * m / 16, s_bitrev4(2 * v + 1) * m / 16, n, &mx[v], &sm[v]);
#pragma GCC unroll 4
    for (int w = 4; w >= w_cross; w /= 2) {
        const int folds = m * w / 16;
        __m512i idx;
        __mmask16 from_d;
        s_fold_pattern(w, &idx, &from_d);
#pragma GCC unroll 4
        for (int v = 0; v < folds; v++) {
            mx[v] = s_fold(1, mx[2 * v], mx[2 * v + 1], idx, from_d);
            sm[v] = s_fold(0, sm[2 * v], sm[2 * v + 1], idx, from_d);
        }
    }
#pragma GCC unroll 4
    for (int w = w_self; w >= 1; w /= 2) {
        mx[0] = s_fold_self(1, mx[0], w);
        sm[0] = s_fold_self(0, sm[0], w);
    }
    *amax = mx[0];
    *sum = sm[0];
    if (m < 16) { /* lane k * 16 / m to lane k */
        const __m512i lane = s_lanes();
        const __m512i at = _mm512_and_si512(_mm512_mullo_epi32(lane, _mm512_set1_epi32(16 / m)),
                                            _mm512_set1_epi32(15));
        *amax = _mm512_permutexvar_ps(at, *amax);
        *sum = _mm512_permutexvar_ps(at, *sum);
    }
}

/* The scales of blocks 0..n-1 (1 <= n <= m) of x, reduced as a group of
 * m: for block b, id[b] = qmax / amax (0, and d 0, where amax is below
 * qmax FLT_MIN, zero included; id 0 and d NaN where amax is NaN) and
 * (d, s) at ds[2b], as y's first two fields; the arrays have room for 16
 * blocks. */
S_DQ_INLINE void s_act_scales(const float *x, int n, int m, __m512 fq, float *id, float *ds) {
    __m512 amax, sum;
    s_act_reduce(x, n, m, &amax, &sum);
    /* as fi_quantize_q16x_ref: a block whose d would not be normal is zeros */
    const __m512 small = _mm512_mul_ps(fq, _mm512_set1_ps(FLT_MIN));
    __m512 d = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(amax, small, _CMP_NLT_UQ), amax, fq);
    _mm512_storeu_ps(id, _mm512_maskz_div_ps(_mm512_cmp_ps_mask(amax, small, _CMP_GE_OQ), fq, amax));
    /* (d, s) pairs of blocks 0..7, then 8..15 */
    const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
    _mm512_storeu_ps(ds, _mm512_permutex2var_ps(d, lo, sum));
    _mm512_storeu_ps(ds + 16, _mm512_permutex2var_ps(d, hi, sum));
}

/* The last n (1..15) blocks' scales, in the smallest group that holds them
 * (each m its own inlined copy, so the loops unroll). */
S_DQ static void s_act_scales_tail(const float *x, int n, __m512 fq, float *id, float *ds) {
    if (n > 8)
        s_act_scales(x, n, 16, fq, id, ds);
    else if (n > 4)
        s_act_scales(x, n, 8, fq, id, ds);
    else if (n > 2)
        s_act_scales(x, n, 4, fq, id, ds);
    else if (n == 2)
        s_act_scales(x, n, 2, fq, id, ds);
    else
        s_act_scales(x, n, 1, fq, id, ds);
}

_Static_assert(offsetof(fi_block_q16x, d) == 0 && offsetof(fi_block_q16x, s) == sizeof(float),
               "s_act_scales lays out d and s as y does");

/* One block: its scales ds (d, s) and its quants, with id = qmax / amax. */
S_INLINE void s_act_block(const float *x, const float *ds, float id, fi_block_q16x *y) {
    /* packs interleaves the two halves' quants by 128-bit lanes */
    const __m512i order = _mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7);
    __m512 vid = _mm512_set1_ps(id);
    __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x), vid));
    __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + 16), vid));
    _mm512_storeu_si512(y->qs, _mm512_permutexvar_epi64(order, _mm512_packs_epi32(q0, q1)));
    memcpy(y, ds, 2 * sizeof(float));
}

#define S_QCHUNK 128 /* blocks per pair of passes: 16 KiB of x, which stays in L1 */

/* Chunks of S_QCHUNK blocks: the scales in groups of 16 (and a tail),
 * then the blocks. Groups start at multiples of 16, so each group's 16
 * entries of id and ds fit. */
S_DQ static void s_quantize(const float *x, fi_block_q16x *y, int nb, int qmax) {
    const __m512 fq = _mm512_set1_ps((float)qmax);
    float id[S_QCHUNK], ds[2 * S_QCHUNK];
    for (int c = 0; c < nb; c += S_QCHUNK, x += (size_t)FI_QK * S_QCHUNK, y += S_QCHUNK) {
        int n = nb - c < S_QCHUNK ? nb - c : S_QCHUNK, g = 0;
        for (; g + 16 <= n; g += 16)
            s_act_scales(x + (size_t)FI_QK * g, 16, 16, fq, id + g, ds + 2 * g);
        if (g < n)
            s_act_scales_tail(x + (size_t)FI_QK * g, n - g, fq, id + g, ds + 2 * g);
#pragma GCC unroll 4
        for (int b = 0; b < n; b++)
            s_act_block(x + (size_t)FI_QK * b, ds + 2 * b, id[b], y + b);
    }
}

#if defined(FI_HAVE_AMX) && FI_HAVE_AMX
/* --- AMX ------------------------------------------------------------------
 *
 * With AMX-INT8 (Sapphire Rapids and later) the integer block sums of 16
 * rows x 16 tokens come from the tile unit, which multiplies bytes, so
 * each activation quant is split exactly into two bytes (s_split):
 *   Q4 (inputs within FI_Q16_QMAX_Q4 = 2039): x = 16 h + l, h = (x + 8)
 *     >> 4 in [-128, 127] and l in [-8, 7], both signed; the weights'
 *     nibbles q (0..15) are laid out as [16 q ; q] (16 q <= 240 is an
 *     unsigned byte), and one product of [h | l] (64 bytes) with them
 *     gives isum = sum (16 h + l) q, exact.
 *   Q8_0: x = 256 hi + lo (hi = x >> 8 signed, lo = x & 255 unsigned);
 *     isum = 256 (W . hi) + (W . lo), two products per block.
 * Both exact in 32 bits (|isum| < 2^28 as above). Q4 inputs quantised
 * with the full 16 bits (act_bits 16) go to the vector kernels instead.
 * The weights' block is the same 16-row dword transpose as above, which
 * is the tile unit's B layout (four consecutive k of a column per dword).
 * isum is then the very integer the vpdpwssd path computes, and it goes
 * through the same floating-point steps (s_tile's: v = float(isum) * d_x,
 * fma by d_w, fma of a * s), so the results are the same bits as the
 * one-token path's: batch invariance holds across the two paths. */
#define S_AMX __attribute__((target("amx-tile,amx-int8")))
#define S_AMX_INLINE static inline __attribute__((always_inline, target("amx-tile,amx-int8")))
#define S_AMX_NB 48 /* most blocks per row (1536 columns): the split quants live on the stack */

/* LDTILECFG's 64-byte operand, palette 1. */
typedef struct s_tilecfg {
    uint8_t palette;     /* 1 */
    uint8_t start_row;   /* 0 */
    uint8_t reserved[14];
    uint16_t colsb[16];  /* bytes per row of each tile */
    uint8_t rows[16];    /* rows of each tile */
} s_tilecfg;

/* Tiles, for T tokens (1..16) of a product of this kind. Q4: 2 the split
 * input [h | l] (T tokens x 64 bytes), 4 the weights [16 q ; q] (16 rows of
 * 4 elements x 16 weight rows), 0 the sums of even blocks and 5 those of
 * odd ones (T tokens x 16 rows, int32). Q8_0: 2 and 3 the high and low
 * bytes (T tokens x 32), 4 the weights (8 rows of 4 elements x 16 weight
 * rows), 0 and 1 the sums with each of even blocks, 5 and 6 of odd ones. */
S_AMX_INLINE void s_amx_config(int kind, int T) {
    s_tilecfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    c.rows[0] = c.rows[1] = c.rows[5] = c.rows[6] = (uint8_t)T;
    c.colsb[0] = c.colsb[1] = c.colsb[5] = c.colsb[6] = 64;
    c.rows[2] = c.rows[3] = (uint8_t)T;
    c.colsb[2] = c.colsb[3] = kind == S_Q8_0 ? 32 : 64;
    c.rows[4] = kind == S_Q8_0 ? 8 : 16;
    c.colsb[4] = 64;
    /* GCC 12's _tile_loadconfig tells the compiler it reads 8 bytes of
     * the operand, not 64, so the stores of the rows and widths could be
     * dropped as dead (ldtilecfg then faults): this makes all 64 live */
    __asm__ volatile("" : : "m"(c));
    _tile_loadconfig(&c);
}

/* One block's products: the input (tile 2, Q8_0 also 3) times the weights
 * (tile 4) into the sum tiles H (and L) (tile numbers are immediates). */
#define S_AMX_PRODUCTS(kind, H, L)  \
    do {                            \
        _tile_zero(H);              \
        if ((kind) == S_Q8_0) {     \
            _tile_zero(L);          \
            _tile_dpbssd(H, 2, 4);  \
            _tile_dpbusd(L, 3, 4);  \
        } else {                    \
            _tile_dpbsud(H, 2, 4);  \
        }                           \
    } while (0)

/* The sum tiles H (and L) stored to out[0] (and out[1]). */
#define S_AMX_STORE(kind, H, L, out)         \
    do {                                     \
        _tile_stored(H, (out)[0], 64);       \
        if ((kind) == S_Q8_0)                \
            _tile_stored(L, (out)[1], 64);   \
    } while (0)

/* Rows r..r+nr-1 (nr <= 16) times tokens k..k+T-1 (T <= 16, the tile
 * configuration's), whose quants are split in xt ([block][token][64]). */
S_AMX_INLINE void s_amx_rows(int kind, size_t bsz, const fi_mm_task *t, int r, int nr, int k, int T,
                             const uint8_t (*xt)[16][64]) {
    const size_t stride = t->w_stride;
    const uint8_t *w0 = t->w + (size_t)r * stride;
    const int nb = t->cols / FI_QK;
    const uint8_t *p[16];
    const __m512i vidx = s_rows(w0, stride, nr, p);
    const fi_block_q16x *xr[16];
    __m512 acc[16];
    for (int j = 0; j < T; j++) {
        xr[j] = (const fi_block_q16x *)(const void *)(t->x + (size_t)(k + j) * t->x_stride);
        acc[j] = _mm512_setzero_ps();
    }
    const uint8_t *pk = s_packed(t, r, nr);
    const size_t gb = 16 * bsz; /* bytes of one block of the 16 rows */
    _Alignas(64) uint8_t bt[3][16][64];
    _Alignas(64) int32_t cs[2][2][16][16]; /* [block & 1][hi, lo][token][row] */
    /* Software pipeline over four blocks: in step b the vector units lay
     * out the weights of block b+2 (a tile load straight after the stores
     * would wait for them to reach the cache), the tile unit starts on the
     * products of block b+1, the sums of block b (whose products began a
     * step ago, so the store need not wait for them) are stored, and the
     * vector units finish block b-1 (stored a step ago). Two sets of sum
     * tiles (0, 1 and 5, 6) and of stored sums alternate. Packed Q8_0
     * quants are already the tile unit's layout and go to it straight
     * from memory. */
    for (int b = -2; b <= nb; b++) {
        if (b + 2 < nb && !(pk && kind == S_Q8_0)) {
            uint8_t (*o)[64] = bt[(b + 2) % 3];
            __m512i D[8];
            s_quants(kind, p, pk ? pk + (size_t)(b + 2) * gb + S_QOFF(kind) : NULL, D);
            if (kind == S_Q8_0) {
                for (int q = 0; q < 8; q++)
                    _mm512_store_si512(o[q], D[q]);
            } else {
                /* [16 q ; q]: byte i of a block holds elements i (low
                 * nibble) and i + 16 (high). Masked first, the nibbles
                 * shift within their bytes (the bits that cross into a
                 * neighbour are the zeros the mask left): four vector
                 * operations per register of quants, not six. */
                const __m512i m4 = _mm512_set1_epi8(0x0f), h4 = _mm512_set1_epi8((char)0xf0);
                for (int q = 0; q < 4; q++) {
                    const __m512i lo = _mm512_and_si512(D[q], m4), hi = _mm512_and_si512(D[q], h4);
                    _mm512_store_si512(o[q], _mm512_slli_epi32(lo, 4));
                    _mm512_store_si512(o[4 + q], hi);
                    _mm512_store_si512(o[8 + q], lo);
                    _mm512_store_si512(o[12 + q], _mm512_srli_epi32(hi, 4));
                }
            }
            if (!pk)
                for (int i = 0; i < 16; i++)
                    p[i] += bsz;
        }
        if (b + 1 >= 0 && b + 1 < nb) {
            const int bn = b + 1, sb = bn & 1;
            _tile_loadd(2, xt[bn], 64);
            if (kind == S_Q8_0)
                _tile_loadd(3, &xt[bn][0][32], 64);
            if (pk && kind == S_Q8_0)
                _tile_loadd(4, pk + (size_t)bn * gb + S_QOFF(kind), 64);
            else
                _tile_loadd(4, bt[bn % 3], 64);
            if (sb == 0)
                S_AMX_PRODUCTS(kind, 0, 1);
            else
                S_AMX_PRODUCTS(kind, 5, 6);
        }
        if (b >= 0 && b < nb) {
            if ((b & 1) == 0)
                S_AMX_STORE(kind, 0, 1, cs[0]);
            else
                S_AMX_STORE(kind, 5, 6, cs[1]);
        }
        if (b < 1)
            continue;
        const int e = b - 1; /* the block finished in this step */
        {
            /* the next group of rows, a share per block: the weights
             * stream from memory while the tile unit works. Into L2 (T1):
             * decode-shaped products of 16 tokens measured ~3% faster
             * than with T0 (bench_kernels, 2 threads). */
            const char *q = (const char *)(pk ? pk : w0) + 16 * stride + (size_t)e * gb;
            for (size_t o = 0; o < gb; o += 64)
                _mm_prefetch(q + o, _MM_HINT_T1);
        }
        __m512 dw, aw;
        s_scales(kind, vidx, w0 + (size_t)e * bsz, pk ? pk + (size_t)e * gb : NULL, &dw, &aw);
        for (int j = 0; j < T; j++) {
            const fi_block_q16x *x = xr[j] + e;
            __m512i is = _mm512_load_si512(cs[e & 1][0][j]);
            if (kind == S_Q8_0)
                is = _mm512_add_epi32(_mm512_slli_epi32(is, 8), _mm512_load_si512(cs[e & 1][1][j]));
            /* from here exactly s_tile's steps */
            __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(is), _mm512_set1_ps(x->d));
            acc[j] = _mm512_fmadd_ps(v, dw, acc[j]);
            if (kind != S_Q8_0)
                acc[j] = _mm512_fmadd_ps(aw, _mm512_set1_ps(x->s), acc[j]);
        }
    }
    const __mmask16 m = (__mmask16)((1u << nr) - 1);
    for (int j = 0; j < T; j++)
        _mm512_mask_storeu_ps(t->y + (size_t)(k + j) * t->y_stride + r, m, acc[j]);
}

/* Token j of a tile of 16 (fi_q16_kernels.split), block by block: Q4
 * (|x| <= FI_Q16_QMAX_Q4) x = 16 h + l, h = (x + 8) >> 4 and l in [-8, 7],
 * both signed; otherwise x = 256 h + l, h = x >> 8 signed, l = x & 255
 * unsigned. h in bytes 0..31 of the token's 64, l in 32..63. */
static void s_split(const fi_block_q16x *x, int nb, uint8_t *tile, int j, int qmax) {
    uint8_t *o = tile + (size_t)j * 64;
    for (int b = 0; b < nb; b++, o += 16 * 64) {
        __m512i q = _mm512_loadu_si512(x[b].qs), h, l;
        if (qmax <= FI_Q16_QMAX_Q4) {
            h = _mm512_srai_epi16(_mm512_add_epi16(q, _mm512_set1_epi16(8)), 4);
            l = _mm512_sub_epi16(q, _mm512_slli_epi16(h, 4));
        } else {
            h = _mm512_srai_epi16(q, 8);
            l = q;
        }
        _mm256_storeu_si256((__m256i *)(void *)o, _mm512_cvtepi16_epi8(h));
        _mm256_storeu_si256((__m256i *)(void *)(o + 32), _mm512_cvtepi16_epi8(l));
    }
}

/* Tokens in tiles of 16 through the tile unit (rows in groups of 16), a
 * last tile of at least FI_Q16_AMX_MIN tokens too, fewer as s_mm's tiles;
 * too few tokens, or rows too long for the stack buffer, entirely as s_mm.
 * T is a constant for full tiles, so their loops unroll. */
S_AMX_INLINE void s_amx_tile(int kind, size_t bsz, const fi_mm_task *t, int r0, int r1, int k, int T,
                             uint8_t *own) {
    const int nb = t->cols / FI_QK;
    const uint8_t *tile = t->xs ? t->xs + (size_t)(k / 16) * FI_Q16_TILE_BYTES(nb) : own;
    if (!t->xs)
        for (int j = 0; j < T; j++)
            s_split((const fi_block_q16x *)(const void *)(t->x + (size_t)(k + j) * t->x_stride), nb, own, j,
                    kind == S_Q8_0 ? FI_Q16_QMAX : FI_Q16_QMAX_Q4);
    const uint8_t (*xt)[16][64] = (const uint8_t (*)[16][64])(const void *)tile;
    for (int r = r0; r < r1; r += 16)
        s_amx_rows(kind, bsz, t, r, r1 - r < 16 ? r1 - r : 16, k, T, xt);
}

S_AMX_INLINE void s_mm_amx(int kind, size_t bsz, const fi_mm_task *t, int r0, int r1) {
    const int nb = t->cols / FI_QK;
    const fi_dtype type = kind == S_Q8_0 ? FI_DTYPE_Q8_0 : FI_DTYPE_Q4_0; /* Q4_0 stands for both Q4 */
    if (t->n < FI_Q16_AMX_MIN || nb > S_AMX_NB || !fi_q16_tiles(type, t->qmax, t->xtok)) {
        s_mm(kind, bsz, t, r0, r1);
        return;
    }
    /* the split tile: the caller's (made once per call), or our own */
    _Alignas(64) uint8_t own[FI_Q16_TILE_BYTES(S_AMX_NB)];
    int k = 0;
    if (t->n >= 16) {
        s_amx_config(kind, 16);
        for (; k + 16 <= t->n; k += 16)
            s_amx_tile(kind, bsz, t, r0, r1, k, 16, own);
    }
    int rest = t->n - k;
    if (rest >= FI_Q16_AMX_MIN) {
        s_amx_config(kind, rest);
        s_amx_tile(kind, bsz, t, r0, r1, k, rest, own);
        k = t->n;
    }
    _tile_release();
    if (k < t->n)
        for (int rb = r0; rb < r1; rb += S_RB) {
            int re = rb + S_RB < r1 ? rb + S_RB : r1;
            for (int r = rb; r < re; r += 16)
                s_tokens(kind, bsz, t, r, re - r < 16 ? re - r : 16, k, 0, 0); /* xtok 0, as above */
        }
}

S_AMX static void s_mm_q4_0_amx(const fi_mm_task *t, int r0, int r1) {
    s_mm_amx(S_Q4_0, sizeof(fi_block_q4_0), t, r0, r1);
}
S_AMX static void s_mm_q4_1_amx(const fi_mm_task *t, int r0, int r1) {
    s_mm_amx(S_Q4_1, sizeof(fi_block_q4_1), t, r0, r1);
}
S_AMX static void s_mm_q8_0_amx(const fi_mm_task *t, int r0, int r1) {
    s_mm_amx(S_Q8_0, sizeof(fi_block_q8_0), t, r0, r1);
}

/* Whether this process may use the tile unit: the processor has AMX-TILE
 * and AMX-INT8 and Linux grants the tile data state (arch_prctl
 * ARCH_REQ_XCOMP_PERM, which is per process and idempotent). */
static int s_amx_usable(void) {
    unsigned a, b, c, d;
    /* CPUID.(7,0):EDX bit 24 AMX-TILE, bit 25 AMX-INT8 (not every compiler
     * knows them as __builtin_cpu_supports names) */
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 24) & 1u) || !((d >> 25) & 1u))
        return 0;
#if defined(__linux__)
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
#else
    return 0;
#endif
}
#endif /* FI_HAVE_AMX */

static void s_mm_q4_0(const fi_mm_task *t, int r0, int r1) {
    s_mm(S_Q4_0, sizeof(fi_block_q4_0), t, r0, r1);
}
static void s_mm_q4_1(const fi_mm_task *t, int r0, int r1) {
    s_mm(S_Q4_1, sizeof(fi_block_q4_1), t, r0, r1);
}
static void s_mm_q8_0(const fi_mm_task *t, int r0, int r1) {
    s_mm(S_Q8_0, sizeof(fi_block_q8_0), t, r0, r1);
}

/* Whether the processor has AVX512DQ, for the quantiser (CPUID.(7,0):EBX
 * bit 17; every AVX512-VNNI processor so far has it). */
static int s_dq_usable(void) {
    unsigned a, b, c, d;
    return __get_cpuid_count(7, 0, &a, &b, &c, &d) && ((b >> 17) & 1u);
}

void fi_q16_kernels_avx512(fi_q16_kernels *k) {
    if (s_dq_usable())
        k->quantize = s_quantize; /* else the AVX2 one stays */
    k->mm_q4_0 = s_mm_q4_0;
    k->mm_q4_1 = s_mm_q4_1;
    k->mm_q8_0 = s_mm_q8_0;
    k->split = NULL;
    k->pack = fi_q16_pack;
}

int fi_q16_kernels_avx512_amx(fi_q16_kernels *k) {
#if defined(FI_HAVE_AMX) && FI_HAVE_AMX
    if (s_amx_usable()) {
        k->mm_q4_0 = s_mm_q4_0_amx;
        k->mm_q4_1 = s_mm_q4_1_amx;
        k->mm_q8_0 = s_mm_q8_0_amx;
        k->split = s_split;
        return 0;
    }
#endif
    (void)k;
    return -1;
}

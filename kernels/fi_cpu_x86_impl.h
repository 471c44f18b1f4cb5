/*
 * fi_cpu_x86_impl.h - the x86 kernels, written once and compiled three
 * times: by fi_cpu_avx2.c (AVX2 + FMA + F16C), by fi_cpu_avxvnni.c (the same
 * plus AVX-VNNI, whose vpdpbusd replaces maddubs + madd and does not
 * saturate) and by fi_cpu_avx512.c (AVX512-VNNI, which adds 512-bit
 * quantised kernels on top). Include it after defining FI_X86_VNNI to 0,
 * 1 or 2; it defines only static functions and s_x86_fill(), which the
 * including file calls.
 *
 * Quantised matmul, one 32-element block at a time, activations in
 * fi_block_q8x (d, s = d*sum(q), 32 int8):
 *   Q4_0: dw*dx*sum(q*x) - 8*dw*s      (q = nibble, 0..15, unsigned)
 *   Q4_1: dw*dx*sum(q*x) + m*s
 *   Q8_0: dw*dx*sum(w*x)               (|w| . x*sign(w), or in the VNNI
 *                                       decode (w^0x80) . x - 128*dw*s)
 *
 * They hold eight rows per register, one row per 32-bit lane (see
 * "quantised products" below), and the same tile serves one token and
 * several, so a (row, token) result is the same bits alone or in any
 * batch, on any split of the rows, as the scheduler needs. One token
 * streams each weight once from L3/DRAM and prefetches the groups ahead.
 */
#ifndef FI_X86_VNNI
#error "define FI_X86_VNNI before including fi_cpu_x86_impl.h"
#endif

#include "fi_kernels_impl.h"

#include <immintrin.h>
#include <float.h>
#include <math.h>
#include <stddef.h>

#include "fi_cpu_lanes8_impl.h"

/* FI_X86_VNNI: 0 AVX2 maddubs + madd; 1 AVX-VNNI (VEX vpdpbusd); 2
 * AVX512-VNNI + VL (the EVEX encoding of the same 256-bit instruction). */
#if FI_X86_VNNI == 1
#define S_DPBUSD256 _mm256_dpbusd_avx_epi32
#elif FI_X86_VNNI == 2
#define S_DPBUSD256 _mm256_dpbusd_epi32
#endif

#define S_INLINE static inline __attribute__((always_inline))
#define S_RB 16 /* float weights: rows per sub-block when several tokens share a call */
#define S_RND (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

S_INLINE float s_hsum(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_movehdup_ps(a));
    return _mm_cvtss_f32(a);
}

S_INLINE uint32_t s_ld32(const void *p) {
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* --- activation quantiser (same arithmetic as fi_quantize_q8x_ref) ----- */

static void s_quantize_q8x(const float *x, fi_block_q8x *y, int nb) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int i = 0; i < nb; i++) {
        const float *v = x + (size_t)i * FI_QK;
        __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8);
        __m256 v2 = _mm256_loadu_ps(v + 16), v3 = _mm256_loadu_ps(v + 24);
        __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                                 _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        h = _mm_max_ss(h, _mm_movehdup_ps(h));
        float amax = _mm_cvtss_f32(h);
        const float lo = 127.0f * FLT_MIN; /* as fi_quantize_q8x_ref */
        float id = amax >= lo ? 127.0f / amax : 0.0f;
        __m256 vid = _mm256_set1_ps(id);
        __m256i i0 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v0, vid), S_RND));
        __m256i i1 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v1, vid), S_RND));
        __m256i i2 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v2, vid), S_RND));
        __m256i i3 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v3, vid), S_RND));
        __m256i s = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        s4 = _mm_hadd_epi32(s4, s4);
        s4 = _mm_hadd_epi32(s4, s4);
        int sum = _mm_cvtsi128_si32(s4);
        /* pack 32 int32 -> 32 int8 and undo the per-lane interleave */
        __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
        p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)y[i].qs, p);
        y[i].d = !(amax < lo) ? amax / 127.0f : 0.0f;
        y[i].s = y[i].d * (float)sum;
    }
}

/* fi_kv_quant_ref, 8 values at a time (the same bits: the same
 * operations, lane by lane); n % 8 values through the reference. */
static float s_kv_quant(int8_t *q, const float *x, int n) {
    if (n & 7)
        return fi_kv_quant_ref(q, x, n);
    const __m256 sign = _mm256_set1_ps(-0.0f), big = _mm256_set1_ps(FLT_MAX);
    __m256 m = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
    for (int j = 0; j < n; j += 8) {
        __m256 a = _mm256_andnot_ps(sign, _mm256_loadu_ps(x + j));
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, big, _CMP_NLE_UQ)); /* inf or NaN */
        m = _mm256_max_ps(m, a);
    }
    if (_mm256_movemask_ps(bad)) {
        memset(q, 0, (size_t)n);
        return NAN;
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float amax = _mm_cvtss_f32(h), lo = 127.0f * FLT_MIN;
    const __m256 vid = _mm256_set1_ps(amax >= lo ? 127.0f / amax : 0.0f);
    for (int j = 0; j < n; j += 8) {
        __m256i i = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + j), vid), S_RND));
        __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(i), _mm256_extracti128_si256(i, 1));
        _mm_storel_epi64((__m128i *)(void *)(q + j), _mm_packs_epi16(w, w));
    }
    return amax >= lo ? amax / 127.0f : 0.0f;
}

/* --- quantised products: eight rows per register ---------------------------
 *
 * One row per 32-bit lane (fi_cpu_lanes8_impl.h: the backend's packed copy,
 * or rows gathered into its layout), so a block's integer dot products need
 * no horizontal sums: lane r of D[k] holds quant bytes 4k..4k+3 of row r,
 * which for Q4 are elements 4k..4k+3 (low nibbles) and 16+4k..19+4k (high
 * nibbles), for Q8_0 elements 4k..4k+3; each pairs with one dword of the
 * token's quants broadcast from memory. Without VNNI, vpmaddubsw leaves
 * 16-bit pair sums, |15 * 127 * 2| per pair, so a Q4 block's eight of them
 * add up in 16 bits (<= 30480) before one vpmaddwd widens them; Q8_0's
 * pairs reach 2 * 128 * 127 and are widened one by one (|w| against x
 * with w's sign). With VNNI, vpdpbusd does each step; Q8_0's signed quants
 * become unsigned as w ^ 0x80 = w + 128, and the 128 * sum(x) that adds
 * is taken off with the offset term, a = -128 dw.
 *
 * Batch invariance: per block, in the row's lane, v = float(isum) * dx,
 * acc = fma(v, dw, acc), then (where a is not 0) acc = fma(a, s, acc);
 * isum is exact in any order, and lanes do not mix (a partial half repeats
 * its last row), so a token's row is the same bits alone or in a batch of
 * any size, on any thread split, packed or not.
 *
 * Why: the kernels this replaced held two rows per register and ended
 * every (row, token) with a horizontal sum, and a batch's tokens re-read
 * each block's weights: on the 2-core AMD EPYC (Zen 3) machine the default
 * model's decode-shaped products for 16 tokens took 34.2 ms at 2 threads
 * (build/tests/bench_kernels 2, BENCH_DECODE_ONLY=1 BENCH_ACT_BITS=8). */
#define S_L8_PT 8        /* tokens per tile */
#define S_L8_RB 32       /* rows per sub-block when several tokens share a call */
#define S_L8_PF_GROUPS 2 /* prefetch this many 16-row groups ahead */

/* The token's quants 4c..4c+3 in every lane. */
_Static_assert(offsetof(fi_block_q8x, qs) % 4 == 0, "q8x quants start on a dword");
S_INLINE __m256i s_l8_x4(const fi_block_q8x *x, int c) {
    return fi_l8_bcast32(x->qs + 4 * c);
}

/* Q4: dword c of the quants of H halves of eight rows (s[h]) against
 * tokens x[0..T-1] (block b): 16-bit pair sums added to p[h][j] (no
 * VNNI), or 32-bit sums (VNNI); each broadcast dword of the token serves
 * every half. */
S_INLINE void s_l8_q4_step(const fi_l8_block *s, int H, const fi_block_q8x *const *x, int b, int T, int c,
                           __m256i p[2][S_L8_PT]) {
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    __m256i lo[2], hi[2];
    for (int h = 0; h < H; h++) {
        __m256i D = _mm256_loadu_si256((const __m256i *)(const void *)(s[h].q + c * s[h].qstep));
        lo[h] = _mm256_and_si256(D, m4);
        hi[h] = _mm256_and_si256(_mm256_srli_epi16(D, 4), m4);
    }
    for (int j = 0; j < T; j++) {
        const __m256i x0 = s_l8_x4(x[j] + b, c), x1 = s_l8_x4(x[j] + b, 4 + c);
        for (int h = 0; h < H; h++) {
#if FI_X86_VNNI
            p[h][j] = S_DPBUSD256(S_DPBUSD256(p[h][j], lo[h], x0), hi[h], x1);
#else
            __m256i q = _mm256_add_epi16(_mm256_maddubs_epi16(lo[h], x0), _mm256_maddubs_epi16(hi[h], x1));
            p[h][j] = _mm256_add_epi16(p[h][j], q);
#endif
        }
    }
}

/* Q8_0: dword c of the quants of H halves against tokens x[0..T-1]
 * (block b), added to isum[h][j]. */
S_INLINE void s_l8_q8_step(const fi_l8_block *s, int H, const fi_block_q8x *const *x, int b, int T, int c,
                           __m256i isum[2][S_L8_PT]) {
    __m256i W[2];
#if FI_X86_VNNI
    for (int h = 0; h < H; h++)
        W[h] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(const void *)(s[h].q + c * s[h].qstep)),
                                _mm256_set1_epi8((char)0x80));
    for (int j = 0; j < T; j++) {
        const __m256i x0 = s_l8_x4(x[j] + b, c);
        for (int h = 0; h < H; h++)
            isum[h][j] = S_DPBUSD256(isum[h][j], W[h], x0);
    }
#else
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i A[2];
    for (int h = 0; h < H; h++) {
        W[h] = _mm256_loadu_si256((const __m256i *)(const void *)(s[h].q + c * s[h].qstep));
        A[h] = _mm256_abs_epi8(W[h]); /* |-128| is 128 unsigned */
    }
    for (int j = 0; j < T; j++) {
        const __m256i x0 = s_l8_x4(x[j] + b, c);
        for (int h = 0; h < H; h++) {
            __m256i q = _mm256_maddubs_epi16(A[h], _mm256_sign_epi8(x0, W[h]));
            isum[h][j] = _mm256_add_epi32(isum[h][j], _mm256_madd_epi16(q, ones));
        }
    }
#endif
}

/* The integer dot products of H halves of eight rows (s[h]) with tokens
 * x[0..T-1] (block b) in isum[h][j], lane r for row r. */
S_INLINE void s_l8_dots(fi_dtype ty, const fi_l8_block *s, int H, const fi_block_q8x *const *x, int b, int T,
                        __m256i isum[2][S_L8_PT]) {
    for (int h = 0; h < H; h++)
        for (int j = 0; j < T; j++)
            isum[h][j] = _mm256_setzero_si256();
    if (ty == FI_DTYPE_Q8_0) {
        FI_L8_STEPS(8, T, c, s_l8_q8_step(s, H, x, b, T, c, isum));
        return;
    }
    FI_L8_STEPS(4, T, c, s_l8_q4_step(s, H, x, b, T, c, isum));
#if !FI_X86_VNNI
    for (int h = 0; h < H; h++)
        for (int j = 0; j < T; j++)
            isum[h][j] = _mm256_madd_epi16(isum[h][j], _mm256_set1_epi16(1));
#endif
}

/* Rows r..r+nr-1 (nr <= 8 H) times tokens k..k+T-1, H halves of eight
 * rows sharing each token's loads; pf: prefetch the group S_L8_PF_GROUPS
 * ahead (the first pass over these rows). */
S_INLINE void s_l8_tile(fi_dtype ty, size_t bsz, const fi_mm_task *t, int r, int nr, int r1, int k, int H,
                        int T, int pf) {
    const int nb = t->cols / FI_QK;
    const fi_block_q8x *xr[S_L8_PT];
    fi_l8_rows rw;
    __m256 acc[2][S_L8_PT];
    fi_l8_rows_of(t, r, nr, r1, H, &rw);
    for (int j = 0; j < T; j++) {
        xr[j] = (const fi_block_q8x *)(const void *)(t->x + (size_t)(k + j) * t->x_stride);
        for (int h = 0; h < H; h++)
            acc[h][j] = _mm256_setzero_ps();
    }
    const uint8_t *ahead = pf && r % 16 == 0 && rw.pk[0] ? rw.pk[0] + S_L8_PF_GROUPS * 16 * t->w_stride : NULL;
    _Alignas(32) uint8_t buf[2][FI_L8_GATHER_BYTES];
    for (int b = 0; b < nb; b++) {
        fi_l8_prefetch(ahead, bsz, b);
        fi_l8_block s[2];
        __m256 dw[2], aw[2];
        for (int h = 0; h < H; h++) {
            s[h] = fi_l8_block_of(ty, bsz, &rw, r, h, b, buf[h]);
            fi_l8_scales(ty, s[h], &dw[h], &aw[h]);
#if FI_X86_VNNI
            if (ty == FI_DTYPE_Q8_0)
                aw[h] = _mm256_mul_ps(dw[h], _mm256_set1_ps(-128.0f)); /* exact */
#endif
        }
#if FI_X86_VNNI
        const int offset = 1;
#else
        const int offset = ty != FI_DTYPE_Q8_0;
#endif
        __m256i isum[2][S_L8_PT];
        s_l8_dots(ty, s, H, xr, b, T, isum);
        for (int h = 0; h < H; h++)
            for (int j = 0; j < T; j++)
                acc[h][j] = fi_l8_accum(acc[h][j], isum[h][j], xr[j][b].d, xr[j][b].s, dw[h], aw[h], offset);
    }
    for (int h = 0; h < H; h++)
        for (int j = 0; j < T; j++)
            fi_l8_store(t->y + (size_t)(k + j) * t->y_stride + r + 8 * h, acc[h][j], rw.nh[h]);
}

#if !FI_X86_VNNI
/* s_l8_tile for several tokens where the eight rows are a packed half
 * (all full groups of a call's rows): the block's pointers step by a
 * constant, nothing is gathered, and each token's sums (16-bit for Q4,
 * 32-bit for Q8_0) stay in a register as one chain of adds. The empty asm
 * statements pin that order: without them GCC reassociates each step's
 * products and the running sum into a tree, with a register copy per
 * token and step. The same integer sums and the same float steps
 * (fi_l8_accum) as s_l8_tile, so the same bits. Sixteen tokens' products
 * (one thread, weights in cache, the default model's shapes): Q4_1
 * 1.15-1.30x s_l8_tile on the 2-core AMD EPYC (Zen 3) machine, alternated
 * in one process. */
S_INLINE void s_l8_tile_pk(fi_dtype ty, size_t bsz, const fi_mm_task *t, int r, int k, int T, int pf) {
    const int nb = t->cols / FI_QK;
    const uint8_t *pk = t->wp + (size_t)(r & ~15) * t->w_stride; /* the packed group */
    const int half = (r >> 3) & 1;
    const uint8_t *ahead = pf && half == 0 ? pk + S_L8_PF_GROUPS * 16 * t->w_stride : NULL;
    const fi_block_q8x *xr[S_L8_PT];
    __m256 acc[S_L8_PT];
    for (int j = 0; j < T; j++) {
        xr[j] = (const fi_block_q8x *)(const void *)(t->x + (size_t)(k + j) * t->x_stride);
        acc[j] = _mm256_setzero_ps();
    }
    const __m256i m4 = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    for (int b = 0; b < nb; b++) {
        fi_l8_prefetch(ahead, bsz, b);
        const fi_l8_block blk = fi_l8_half(ty, pk, bsz, b, half);
        const uint8_t *pq = blk.q;
        __m256 dw, aw;
        fi_l8_scales(ty, blk, &dw, &aw);
        __m256i p[S_L8_PT];
        for (int j = 0; j < T; j++)
            p[j] = _mm256_setzero_si256();
        if (ty == FI_DTYPE_Q8_0) {
            /* signed bytes: |w| against x with w's sign, each pair sum
             * widened at once (two would pass 16 bits) */
            _Pragma("GCC unroll 1") for (int c = 0; c < 8; c++) {
                const __m256i W = _mm256_loadu_si256((const __m256i *)(const void *)(pq + 64 * c));
                const __m256i A = _mm256_abs_epi8(W); /* |-128| is 128 unsigned */
                for (int j = 0; j < T; j++) {
                    const __m256i q = _mm256_maddubs_epi16(A, _mm256_sign_epi8(s_l8_x4(xr[j] + b, c), W));
                    p[j] = _mm256_add_epi32(p[j], _mm256_madd_epi16(q, ones));
                    __asm__("" : "+x"(p[j]));
                }
            }
            for (int j = 0; j < T; j++)
                acc[j] = fi_l8_accum(acc[j], p[j], xr[j][b].d, xr[j][b].s, dw, aw, 0);
            continue;
        }
        _Pragma("GCC unroll 1") for (int c = 0; c < 4; c++) {
            const __m256i D = _mm256_loadu_si256((const __m256i *)(const void *)(pq + 64 * c));
            const __m256i lo = _mm256_and_si256(D, m4), hi = _mm256_and_si256(_mm256_srli_epi16(D, 4), m4);
            for (int j = 0; j < T; j++) {
                const __m256i x0 = s_l8_x4(xr[j] + b, c), x1 = s_l8_x4(xr[j] + b, 4 + c);
                p[j] = _mm256_add_epi16(p[j], _mm256_maddubs_epi16(lo, x0));
                __asm__("" : "+x"(p[j]));
                p[j] = _mm256_add_epi16(p[j], _mm256_maddubs_epi16(hi, x1));
                __asm__("" : "+x"(p[j]));
            }
        }
        for (int j = 0; j < T; j++)
            acc[j] = fi_l8_accum(acc[j], _mm256_madd_epi16(p[j], ones), xr[j][b].d, xr[j][b].s, dw, aw, 1);
    }
    for (int j = 0; j < T; j++)
        _mm256_storeu_ps(t->y + (size_t)(k + j) * t->y_stride + r, acc[j]);
}
#endif

/* s_l8_tile, or s_l8_tile_pk where it applies. */
S_INLINE void s_l8_tile_any(fi_dtype ty, size_t bsz, const fi_mm_task *t, int r, int nr, int r1, int k, int H,
                            int T, int pf) {
#if !FI_X86_VNNI
    if (FI_L8_PACKED_TILES && H == 1 && T > 1 && fi_l8_packed(t, r, nr, r1)) {
        s_l8_tile_pk(ty, bsz, t, r, k, T, pf);
        return;
    }
#endif
    s_l8_tile(ty, bsz, t, r, nr, r1, k, H, T, pf);
}

FI_L8_DEFINE_MM(s_mm_quant, s_l8_tile_any, S_L8_PT, S_L8_RB)

static void s_mm_q4_0(const fi_mm_task *t, int r0, int r1) {
    s_mm_quant(FI_DTYPE_Q4_0, sizeof(fi_block_q4_0), t, r0, r1);
}

static void s_mm_q4_1(const fi_mm_task *t, int r0, int r1) {
    s_mm_quant(FI_DTYPE_Q4_1, sizeof(fi_block_q4_1), t, r0, r1);
}

static void s_mm_q8_0(const fi_mm_task *t, int r0, int r1) {
    s_mm_quant(FI_DTYPE_Q8_0, sizeof(fi_block_q8_0), t, r0, r1);
}

/* --- float weights -------------------------------------------------------- */

/* 8 weights starting at element c of a row of type ty, as floats. */
S_INLINE __m256 s_wload8(int ty, const uint8_t *row, int c) {
    if (ty == FI_DTYPE_F32)
        return _mm256_loadu_ps((const float *)row + c);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)row + c));
    if (ty == FI_DTYPE_F16)
        return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

S_INLINE float s_wscalar(int ty, const uint8_t *row, int c) {
    if (ty == FI_DTYPE_F32)
        return ((const float *)row)[c];
    uint16_t h;
    memcpy(&h, row + (size_t)c * 2, sizeof h);
    return ty == FI_DTYPE_F16 ? fi_h2f(h) : fi_bf2f(h);
}

/* Rows r..r+R-1 times tokens k..k+T-1; R*T <= 4. */
S_INLINE void s_ftile(int ty, const fi_mm_task *t, int r, int k, int R, int T) {
    const uint8_t *wr[4];
    const float *xr[4];
    __m256 acc[4][4];
    for (int i = 0; i < R; i++)
        wr[i] = t->w + (size_t)(r + i) * t->w_stride;
    for (int j = 0; j < T; j++)
        xr[j] = (const float *)(t->x + (size_t)(k + j) * t->x_stride);
    for (int i = 0; i < R; i++)
        for (int j = 0; j < T; j++)
            acc[i][j] = _mm256_setzero_ps();
    int c = 0;
    for (; c + 8 <= t->cols; c += 8) {
        for (int i = 0; i < R; i++) {
            __m256 w = s_wload8(ty, wr[i], c);
            for (int j = 0; j < T; j++)
                acc[i][j] = _mm256_fmadd_ps(w, _mm256_loadu_ps(xr[j] + c), acc[i][j]);
        }
    }
    for (int i = 0; i < R; i++)
        for (int j = 0; j < T; j++) {
            float v = s_hsum(acc[i][j]);
            for (int cc = c; cc < t->cols; cc++)
                v += s_wscalar(ty, wr[i], cc) * xr[j][cc];
            t->y[(size_t)(k + j) * t->y_stride + r + i] = v;
        }
}

S_INLINE void s_mm_float(int ty, const fi_mm_task *t, int r0, int r1) {
    for (int rb = r0; rb < r1; rb += S_RB) {
        int re = rb + S_RB < r1 ? rb + S_RB : r1;
        int k = 0;
        for (; k + 4 <= t->n; k += 4)
            for (int r = rb; r < re; r++)
                s_ftile(ty, t, r, k, 1, 4);
        for (; k < t->n; k++) {
            int r = rb;
            for (; r + 4 <= re; r += 4)
                s_ftile(ty, t, r, k, 4, 1);
            for (; r < re; r++)
                s_ftile(ty, t, r, k, 1, 1);
        }
    }
}

static void s_mm_f32(const fi_mm_task *t, int r0, int r1) {
    s_mm_float(FI_DTYPE_F32, t, r0, r1);
}

static void s_mm_f16(const fi_mm_task *t, int r0, int r1) {
    s_mm_float(FI_DTYPE_F16, t, r0, r1);
}

static void s_mm_bf16(const fi_mm_task *t, int r0, int r1) {
    s_mm_float(FI_DTYPE_BF16, t, r0, r1);
}

/* --- attention helpers ------------------------------------------------------ */

/* 8 fp16 values as floats. */
S_INLINE __m256 s_h8(const uint16_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)p));
}

/* Heads and rows at which the scores are tiled: S_AG heads x 4 rows make
 * 12 accumulators, which with the converted row fit the 16 ymm registers. */
#define S_AG 3

/* Cache rows are bytes here: k points at a KV head's values in the first
 * row, rows are `stride` bytes apart, and Q8 (a compile-time 0 or 1) says
 * which format they are in: 0, fp16 (FI_KV_ROW_F16); 1, int8 quants
 * whose head scale is the float `soff` bytes after the pointer given
 * (FI_KV_ROW_Q8). A Q8 score is (dot * row scale) * scale, a Q8 weight
 * s * row scale: the scale is applied once per row, not per value. */

/* 8 values of a row from element d on, as floats. */
S_INLINE __m256 s_kv8(const uint8_t *row, int d, const int Q8) {
    if (Q8)
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)(row + d))));
    return s_h8((const uint16_t *)(const void *)row + d);
}

/* A Q8 row's scale. */
S_INLINE float s_kv_scale(const uint8_t *row, size_t soff) {
    float f;
    memcpy(&f, row + soff, sizeof f);
    return f;
}

/* Scores of G heads (G <= S_AG) against rows 0..nr-1 of k (1 <= nr <= 4).
 * Rows past nr repeat the last one and are dropped, so that every row goes
 * through the same sums whatever nr is. */
S_INLINE void s_att_dots4(float *s, size_t ss, const float *q, const int G, const uint8_t *k,
                          size_t stride, size_t soff, int nr, int hd, __m128 vs, const int Q8) {
    const uint8_t *kr[4];
    __m256 a[S_AG][4];
    for (int r = 0; r < 4; r++) {
        kr[r] = k + (size_t)(r < nr ? r : nr - 1) * stride;
        for (int g = 0; g < G; g++)
            a[g][r] = _mm256_setzero_ps();
    }
    __m128 ks = _mm_set1_ps(1.0f);
    if (Q8)
        ks = _mm_setr_ps(s_kv_scale(kr[0], soff), s_kv_scale(kr[1], soff), s_kv_scale(kr[2], soff),
                         s_kv_scale(kr[3], soff));
    for (int d = 0; d < hd; d += 8)
        for (int r = 0; r < 4; r++) {
            __m256 kv = s_kv8(kr[r], d, Q8);
            for (int g = 0; g < G; g++)
                a[g][r] = _mm256_fmadd_ps(_mm256_loadu_ps(q + (size_t)g * hd + d), kv, a[g][r]);
        }
    for (int g = 0; g < G; g++) {
        __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a[g][0], a[g][1]), _mm256_hadd_ps(a[g][2], a[g][3]));
        __m128 r = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
        r = _mm_mul_ps(Q8 ? _mm_mul_ps(r, ks) : r, vs);
        if (nr == 4) {
            _mm_storeu_ps(s + g * ss, r);
        } else {
            float t[4];
            _mm_storeu_ps(t, r);
            memcpy(s + g * ss, t, (size_t)nr * sizeof(float));
        }
    }
}

#ifdef __AVX512F__
/* 512-bit attention helpers (the avx512 flavour), for head_dim a multiple
 * of 16: a K or V row of 64 values is four vcvtph2ps. */

/* 16 fp16 values as floats. */
S_INLINE __m512 s_h16(const uint16_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)p));
}

/* 16 values of a row from element d on, as floats (s_kv8). */
S_INLINE __m512 s_kv16(const uint8_t *row, int d, const int Q8) {
    if (Q8)
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(const void *)(row + d))));
    return s_h16((const uint16_t *)(const void *)row + d);
}

/* [sum(a[0]), ..., sum(a[7])]: a transposition tree (each step adds two
 * shuffles of a pair of registers), 25 instructions for the 8 sums. */
S_INLINE __m256 s_hsum8x16(const __m512 a[8]) {
    __m512 x[4];
    for (int i = 0; i < 4; i++) /* [a(2i): 8 partial sums | a(2i+1): 8] */
        x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xee));
    /* [a0: 4 | a1: 4 | a2: 4 | a3: 4], the same for a4..a7 */
    __m512 y0 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x88), _mm512_shuffle_f32x4(x[0], x[1], 0xdd));
    __m512 y1 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], 0x88), _mm512_shuffle_f32x4(x[2], x[3], 0xdd));
    /* 128-bit lane k: [ak: 2, a(k+4): 2], then [ak, a(k+4), ak, a(k+4)] */
    __m512 z = _mm512_add_ps(_mm512_shuffle_ps(y0, y1, 0x88), _mm512_shuffle_ps(y0, y1, 0xdd));
    z = _mm512_add_ps(_mm512_shuffle_ps(z, z, 0x88), _mm512_shuffle_ps(z, z, 0xdd));
    const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_castps512_ps256(_mm512_permutexvar_ps(idx, z));
}

/* Scores of G heads (G <= S_AG) against rows 0..nr-1 of k (1 <= nr <= 8),
 * 16 values per step: 8*G accumulators, the K row and G query registers
 * fit the 32 zmm registers. Rows past nr repeat the last one and are
 * dropped, as in s_att_dots4. */
S_INLINE void s_att_dots8_512(float *s, size_t ss, const float *q, const int G, const uint8_t *k,
                              size_t stride, size_t soff, int nr, int hd, __m256 vs, const int Q8) {
    const uint8_t *kr[8];
    __m512 a[S_AG][8];
    float ksr[8];
    for (int r = 0; r < 8; r++) {
        kr[r] = k + (size_t)(r < nr ? r : nr - 1) * stride;
        ksr[r] = Q8 ? s_kv_scale(kr[r], soff) : 1.0f;
        for (int g = 0; g < G; g++)
            a[g][r] = _mm512_setzero_ps();
    }
    const __m256 ks = _mm256_loadu_ps(ksr);
    for (int d = 0; d < hd; d += 16) {
        __m512 qv[S_AG];
        for (int g = 0; g < G; g++)
            qv[g] = _mm512_loadu_ps(q + (size_t)g * hd + d);
        for (int r = 0; r < 8; r++) {
            __m512 kv = s_kv16(kr[r], d, Q8);
            for (int g = 0; g < G; g++)
                a[g][r] = _mm512_fmadd_ps(qv[g], kv, a[g][r]);
        }
    }
    for (int g = 0; g < G; g++) {
        __m256 h = s_hsum8x16(a[g]);
        _mm256_mask_storeu_ps(s + g * ss, (__mmask8)((1u << nr) - 1u), _mm256_mul_ps(Q8 ? _mm256_mul_ps(h, ks) : h, vs));
    }
}

/* Columns [0, 16*C) of G heads: G*C accumulators over all the rows. */
S_INLINE void s_att_wsum_512(float *o, const float *s, size_t ss, const int G, const int C,
                             const uint8_t *v, size_t stride, size_t soff, int np, int hd, const int Q8) {
    __m512 a[S_AG][4];
    for (int g = 0; g < G; g++)
        for (int c = 0; c < C; c++)
            a[g][c] = _mm512_loadu_ps(o + (size_t)g * hd + 16 * c);
    for (int i = 0; i < np; i++) {
        const uint8_t *vr = v + (size_t)i * stride;
        const float vsc = Q8 ? s_kv_scale(vr, soff) : 1.0f;
        __m512 vv[4];
        for (int c = 0; c < C; c++)
            vv[c] = s_kv16(vr, 16 * c, Q8);
        for (int g = 0; g < G; g++) {
            __m512 w = _mm512_set1_ps(Q8 ? s[g * ss + i] * vsc : s[g * ss + i]);
            for (int c = 0; c < C; c++)
                a[g][c] = _mm512_fmadd_ps(w, vv[c], a[g][c]);
        }
    }
    for (int g = 0; g < G; g++)
        for (int c = 0; c < C; c++)
            _mm512_storeu_ps(o + (size_t)g * hd + 16 * c, a[g][c]);
}

#endif

/* Heads in sets of S_AG, rows in tiles of 4 (8 with AVX512), each K row
 * converted once per set. */
S_INLINE void s_att_dots_g(float *s, size_t ss, const float *q, int gn, const uint8_t *k,
                           size_t stride, size_t soff, int np, int hd, float scale, const int Q8) {
    if (hd & 7) {
        for (int i = 0; i < np; i++) {
            const uint8_t *kr = k + (size_t)i * stride;
            for (int g = 0; g < gn; g++) {
                float a = 0.0f;
                for (int d = 0; d < hd; d++)
                    a += q[(size_t)g * hd + d] *
                         (Q8 ? (float)(int8_t)kr[d] : fi_h2f(((const uint16_t *)(const void *)kr)[d]));
                s[g * ss + i] = (Q8 ? a * s_kv_scale(kr, soff) : a) * scale;
            }
        }
        return;
    }
#ifdef __AVX512F__
    if ((hd & 15) == 0) {
        const __m256 vs = _mm256_set1_ps(scale);
        for (int g0 = 0; g0 < gn; g0 += S_AG) {
            const float *qg = q + (size_t)g0 * hd;
            float *sg = s + g0 * ss;
            for (int i = 0; i < np; i += 8) {
                int nr = np - i < 8 ? np - i : 8;
                const uint8_t *ki = k + (size_t)i * stride;
                switch (gn - g0) {
                case 1: s_att_dots8_512(sg + i, ss, qg, 1, ki, stride, soff, nr, hd, vs, Q8); break;
                case 2: s_att_dots8_512(sg + i, ss, qg, 2, ki, stride, soff, nr, hd, vs, Q8); break;
                default: s_att_dots8_512(sg + i, ss, qg, 3, ki, stride, soff, nr, hd, vs, Q8); break;
                }
            }
        }
        return;
    }
#endif
    const __m128 vs = _mm_set1_ps(scale);
    for (int g0 = 0; g0 < gn; g0 += S_AG) {
        const float *qg = q + (size_t)g0 * hd;
        float *sg = s + g0 * ss;
        for (int i = 0; i < np; i += 4) {
            int nr = np - i < 4 ? np - i : 4;
            const uint8_t *ki = k + (size_t)i * stride;
            switch (gn - g0) {
            case 1: s_att_dots4(sg + i, ss, qg, 1, ki, stride, soff, nr, hd, vs, Q8); break;
            case 2: s_att_dots4(sg + i, ss, qg, 2, ki, stride, soff, nr, hd, vs, Q8); break;
            default: s_att_dots4(sg + i, ss, qg, 3, ki, stride, soff, nr, hd, vs, Q8); break;
            }
        }
    }
}

static void s_att_dots(float *s, size_t ss, const float *q, int gn, const uint16_t *k,
                       size_t stride, int np, int hd, float scale) {
    s_att_dots_g(s, ss, q, gn, (const uint8_t *)(const void *)k, stride * sizeof *k, 0, np, hd, scale, 0);
}

static void s_att_dots_q8(float *s, size_t ss, const float *q, int gn, const int8_t *k,
                          size_t stride, size_t soff, int np, int hd, float scale) {
    s_att_dots_g(s, ss, q, gn, (const uint8_t *)k, stride, soff, np, hd, scale, 1);
}

/* exp(x) (Cephes polynomial, about 1 ulp) for x in [-87.33, 88]; x is
 * clamped to that range first (so below it gives ~1e-38, not 0). */
S_INLINE __m256 s_exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.33f)), _mm256_set1_ps(88.0f));
    __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

#ifdef __AVX512F__
/* s_exp8 on 16 lanes. */
S_INLINE __m512 s_exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.33f)), _mm512_set1_ps(88.0f));
    __m512 fx = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                     _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(fx), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

static float s_exp_sum(float *s, int n, float *m) {
    const int full = n & ~15;
    const __mmask16 tail = (__mmask16)((1u << (n - full)) - 1u);
    __m512 vm = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tail, s + full);
    for (int i = 0; i < full; i += 16)
        vm = _mm512_max_ps(vm, _mm512_loadu_ps(s + i));
    *m = _mm512_reduce_max_ps(vm);
    vm = _mm512_set1_ps(*m);
    __m512 acc = _mm512_setzero_ps();
    for (int i = 0; i < full; i += 16) {
        __m512 e = s_exp16(_mm512_sub_ps(_mm512_loadu_ps(s + i), vm));
        _mm512_storeu_ps(s + i, e);
        acc = _mm512_add_ps(acc, e);
    }
    if (tail) {
        __m512 e = s_exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + full), vm));
        _mm512_mask_storeu_ps(s + full, tail, e);
        acc = _mm512_mask_add_ps(acc, tail, acc, e);
    }
    return _mm512_reduce_add_ps(acc);
}
#else
/* The last n % 8 elements go through masked loads and stores, so that no
 * value is rounded through a scalar path (and no store is forwarded to a
 * wider load). */
static float s_exp_sum(float *s, int n, float *m) {
    const int full = n & ~7;
    const __m256i tail = _mm256_cmpgt_epi32(_mm256_set1_epi32(n - full), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    __m256 vm = _mm256_blendv_ps(ninf, _mm256_maskload_ps(s + full, tail), _mm256_castsi256_ps(tail));
    for (int i = 0; i < full; i += 8)
        vm = _mm256_max_ps(vm, _mm256_loadu_ps(s + i));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vm), _mm256_extractf128_ps(vm, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    *m = _mm_cvtss_f32(m4);
    vm = _mm256_broadcastss_ps(m4);
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < full; i += 8) {
        __m256 e = s_exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), vm));
        _mm256_storeu_ps(s + i, e);
        acc = _mm256_add_ps(acc, e);
    }
    if (full < n) {
        __m256 e = s_exp8(_mm256_sub_ps(_mm256_maskload_ps(s + full, tail), vm));
        e = _mm256_and_ps(e, _mm256_castsi256_ps(tail));
        _mm256_maskstore_ps(s + full, tail, e);
        acc = _mm256_add_ps(acc, e);
    }
    return s_hsum(acc);
}
#endif

/* Columns [0, 8*C) of G heads (o and v already offset to the first one):
 * 2*G accumulators held over all the rows. */
S_INLINE void s_att_wsum_cols(float *o, const float *s, size_t ss, const int G, const int C,
                              const uint8_t *v, size_t stride, size_t soff, int np, int hd, const int Q8) {
    __m256 a[S_AG][2];
    for (int g = 0; g < G; g++)
        for (int c = 0; c < C; c++)
            a[g][c] = _mm256_loadu_ps(o + (size_t)g * hd + 8 * c);
    for (int i = 0; i < np; i++) {
        const uint8_t *vr = v + (size_t)i * stride;
        const float vsc = Q8 ? s_kv_scale(vr, soff) : 1.0f;
        __m256 vv[2];
        for (int c = 0; c < C; c++)
            vv[c] = s_kv8(vr, 8 * c, Q8);
        for (int g = 0; g < G; g++) {
            __m256 w = Q8 ? _mm256_set1_ps(s[g * ss + i] * vsc) : _mm256_broadcast_ss(s + g * ss + i);
            for (int c = 0; c < C; c++)
                a[g][c] = _mm256_fmadd_ps(w, vv[c], a[g][c]);
        }
    }
    for (int g = 0; g < G; g++)
        for (int c = 0; c < C; c++)
            _mm256_storeu_ps(o + (size_t)g * hd + 8 * c, a[g][c]);
}

/* Heads in sets of S_AG, columns 64 and 16 at a time with AVX512, then 16
 * and 8, each V row converted once per set and column range. The element
 * offset d moves the pointer by d values (2d bytes for fp16) and the scale
 * stays where it is, soff - d bytes on (Q8). */
S_INLINE void s_att_wsum_g(float *o, const float *s, size_t ss, int gn, const uint8_t *v,
                           size_t stride, size_t soff, int np, int hd, const int Q8) {
    const size_t es = Q8 ? 1 : 2; /* bytes per value */
    if (hd & 7) {
        for (int i = 0; i < np; i++) {
            const uint8_t *vr = v + (size_t)i * stride;
            for (int g = 0; g < gn; g++) {
                float e = Q8 ? s[g * ss + i] * s_kv_scale(vr, soff) : s[g * ss + i];
                for (int d = 0; d < hd; d++)
                    o[(size_t)g * hd + d] +=
                        e * (Q8 ? (float)(int8_t)vr[d] : fi_h2f(((const uint16_t *)(const void *)vr)[d]));
            }
        }
        return;
    }
    for (int g0 = 0; g0 < gn; g0 += S_AG) {
        int G = gn - g0 < S_AG ? gn - g0 : S_AG;
        float *og = o + (size_t)g0 * hd;
        const float *sg = s + g0 * ss;
        int d = 0;
#ifdef __AVX512F__
        for (; d + 64 <= hd; d += 64)
            switch (G) {
            case 1: s_att_wsum_512(og + d, sg, ss, 1, 4, v + d * es, stride, soff - d, np, hd, Q8); break;
            case 2: s_att_wsum_512(og + d, sg, ss, 2, 4, v + d * es, stride, soff - d, np, hd, Q8); break;
            default: s_att_wsum_512(og + d, sg, ss, 3, 4, v + d * es, stride, soff - d, np, hd, Q8); break;
            }
        for (; d + 16 <= hd; d += 16)
            switch (G) {
            case 1: s_att_wsum_512(og + d, sg, ss, 1, 1, v + d * es, stride, soff - d, np, hd, Q8); break;
            case 2: s_att_wsum_512(og + d, sg, ss, 2, 1, v + d * es, stride, soff - d, np, hd, Q8); break;
            default: s_att_wsum_512(og + d, sg, ss, 3, 1, v + d * es, stride, soff - d, np, hd, Q8); break;
            }
#endif
        for (; d < hd; d += 16) {
            int C = hd - d >= 16 ? 2 : 1;
            const uint8_t *vd = v + d * es;
            switch (G * 2 + C - 1) {
            case 2: s_att_wsum_cols(og + d, sg, ss, 1, 1, vd, stride, soff - d, np, hd, Q8); break;
            case 3: s_att_wsum_cols(og + d, sg, ss, 1, 2, vd, stride, soff - d, np, hd, Q8); break;
            case 4: s_att_wsum_cols(og + d, sg, ss, 2, 1, vd, stride, soff - d, np, hd, Q8); break;
            case 5: s_att_wsum_cols(og + d, sg, ss, 2, 2, vd, stride, soff - d, np, hd, Q8); break;
            case 6: s_att_wsum_cols(og + d, sg, ss, 3, 1, vd, stride, soff - d, np, hd, Q8); break;
            default: s_att_wsum_cols(og + d, sg, ss, 3, 2, vd, stride, soff - d, np, hd, Q8); break;
            }
        }
    }
}

static void s_att_wsum(float *o, const float *s, size_t ss, int gn, const uint16_t *v,
                       size_t stride, int np, int hd) {
    s_att_wsum_g(o, s, ss, gn, (const uint8_t *)(const void *)v, stride * sizeof *v, 0, np, hd, 0);
}

static void s_att_wsum_q8(float *o, const float *s, size_t ss, int gn, const int8_t *v,
                          size_t stride, size_t soff, int np, int hd) {
    s_att_wsum_g(o, s, ss, gn, (const uint8_t *)v, stride, soff, np, hd, 1);
}

/* The squares are exact in double, so lane k of the vector sums is the
 * portable code's p[k], bit for bit, whatever the width. */
static void s_rmsnorm(float *y, const float *x, const float *g, int dim, float eps) {
    double p[8];
    int i = 0;
#ifdef __AVX512F__
    __m512d acc = _mm512_setzero_pd();
    for (; i + 8 <= dim; i += 8) {
        __m512d v = _mm512_cvtps_pd(_mm256_loadu_ps(x + i));
        acc = _mm512_add_pd(acc, _mm512_mul_pd(v, v));
    }
    _mm512_storeu_pd(p, acc);
#else
    __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
    for (; i + 8 <= dim; i += 8) {
        __m256d a = _mm256_cvtps_pd(_mm_loadu_ps(x + i)), b = _mm256_cvtps_pd(_mm_loadu_ps(x + i + 4));
        lo = _mm256_add_pd(lo, _mm256_mul_pd(a, a));
        hi = _mm256_add_pd(hi, _mm256_mul_pd(b, b));
    }
    _mm256_storeu_pd(p, lo);
    _mm256_storeu_pd(p + 4, hi);
#endif
    double ss = ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
    for (; i < dim; i++)
        ss += (double)x[i] * x[i];
    const float scale = (float)(1.0 / sqrt(ss / dim + eps));
    const __m256 vs = _mm256_set1_ps(scale);
    for (i = 0; i + 8 <= dim; i += 8)
        _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), vs),
                                              _mm256_loadu_ps(g + i)));
    for (; i < dim; i++)
        y[i] = x[i] * scale * g[i];
}

#ifdef __AVX512F__
/* 16 lanes, and the last few elements through the same vector code (a
 * masked load and store): every element is computed alike wherever a
 * thread's share begins. */
static void s_swiglu(float *g, const float *u, size_t n) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (size_t i = 0; i < n; i += 16) {
        const __mmask16 m = n - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1u);
        __m512 x = _mm512_maskz_loadu_ps(m, g + i);
        __m512 e = s_exp16(_mm512_sub_ps(_mm512_setzero_ps(), x)); /* exp(-x) */
        __m512 y = _mm512_div_ps(x, _mm512_add_ps(one, e));
        _mm512_mask_storeu_ps(g + i, m, _mm512_mul_ps(y, _mm512_maskz_loadu_ps(m, u + i)));
    }
}
#else
static void s_swiglu(float *g, const float *u, size_t n) {
    const __m256 one = _mm256_set1_ps(1.0f), neg = _mm256_set1_ps(-0.0f);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 x = _mm256_loadu_ps(g + i);
        __m256 e = s_exp8(_mm256_xor_ps(x, neg)); /* exp(-x) */
        __m256 y = _mm256_div_ps(x, _mm256_add_ps(one, e));
        _mm256_storeu_ps(g + i, _mm256_mul_ps(y, _mm256_loadu_ps(u + i)));
    }
    for (; i < n; i++)
        g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}
#endif

static void s_to_f16(uint16_t *dst, const float *src, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(void *)(dst + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++)
        dst[i] = fi_fp32_to_fp16(src[i]);
}

/* One head's pairs 2i, 2i + 1 from i0 / 2 on, one by one (the tails). */
S_INLINE void s_rope_pairs(float *p, int i0, int head_dim, const float *tab) {
    for (int i = i0; i < head_dim; i += 2) {
        float a = p[i], b = p[i + 1], c = tab[i], s = tab[i + 1];
        p[i] = a * c - b * s;
        p[i + 1] = a * s + b * c;
    }
}

#ifdef __AVX512F__
/* Eight pairs a step: x = (a0, b0, a1, b1, ..), the table row (c0, s0,
 * ..); x * (c0, c0, ..) + (b0, a0, ..) * (-s0, s0, ..). */
static void s_rope(float *row, int n_heads, int head_dim, const float *tab) {
    const __m512 sign = _mm512_setr_ps(-1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1);
    for (int h = 0; h < n_heads; h++) {
        float *p = row + (size_t)h * head_dim;
        int i = 0;
        for (; i + 16 <= head_dim; i += 16) {
            __m512 x = _mm512_loadu_ps(p + i), t = _mm512_loadu_ps(tab + i);
            __m512 sw = _mm512_mul_ps(_mm512_permute_ps(x, 0xb1), _mm512_mul_ps(_mm512_movehdup_ps(t), sign));
            _mm512_storeu_ps(p + i, _mm512_fmadd_ps(x, _mm512_moveldup_ps(t), sw));
        }
        s_rope_pairs(p, i, head_dim, tab);
    }
}
#else
/* Four pairs a step, as the 512-bit version. */
static void s_rope(float *row, int n_heads, int head_dim, const float *tab) {
    const __m256 sign = _mm256_setr_ps(-1, 1, -1, 1, -1, 1, -1, 1);
    for (int h = 0; h < n_heads; h++) {
        float *p = row + (size_t)h * head_dim;
        int i = 0;
        for (; i + 8 <= head_dim; i += 8) {
            __m256 x = _mm256_loadu_ps(p + i), t = _mm256_loadu_ps(tab + i);
            __m256 sw = _mm256_mul_ps(_mm256_permute_ps(x, 0xb1), _mm256_mul_ps(_mm256_movehdup_ps(t), sign));
            _mm256_storeu_ps(p + i, _mm256_fmadd_ps(x, _mm256_moveldup_ps(t), sw));
        }
        s_rope_pairs(p, i, head_dim, tab);
    }
}
#endif

#ifdef __AVX512F__
/* fi_argmax_f32 on 64 lanes: the maximum (maxps keeps the running maximum
 * against a NaN, as there), then the first index holding it. */
static int32_t s_argmax(const float *x, int n) {
    __m512 m0 = _mm512_set1_ps(-INFINITY), m1 = m0, m2 = m0, m3 = m0;
    int i = 0;
    for (; i + 64 <= n; i += 64) {
        m0 = _mm512_max_ps(_mm512_loadu_ps(x + i), m0);
        m1 = _mm512_max_ps(_mm512_loadu_ps(x + i + 16), m1);
        m2 = _mm512_max_ps(_mm512_loadu_ps(x + i + 32), m2);
        m3 = _mm512_max_ps(_mm512_loadu_ps(x + i + 48), m3);
    }
    float best = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m0, m1), _mm512_max_ps(m2, m3)));
    for (; i < n; i++)
        best = x[i] > best ? x[i] : best;
    const __m512 vb = _mm512_set1_ps(best);
    for (i = 0; i + 16 <= n; i += 16) {
        __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), vb, _CMP_EQ_OQ);
        if (hit)
            return i + __builtin_ctz((unsigned)hit);
    }
    for (; i < n; i++)
        if (x[i] == best)
            return i;
    return 0;
}
#else
#define s_argmax fi_argmax_f32
#endif

/* Fills k with this flavour's kernels under `name`. */
static void s_x86_fill(fi_cpu_kernels *k, const char *name) {
    k->name = name;
    k->quantize_q8x = s_quantize_q8x;
    k->kv_quant = s_kv_quant;
    k->mm_f32 = s_mm_f32;
    k->mm_f16 = s_mm_f16;
    k->mm_bf16 = s_mm_bf16;
    k->mm_q4_0 = s_mm_q4_0;
    k->mm_q4_1 = s_mm_q4_1;
    k->mm_q8_0 = s_mm_q8_0;
    k->att_dots = s_att_dots;
    k->att_wsum = s_att_wsum;
    k->att_dots_q8 = s_att_dots_q8;
    k->att_wsum_q8 = s_att_wsum_q8;
    k->exp_sum = s_exp_sum;
    k->rmsnorm = s_rmsnorm;
    k->swiglu = s_swiglu;
    k->to_f16 = s_to_f16;
    k->rope = s_rope;
    k->argmax = s_argmax;
}

/*
 * fi_cpu_q16_avx2.c - AVX2 16-bit-activation kernels (see
 * fi_cpu_q16_impl.h). Compiled with -mavx2 -mfma -mf16c and entered only
 * after a run-time check.
 *
 * Per 32-element block: the weights are widened to 16 bits once
 * (vpmovzxbw / vpmovsxbw) and multiplied with the activation quants of up
 * to four tokens by vpmaddwd, which sums adjacent products into 32 bits
 * (|w| <= 15 or 127, |x| <= 32767: no overflow); the block's integer sums
 * are scaled by d_w * d_x in float and accumulated with FMA. One token
 * takes four rows at a time (independent FMA chains) and prefetches the
 * weights ahead, as decode streams them from L3/DRAM.
 */
#include "fi_cpu_q16_impl.h"

#include <float.h>
#include <immintrin.h>
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

static void s_quantize(const float *x, fi_block_q16x *y, int nb, int qmax) {
    const float fq = (float)qmax;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int b = 0; b < nb; b++, x += FI_QK) {
        __m256 v0 = _mm256_loadu_ps(x), v1 = _mm256_loadu_ps(x + 8);
        __m256 v2 = _mm256_loadu_ps(x + 16), v3 = _mm256_loadu_ps(x + 24);
        __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                                  _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
        float amax = s_hmax(mx);
        const float lo = fq * FLT_MIN; /* as fi_quantize_q16x_ref */
        float id = amax >= lo ? fq / amax : 0.0f;
        y[b].d = !(amax < lo) ? amax / fq : 0.0f;
        y[b].s = s_hsum(_mm256_add_ps(_mm256_add_ps(v0, v1), _mm256_add_ps(v2, v3)));
        __m256 vid = _mm256_set1_ps(id);
        __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, vid));
        __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, vid));
        __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, vid));
        __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, vid));
        /* packs works within 128-bit lanes; the permute restores order */
        __m256i p0 = _mm256_permute4x64_epi64(_mm256_packs_epi32(i0, i1), 0xD8);
        __m256i p1 = _mm256_permute4x64_epi64(_mm256_packs_epi32(i2, i3), 0xD8);
        _mm256_storeu_si256((__m256i *)(void *)y[b].qs, p0);
        _mm256_storeu_si256((__m256i *)(void *)(y[b].qs + 16), p1);
    }
}

#define S_INLINE static inline __attribute__((always_inline))
#define S_RB 16      /* rows per sub-block when several tokens share a call */
#define S_PF_TILES 4 /* one token: prefetch this many 4-row tiles ahead */
#ifndef S_PT
#define S_PT 4       /* tokens per prefill tile (4 rows each) */
#endif

/* 16 nibble bytes widened once to 16 bits (byte j = lo + 16 hi): the low
 * nibbles (elements 0..15) are the low 4 bits, the high nibbles (16..31)
 * the value shifted right by 4. One vpmovzxbw instead of two. */
S_INLINE void s_widen_nibbles(const uint8_t *qs, __m256i *wl, __m256i *wh) {
    __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(const void *)qs));
    *wl = _mm256_and_si256(w, _mm256_set1_epi16(0x0f));
    *wh = _mm256_srli_epi16(w, 4);
}

/* Block b's weights widened to 16 bits: wl elements 0..15, wh 16..31;
 * d and a (the offset per unit of sum(x): m for Q4_1, -8d for Q4_0, 0 for
 * Q8_0) as scalars in lane 0. kind: 0 Q4_0, 1 Q4_1, 2 Q8_0. */
S_INLINE void s_block(int kind, const uint8_t *blk, __m256i *wl, __m256i *wh, __m128 *d, __m128 *a) {
    if (kind == 2) {
        const fi_block_q8_0 *w = (const fi_block_q8_0 *)(const void *)blk;
        *wl = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(const void *)w->qs));
        *wh = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(const void *)(w->qs + 16)));
        *d = _mm_set_ss(_cvtsh_ss(w->d));
        *a = _mm_setzero_ps();
        return;
    }
    const uint8_t *qs;
    if (kind == 1) {
        const fi_block_q4_1 *w = (const fi_block_q4_1 *)(const void *)blk;
        qs = w->qs;
        *d = _mm_set_ss(_cvtsh_ss(w->d));
        *a = _mm_set_ss(_cvtsh_ss(w->m));
    } else {
        const fi_block_q4_0 *w = (const fi_block_q4_0 *)(const void *)blk;
        qs = w->qs;
        *d = _mm_set_ss(_cvtsh_ss(w->d));
        *a = _mm_mul_ss(*d, _mm_set_ss(-8.0f)); /* (q - 8) d = q d + (-8 d) */
    }
    s_widen_nibbles(qs, wl, wh);
}

/* Rows r..r+R-1 times tokens k..k+T-1 (R*T <= 4 x 4). Every (row, token)
 * result is formed by the same sequence of operations whatever R and T
 * are: per block, acc += float(int dot) * (d * dx) and mt += a * s, then
 * y = hsum(acc) + mt. So a token's result does not depend on how many
 * tokens share the call, nor a row's on how rows are grouped (all
 * intrinsics: no compiler contraction can tell the shapes apart). pf: the
 * one-token tile, which prefetches the tiles ahead. */
S_INLINE void s_tile(int kind, size_t bsz, const fi_mm_task *t, int r, int k, int R, int T, int pf) {
    const size_t stride = t->w_stride;
    const uint8_t *w0 = t->w + (size_t)r * stride;
    const int nb = t->cols / FI_QK;
    const fi_block_q16x *xr[4];
    __m256 acc[4][4];
    __m128 mt[4][4];
    for (int j = 0; j < T; j++)
        xr[j] = (const fi_block_q16x *)(const void *)(t->x + (size_t)(k + j) * t->x_stride);
    for (int i = 0; i < R; i++)
        for (int j = 0; j < T; j++) {
            acc[i][j] = _mm256_setzero_ps();
            mt[i][j] = _mm_setzero_ps();
        }
    for (int b = 0; b < nb; b++) {
        if (pf) {
            /* this step's share of the tile S_PF_TILES ahead: 4*bsz bytes */
            const char *p = (const char *)w0 + S_PF_TILES * 4 * stride + (size_t)b * 4 * bsz;
            _mm_prefetch(p, _MM_HINT_T1);
            _mm_prefetch(p + 64, _MM_HINT_T1);
            if (4 * bsz > 128)
                _mm_prefetch(p + 128, _MM_HINT_T1);
        }
        for (int i = 0; i < R; i++) {
            __m256i wl, wh;
            __m128 d, a;
            s_block(kind, w0 + (size_t)i * stride + (size_t)b * bsz, &wl, &wh, &d, &a);
            for (int j = 0; j < T; j++) {
                const fi_block_q16x *x = xr[j] + b;
                __m256i xl = _mm256_loadu_si256((const __m256i *)(const void *)x->qs);
                __m256i xh = _mm256_loadu_si256((const __m256i *)(const void *)(x->qs + 16));
                __m256i isum = _mm256_add_epi32(_mm256_madd_epi16(wl, xl), _mm256_madd_epi16(wh, xh));
                __m128 sc = _mm_mul_ss(d, _mm_load_ss(&x->d));
                acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_broadcastss_ps(sc), acc[i][j]);
                mt[i][j] = _mm_add_ss(mt[i][j], _mm_mul_ss(a, _mm_load_ss(&x->s)));
            }
        }
    }
    for (int i = 0; i < R; i++)
        for (int j = 0; j < T; j++)
            t->y[(size_t)(k + j) * t->y_stride + r + i] = s_hsum(acc[i][j]) + _mm_cvtss_f32(mt[i][j]);
}

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

/* Rows r..r+3 times tokens k..k+T-1 (T <= 4): s_tile(kind, bsz, t, r, k,
 * 4, T, pf) with the four rows' scales converted and multiplied in one
 * register each. Lane i of a vector multiply or add is the same IEEE
 * operation as the scalar one in s_tile, so the results are identical to
 * it, bit for bit. */
S_INLINE void s_rows4(int kind, size_t bsz, const fi_mm_task *t, int r, int k, int T, int pf) {
    const size_t stride = t->w_stride;
    const uint8_t *w0 = t->w + (size_t)r * stride;
    const int nb = t->cols / FI_QK;
    const fi_block_q16x *xr[4];
    __m256 acc[4][4];
    __m128 mt[4];
    for (int j = 0; j < T; j++) {
        xr[j] = (const fi_block_q16x *)(const void *)(t->x + (size_t)(k + j) * t->x_stride);
        mt[j] = _mm_setzero_ps();
        for (int i = 0; i < 4; i++)
            acc[i][j] = _mm256_setzero_ps();
    }
    for (int b = 0; b < nb; b++) {
        const uint8_t *wb = w0 + (size_t)b * bsz;
        if (pf) {
            const char *p = (const char *)w0 + S_PF_TILES * 4 * stride + (size_t)b * 4 * bsz;
            _mm_prefetch(p, _MM_HINT_T1);
            _mm_prefetch(p + 64, _MM_HINT_T1);
            if (4 * bsz > 128)
                _mm_prefetch(p + 128, _MM_HINT_T1);
        }
        __m128 d, a;
        if (kind == 1) {
            __m128i h = _mm_cvtsi32_si128((int)s_ld32(wb));
            h = _mm_insert_epi32(h, (int)s_ld32(wb + stride), 1);
            h = _mm_insert_epi32(h, (int)s_ld32(wb + 2 * stride), 2);
            h = _mm_insert_epi32(h, (int)s_ld32(wb + 3 * stride), 3);
            __m256 dm = _mm256_cvtph_ps(h); /* d0 m0 d1 m1 d2 m2 d3 m3 */
            d = _mm256_castps256_ps128(_mm256_permutevar8x32_ps(dm, _mm256_setr_epi32(0, 2, 4, 6, 0, 0, 0, 0)));
            a = _mm256_castps256_ps128(_mm256_permutevar8x32_ps(dm, _mm256_setr_epi32(1, 3, 5, 7, 0, 0, 0, 0)));
        } else {
            __m128i h = _mm_cvtsi32_si128(s_ld16(wb));
            h = _mm_insert_epi16(h, s_ld16(wb + stride), 1);
            h = _mm_insert_epi16(h, s_ld16(wb + 2 * stride), 2);
            h = _mm_insert_epi16(h, s_ld16(wb + 3 * stride), 3);
            d = _mm_cvtph_ps(h);
            a = kind == 0 ? _mm_mul_ps(d, _mm_set1_ps(-8.0f)) : _mm_setzero_ps();
        }
        __m256 sc[4];
        for (int j = 0; j < T; j++) {
            sc[j] = _mm256_castps128_ps256(_mm_mul_ps(d, _mm_set1_ps(xr[j][b].d)));
            if (kind != 2)
                mt[j] = _mm_add_ps(mt[j], _mm_mul_ps(a, _mm_set1_ps(xr[j][b].s)));
        }
        for (int i = 0; i < 4; i++) {
            __m256i wl, wh;
            const uint8_t *blk = wb + (size_t)i * stride;
            if (kind == 2) {
                wl = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(const void *)(blk + 2)));
                wh = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(const void *)(blk + 18)));
            } else {
                s_widen_nibbles(blk + (kind == 1 ? 4 : 2), &wl, &wh);
            }
            for (int j = 0; j < T; j++) {
                const fi_block_q16x *x = xr[j] + b;
                __m256i xl = _mm256_loadu_si256((const __m256i *)(const void *)x->qs);
                __m256i xh = _mm256_loadu_si256((const __m256i *)(const void *)(x->qs + 16));
                __m256i isum = _mm256_add_epi32(_mm256_madd_epi16(wl, xl), _mm256_madd_epi16(wh, xh));
                __m256 si = _mm256_permutevar8x32_ps(sc[j], _mm256_set1_epi32(i));
                acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), si, acc[i][j]);
            }
        }
    }
    for (int j = 0; j < T; j++) {
        float m4v[4];
        _mm_storeu_ps(m4v, mt[j]);
        for (int i = 0; i < 4; i++)
            t->y[(size_t)(k + j) * t->y_stride + r + i] = s_hsum(acc[i][j]) + m4v[i];
    }
}

/* One token: rows in 4s (four independent FMA chains, prefetching).
 * Several: sub-blocks of S_RB rows, tokens in 4s sharing each widened
 * block, leftover tokens as one token. */
S_INLINE void s_mm(int kind, size_t bsz, const fi_mm_task *t, int r0, int r1) {
    for (int rb = r0; rb < r1; rb += (t->n == 1 ? r1 - r0 : S_RB)) {
        int re = t->n == 1 ? r1 : (rb + S_RB < r1 ? rb + S_RB : r1);
        int k = 0;
        int r4 = rb + (re - rb) / 4 * 4;
        for (; k + S_PT <= t->n; k += S_PT) {
            for (int r = rb; r < r4; r += 4)
                s_rows4(kind, bsz, t, r, k, S_PT, 0);
            for (int r = r4; r < re; r++)
                s_tile(kind, bsz, t, r, k, 1, S_PT, 0);
        }
        for (; k < t->n; k++) {
            int r = rb;
            for (; r + 4 <= re; r += 4)
                s_rows4(kind, bsz, t, r, k, 1, t->n == 1);
            for (; r < re; r++)
                s_tile(kind, bsz, t, r, k, 1, 1, 0);
        }
    }
}

static void s_mm_q4_0(const fi_mm_task *t, int r0, int r1) {
    s_mm(0, sizeof(fi_block_q4_0), t, r0, r1);
}
static void s_mm_q4_1(const fi_mm_task *t, int r0, int r1) {
    s_mm(1, sizeof(fi_block_q4_1), t, r0, r1);
}
static void s_mm_q8_0(const fi_mm_task *t, int r0, int r1) {
    s_mm(2, sizeof(fi_block_q8_0), t, r0, r1);
}

void fi_q16_kernels_avx2(fi_q16_kernels *k) {
    k->quantize = s_quantize;
    k->mm_q4_0 = s_mm_q4_0;
    k->mm_q4_1 = s_mm_q4_1;
    k->mm_q8_0 = s_mm_q8_0;
    k->split = NULL;
    k->pack = NULL;
}

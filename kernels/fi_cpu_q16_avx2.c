/*
 * fi_cpu_q16_avx2.c - AVX2 16-bit-activation kernels (see
 * fi_cpu_q16_impl.h). Compiled with -mavx2 -mfma -mf16c and entered only
 * after a run-time check.
 *
 * Per 32-element block: the weights are widened to 16 bits once
 * (vpmovzxbw / vpmovsxbw) and multiplied with the activation quants of up
 * to four tokens by vpmaddwd, which sums adjacent products into 32 bits
 * (|w| <= 15 or 127, |x| <= 32767: no overflow); the block's integer sums
 * are scaled by d_w * d_x in float and accumulated with FMA.
 */
#include "fi_cpu_q16_impl.h"

#include <immintrin.h>

#define S_TILE 4 /* tokens sharing one unpacked weight block */

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

static void s_quantize(const float *x, fi_block_q16x *y, int nb) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int b = 0; b < nb; b++, x += FI_QK) {
        __m256 v0 = _mm256_loadu_ps(x), v1 = _mm256_loadu_ps(x + 8);
        __m256 v2 = _mm256_loadu_ps(x + 16), v3 = _mm256_loadu_ps(x + 24);
        __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                                  _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
        float amax = s_hmax(mx);
        float id = amax > 0.0f ? 32767.0f / amax : 0.0f;
        y[b].d = amax / 32767.0f;
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

/* Integer block dot of widened weights (wl: elements 0..15, wh: 16..31)
 * with one activation block, as 8 int32 partial sums. */
static inline __m256i s_bdot(__m256i wl, __m256i wh, const fi_block_q16x *x) {
    __m256i xl = _mm256_loadu_si256((const __m256i *)(const void *)x->qs);
    __m256i xh = _mm256_loadu_si256((const __m256i *)(const void *)(x->qs + 16));
    return _mm256_add_epi32(_mm256_madd_epi16(wl, xl), _mm256_madd_epi16(wh, xh));
}

/* Widened weights of one block. kind: 0 Q4_0, 1 Q4_1, 2 Q8_0. */
static inline void s_unpack(int kind, const uint8_t *blk, __m256i *wl, __m256i *wh, float *d,
                            float *m) {
    if (kind == 2) {
        const fi_block_q8_0 *w = (const fi_block_q8_0 *)(const void *)blk;
        __m256i q = _mm256_loadu_si256((const __m256i *)(const void *)w->qs);
        *wl = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(q));
        *wh = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(q, 1));
        *d = _cvtsh_ss(w->d);
        *m = 0.0f;
        return;
    }
    const uint8_t *qs;
    if (kind == 1) {
        const fi_block_q4_1 *w = (const fi_block_q4_1 *)(const void *)blk;
        qs = w->qs;
        *d = _cvtsh_ss(w->d);
        *m = _cvtsh_ss(w->m);
    } else {
        const fi_block_q4_0 *w = (const fi_block_q4_0 *)(const void *)blk;
        qs = w->qs;
        *d = _cvtsh_ss(w->d);
        *m = -8.0f * *d; /* value = (q - 8) * d = q * d + (-8 d) */
    }
    const __m128i m4 = _mm_set1_epi8(0x0f);
    __m128i q = _mm_loadu_si128((const __m128i *)(const void *)qs);
    *wl = _mm256_cvtepu8_epi16(_mm_and_si128(q, m4));
    *wh = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(q, 4), m4));
}

static inline void s_mm(int kind, size_t bbytes, const fi_mm_task *t, int r0, int r1) {
    int nb = t->cols / FI_QK;
    for (int r = r0; r < r1; r++) {
        const uint8_t *wrow = t->w + (size_t)r * t->w_stride;
        int k = 0;
        /* Tiles of S_TILE tokens share each unpacked block. Every token's
         * sum is formed in the same order as in the one-token loop below
         * (even blocks in acc0, odd in acc1), so a token's result does not
         * depend on how many tokens share the call. */
        for (; k + S_TILE <= t->n; k += S_TILE) {
            const fi_block_q16x *x[S_TILE];
            __m256 acc0[S_TILE], acc1[S_TILE];
            float mt[S_TILE];
            for (int j = 0; j < S_TILE; j++) {
                x[j] = (const fi_block_q16x *)(const void *)(t->x + (size_t)(k + j) * t->x_stride);
                acc0[j] = acc1[j] = _mm256_setzero_ps();
                mt[j] = 0.0f;
            }
            int b = 0;
            for (; b + 2 <= nb; b += 2) {
                __m256i wl, wh, wl2, wh2;
                float d, m, d2, m2;
                s_unpack(kind, wrow + (size_t)b * bbytes, &wl, &wh, &d, &m);
                s_unpack(kind, wrow + (size_t)(b + 1) * bbytes, &wl2, &wh2, &d2, &m2);
                for (int j = 0; j < S_TILE; j++) {
                    acc0[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s_bdot(wl, wh, &x[j][b])),
                                              _mm256_set1_ps(d * x[j][b].d), acc0[j]);
                    acc1[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s_bdot(wl2, wh2, &x[j][b + 1])),
                                              _mm256_set1_ps(d2 * x[j][b + 1].d), acc1[j]);
                    mt[j] += m * x[j][b].s + m2 * x[j][b + 1].s;
                }
            }
            for (; b < nb; b++) {
                __m256i wl, wh;
                float d, m;
                s_unpack(kind, wrow + (size_t)b * bbytes, &wl, &wh, &d, &m);
                for (int j = 0; j < S_TILE; j++) {
                    acc0[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s_bdot(wl, wh, &x[j][b])),
                                              _mm256_set1_ps(d * x[j][b].d), acc0[j]);
                    mt[j] += m * x[j][b].s;
                }
            }
            for (int j = 0; j < S_TILE; j++)
                t->y[(size_t)(k + j) * t->y_stride + r] = s_hsum(_mm256_add_ps(acc0[j], acc1[j])) + mt[j];
        }
        for (; k < t->n; k++) {
            const fi_block_q16x *x = (const fi_block_q16x *)(const void *)(t->x + (size_t)k * t->x_stride);
            __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
            float mt = 0.0f;
            int b = 0;
            /* two blocks per step: two independent FMA chains */
            for (; b + 2 <= nb; b += 2) {
                __m256i wl, wh, wl2, wh2;
                float d, m, d2, m2;
                s_unpack(kind, wrow + (size_t)b * bbytes, &wl, &wh, &d, &m);
                s_unpack(kind, wrow + (size_t)(b + 1) * bbytes, &wl2, &wh2, &d2, &m2);
                acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s_bdot(wl, wh, &x[b])),
                                       _mm256_set1_ps(d * x[b].d), acc0);
                acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s_bdot(wl2, wh2, &x[b + 1])),
                                       _mm256_set1_ps(d2 * x[b + 1].d), acc1);
                mt += m * x[b].s + m2 * x[b + 1].s;
            }
            for (; b < nb; b++) {
                __m256i wl, wh;
                float d, m;
                s_unpack(kind, wrow + (size_t)b * bbytes, &wl, &wh, &d, &m);
                acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s_bdot(wl, wh, &x[b])),
                                       _mm256_set1_ps(d * x[b].d), acc0);
                mt += m * x[b].s;
            }
            t->y[(size_t)k * t->y_stride + r] = s_hsum(_mm256_add_ps(acc0, acc1)) + mt;
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
}

/*
 * fi_cpu_q16_avx2.c - AVX2 16-bit-activation kernels (see
 * fi_cpu_q16_impl.h). Compiled with -mavx2 -mfma -mf16c and entered only
 * after a run-time check.
 *
 * Per 32-element block: the weights are widened to 16 bits once
 * (vpmovzxbw / vpmovsxbw) and multiplied with the activation quants by
 * vpmaddwd, which sums adjacent products into 32 bits (|w| <= 15 or 127,
 * |x| <= 32767: no overflow); the block's integer sums are scaled by
 * d_w * d_x in float and accumulated with FMA. Tiles: four tokens share a
 * block in prefill; four rows share the activations in decode (four
 * independent weight streams keep more loads in flight).
 */
#include "fi_cpu_q16_impl.h"

#include <immintrin.h>


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
 * with one activation block, as 8 float partial sums. */
static inline __m256 s_bdot(__m256i wl, __m256i wh, const fi_block_q16x *x) {
    __m256i xl = _mm256_loadu_si256((const __m256i *)(const void *)x->qs);
    __m256i xh = _mm256_loadu_si256((const __m256i *)(const void *)(x->qs + 16));
    return _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_madd_epi16(wl, xl), _mm256_madd_epi16(wh, xh)));
}

/* Widened weights of block b of a row, and ws = [d_w, aux]: aux is the
 * minimum m (Q4_1), d_w (Q4_0, whose offset -8 is applied at the end) or
 * 0 (Q8_0). kind: 0 Q4_0, 1 Q4_1, 2 Q8_0. */
static inline void s_unpack(int kind, const uint8_t *row, int b, __m256i *wl, __m256i *wh,
                            __m128 *ws) {
    if (kind == 2) {
        const fi_block_q8_0 *w = (const fi_block_q8_0 *)(const void *)row + b;
        __m256i q = _mm256_loadu_si256((const __m256i *)(const void *)w->qs);
        *wl = _mm256_cvtepi8_epi16(_mm256_castsi256_si128(q));
        *wh = _mm256_cvtepi8_epi16(_mm256_extracti128_si256(q, 1));
        *ws = _mm_cvtph_ps(_mm_cvtsi32_si128(w->d)); /* [d, 0] */
        return;
    }
    const uint8_t *qs;
    if (kind == 1) {
        const fi_block_q4_1 *w = (const fi_block_q4_1 *)(const void *)row + b;
        uint32_t dm;
        memcpy(&dm, w, sizeof dm); /* d and m are adjacent fp16 */
        *ws = _mm_cvtph_ps(_mm_cvtsi32_si128((int)dm));
        qs = w->qs;
    } else {
        const fi_block_q4_0 *w = (const fi_block_q4_0 *)(const void *)row + b;
        *ws = _mm_cvtph_ps(_mm_set1_epi16((short)w->d));
        qs = w->qs;
    }
    const __m128i m4 = _mm_set1_epi8(0x0f);
    __m128i q = _mm_loadu_si128((const __m128i *)(const void *)qs);
    *wl = _mm256_cvtepu8_epi16(_mm_and_si128(q, m4));
    *wh = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(q, 4), m4));
}

/* Rows r..r+R-1 times tokens k..k+T-1 over all blocks, R*T <= 4. Each
 * (row, token) has one accumulator summed in block order, so its result
 * does not depend on the tile shape (batched and single-token calls give
 * identical numbers). */
static inline void s_tile(int kind, const fi_mm_task *t, int r, int k, int R, int T) {
    int nb = t->cols / FI_QK;
    const uint8_t *wr[4];
    const fi_block_q16x *xr[4];
    __m256 acc[4][4];
    __m128 aux[4][4];
    for (int i = 0; i < R; i++)
        wr[i] = t->w + (size_t)(r + i) * t->w_stride;
    for (int j = 0; j < T; j++)
        xr[j] = (const fi_block_q16x *)(const void *)(t->x + (size_t)(k + j) * t->x_stride);
    for (int i = 0; i < R; i++)
        for (int j = 0; j < T; j++) {
            acc[i][j] = _mm256_setzero_ps();
            aux[i][j] = _mm_setzero_ps();
        }
    for (int b = 0; b < nb; b++) {
        for (int i = 0; i < R; i++) {
            __m256i wl, wh;
            __m128 ws;
            s_unpack(kind, wr[i], b, &wl, &wh, &ws);
            for (int j = 0; j < T; j++) {
                const fi_block_q16x *x = xr[j] + b;
                /* [d_w * d_x, aux * s] */
                __m128 p = _mm_mul_ps(ws, _mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)(const void *)x)));
                acc[i][j] = _mm256_fmadd_ps(s_bdot(wl, wh, x), _mm256_broadcastss_ps(p), acc[i][j]);
                aux[i][j] = _mm_add_ps(aux[i][j], p);
            }
        }
    }
    for (int i = 0; i < R; i++)
        for (int j = 0; j < T; j++) {
            float v = s_hsum(acc[i][j]);
            float a = _mm_cvtss_f32(_mm_movehdup_ps(aux[i][j]));
            if (kind == 1)
                v += a;          /* + m * sum(x) */
            else if (kind == 0)
                v -= 8.0f * a;   /* (q - 8) * d: - 8 d * sum(x) */
            t->y[(size_t)(k + j) * t->y_stride + r + i] = v;
        }
}

static inline void s_mm(int kind, const fi_mm_task *t, int r0, int r1) {
    int k = 0;
    for (; k + 4 <= t->n; k += 4) /* prefill: one weight block, four tokens */
        for (int r = r0; r < r1; r++)
            s_tile(kind, t, r, k, 1, 4);
    for (; k < t->n; k++) {        /* decode: four rows at once */
        int r = r0;
        for (; r + 4 <= r1; r += 4)
            s_tile(kind, t, r, k, 4, 1);
        for (; r < r1; r++)
            s_tile(kind, t, r, k, 1, 1);
    }
}

static void s_mm_q4_0(const fi_mm_task *t, int r0, int r1) {
    s_mm(0, t, r0, r1);
}
static void s_mm_q4_1(const fi_mm_task *t, int r0, int r1) {
    s_mm(1, t, r0, r1);
}
static void s_mm_q8_0(const fi_mm_task *t, int r0, int r1) {
    s_mm(2, t, r0, r1);
}

void fi_q16_kernels_avx2(fi_q16_kernels *k) {
    k->quantize = s_quantize;
    k->mm_q4_0 = s_mm_q4_0;
    k->mm_q4_1 = s_mm_q4_1;
    k->mm_q8_0 = s_mm_q8_0;
}

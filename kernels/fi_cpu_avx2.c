/*
 * fi_cpu_avx2.c - AVX2 + FMA + F16C kernels. Compiled with -mavx2 -mfma
 * -mf16c and entered only after fi_cpu.c has checked the processor.
 *
 * Quantised matmul works on one 32-element block at a time:
 *   Q4_x: the 16 nibble bytes expand to 32 unsigned bytes (low nibbles
 *         first, as the activation block is laid out), then
 *         maddubs(u8 weight, s8 activation) + madd(.,1) give 8 int32 sums;
 *   Q8_0: maddubs needs one unsigned operand, so |w| times x*sign(w).
 * The int32 sums are converted and accumulated with one FMA by dw*dx per
 * block; the Q4_1 minimum and the Q4_0 offset are accumulated separately
 * as m*s and dw*s (s = dx*sum(qx), stored in the activation block).
 *
 * Tiling: decode (one token) takes 4 rows at a time for four independent
 * FMA chains; prefill takes 4 tokens per weight block so that each weight
 * block is expanded once and used 4 times. Rows are walked in sub-blocks
 * of S_RB rows, tokens inside, so the weights of a sub-block stay in L1
 * while every token passes over them.
 */
#include "fi_kernels_impl.h"

#include <immintrin.h>

#define S_INLINE static inline __attribute__((always_inline))
#define S_RB 16 /* rows per sub-block in the prefill loop */
#define S_RND (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

S_INLINE float s_hsum(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_movehdup_ps(a));
    return _mm_cvtss_f32(a);
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
        float id = amax > 0.0f ? 127.0f / amax : 0.0f;
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
        y[i].d = amax / 127.0f;
        y[i].s = y[i].d * (float)sum;
    }
}

/* --- quantised blocks ---------------------------------------------------- */

/* Expands 16 nibble bytes to 32 bytes: low nibbles, then high nibbles. */
S_INLINE __m256i s_nibbles(const uint8_t *qs) {
    __m128i b = _mm_loadu_si128((const __m128i *)qs);
    __m256i v = _mm256_set_m128i(_mm_srli_epi16(b, 4), b);
    return _mm256_and_si256(v, _mm256_set1_epi8(0x0f));
}

/* Weight block b of a row of type ty: its byte vector and [dw, aux] where
 * aux is m (Q4_1) or dw (Q4_0, Q8_0). */
S_INLINE __m256i s_wblock(int ty, const uint8_t *row, int b, __m128 *ws) {
    if (ty == FI_DTYPE_Q4_1) {
        const fi_block_q4_1 *w = (const fi_block_q4_1 *)row + b;
        uint32_t dm;
        memcpy(&dm, w, sizeof dm);
        *ws = _mm_cvtph_ps(_mm_cvtsi32_si128((int)dm));
        return s_nibbles(w->qs);
    }
    if (ty == FI_DTYPE_Q4_0) {
        const fi_block_q4_0 *w = (const fi_block_q4_0 *)row + b;
        *ws = _mm_cvtph_ps(_mm_set1_epi16((short)w->d));
        return s_nibbles(w->qs);
    }
    const fi_block_q8_0 *w = (const fi_block_q8_0 *)row + b;
    *ws = _mm_cvtph_ps(_mm_set1_epi16((short)w->d));
    return _mm256_loadu_si256((const __m256i *)w->qs);
}

/* 8 int32 partial sums of w . x, as floats. */
S_INLINE __m256 s_bdot(int ty, __m256i w, __m256i x) {
    __m256i p;
    if (ty == FI_DTYPE_Q8_0)
        p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
    else
        p = _mm256_maddubs_epi16(w, x);
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}

/* Rows r..r+R-1 times tokens k..k+T-1, all blocks; R*T <= 4. */
S_INLINE void s_qtile(int ty, const fi_mm_task *t, int r, int k, int R, int T) {
    int nb = t->cols / FI_QK;
    const uint8_t *wr[4];
    const fi_block_q8x *xr[4];
    __m256 acc[4][4];
    __m128 aux[4][4];
    for (int i = 0; i < R; i++)
        wr[i] = t->w + (size_t)(r + i) * t->w_stride;
    for (int j = 0; j < T; j++)
        xr[j] = (const fi_block_q8x *)(t->x + (size_t)(k + j) * t->x_stride);
    for (int i = 0; i < R; i++)
        for (int j = 0; j < T; j++) {
            acc[i][j] = _mm256_setzero_ps();
            aux[i][j] = _mm_setzero_ps();
        }
    for (int b = 0; b < nb; b++) {
        for (int i = 0; i < R; i++) {
            __m128 ws;
            __m256i wv = s_wblock(ty, wr[i], b, &ws);
            for (int j = 0; j < T; j++) {
                const fi_block_q8x *x = xr[j] + b;
                __m128 xs = _mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)x));
                __m128 p = _mm_mul_ps(ws, xs); /* [dw*dx, aux*s] */
                __m256i xv = _mm256_loadu_si256((const __m256i *)x->qs);
                acc[i][j] = _mm256_fmadd_ps(s_bdot(ty, wv, xv), _mm256_broadcastss_ps(p), acc[i][j]);
                if (ty != FI_DTYPE_Q8_0)
                    aux[i][j] = _mm_add_ps(aux[i][j], p);
            }
        }
    }
    for (int i = 0; i < R; i++)
        for (int j = 0; j < T; j++) {
            float v = s_hsum(acc[i][j]);
            float a = _mm_cvtss_f32(_mm_movehdup_ps(aux[i][j]));
            if (ty == FI_DTYPE_Q4_1)
                v += a;
            else if (ty == FI_DTYPE_Q4_0)
                v -= 8.0f * a;
            t->y[(size_t)(k + j) * t->y_stride + r + i] = v;
        }
}

S_INLINE void s_mm_quant(int ty, const fi_mm_task *t, int r0, int r1) {
    for (int rb = r0; rb < r1; rb += S_RB) {
        int re = rb + S_RB < r1 ? rb + S_RB : r1;
        int k = 0;
        for (; k + 4 <= t->n; k += 4)
            for (int r = rb; r < re; r++)
                s_qtile(ty, t, r, k, 1, 4);
        for (; k < t->n; k++) {
            int r = rb;
            for (; r + 4 <= re; r += 4)
                s_qtile(ty, t, r, k, 4, 1);
            for (; r < re; r++)
                s_qtile(ty, t, r, k, 1, 1);
        }
    }
}

static void s_mm_q4_0(const fi_mm_task *t, int r0, int r1) {
    s_mm_quant(FI_DTYPE_Q4_0, t, r0, r1);
}

static void s_mm_q4_1(const fi_mm_task *t, int r0, int r1) {
    s_mm_quant(FI_DTYPE_Q4_1, t, r0, r1);
}

static void s_mm_q8_0(const fi_mm_task *t, int r0, int r1) {
    s_mm_quant(FI_DTYPE_Q8_0, t, r0, r1);
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
    return ty == FI_DTYPE_F16 ? fi_h2f(h) : fi_bf16_to_fp32(h);
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

static inline __m256 s_load_h8(const uint16_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)p));
}

static float s_dot(const float *a, const uint16_t *b, int n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), s_load_h8(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), s_load_h8(b + i + 8), s1);
    }
    for (; i + 8 <= n; i += 8)
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), s_load_h8(b + i), s0);
    float s = s_hsum(_mm256_add_ps(s0, s1));
    for (; i < n; i++)
        s += a[i] * fi_h2f(b[i]);
    return s;
}

static void s_axpy(float *y, float a, const uint16_t *x, int n) {
    __m256 va = _mm256_set1_ps(a);
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, s_load_h8(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++)
        y[i] += a * fi_h2f(x[i]);
}

static void s_to_f16(uint16_t *dst, const float *src, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(void *)(dst + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++)
        dst[i] = fi_fp32_to_fp16(src[i]);
}

void fi_cpu_kernels_avx2(fi_cpu_kernels *k) {
    k->name = "avx2";
    k->quantize_q8x = s_quantize_q8x;
    k->mm_f32 = s_mm_f32;
    k->mm_f16 = s_mm_f16;
    k->mm_bf16 = s_mm_bf16;
    k->mm_q4_0 = s_mm_q4_0;
    k->mm_q4_1 = s_mm_q4_1;
    k->mm_q8_0 = s_mm_q8_0;
    k->dot = s_dot;
    k->axpy = s_axpy;
    k->to_f16 = s_to_f16;
}

/*
 * fi_cpu_avx512.c - AVX512-VNNI kernels for the quantised matmul, on top
 * of the x86 kernels of fi_cpu_x86_impl.h (compiled here with the EVEX
 * 256-bit vpdpbusd). Compiled with -mavx512f -mavx512bw -mavx512vl
 * -mavx512vnni (plus AVX2/FMA/F16C) when the compiler knows them, and
 * entered only after fi_cpu.c has checked the processor and that the OS
 * saves the ZMM state.
 *
 * Why: the 256-bit kernels are bound by instruction throughput (about 4.5
 * instructions per 32-element block and token in prefill); one 512-bit
 * register holds the same block of four rows (Q4_x: one row per 128-bit
 * lane) or two rows (Q8_0: one per 256-bit half), so the nibble expansion,
 * the dot products, the conversion and the FMA each serve 2-4 rows.
 *
 * Q8_0 has no 512-bit vpsignb, so it uses (w ^ 0x80) . x - 128 * sum(x):
 * the bias joins the accumulator as -128*dw*s in one lane per row, like
 * the Q4_1 minimum (m*s) and the Q4_0 offset (-8*dw*s).
 */
#define FI_X86_VNNI 2
#include "fi_cpu_x86_impl.h"

/* Four rows' nibbles of one block (rows q0 + i*stride) as one register
 * per half: lo = low nibbles [A | B | C | D], hi = high nibbles. */
S_INLINE void s_nib4(const uint8_t *q0, size_t stride, __m512i *lo, __m512i *hi) {
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)q0));
    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(q0 + stride)), 1);
    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(q0 + 2 * stride)), 2);
    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(q0 + 3 * stride)), 3);
    *lo = _mm512_and_si512(v, m4);
    *hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
}

/* Sum of each 128-bit lane of v: out[0..3]. */
S_INLINE void s_hsum4(__m512 v, float *out) {
    __m256 a = _mm512_castps512_ps256(v);
    __m256 b = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    __m256 h = _mm256_hadd_ps(a, b); /* A01 A23 C01 C23 | B01 B23 D01 D23 */
    h = _mm256_hadd_ps(h, h);        /* A C A C | B D B D */
    __m128 lo = _mm256_castps256_ps128(h), hi = _mm256_extractf128_ps(h, 1);
    out[0] = _mm_cvtss_f32(lo);
    out[1] = _mm_cvtss_f32(hi);
    out[2] = _mm_cvtss_f32(_mm_movehdup_ps(lo));
    out[3] = _mm_cvtss_f32(_mm_movehdup_ps(hi));
}

/* Block b's scales of rows r..r+3: dw = [d0 x4 | d1 x4 | d2 x4 | d3 x4]
 * and aw = [a0 0 0 0 | a1 0 0 0 | ...], a = m (Q4_1) or -8d (Q4_0). */
S_INLINE void s_q4_scales4(int ty, const uint8_t *wb, size_t stride, __m512 *dw, __m512 *aw) {
    const __m512 lane0 = _mm512_setr_ps(1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0);
    if (ty == FI_DTYPE_Q4_1) {
        __m512 dm = _mm512_castps256_ps512(_mm256_cvtph_ps(s_gather32(wb, stride, 0))); /* d0 m0 d1 m1 .. */
        *dw = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6), dm);
        *aw = _mm512_mul_ps(
            _mm512_permutexvar_ps(_mm512_setr_epi32(1, 1, 1, 1, 3, 3, 3, 3, 5, 5, 5, 5, 7, 7, 7, 7), dm), lane0);
    } else {
        __m512 d = _mm512_castps128_ps512(_mm_cvtph_ps(s_gather16(wb, stride, 0))); /* d0 d1 d2 d3 */
        *dw = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3), d);
        *aw = _mm512_mul_ps(*dw, _mm512_mul_ps(lane0, _mm512_set1_ps(-8.0f)));
    }
}

/* Q4_0 / Q4_1: rows r..r+3 times tokens k..k+T-1 (T <= 4; T == 1
 * prefetches as the decode kernels do). */
S_INLINE void s_q4_4xT(int ty, const fi_mm_task *t, int r, int k, int T) {
    const size_t stride = t->w_stride;
    const size_t bsz = ty == FI_DTYPE_Q4_1 ? sizeof(fi_block_q4_1) : sizeof(fi_block_q4_0);
    const size_t qoff = ty == FI_DTYPE_Q4_1 ? 4 : 2;
    const uint8_t *w0 = t->w + (size_t)r * stride;
    const int nb = t->cols / FI_QK;
    const fi_block_q8x *xr[4];
    __m512 acc[4];
    for (int j = 0; j < T; j++) {
        xr[j] = (const fi_block_q8x *)(t->x + (size_t)(k + j) * t->x_stride);
        acc[j] = _mm512_setzero_ps();
    }
    for (int b = 0; b < nb; b++) {
        const uint8_t *wb = w0 + (size_t)b * bsz;
        if (T == 1)
            s_prefetch_step(w0, stride, b, bsz);
        __m512 dw, aw;
        s_q4_scales4(ty, wb, stride, &dw, &aw);
        __m512i lo, hi;
        s_nib4(wb + qoff, stride, &lo, &hi);
        for (int j = 0; j < T; j++) {
            const fi_block_q8x *x = xr[j] + b;
            __m512i xlo = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)x->qs));
            __m512i xhi = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(x->qs + 16)));
            __m512i isum = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xlo), hi, xhi);
            __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(x->d));
            acc[j] = _mm512_fmadd_ps(v, dw, acc[j]);
            acc[j] = _mm512_fmadd_ps(aw, _mm512_set1_ps(x->s), acc[j]);
        }
    }
    for (int j = 0; j < T; j++)
        s_hsum4(acc[j], t->y + (size_t)(k + j) * t->y_stride + r);
}

/* Q8_0: rows r..r+3 (two registers of two rows) times tokens k..k+T-1
 * (T <= 4). */
S_INLINE void s_q8_4xT(const fi_mm_task *t, int r, int k, int T) {
    const size_t stride = t->w_stride;
    const size_t bsz = sizeof(fi_block_q8_0);
    const uint8_t *w0 = t->w + (size_t)r * stride;
    const int nb = t->cols / FI_QK;
    const __m512i bias = _mm512_set1_epi8((char)0x80);
    const __m512 lane0 = _mm512_setr_ps(-128, 0, 0, 0, 0, 0, 0, 0, -128, 0, 0, 0, 0, 0, 0, 0);
    const fi_block_q8x *xr[4];
    __m512 acc[4][2];
    for (int j = 0; j < T; j++) {
        xr[j] = (const fi_block_q8x *)(t->x + (size_t)(k + j) * t->x_stride);
        acc[j][0] = acc[j][1] = _mm512_setzero_ps();
    }
    for (int b = 0; b < nb; b++) {
        const uint8_t *wb = w0 + (size_t)b * bsz;
        if (T == 1)
            s_prefetch_step(w0, stride, b, bsz);
        __m512 d = _mm512_castps128_ps512(_mm_cvtph_ps(s_gather16(wb, stride, 0))); /* d0 d1 d2 d3 */
        __m512 dw01 = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1), d);
        __m512 dw23 = _mm512_permutexvar_ps(_mm512_setr_epi32(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3), d);
        __m512 aw01 = _mm512_mul_ps(dw01, lane0), aw23 = _mm512_mul_ps(dw23, lane0);
        __m512i u01 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(wb + 2))),
                                         _mm256_loadu_si256((const __m256i *)(wb + stride + 2)), 1);
        __m512i u23 = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(wb + 2 * stride + 2))),
            _mm256_loadu_si256((const __m256i *)(wb + 3 * stride + 2)), 1);
        u01 = _mm512_xor_si512(u01, bias);
        u23 = _mm512_xor_si512(u23, bias);
        for (int j = 0; j < T; j++) {
            const fi_block_q8x *x = xr[j] + b;
            __m512i xv = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)x->qs));
            __m512 dx = _mm512_set1_ps(x->d), sx = _mm512_set1_ps(x->s);
            __m512i i01 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u01, xv);
            __m512i i23 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u23, xv);
            acc[j][0] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(i01), dx), dw01, acc[j][0]);
            acc[j][1] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(i23), dx), dw23, acc[j][1]);
            acc[j][0] = _mm512_fmadd_ps(aw01, sx, acc[j][0]);
            acc[j][1] = _mm512_fmadd_ps(aw23, sx, acc[j][1]);
        }
    }
    for (int j = 0; j < T; j++) {
        float *y = t->y + (size_t)(k + j) * t->y_stride + r;
        for (int h = 0; h < 2; h++) {
            __m256 lo = _mm512_castps512_ps256(acc[j][h]);
            __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[j][h]), 1));
            y[2 * h] = s_hsum(lo);
            y[2 * h + 1] = s_hsum(hi);
        }
    }
}

/* Prefill: tokens in 4s inside sub-blocks of S_RB rows, as in
 * fi_cpu_x86_impl.h, rows in 4s; leftover tokens and rows, and decode,
 * by the 256-bit kernels, which measured faster when one token streams
 * the weights (512-bit instructions get two ports on this core, 256-bit
 * ones three, and decode has fewer dot products per scale to amortise). */
S_INLINE void s_mm_quant512(int ty, const fi_mm_task *t, int r0, int r1) {
    if (t->n < 4) {
        s_mm_quant(ty, t, r0, r1);
        return;
    }
    for (int rb = r0; rb < r1; rb += S_RB) {
        int re = rb + S_RB < r1 ? rb + S_RB : r1;
        int r4 = rb + (re - rb) / 4 * 4;
        int k = 0;
        for (; k + 4 <= t->n; k += 4)
            for (int r = rb; r < r4; r += 4) {
                if (ty == FI_DTYPE_Q8_0)
                    s_q8_4xT(t, r, k, 4);
                else
                    s_q4_4xT(ty, t, r, k, 4);
            }
        for (; k < t->n; k++)
            for (int r = rb; r < r4; r += 4) {
                if (ty == FI_DTYPE_Q8_0)
                    s_q8_dec4(t, r, k);
                else
                    s_q4_dec4(ty, t, r, k);
            }
        for (int r = r4; r < re; r++)
            for (k = 0; k < t->n; k++)
                s_qtile(ty, t, r, k, 1, 1);
    }
}

static void s_mm512_q4_0(const fi_mm_task *t, int r0, int r1) {
    s_mm_quant512(FI_DTYPE_Q4_0, t, r0, r1);
}

static void s_mm512_q4_1(const fi_mm_task *t, int r0, int r1) {
    s_mm_quant512(FI_DTYPE_Q4_1, t, r0, r1);
}

static void s_mm512_q8_0(const fi_mm_task *t, int r0, int r1) {
    s_mm_quant512(FI_DTYPE_Q8_0, t, r0, r1);
}

void fi_cpu_kernels_avx512(fi_cpu_kernels *k) {
    s_x86_fill(k, "avx512vnni");
    k->mm_q4_0 = s_mm512_q4_0;
    k->mm_q4_1 = s_mm512_q4_1;
    k->mm_q8_0 = s_mm512_q8_0;
}

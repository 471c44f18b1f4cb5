/*
 * fi_cpu_portable.c - plain C matmul kernels and float helpers; the
 * fallback on every processor and the reference for the SIMD flavours.
 *
 * Quantised kernels take activations already quantised to fi_block_q8x and
 * compute each block's dot product in integers, then scale it in float:
 *   Q8_0: dw*dx*sum(w*x)
 *   Q4_0: dw*dx*sum(q*x) - 8*dw*s          (s = dx*sum(x))
 *   Q4_1: dw*dx*sum(q*x) + m*s
 * One weight row is used for every token before moving on, so it is read
 * from memory once per call whatever the number of tokens.
 */
#include "fi_kernels_impl.h"

#define S_ROW(t, r) ((const void *)((t)->w + (size_t)(r) * (t)->w_stride))
#define S_XROW(t, k) ((const void *)((t)->x + (size_t)(k) * (t)->x_stride))

static void s_mm_q8_0(const fi_mm_task *t, int r0, int r1) {
    int nb = t->cols / FI_QK;
    for (int r = r0; r < r1; r++) {
        const fi_block_q8_0 *w = S_ROW(t, r);
        for (int k = 0; k < t->n; k++) {
            const fi_block_q8x *x = S_XROW(t, k);
            float acc = 0.0f;
            for (int b = 0; b < nb; b++) {
                int isum = 0;
                for (int j = 0; j < FI_QK; j++)
                    isum += w[b].qs[j] * x[b].qs[j];
                acc += fi_h2f(w[b].d) * x[b].d * (float)isum;
            }
            t->y[(size_t)k * t->y_stride + r] = acc;
        }
    }
}

static int s_dot_nibbles(const uint8_t *qs, const int8_t *xq) {
    int isum = 0;
    for (int j = 0; j < FI_QK / 2; j++)
        isum += (qs[j] & 0x0f) * xq[j] + (qs[j] >> 4) * xq[j + FI_QK / 2];
    return isum;
}

static void s_mm_q4_0(const fi_mm_task *t, int r0, int r1) {
    int nb = t->cols / FI_QK;
    for (int r = r0; r < r1; r++) {
        const fi_block_q4_0 *w = S_ROW(t, r);
        for (int k = 0; k < t->n; k++) {
            const fi_block_q8x *x = S_XROW(t, k);
            float acc = 0.0f;
            for (int b = 0; b < nb; b++) {
                float d = fi_h2f(w[b].d);
                acc += d * x[b].d * (float)s_dot_nibbles(w[b].qs, x[b].qs) - 8.0f * d * x[b].s;
            }
            t->y[(size_t)k * t->y_stride + r] = acc;
        }
    }
}

static void s_mm_q4_1(const fi_mm_task *t, int r0, int r1) {
    int nb = t->cols / FI_QK;
    for (int r = r0; r < r1; r++) {
        const fi_block_q4_1 *w = S_ROW(t, r);
        for (int k = 0; k < t->n; k++) {
            const fi_block_q8x *x = S_XROW(t, k);
            float acc = 0.0f;
            for (int b = 0; b < nb; b++) {
                acc += fi_h2f(w[b].d) * x[b].d * (float)s_dot_nibbles(w[b].qs, x[b].qs) +
                       fi_h2f(w[b].m) * x[b].s;
            }
            t->y[(size_t)k * t->y_stride + r] = acc;
        }
    }
}

/* Float rows: four partial sums so the compiler can vectorise. */
static void s_mm_f32(const fi_mm_task *t, int r0, int r1) {
    for (int r = r0; r < r1; r++) {
        const float *w = S_ROW(t, r);
        for (int k = 0; k < t->n; k++) {
            const float *x = S_XROW(t, k);
            float a[4] = {0, 0, 0, 0};
            int c = 0;
            for (; c + 4 <= t->cols; c += 4)
                for (int j = 0; j < 4; j++)
                    a[j] += w[c + j] * x[c + j];
            for (; c < t->cols; c++)
                a[0] += w[c] * x[c];
            t->y[(size_t)k * t->y_stride + r] = (a[0] + a[1]) + (a[2] + a[3]);
        }
    }
}

static void s_mm_f16(const fi_mm_task *t, int r0, int r1) {
    for (int r = r0; r < r1; r++) {
        const uint16_t *w = S_ROW(t, r);
        for (int k = 0; k < t->n; k++) {
            const float *x = S_XROW(t, k);
            float acc = 0.0f;
            for (int c = 0; c < t->cols; c++)
                acc += fi_h2f(w[c]) * x[c];
            t->y[(size_t)k * t->y_stride + r] = acc;
        }
    }
}

static void s_mm_bf16(const fi_mm_task *t, int r0, int r1) {
    for (int r = r0; r < r1; r++) {
        const uint16_t *w = S_ROW(t, r);
        for (int k = 0; k < t->n; k++) {
            const float *x = S_XROW(t, k);
            float acc = 0.0f;
            for (int c = 0; c < t->cols; c++)
                acc += fi_bf16_to_fp32(w[c]) * x[c];
            t->y[(size_t)k * t->y_stride + r] = acc;
        }
    }
}

static float s_dot(const float *a, const uint16_t *b, int n) {
    float s[4] = {0, 0, 0, 0};
    int i = 0;
    for (; i + 4 <= n; i += 4)
        for (int j = 0; j < 4; j++)
            s[j] += a[i + j] * fi_h2f(b[i + j]);
    for (; i < n; i++)
        s[0] += a[i] * fi_h2f(b[i]);
    return (s[0] + s[1]) + (s[2] + s[3]);
}

static void s_axpy(float *y, float a, const uint16_t *x, int n) {
    for (int i = 0; i < n; i++)
        y[i] += a * fi_h2f(x[i]);
}

static void s_to_f16(uint16_t *dst, const float *src, size_t n) {
    for (size_t i = 0; i < n; i++)
        dst[i] = fi_fp32_to_fp16(src[i]);
}

void fi_cpu_kernels_portable(fi_cpu_kernels *k) {
    k->name = "portable";
    k->quantize_q8x = fi_quantize_q8x_ref;
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

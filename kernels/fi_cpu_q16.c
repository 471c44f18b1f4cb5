/*
 * fi_cpu_q16.c - portable 16-bit-activation kernels (see
 * fi_cpu_q16_impl.h). Plain C: the reference the SIMD kernels are tested
 * against, and the path on processors without AVX2.
 */
#include "fi_cpu_q16_impl.h"

#include <float.h>
#include <math.h>
#include <string.h>

void fi_quantize_q16x_ref(const float *x, fi_block_q16x *y, int nb, int qmax) {
    const float fq = (float)qmax;
    for (int b = 0; b < nb; b++, x += FI_QK) {
        float amax = 0.0f, s = 0.0f;
        for (int i = 0; i < FI_QK; i++) {
            float a = fabsf(x[i]);
            amax = a > amax ? a : amax;
            s += x[i];
        }
        /* a block too small for a normal d (qmax / amax would overflow to
         * inf, and inf * x to NaN or a clipped quant) counts as zeros; a
         * NaN amax (which a SIMD max may keep) gives d NaN and quants 0 */
        const float lo = fq * FLT_MIN;
        float d = !(amax < lo) ? amax / fq : 0.0f, id = amax >= lo ? fq / amax : 0.0f;
        y[b].d = d;
        y[b].s = s;
        for (int i = 0; i < FI_QK; i++)
            y[b].qs[i] = (int16_t)lrintf(x[i] * id);
    }
}

/* One scale for the row: d = amax / 32767 over all its blocks, each
 * block's s the sum of its x times 1 / d (fi_block_q16x). The same guards
 * as above: a row too small for a normal d quantises to zeros with d 0 and
 * s 0, a NaN amax gives d NaN and quants 0. */
void fi_quantize_q16x_tok_ref(const float *x, fi_block_q16x *y, int nb) {
    const float fq = (float)FI_Q16_QMAX;
    float amax = 0.0f;
    for (int i = 0; i < nb * FI_QK; i++) {
        float a = fabsf(x[i]);
        amax = a > amax || a != a ? a : amax;
    }
    const float lo = fq * FLT_MIN;
    float d = !(amax < lo) ? amax / fq : 0.0f, id = amax >= lo ? fq / amax : 0.0f;
    for (int b = 0; b < nb; b++, x += FI_QK) {
        float s = 0.0f;
        for (int i = 0; i < FI_QK; i++)
            s += x[i];
        y[b].d = d;
        y[b].s = s * id;
        for (int i = 0; i < FI_QK; i++)
            y[b].qs[i] = (int16_t)lrintf(x[i] * id);
    }
}

/* Sum over one block of (nibble value) * qs, nibbles as GGML lays them. */
static int32_t s_dot_nib(const uint8_t *qs, const int16_t *x) {
    int32_t sum = 0;
    for (int i = 0; i < FI_QK / 2; i++)
        sum += (int32_t)(qs[i] & 0x0f) * x[i] + (int32_t)(qs[i] >> 4) * x[i + FI_QK / 2];
    return sum;
}

static void s_mm_q4_0(const fi_mm_task *t, int r0, int r1) {
    int nb = t->cols / FI_QK;
    for (int r = r0; r < r1; r++) {
        const fi_block_q4_0 *w = (const fi_block_q4_0 *)(const void *)(t->w + (size_t)r * t->w_stride);
        for (int k = 0; k < t->n; k++) {
            const fi_block_q16x *x = (const fi_block_q16x *)(const void *)(t->x + (size_t)k * t->x_stride);
            float acc = 0.0f;
            for (int b = 0; b < nb; b++) {
                float d = fi_h2f(w[b].d), dx = t->xtok ? 1.0f : x[b].d;
                acc += d * dx * (float)s_dot_nib(w[b].qs, x[b].qs) - 8.0f * d * x[b].s;
            }
            t->y[(size_t)k * t->y_stride + r] = t->xtok ? acc * x[0].d : acc;
        }
    }
}

static void s_mm_q4_1(const fi_mm_task *t, int r0, int r1) {
    int nb = t->cols / FI_QK;
    for (int r = r0; r < r1; r++) {
        const fi_block_q4_1 *w = (const fi_block_q4_1 *)(const void *)(t->w + (size_t)r * t->w_stride);
        for (int k = 0; k < t->n; k++) {
            const fi_block_q16x *x = (const fi_block_q16x *)(const void *)(t->x + (size_t)k * t->x_stride);
            float acc = 0.0f;
            for (int b = 0; b < nb; b++)
                acc += fi_h2f(w[b].d) * (t->xtok ? 1.0f : x[b].d) * (float)s_dot_nib(w[b].qs, x[b].qs) +
                       fi_h2f(w[b].m) * x[b].s;
            t->y[(size_t)k * t->y_stride + r] = t->xtok ? acc * x[0].d : acc;
        }
    }
}

static void s_mm_q8_0(const fi_mm_task *t, int r0, int r1) {
    int nb = t->cols / FI_QK;
    for (int r = r0; r < r1; r++) {
        const fi_block_q8_0 *w = (const fi_block_q8_0 *)(const void *)(t->w + (size_t)r * t->w_stride);
        for (int k = 0; k < t->n; k++) {
            const fi_block_q16x *x = (const fi_block_q16x *)(const void *)(t->x + (size_t)k * t->x_stride);
            float acc = 0.0f;
            for (int b = 0; b < nb; b++) {
                int32_t sum = 0;
                for (int i = 0; i < FI_QK; i++)
                    sum += (int32_t)w[b].qs[i] * x[b].qs[i];
                acc += fi_h2f(w[b].d) * (t->xtok ? 1.0f : x[b].d) * (float)sum;
            }
            t->y[(size_t)k * t->y_stride + r] = t->xtok ? acc * x[0].d : acc;
        }
    }
}

void fi_q16_pack(fi_dtype type, const uint8_t *w, size_t stride, int rows, int cols, uint8_t *out) {
    const size_t bsz = fi_dtype_block_bytes(type);
    const int nb = cols / FI_QK;
    /* where a block's quants start, and how many dwords they are */
    const size_t qs = type == FI_DTYPE_Q4_1 ? 4 : 2;
    const int nq = type == FI_DTYPE_Q8_0 ? 8 : 4;
    const size_t qoff = type == FI_DTYPE_Q4_1 ? 64 : 32;
    for (int g = 0; g + 16 <= rows; g += 16)
        for (int b = 0; b < nb; b++) {
            uint8_t *o = out + (size_t)g * stride + (size_t)b * 16 * bsz;
            for (int r = 0; r < 16; r++) {
                const uint8_t *blk = w + (size_t)(g + r) * stride + (size_t)b * bsz;
                memcpy(o + 2 * r, blk, 2); /* d */
                if (type == FI_DTYPE_Q4_1)
                    memcpy(o + 32 + 2 * r, blk + 2, 2); /* m */
                for (int q = 0; q < nq; q++)
                    memcpy(o + qoff + 64 * q + 4 * r, blk + qs + 4 * q, 4);
            }
        }
}

void fi_q16_kernels_portable(fi_q16_kernels *k) {
    k->quantize = fi_quantize_q16x_ref;
    k->quantize_tok = fi_quantize_q16x_tok_ref;
    k->mm_q4_0 = s_mm_q4_0;
    k->mm_q4_1 = s_mm_q4_1;
    k->mm_q8_0 = s_mm_q8_0;
    k->split = NULL;
    k->pack = NULL;
}

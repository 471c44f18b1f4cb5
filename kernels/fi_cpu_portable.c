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

#include <math.h>
#include <string.h>

#define S_ROW(t, r) ((const void *)((t)->w + (size_t)(r) * (t)->w_stride))
#define S_XROW(t, k) ((const void *)((t)->x + (size_t)(k) * (t)->x_stride))

#define S_CHUNK 64 /* blocks unpacked at a time */

/* Exact int8 dot product of 32 elements (the compiler vectorises it). */
static int s_dot32(const int8_t *a, const int8_t *b) {
    int isum = 0;
    for (int j = 0; j < FI_QK; j++)
        isum += a[j] * b[j];
    return isum;
}

/* Unpacks blocks [b0, b0+nb) of a quantised row into int8 values (Q4_0
 * with its offset 8 removed), scales d and minimums m (Q4_1; else 0). */
static void s_unpack(fi_dtype ty, const void *row, int b0, int nb, int8_t *q, float *d, float *m) {
    for (int b = 0; b < nb; b++) {
        int8_t *o = q + b * FI_QK;
        if (ty == FI_DTYPE_Q8_0) {
            const fi_block_q8_0 *w = (const fi_block_q8_0 *)row + b0 + b;
            memcpy(o, w->qs, FI_QK);
            d[b] = fi_h2f(w->d);
            m[b] = 0.0f;
        } else if (ty == FI_DTYPE_Q4_0) {
            const fi_block_q4_0 *w = (const fi_block_q4_0 *)row + b0 + b;
            for (int j = 0; j < FI_QK / 2; j++) {
                o[j] = (int8_t)((w->qs[j] & 0x0f) - 8);
                o[j + FI_QK / 2] = (int8_t)((w->qs[j] >> 4) - 8);
            }
            d[b] = fi_h2f(w->d);
            m[b] = 0.0f;
        } else {
            const fi_block_q4_1 *w = (const fi_block_q4_1 *)row + b0 + b;
            for (int j = 0; j < FI_QK / 2; j++) {
                o[j] = (int8_t)(w->qs[j] & 0x0f);
                o[j + FI_QK / 2] = (int8_t)(w->qs[j] >> 4);
            }
            d[b] = fi_h2f(w->d);
            m[b] = fi_h2f(w->m);
        }
    }
}

/* Each row is unpacked S_CHUNK blocks at a time and used for every token
 * while it is hot; y accumulates across chunks. */
static void s_mm_quant(fi_dtype ty, const fi_mm_task *t, int r0, int r1) {
    const int nb = t->cols / FI_QK;
    int8_t q[S_CHUNK * FI_QK];
    float d[S_CHUNK], m[S_CHUNK];
    for (int r = r0; r < r1; r++) {
        const void *row = S_ROW(t, r);
        for (int k = 0; k < t->n; k++)
            t->y[(size_t)k * t->y_stride + r] = 0.0f;
        for (int b0 = 0; b0 < nb; b0 += S_CHUNK) {
            int cn = nb - b0 < S_CHUNK ? nb - b0 : S_CHUNK;
            s_unpack(ty, row, b0, cn, q, d, m);
            for (int k = 0; k < t->n; k++) {
                const fi_block_q8x *x = (const fi_block_q8x *)S_XROW(t, k) + b0;
                float acc = 0.0f;
                for (int b = 0; b < cn; b++)
                    acc += d[b] * x[b].d * (float)s_dot32(q + b * FI_QK, x[b].qs) + m[b] * x[b].s;
                t->y[(size_t)k * t->y_stride + r] += acc;
            }
        }
    }
}

static void s_mm_q8_0(const fi_mm_task *t, int r0, int r1) {
    s_mm_quant(FI_DTYPE_Q8_0, t, r0, r1);
}

static void s_mm_q4_0(const fi_mm_task *t, int r0, int r1) {
    s_mm_quant(FI_DTYPE_Q4_0, t, r0, r1);
}

static void s_mm_q4_1(const fi_mm_task *t, int r0, int r1) {
    s_mm_quant(FI_DTYPE_Q4_1, t, r0, r1);
}

/* Float rows: four partial sums so the compiler can vectorise. */
static float s_fdot(const float *w, const float *x, int n) {
    float a[4] = {0, 0, 0, 0};
    int c = 0;
    for (; c + 4 <= n; c += 4)
        for (int j = 0; j < 4; j++)
            a[j] += w[c + j] * x[c + j];
    for (; c < n; c++)
        a[0] += w[c] * x[c];
    return (a[0] + a[1]) + (a[2] + a[3]);
}

static void s_mm_f32(const fi_mm_task *t, int r0, int r1) {
    for (int r = r0; r < r1; r++)
        for (int k = 0; k < t->n; k++)
            t->y[(size_t)k * t->y_stride + r] = s_fdot(S_ROW(t, r), S_XROW(t, k), t->cols);
}

/* F16 / BF16 rows: converted S_FCHUNK elements at a time into floats,
 * then the same dot as F32 for every token. */
#define S_FCHUNK 512

static void s_mm_half(fi_dtype ty, const fi_mm_task *t, int r0, int r1) {
    float wf[S_FCHUNK];
    for (int r = r0; r < r1; r++) {
        const uint16_t *w = S_ROW(t, r);
        for (int k = 0; k < t->n; k++)
            t->y[(size_t)k * t->y_stride + r] = 0.0f;
        for (int c0 = 0; c0 < t->cols; c0 += S_FCHUNK) {
            int cn = t->cols - c0 < S_FCHUNK ? t->cols - c0 : S_FCHUNK;
            if (ty == FI_DTYPE_F16)
                for (int c = 0; c < cn; c++)
                    wf[c] = fi_h2f(w[c0 + c]);
            else
                for (int c = 0; c < cn; c++)
                    wf[c] = fi_bf2f(w[c0 + c]);
            for (int k = 0; k < t->n; k++) {
                const float *x = (const float *)S_XROW(t, k) + c0;
                t->y[(size_t)k * t->y_stride + r] += s_fdot(wf, x, cn);
            }
        }
    }
}

static void s_mm_f16(const fi_mm_task *t, int r0, int r1) {
    s_mm_half(FI_DTYPE_F16, t, r0, r1);
}

static void s_mm_bf16(const fi_mm_task *t, int r0, int r1) {
    s_mm_half(FI_DTYPE_BF16, t, r0, r1);
}

/* Value d of a cache row: fp16 (Q8 = 0) or int8 (Q8 = 1, FI_KV_ROW_Q8). */
static inline float s_kv_val(const uint8_t *row, int d, const int Q8) {
    if (Q8)
        return (float)((const int8_t *)row)[d];
    uint16_t h;
    memcpy(&h, row + 2 * (size_t)d, sizeof h);
    return fi_h2f(h);
}

/* A FI_KV_ROW_Q8 row's scale, soff bytes after its head's quants. */
static inline float s_kv_scale(const uint8_t *row, size_t soff) {
    float f;
    memcpy(&f, row + soff, sizeof f);
    return f;
}

/* Rows `stride` bytes apart; a Q8 score is (dot * row scale) * scale. */
static inline void s_att_dots_g(float *s, size_t ss, const float *q, int gn, const uint8_t *k,
                                size_t stride, size_t soff, int np, int hd, float scale, const int Q8) {
    for (int i = 0; i < np; i++) {
        const uint8_t *kr = k + (size_t)i * stride;
        for (int g = 0; g < gn; g++) {
            const float *qg = q + (size_t)g * hd;
            float a[4] = {0, 0, 0, 0};
            int d = 0;
            for (; d + 4 <= hd; d += 4)
                for (int u = 0; u < 4; u++)
                    a[u] += qg[d + u] * s_kv_val(kr, d + u, Q8);
            for (; d < hd; d++)
                a[0] += qg[d] * s_kv_val(kr, d, Q8);
            float dot = (a[0] + a[1]) + (a[2] + a[3]);
            s[g * ss + i] = (Q8 ? dot * s_kv_scale(kr, soff) : dot) * scale;
        }
    }
}

/* A Q8 row's weight is s * row scale. */
static inline void s_att_wsum_g(float *o, const float *s, size_t ss, int gn, const uint8_t *v,
                                size_t stride, size_t soff, int np, int hd, const int Q8) {
    for (int i = 0; i < np; i++) {
        const uint8_t *vr = v + (size_t)i * stride;
        for (int g = 0; g < gn; g++) {
            float e = Q8 ? s[g * ss + i] * s_kv_scale(vr, soff) : s[g * ss + i];
            float *og = o + (size_t)g * hd;
            for (int d = 0; d < hd; d++)
                og[d] += e * s_kv_val(vr, d, Q8);
        }
    }
}

static void s_att_dots(float *s, size_t ss, const float *q, int gn, const uint16_t *k,
                       size_t stride, int np, int hd, float scale) {
    s_att_dots_g(s, ss, q, gn, (const uint8_t *)k, stride * sizeof *k, 0, np, hd, scale, 0);
}

static void s_att_wsum(float *o, const float *s, size_t ss, int gn, const uint16_t *v,
                       size_t stride, int np, int hd) {
    s_att_wsum_g(o, s, ss, gn, (const uint8_t *)v, stride * sizeof *v, 0, np, hd, 0);
}

static void s_att_dots_q8(float *s, size_t ss, const float *q, int gn, const int8_t *k,
                          size_t stride, size_t soff, int np, int hd, float scale) {
    s_att_dots_g(s, ss, q, gn, (const uint8_t *)k, stride, soff, np, hd, scale, 1);
}

static void s_att_wsum_q8(float *o, const float *s, size_t ss, int gn, const int8_t *v,
                          size_t stride, size_t soff, int np, int hd) {
    s_att_wsum_g(o, s, ss, gn, (const uint8_t *)v, stride, soff, np, hd, 1);
}

static float s_exp_sum(float *s, int n, float *m) {
    float mx = s[0], sum = 0.0f;
    for (int i = 1; i < n; i++)
        mx = s[i] > mx ? s[i] : mx;
    for (int i = 0; i < n; i++) {
        s[i] = expf(s[i] - mx);
        sum += s[i];
    }
    *m = mx;
    return sum;
}

static void s_rmsnorm(float *y, const float *x, const float *g, int dim, float eps) {
    double p[8] = {0};
    int i = 0;
    for (; i + 8 <= dim; i += 8)
        for (int k = 0; k < 8; k++)
            p[k] += (double)x[i + k] * x[i + k];
    double ss = ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
    for (; i < dim; i++)
        ss += (double)x[i] * x[i];
    float scale = (float)(1.0 / sqrt(ss / dim + eps));
    for (i = 0; i < dim; i++)
        y[i] = x[i] * scale * g[i];
}

static void s_swiglu(float *g, const float *u, size_t n) {
    for (size_t i = 0; i < n; i++)
        g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

static void s_to_f16(uint16_t *dst, const float *src, size_t n) {
    for (size_t i = 0; i < n; i++)
        dst[i] = fi_fp32_to_fp16(src[i]);
}

static void s_rope(float *row, int n_heads, int head_dim, const float *tab) {
    for (int h = 0; h < n_heads; h++) {
        float *p = row + (size_t)h * head_dim;
        for (int i = 0; i < head_dim; i += 2) {
            float a = p[i], b = p[i + 1], c = tab[i], s = tab[i + 1];
            p[i] = a * c - b * s;
            p[i + 1] = a * s + b * c;
        }
    }
}

void fi_cpu_kernels_portable(fi_cpu_kernels *k) {
    k->name = "portable";
    k->quantize_q8x = fi_quantize_q8x_ref;
    k->kv_quant = fi_kv_quant_ref;
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
    k->argmax = fi_argmax_f32;
}

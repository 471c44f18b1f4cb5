/*
 * fi_dtype.c - element types: sizes, names, fp16/bf16 conversions, the
 * reference dequantisers for the GGML block layouts (see fi_kernels_impl.h)
 * and the argmax of a float row (greedy decoding).
 *
 * Everything here is portable C and is the reference the SIMD kernels and
 * the tests are checked against.
 */
#include "fi_kernels_impl.h"

#include <float.h>
#include <math.h>
#if defined(__SSE__)
#include <xmmintrin.h>
#endif

int fi_dtype_supported(uint32_t id) {
    switch (id) {
    case FI_DTYPE_F32:
    case FI_DTYPE_F16:
    case FI_DTYPE_BF16:
    case FI_DTYPE_Q4_0:
    case FI_DTYPE_Q4_1:
    case FI_DTYPE_Q8_0:
        return 1;
    default:
        return 0;
    }
}

const char *fi_dtype_name(uint32_t id) {
    switch (id) {
    case FI_DTYPE_F32: return "f32";
    case FI_DTYPE_F16: return "f16";
    case FI_DTYPE_BF16: return "bf16";
    case FI_DTYPE_Q4_0: return "q4_0";
    case FI_DTYPE_Q4_1: return "q4_1";
    case FI_DTYPE_Q8_0: return "q8_0";
    default: return "unknown";
    }
}

int fi_dtype_block_elems(uint32_t id) {
    switch (id) {
    case FI_DTYPE_F32:
    case FI_DTYPE_F16:
    case FI_DTYPE_BF16:
        return 1;
    case FI_DTYPE_Q4_0:
    case FI_DTYPE_Q4_1:
    case FI_DTYPE_Q8_0:
        return FI_QK;
    default:
        return 0;
    }
}

size_t fi_dtype_block_bytes(uint32_t id) {
    switch (id) {
    case FI_DTYPE_F32: return 4;
    case FI_DTYPE_F16: return 2;
    case FI_DTYPE_BF16: return 2;
    case FI_DTYPE_Q4_0: return sizeof(fi_block_q4_0);
    case FI_DTYPE_Q4_1: return sizeof(fi_block_q4_1);
    case FI_DTYPE_Q8_0: return sizeof(fi_block_q8_0);
    default: return 0;
    }
}

size_t fi_dtype_row_bytes(uint32_t id, int64_t n) {
    int be = fi_dtype_block_elems(id);
    if (be == 0 || n < 0 || n % be != 0)
        return 0;
    return (size_t)(n / be) * fi_dtype_block_bytes(id);
}

/* --- fp16 / bf16 ------------------------------------------------------- */

float fi_fp16_to_fp32(uint16_t h) {
    return fi_h2f(h);
}

/* Round to nearest, ties to even; overflow gives inf, NaN stays NaN (quiet,
 * top payload bits kept), results below half the smallest subnormal give a
 * signed zero. */
uint16_t fi_fp32_to_fp16(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) {
        if (ax > 0x7f800000u)
            return (uint16_t)(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));
        return (uint16_t)(sign | 0x7c00u);
    }
    if (ax >= 0x477ff000u) /* >= 65520 rounds to infinity */
        return (uint16_t)(sign | 0x7c00u);
    if (ax < 0x38800000u) { /* below 2^-14: subnormal fp16 or zero */
        int e = (int)(ax >> 23);
        if (e < 102) /* below 2^-25: rounds to zero */
            return (uint16_t)sign;
        uint32_t mant = (ax & 0x7fffffu) | 0x800000u;
        int shift = 126 - e; /* 14..24 */
        uint32_t m = mant >> shift;
        uint32_t rem = mant & ((1u << shift) - 1u);
        uint32_t half = 1u << (shift - 1);
        if (rem > half || (rem == half && (m & 1u)))
            m++; /* may carry into the smallest normal: still correct */
        return (uint16_t)(sign | m);
    }
    uint32_t h = (ax - 0x38000000u) >> 13; /* rebias 127 -> 15 */
    uint32_t rem = ax & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u)))
        h++;
    return (uint16_t)(sign | h);
}

float fi_bf16_to_fp32(uint16_t h) {
    return fi_bf2f(h);
}

/* Round to nearest, ties to even; NaN stays a (quiet) NaN. */
uint16_t fi_fp32_to_bf16(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    if ((x & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((x >> 16) | 0x40u);
    x += 0x7fffu + ((x >> 16) & 1u);
    return (uint16_t)(x >> 16);
}

/* --- dequantisation ------------------------------------------------------ */

void fi_dequantize_row(fi_dtype t, const void *src, float *dst, int64_t n) {
    switch (t) {
    case FI_DTYPE_F32:
        memcpy(dst, src, (size_t)n * sizeof(float));
        return;
    case FI_DTYPE_F16: {
        const uint16_t *s = src;
        for (int64_t i = 0; i < n; i++)
            dst[i] = fi_h2f(s[i]);
        return;
    }
    case FI_DTYPE_BF16: {
        const uint16_t *s = src;
        for (int64_t i = 0; i < n; i++)
            dst[i] = fi_bf2f(s[i]);
        return;
    }
    case FI_DTYPE_Q8_0: {
        const fi_block_q8_0 *b = src;
        for (int64_t i = 0; i < n / FI_QK; i++) {
            float d = fi_h2f(b[i].d);
            for (int j = 0; j < FI_QK; j++)
                dst[i * FI_QK + j] = (float)b[i].qs[j] * d;
        }
        return;
    }
    case FI_DTYPE_Q4_0: {
        const fi_block_q4_0 *b = src;
        for (int64_t i = 0; i < n / FI_QK; i++) {
            float d = fi_h2f(b[i].d);
            float *o = dst + i * FI_QK;
            for (int j = 0; j < FI_QK / 2; j++) {
                o[j] = (float)((b[i].qs[j] & 0x0f) - 8) * d;
                o[j + FI_QK / 2] = (float)((b[i].qs[j] >> 4) - 8) * d;
            }
        }
        return;
    }
    case FI_DTYPE_Q4_1: {
        const fi_block_q4_1 *b = src;
        for (int64_t i = 0; i < n / FI_QK; i++) {
            float d = fi_h2f(b[i].d);
            float m = fi_h2f(b[i].m);
            float *o = dst + i * FI_QK;
            for (int j = 0; j < FI_QK / 2; j++) {
                o[j] = (float)(b[i].qs[j] & 0x0f) * d + m;
                o[j + FI_QK / 2] = (float)(b[i].qs[j] >> 4) * d + m;
            }
        }
        return;
    }
    }
}

/* --- activation quantiser ------------------------------------------------ */

void fi_quantize_q8x_ref(const float *x, fi_block_q8x *y, int nb) {
    for (int i = 0; i < nb; i++) {
        const float *v = x + (size_t)i * FI_QK;
        float amax = 0.0f;
        for (int j = 0; j < FI_QK; j++) {
            float a = fabsf(v[j]);
            amax = a > amax ? a : amax;
        }
        /* a block too small for a normal d (127 / amax would overflow) is
         * zeros */
        const float lo = 127.0f * FLT_MIN;
        float id = amax >= lo ? 127.0f / amax : 0.0f;
        int sum = 0;
        for (int j = 0; j < FI_QK; j++) {
            int q = (int)nearbyintf(v[j] * id);
            y[i].qs[j] = (int8_t)q;
            sum += q;
        }
        y[i].d = !(amax < lo) ? amax / 127.0f : 0.0f; /* NaN stays NaN */
        y[i].s = y[i].d * (float)sum;
    }
}

float fi_kv_quant_ref(int8_t *q, const float *x, int n) {
    float amax = 0.0f;
    int finite = 1;
    for (int j = 0; j < n; j++) {
        float a = fabsf(x[j]);
        finite &= a <= FLT_MAX; /* 0 for an infinity or a NaN */
        amax = a > amax ? a : amax;
    }
    if (!finite) {
        memset(q, 0, (size_t)n);
        return NAN;
    }
    const float lo = 127.0f * FLT_MIN; /* as fi_quantize_q8x_ref */
    float id = amax >= lo ? 127.0f / amax : 0.0f;
    for (int j = 0; j < n; j++)
        q[j] = (int8_t)nearbyintf(x[j] * id);
    return amax >= lo ? amax / 127.0f : 0.0f;
}

/* --- argmax --------------------------------------------------------------- */

int32_t fi_argmax_f32(const float *x, int n) {
    /* the maximum over running maxima (no chain of dependent compares
     * through the whole vocabulary), then its first index; NaNs never win
     * (maxps returns its second operand, the running maximum, for one) */
    float best = -INFINITY;
    int i = 0;
#if defined(__SSE__)
    __m128 m0 = _mm_set1_ps(-INFINITY), m1 = m0, m2 = m0, m3 = m0;
    for (; i + 16 <= n; i += 16) {
        m0 = _mm_max_ps(_mm_loadu_ps(x + i), m0);
        m1 = _mm_max_ps(_mm_loadu_ps(x + i + 4), m1);
        m2 = _mm_max_ps(_mm_loadu_ps(x + i + 8), m2);
        m3 = _mm_max_ps(_mm_loadu_ps(x + i + 12), m3);
    }
    float m[4];
    _mm_storeu_ps(m, _mm_max_ps(_mm_max_ps(m0, m1), _mm_max_ps(m2, m3)));
    for (int k = 0; k < 4; k++)
        best = m[k] > best ? m[k] : best;
#endif
    for (; i < n; i++)
        best = x[i] > best ? x[i] : best;
    i = 0;
#if defined(__SSE__)
    const __m128 vb = _mm_set1_ps(best);
    for (; i + 4 <= n; i += 4) {
        int hit = _mm_movemask_ps(_mm_cmpeq_ps(_mm_loadu_ps(x + i), vb));
        if (hit) return i + __builtin_ctz((unsigned)hit);
    }
#endif
    for (; i < n; i++)
        if (x[i] == best) return i;
    return 0;
}

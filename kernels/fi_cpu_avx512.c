/*
 * fi_cpu_avx512.c - AVX512-VNNI kernels for the quantised matmul with
 * 8-bit activations (fi_block_q8x), on top of the x86 kernels of
 * fi_cpu_x86_impl.h (compiled here with the EVEX 256-bit vpdpbusd, which
 * serve everything else). Compiled with -mavx512f -mavx512bw -mavx512vl
 * -mavx512vnni (plus AVX2/FMA/F16C) when the compiler knows them, and
 * entered only after fi_cpu.c has checked the processor and that the OS
 * saves the ZMM state.
 *
 * Why: the 256-bit kernels hold two rows per register and end every
 * (row, token) with a horizontal sum; here each 32-bit lane holds one row
 * of a group of sixteen, as in the 16-bit-activation kernels
 * (fi_cpu_q16_avx512.c), so one conversion and two FMAs serve sixteen
 * (row, token) pairs per block and nothing is summed across lanes.
 */
#define FI_X86_VNNI 2
#include "fi_cpu_x86_impl.h"
#include "fi_cpu_avx512_impl.h"

/* --- sixteen rows per register ---------------------------------------------
 *
 * A group of 16 rows, one row per 32-bit lane (fi_cpu_avx512_impl.h: from
 * the backend's packed copy where it made one, else transposed in
 * registers, the same bytes), so a block's integer dot products need no
 * horizontal sums: lane r of D[k] holds quant bytes 4k..4k+3 of row r,
 * which for Q4 are elements 4k..4k+3 (low nibbles) and 16+4k..19+4k (high
 * nibbles), and for Q8_0 elements 4k..4k+3. Each vpdpbusd takes one dword
 * of the token's quants broadcast from memory: 8 per (16 rows, token,
 * block), half the vpdpwssd of the 16-bit kernels (the products are the
 * bound once several tokens share the weights: 16 tokens of the default
 * model's decode-shaped products took 7.4 ms at 2 threads on Zen 4,
 * against 24.4 with this file's earlier kernels, four rows per register,
 * and 12.35 with 16-bit activations).
 * Q8_0's signed quants become unsigned as w ^ 0x80 = w + 128, and the
 * 128 * sum(x) that adds joins the offset term, -128 * dw * s, as the
 * minimum does for Q4_1 (m * s) and the nibble offset for Q4_0 (-8 dw * s).
 *
 * Batch invariance: per block, in the row's lane, v = float(isum) * dx,
 * acc = fma(v, dw, acc), acc = fma(a, s, acc), whatever the tile's token
 * count and whichever layout the weights came from (isum is exact in any
 * order, and lanes do not mix; a partial group repeats its last row): a
 * token's row is the same bits alone or in a batch of any size, on any
 * thread split, packed or not. */
#define S_PT8 8        /* tokens per tile */
#define S_PF_GROUPS8 2 /* prefetch this many 16-row groups ahead */

/* Rows r..r+nr-1 (1 <= nr <= 16) times tokens k..k+T-1 (T <= S_PT8), one
 * row per lane; pf: the group's first tile, which prefetches the groups
 * ahead (the weights stream from memory once per call). */
S_INLINE void s_lane_tile(int kind, size_t bsz, const fi_mm_task *t, int r, int nr, int k, int T, int pf) {
    const size_t stride = t->w_stride;
    const uint8_t *w0 = t->w + (size_t)r * stride;
    const int nb = t->cols / FI_QK, nd = kind == S_Q8_0 ? 8 : 4;
    const uint8_t *pk = s_packed(t, r, nr), *p[16] = {0};
    const __m512i vidx = pk ? _mm512_setzero_si512() : s_rows(w0, stride, nr, p); /* GGUF's layout */
    const __m512i m4 = _mm512_set1_epi8(0x0f), bias = _mm512_set1_epi8((char)0x80);
    const fi_block_q8x *xr[S_PT8];
    __m512 acc[S_PT8];
    for (int j = 0; j < T; j++) {
        xr[j] = (const fi_block_q8x *)(const void *)(t->x + (size_t)(k + j) * t->x_stride);
        acc[j] = _mm512_setzero_ps();
    }
    for (int b = 0; b < nb; b++) {
        if (pf) {
            /* this step's share of the group S_PF_GROUPS8 ahead */
            const char *q = (const char *)(pk ? pk : w0) + S_PF_GROUPS8 * 16 * stride + (size_t)b * 16 * bsz;
            for (size_t o = 0; o < 16 * bsz; o += 64)
                _mm_prefetch(q + o, _MM_HINT_T0); /* T1 measured 1.5-2x slower on Zen 4 */
        }
        const uint8_t *pb = pk ? pk + (size_t)b * 16 * bsz : NULL;
        __m512 dw, aw;
        s_scales(kind, vidx, w0 + (size_t)b * bsz, pb, &dw, &aw);
        if (kind == S_Q8_0)
            aw = _mm512_mul_ps(dw, _mm512_set1_ps(-128.0f)); /* exact */
        __m512i D[8], W[8]; /* W[c] pairs with the token's quant dword c */
        s_quants(kind, p, pb ? pb + S_QOFF(kind) : NULL, D);
        if (!pb)
            for (int i = 0; i < 16; i++)
                p[i] += bsz;
        for (int c = 0; c < nd; c++) {
            if (kind == S_Q8_0) {
                W[c] = _mm512_xor_si512(D[c], bias);
            } else {
                W[c] = _mm512_and_si512(D[c], m4);
                W[4 + c] = _mm512_and_si512(_mm512_srli_epi16(D[c], 4), m4);
            }
        }
#pragma GCC unroll 8
        for (int j = 0; j < T; j++) {
            const fi_block_q8x *x = xr[j] + b;
            const int8_t *xq = x->qs; /* dword c: quants 4c..4c+3 (s_ld32: no aliasing) */
            /* two chains, so that one token's products overlap */
            __m512i c0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), W[0], _mm512_set1_epi32((int)s_ld32(xq)));
            __m512i c1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), W[1], _mm512_set1_epi32((int)s_ld32(xq + 4)));
            for (int c = 2; c < 8; c += 2) {
                c0 = _mm512_dpbusd_epi32(c0, W[c], _mm512_set1_epi32((int)s_ld32(xq + 4 * c)));
                c1 = _mm512_dpbusd_epi32(c1, W[c + 1], _mm512_set1_epi32((int)s_ld32(xq + 4 * c + 4)));
            }
            __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(c0, c1)), _mm512_set1_ps(x->d));
            acc[j] = _mm512_fmadd_ps(v, dw, acc[j]);
            acc[j] = _mm512_fmadd_ps(aw, _mm512_set1_ps(x->s), acc[j]);
        }
    }
    const __mmask16 m = (__mmask16)((1u << nr) - 1);
    for (int j = 0; j < T; j++)
        _mm512_mask_storeu_ps(t->y + (size_t)(k + j) * t->y_stride + r, m, acc[j]);
}

/* Tokens k..n-1 of rows r..r+nr-1 in tiles of S_PT8, then 4, 2, 1; the
 * group's weights (at most 16 KiB for the default model) stay in L1 while
 * the tiles pass. */
S_DEFINE_TOKEN_TILES(s_lane_tokens, s_lane_tile, S_PT8)

/* Rows [r0, r1) in groups of 16 (the backend's row ranges start at
 * multiples of 16, so its groups are the packed ones); one token or many. */
S_INLINE void s_mm_lanes(int kind, size_t bsz, const fi_mm_task *t, int r0, int r1) {
    for (int r = r0; r < r1; r += 16)
        s_lane_tokens(kind, bsz, t, r, r1 - r < 16 ? r1 - r : 16, 0, 1); /* the first tile prefetches */
}

static void s_mm512_q4_0(const fi_mm_task *t, int r0, int r1) {
    s_mm_lanes(S_Q4_0, sizeof(fi_block_q4_0), t, r0, r1);
}

static void s_mm512_q4_1(const fi_mm_task *t, int r0, int r1) {
    s_mm_lanes(S_Q4_1, sizeof(fi_block_q4_1), t, r0, r1);
}

static void s_mm512_q8_0(const fi_mm_task *t, int r0, int r1) {
    s_mm_lanes(S_Q8_0, sizeof(fi_block_q8_0), t, r0, r1);
}

void fi_cpu_kernels_avx512(fi_cpu_kernels *k) {
    s_x86_fill(k, "avx512vnni");
    k->mm_q4_0 = s_mm512_q4_0;
    k->mm_q4_1 = s_mm512_q4_1;
    k->mm_q8_0 = s_mm512_q8_0;
}

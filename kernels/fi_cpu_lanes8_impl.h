/*
 * fi_cpu_lanes8_impl.h - private to kernels/: the weights of the 256-bit
 * quantised kernels that hold one row per 32-bit lane, eight rows per
 * register (fi_cpu_q16_avx2.c with 16-bit activations, fi_cpu_x86_impl.h
 * with 8-bit ones on AVX2 and AVX-VNNI). Only for files compiled for AVX2
 * + F16C.
 *
 * They read a block of eight rows as the packed layout (fi_q16_pack) holds
 * it: the rows' fp16 scales d, Q4_1's minimums m, then the quants
 * transposed by dwords, so that one 32-byte load gives lane r quant bytes
 * 4k..4k+3 of row r. Rows outside a packed group (a partial group, a row
 * range that does not start on one, a matrix the backend did not pack) are
 * gathered into the same layout block by block: the same bytes in the
 * same lanes, so the same results.
 */
#ifndef FI_CPU_LANES8_IMPL_H
#define FI_CPU_LANES8_IMPL_H

#include "fi_kernels_impl.h"

#include <immintrin.h>
#include <string.h>

/* Every helper here is always inlined: besides speed, a separate
 * fi_l8_prefetch would be a function without side effects to GCC (12,
 * -O2 and up), whose calls it deletes, prefetches and all. */
#define FI_L8_INLINE static inline __attribute__((always_inline))

/* One block of eight rows: d, their 8 fp16 scales; m, Q4_1's 8 fp16
 * minimums; q, the quants, dword k of the 8 rows (32 bytes) at q + k *
 * qstep. */
typedef struct fi_l8_block {
    const uint8_t *d, *m, *q;
    size_t qstep;
} fi_l8_block;

/* Bytes of a gathered block (fi_l8_gather): d, m, then up to 8 dwords. */
#define FI_L8_GATHER_BYTES (32 + 8 * 32)

/* Where rows rh..rh+nh-1 are the half (eight rows) of a packed group, and
 * the group lies within the call's rows [.., r1) (the backend packs every
 * full group, and rows up to r1 exist), the group; else NULL. */
FI_L8_INLINE const uint8_t *fi_l8_packed(const fi_mm_task *t, int rh, int nh, int r1) {
    int g = rh & ~15;
    return t->wp && nh == 8 && rh % 8 == 0 && g + 16 <= r1 ? t->wp + (size_t)g * t->w_stride : NULL;
}

/* Half h (rows 8h..8h+7) of block b of the packed group at pk. */
FI_L8_INLINE fi_l8_block fi_l8_half(fi_dtype ty, const uint8_t *pk, size_t bsz, int b, int h) {
    const uint8_t *pb = pk + (size_t)b * 16 * bsz;
    return (fi_l8_block){pb + 16 * h, pb + 32 + 16 * h, pb + (ty == FI_DTYPE_Q4_1 ? 64 : 32) + 32 * h, 64};
}

/* The block at byte offset off of rows p[0..7] (GGUF's layout) gathered
 * into buf (FI_L8_GATHER_BYTES) in the packed layout. */
FI_L8_INLINE fi_l8_block fi_l8_gather(fi_dtype ty, const uint8_t *const p[8], size_t off, uint8_t *buf) {
    const int qoff = ty == FI_DTYPE_Q4_1 ? 4 : 2, nq = ty == FI_DTYPE_Q8_0 ? 8 : 4;
    for (int r = 0; r < 8; r++) {
        const uint8_t *blk = p[r] + off;
        memcpy(buf + 2 * r, blk, 2);
        if (ty == FI_DTYPE_Q4_1)
            memcpy(buf + 16 + 2 * r, blk + 2, 2);
        for (int k = 0; k < nq; k++)
            memcpy(buf + 32 + 32 * k + 4 * r, blk + qoff + 4 * k, 4);
    }
    return (fi_l8_block){buf, buf + 16, buf + 32, 32};
}

/* The rows of a tile: for each of its H (1 or 2) halves of eight rows
 * starting at r (nr rows in all; a partial half repeats its last row),
 * its packed group or its row pointers, and how many rows it has. */
typedef struct fi_l8_rows {
    const uint8_t *pk[2];
    const uint8_t *p[2][8];
    int nh[2];
} fi_l8_rows;

FI_L8_INLINE void fi_l8_rows_of(const fi_mm_task *t, int r, int nr, int r1, int H, fi_l8_rows *rw) {
    for (int h = 0; h < H; h++) {
        int rh = r + 8 * h;
        rw->nh[h] = nr - 8 * h < 8 ? nr - 8 * h : 8;
        rw->pk[h] = fi_l8_packed(t, rh, rw->nh[h], r1);
        for (int i = 0; i < 8; i++)
            rw->p[h][i] = t->w + (size_t)(rh + (i < rw->nh[h] ? i : rw->nh[h] - 1)) * t->w_stride;
    }
}

/* Block b of half h of a tile at r: packed, or gathered into buf. */
FI_L8_INLINE fi_l8_block fi_l8_block_of(fi_dtype ty, size_t bsz, const fi_l8_rows *rw, int r, int h, int b,
                                         uint8_t *buf) {
    return rw->pk[h] ? fi_l8_half(ty, rw->pk[h], bsz, b, ((r + 8 * h) >> 3) & 1)
                     : fi_l8_gather(ty, rw->p[h], (size_t)b * bsz, buf);
}

/* The eight rows' scales as floats, and a, the offset per unit of the
 * token's block sum: m for Q4_1, -8 d for Q4_0 (the unsigned nibbles'
 * offset, exact), 0 for Q8_0. */
FI_L8_INLINE void fi_l8_scales(fi_dtype ty, fi_l8_block s, __m256 *dw, __m256 *aw) {
    *dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)s.d));
    if (ty == FI_DTYPE_Q4_1)
        *aw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)s.m));
    else if (ty == FI_DTYPE_Q4_0)
        *aw = _mm256_mul_ps(*dw, _mm256_set1_ps(-8.0f));
    else
        *aw = _mm256_setzero_ps();
}

/* Prefetches into L2 block b of the group S ahead of a tile's rows, where
 * they are packed (a block's 16 rows are then one run of bytes). */
FI_L8_INLINE void fi_l8_prefetch(const uint8_t *ahead, size_t bsz, int b) {
    if (ahead)
        for (size_t o = 0; o < 16 * bsz; o += 64)
            _mm_prefetch((const char *)ahead + (size_t)b * 16 * bsz + o, _MM_HINT_T1);
}

/* The dword at p, 4-byte aligned (a dword of a block's quants: they start
 * at byte 8 of fi_block_q8x and fi_block_q16x), in every lane. Read
 * through an aligned type that may alias: the sanitizers check an aligned
 * 4-byte read on their fast path, one copied by memcpy (alignment 1) on
 * their slow one, which took two thirds of test_sched_model's time under
 * ThreadSanitizer. The same vpbroadcastd otherwise. */
typedef int32_t fi_l8_dword __attribute__((may_alias, aligned(4)));
FI_L8_INLINE __m256i fi_l8_bcast32(const void *p) {
    return _mm256_set1_epi32(*(const fi_l8_dword *)p);
}

/* One block's step of every (row, token) result in its lane, the same
 * sequence of floating-point operations in every tile (batch invariance):
 * v = float(isum) * dx, acc = fma(v, dw, acc), then, with an offset term,
 * acc = fma(aw, s, acc). */
FI_L8_INLINE __m256 fi_l8_accum(__m256 acc, __m256i isum, float dx, float s, __m256 dw, __m256 aw, int offset) {
    __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(dx));
    acc = _mm256_fmadd_ps(v, dw, acc);
    return offset ? _mm256_fmadd_ps(aw, _mm256_set1_ps(s), acc) : acc;
}

/* fi_l8_accum for x with one scale per token (fi_mm_task.xtok, s in units
 * of it): no multiply by dx here; the row's sum takes it once at the end. */
FI_L8_INLINE __m256 fi_l8_accum_tok(__m256 acc, __m256i isum, float s, __m256 dw, __m256 aw, int offset) {
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), dw, acc);
    return offset ? _mm256_fmadd_ps(aw, _mm256_set1_ps(s), acc) : acc;
}

/* FI_L8_PACKED_TILES: whether the tiles of several tokens over packed
 * rows take their own path (s_tile_pk, s_l8_tile_pk). Not under
 * AddressSanitizer or ThreadSanitizer: instrumented by clang, they ran
 * about 1.4x slower than the general tiles (bench_kernels, 32 tokens'
 * decode-shaped products at 12 bits: 760 against 552 ms), and test_edge
 * passed its time limit there. The general tiles give the same bits, and
 * the uninstrumented builds' tests compare the two. */
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define FI_L8_PACKED_TILES 0
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define FI_L8_PACKED_TILES 0
#endif
#endif
#ifndef FI_L8_PACKED_TILES
#define FI_L8_PACKED_TILES 1
#endif

/* Stores lane i < nh of v at y[i]. */
FI_L8_INLINE void fi_l8_store(float *y, __m256 v, int nh) {
    if (nh == 8) {
        _mm256_storeu_ps(y, v);
        return;
    }
    float a[8];
    _mm256_storeu_ps(a, v);
    memcpy(y, a, (size_t)nh * sizeof *y);
}

/* Runs STEP, a statement using c, for c = 0..N-1: in a loop that stays a
 * loop where T, the tile's tokens, is 4 or more (their sums keep the
 * registers busy; unrolled, the compiler hoists every product ahead of the
 * adds and spills them), unrolled for fewer. */
#define FI_L8_STEPS(N, T, c, STEP)                        \
    do {                                                  \
        if ((T) >= 4) {                                   \
            _Pragma("GCC unroll 1") for (int c = 0; c < (N); c++) STEP; \
        } else {                                          \
            for (int c = 0; c < (N); c++)                 \
                STEP;                                     \
        }                                                 \
    } while (0)

/* Defines NAME(ty, bsz, t, r0, r1), the driver of a tile function
 * TILE(ty, bsz, t, r, nr, r1, k, H, T, pf) (rows r..r+nr-1, nr <= 8 H,
 * times tokens k..k+T-1; pf: the first pass over these rows, which
 * prefetches). One token: groups of 16 rows, two halves (two independent
 * chains). Several: sub-blocks of RB rows (their weights stay in L1 while
 * the token tiles pass over them), eight rows times PT tokens, then tiles
 * of 4, 2 and 1 for the rest (each T a constant, so that the tile's loops
 * unroll). */
#define FI_L8_DEFINE_MM(NAME, TILE, PT, RB)                                                    \
    static inline __attribute__((always_inline)) void NAME(fi_dtype ty, size_t bsz,         \
                                                           const fi_mm_task *t, int r0, int r1) { \
        if (t->n == 1) {                                                                      \
            for (int r = r0; r < r1; r += 16) {                                               \
                int nr = r1 - r < 16 ? r1 - r : 16;                                           \
                if (nr > 8)                                                                   \
                    TILE(ty, bsz, t, r, nr, r1, 0, 2, 1, 1);                                  \
                else                                                                          \
                    TILE(ty, bsz, t, r, nr, r1, 0, 1, 1, 1);                                  \
            }                                                                                 \
            return;                                                                           \
        }                                                                                     \
        for (int rb = r0; rb < r1; rb += (RB)) {                                              \
            int re = rb + (RB) < r1 ? rb + (RB) : r1, k = 0;                                  \
            for (; k + (PT) <= t->n; k += (PT))                                               \
                for (int r = rb; r < re; r += 8)                                              \
                    TILE(ty, bsz, t, r, re - r < 8 ? re - r : 8, r1, k, 1, (PT), k == 0);     \
            if (k + 4 <= t->n) {                                                              \
                for (int r = rb; r < re; r += 8)                                              \
                    TILE(ty, bsz, t, r, re - r < 8 ? re - r : 8, r1, k, 1, 4, k == 0);        \
                k += 4;                                                                       \
            }                                                                                 \
            for (; k + 2 <= t->n; k += 2)                                                     \
                for (int r = rb; r < re; r += 8)                                              \
                    TILE(ty, bsz, t, r, re - r < 8 ? re - r : 8, r1, k, 1, 2, k == 0);        \
            for (; k < t->n; k++)                                                             \
                for (int r = rb; r < re; r += 8)                                              \
                    TILE(ty, bsz, t, r, re - r < 8 ? re - r : 8, r1, k, 1, 1, k == 0);        \
        }                                                                                     \
    }

#endif /* FI_CPU_LANES8_IMPL_H */

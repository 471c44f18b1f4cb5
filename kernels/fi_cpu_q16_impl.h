/*
 * fi_cpu_q16_impl.h - private to kernels/: integer matrix products of
 * quantised weights (Q4_0, Q4_1, Q8_0) with activations quantised to 16
 * bits per element.
 *
 * Why 16 bits: quantising activations to 8 bits per element (as the
 * fi_block_q8x path does) moves the default model's logits by up to ~1.0
 * against an exact reference, enough to flip greedy choices whose margin is
 * well above any near tie; 16-bit quants with one scale per token
 * (act_bits 16, the default without an AMX tile unit) keep it within
 * ~0.08, and one scale per block with the bound of 2039 for Q4 products'
 * inputs (act_bits 12, fi_q16_qmax: one tile product per block, the
 * default with the tile unit) within ~0.18 (tests/test_golden.c), while
 * the products stay in integer SIMD (vpmaddwd: 16 products per
 * instruction; vpdpwssd on 512 bits: 32; AMX-INT8 on the quants split into
 * two bytes, fi_cpu_q16_avx512.c).
 *
 * One scale per token (fi_mm_task.xtok) drops a multiply per block and
 * (row, token): the kernels sum d_w * isum + a * s over the blocks and
 * multiply the row's sum by the token's d once.
 *
 * Every kernel here is batch-invariant: a (row, token) result is the same
 * bits whatever the number of tokens in the call and whatever row range
 * it is computed in (the scheduler's batched decode equals one sequence
 * alone). Kernels of different flavours may differ in the last bits.
 */
#ifndef FI_CPU_Q16_IMPL_H
#define FI_CPU_Q16_IMPL_H

#include "fi_kernels_impl.h"

/* One 32-element block of an activation row: x[i] ~= qs[i] * d with
 * |qs[i]| <= qmax (fi_q16_qmax: 32767 or 2039), and s the float sum of
 * the block's x (Q4_1's minimum and Q4_0's offset multiply it). Rows
 * quantised with one scale per token (fi_mm_task.xtok, act_bits 16) have
 * the token's d in every block and s in units of d (sum of x times
 * qmax / amax), so that the kernels multiply by d once per row instead of
 * once per block. 72 bytes. */
typedef struct fi_block_q16x {
    float d;              /* scale */
    float s;              /* sum of x over the block (per token: over d) */
    int16_t qs[FI_QK];    /* quants */
} fi_block_q16x;

_Static_assert(sizeof(fi_block_q16x) == 72, "q16x block is 72 bytes");

/* The bound of the activation quants (fi_mm_task.qmax), by weight type and
 * the backend's activation precision (fi_cpu_backend_set_act_bits). 16:
 * 32767 for every type, one scale per token (fi_mm_task.xtok). 12 (one
 * scale per block, the default where there is an AMX tile unit): Q8_0 weights still take 32767,
 * Q4 weights (nibbles 0..15) take 2039, a little under 12 bits, so that
 * x = 16 h + l with h in [-128, 127] and l in [-8, 7] are both bytes and
 * the tile unit forms x . q in one product of [h | l] with [16 q ; q]
 * (16 q <= 240 is still a byte; fi_cpu_q16_avx512.c), instead of two.
 * Every kernel computes the same exact integer sums whatever the bound;
 * it only sets how finely x is resolved. On the default model
 * (tests/test_golden.c, against the float64 reference) the logits stay
 * within 0.17 (median 0.07) at 12, 0.02 at 16, and move by up to ~1.0
 * with 8-bit activations. */
#define FI_Q16_QMAX 32767
#define FI_Q16_QMAX_Q4 2039
static inline int fi_q16_qmax(fi_dtype t, int act_bits) {
    return act_bits == 12 && (t == FI_DTYPE_Q4_0 || t == FI_DTYPE_Q4_1) ? FI_Q16_QMAX_Q4 : FI_Q16_QMAX;
}

/* Whether the AMX kernels give a product of weights of type t, with x
 * quantised within qmax, to the tile unit (and read fi_mm_task.xs): one
 * scale per block only (xtok 0; rows with one scale per token go to the
 * vector kernels), then Q8_0 at any bound, Q4 only within FI_Q16_QMAX_Q4
 * (one byte product per block; wider Q4 inputs go to the vector kernels). */
static inline int fi_q16_tiles(fi_dtype t, int qmax, int xtok) {
    return !xtok && (t == FI_DTYPE_Q8_0 || qmax <= FI_Q16_QMAX_Q4);
}

/* The 16-bit-activation kernels of one SIMD flavour. The matmul functions
 * take an fi_mm_task whose x holds fi_block_q16x rows. */
typedef struct fi_q16_kernels {
    void (*quantize)(const float *x, fi_block_q16x *y, int nb, int qmax); /* |qs| <= qmax */
    /* one scale for the whole row of nb blocks, |qs| <= FI_Q16_QMAX (see
     * fi_block_q16x: s in units of d) */
    void (*quantize_tok)(const float *x, fi_block_q16x *y, int nb);
    fi_mm_fn mm_q4_0;
    fi_mm_fn mm_q4_1;
    fi_mm_fn mm_q8_0;
    /* NULL, or (the AMX kernels) writes token j (0..15) of a tile of 16
     * tokens in the layout the kernels read from fi_mm_task.xs: each quant
     * split into two bytes h and l, [nb][16][64] with token j's h in bytes
     * 0..31 of its row and l in 32..63 (FI_Q16_TILE_BYTES(nb) bytes); qmax
     * is the bound x was quantised with, and chooses the split (see
     * fi_cpu_q16_avx512.c). Lets the caller split x once per call instead
     * of the kernel once per range of rows. */
    void (*split)(const fi_block_q16x *x, int nb, uint8_t *tile, int j, int qmax);
    /* NULL, or fi_q16_pack where the kernels read fi_mm_task.wp (the
     * AVX2 and AVX512 ones): the backend packs each quantised matrix once. */
    void (*pack)(fi_dtype type, const uint8_t *w, size_t stride, int rows, int cols, uint8_t *out);
} fi_q16_kernels;

/* Packs the full groups of 16 rows of a Q4_0, Q4_1 or Q8_0 matrix (rows /
 * 16 * 16 rows of `stride` bytes) into out, which has as many bytes: group
 * g keeps its byte range; within it, block by block, the 16 rows' d
 * (fp16), for Q4_1 their 16 m, then their quants transposed by dwords
 * (byte 4q+i of lane r is quant byte 4q+i of row r), which is both the
 * AVX512 kernels' register layout and the AMX tile unit's B layout. The
 * scales load as one vector and the quants need no shuffling. */
void fi_q16_pack(fi_dtype type, const uint8_t *w, size_t stride, int rows, int cols, uint8_t *out);

/* The AMX kernels give the tile unit tiles of 16 tokens, and a last tile
 * of at least this many; fewer tokens go to the vector kernels, which are
 * faster there (decode-shaped products at 2 threads: 8 tokens 6.5 ms
 * against 7.1 through the tile unit, 12 tokens 9.8 against 9.3). */
#ifndef FI_Q16_AMX_MIN
#define FI_Q16_AMX_MIN 10
#endif

/* Bytes of one split tile of 16 tokens of nb blocks (fi_q16_kernels.split). */
#define FI_Q16_TILE_BYTES(nb) ((size_t)(nb) * 2 * 16 * 32)

/* Portable kernels; also the reference for the SIMD ones. */
void fi_q16_kernels_portable(fi_q16_kernels *k);
void fi_quantize_q16x_ref(const float *x, fi_block_q16x *y, int nb, int qmax);
void fi_quantize_q16x_tok_ref(const float *x, fi_block_q16x *y, int nb);
#if defined(FI_HAVE_X86) && FI_HAVE_X86
/* AVX2 kernels; call only after checking the processor has AVX2 and FMA. */
void fi_q16_kernels_avx2(fi_q16_kernels *k);
#endif
#if defined(FI_HAVE_AVX512) && FI_HAVE_AVX512
/* Overwrites the matmul members of k (filled by fi_q16_kernels_avx2 first)
 * with AVX512-VNNI ones, and the quantiser too where the processor has
 * AVX512DQ (checked inside; the AVX2 one stays otherwise, the same bits);
 * call only after checking for
 * AVX2, FMA, F16C, AVX512 F/BW/VL/VNNI and ZMM OS support. */
void fi_q16_kernels_avx512(fi_q16_kernels *k);
/* Overwrites the matmul members of k (filled by fi_q16_kernels_avx512)
 * with ones that give tiles of 16 tokens to the AMX-INT8 tile unit, with
 * the same results bit for bit; 0, or -1 (k unchanged) when the processor
 * lacks AMX, the compiler did not build it, or the OS refuses this process
 * the tile state. Asks the OS for that state (once per process). The AMX
 * kernels use about 56 KiB of stack. */
int fi_q16_kernels_avx512_amx(fi_q16_kernels *k);
#endif

#endif /* FI_CPU_Q16_IMPL_H */

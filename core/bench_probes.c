/*
 * bench_probes.c - the machine probes of `fedinfer bench` and `bench
 * --serve`, the bounds their figures are set against:
 *
 *   read bandwidth  how fast this machine's threads can read a buffer
 *                   (wide loads, no computation), which bounds the decode
 *                   of a small model, as every weight is read once a token;
 *   products' peak  how many multiply-adds a second they can issue in the
 *                   integer instruction sequence of the CPU kernels'
 *                   quantised products, with every operand already in a
 *                   register. A batch of tokens reads each weight once for
 *                   all of them, so the products, not memory, bound many
 *                   streams' decode.
 *
 * The products' sequences are the kernels' own per-instruction work (AVX2,
 * no VNNI):
 *   vpmaddwd + vpaddd                  16 multiply-adds: 12- and 16-bit
 *                                      activations, every weight type
 *                                      (kernels/fi_cpu_q16_avx2.c)
 *   vpmaddubsw + vpaddw                32: 8-bit activations, Q4 weights
 *   vpsignb + vpmaddubsw + vpmaddwd    32: 8-bit activations, Q8_0 weights
 *     + vpaddd                         (kernels/fi_cpu_x86_impl.h)
 * and with AVX512-VNNI (kernels/fi_cpu_q16_avx512.c, fi_cpu_avx512.c), one
 * instruction on 512 bits:
 *   vpdpwssd                           32: 12- and 16-bit activations
 *   vpdpbusd                           64: 8-bit activations (Q8_0's
 *                                      signed quants offset by 128 once
 *                                      a block, not once a product)
 * Eight independent accumulators a thread, in registers, the loop written
 * in assembly (in C, GCC reassociates the adds, or hoists the
 * loop-invariant products out of the loop).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

#include "fi_cmd.h"
#include "fi_model.h"

static double s_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* The shortest of `reps` timed runs of fn over the pool, after one
 * untimed run (clocks up, pages in), in seconds. */
static double s_best(fi_pool *pool, fi_pool_fn fn, void *arg, int reps) {
    fi_pool_run(pool, fn, arg);
    double best = 1e30;
    for (int r = 0; r < reps; r++) {
        double t0 = s_now();
        fi_pool_run(pool, fn, arg);
        double dt = s_now() - t0;
        if (dt < best) best = dt;
    }
    return best;
}

/* --- bandwidth probe ---------------------------------------------------- */

typedef struct probe {
    const unsigned char *buf; /* buffer to read */
    size_t bytes;             /* its size, a multiple of 64 * nth */
    uint64_t sink[64];        /* per-thread results, so reads are not elided */
    int avx2;                 /* use 256-bit loads */
} probe;

#if defined(__x86_64__)
__attribute__((target("avx2"))) static uint64_t s_read_avx2(const unsigned char *p, size_t n) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    for (size_t i = 0; i + 128 <= n; i += 128) {
        a0 = _mm256_xor_si256(a0, _mm256_load_si256((const __m256i *)(p + i)));
        a1 = _mm256_xor_si256(a1, _mm256_load_si256((const __m256i *)(p + i + 32)));
        a2 = _mm256_xor_si256(a2, _mm256_load_si256((const __m256i *)(p + i + 64)));
        a3 = _mm256_xor_si256(a3, _mm256_load_si256((const __m256i *)(p + i + 96)));
    }
    a0 = _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3));
    return (uint64_t)_mm256_extract_epi64(a0, 0) ^ (uint64_t)_mm256_extract_epi64(a0, 3);
}
#endif

static uint64_t s_read_portable(const unsigned char *p, size_t n) {
    const uint64_t *q = (const uint64_t *)(const void *)p;
    uint64_t a = 0, b = 0, c = 0, d = 0;
    for (size_t i = 0; i + 4 <= n / 8; i += 4) {
        a ^= q[i];
        b ^= q[i + 1];
        c ^= q[i + 2];
        d ^= q[i + 3];
    }
    return a ^ b ^ c ^ d;
}

static void s_probe_task(void *arg, int ith, int nth) {
    probe *pr = arg;
    size_t chunk = pr->bytes / (size_t)nth;
    const unsigned char *p = pr->buf + chunk * (size_t)ith;
#if defined(__x86_64__)
    if (pr->avx2) {
        pr->sink[ith % 64] ^= s_read_avx2(p, chunk);
        return;
    }
#endif
    pr->sink[ith % 64] ^= s_read_portable(p, chunk);
}

double fi_bench_read_bandwidth(fi_pool *pool, size_t bytes, int reps) {
    int nth = fi_pool_threads(pool);
    size_t unit = (size_t)128 * (size_t)nth;
    bytes = (bytes + unit - 1) / unit * unit;
    unsigned char *buf = aligned_alloc(64, bytes);
    if (!buf) return 0;
    for (size_t i = 0; i < bytes; i++) buf[i] = (unsigned char)(i * 131u + 7u); /* touch every page */
    probe pr = {buf, bytes, {0}, 0};
#if defined(__x86_64__)
    __builtin_cpu_init();
    pr.avx2 = __builtin_cpu_supports("avx2");
#endif
    double best = s_best(pool, s_probe_task, &pr, reps);
    uint64_t x = 0;
    for (int i = 0; i < 64; i++) x ^= pr.sink[i];
    free(buf);
    if (x == 0x5a5a5a5a5a5a5a5aULL) fprintf(stderr, " "); /* keep the reads observable */
    return (double)bytes / best;
}

/* --- products' peak ---------------------------------------------------- */

#define S_ITERS 4000000L /* loop iterations a thread (8 sequences each) */

/* multiply-adds per sequence */
static const int s_macs[FI_PEAK_N] = {16, 32, 32, 32, 64};

typedef struct peak {
    fi_peak_mix mix;
    uint64_t sink[64]; /* per-thread results, so the work is not elided */
} peak;

#if defined(__x86_64__)
/* One mix's loop body: eight sequences into accumulators %0..%7 from
 * weights %9..%12 and activations %13 (and %14), ymm14 and ymm15 free. */
#define S_WD(a, w, x) "vpmaddwd " x ", " w ", %%ymm14\n\tvpaddd %%ymm14, " a ", " a "\n\t"
#define S_UB(a, w, x) "vpmaddubsw " x ", " w ", %%ymm14\n\tvpaddw %%ymm14, " a ", " a "\n\t"
/* signed weights w against signed activations x as the Q8_0 kernel has
 * them: |w| unsigned times x with w's sign, pairs widened by %14 (ones) */
#define S_Q8(a, w, x)                                                                         \
    "vpabsb " w ", %%ymm15\n\tvpsignb " w ", " x ", %%ymm14\n\tvpmaddubsw %%ymm14, %%ymm15, " \
    "%%ymm14\n\tvpmaddwd %14, %%ymm14, %%ymm14\n\tvpaddd %%ymm14, " a ", " a "\n\t"
#define S_BODY(OP)                                                                            \
    "1:\n\t" OP("%0", "%9", "%13") OP("%1", "%10", "%13") OP("%2", "%11", "%13")              \
        OP("%3", "%12", "%13") OP("%4", "%9", "%13") OP("%5", "%10", "%13")                   \
            OP("%6", "%11", "%13") OP("%7", "%12", "%13") "dec %8\n\tjnz 1b\n\t"

/* S_ITERS x 8 sequences of the mix, in assembly: the compiler can
 * neither reorder, reassociate nor hoist them. */
__attribute__((target("avx2"))) static uint64_t s_run(fi_peak_mix mix) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    const __m256i w0 = _mm256_set1_epi16(0x0305), w1 = _mm256_set1_epi16(0x0702),
                  w2 = _mm256_set1_epi16(-0x0b0d), w3 = _mm256_set1_epi16(0x0109),
                  x0 = _mm256_set1_epi16(0x11fe), ones = _mm256_set1_epi16(1);
    long n = S_ITERS;
    if (mix == FI_PEAK_MADDWD)
        __asm__ volatile(S_BODY(S_WD)
                         : "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3), "+x"(a4), "+x"(a5), "+x"(a6), "+x"(a7), "+r"(n)
                         : "x"(w0), "x"(w1), "x"(w2), "x"(w3), "x"(x0), "x"(ones)
                         : "xmm14", "xmm15", "cc");
    else if (mix == FI_PEAK_MADDUBSW)
        __asm__ volatile(S_BODY(S_UB)
                         : "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3), "+x"(a4), "+x"(a5), "+x"(a6), "+x"(a7), "+r"(n)
                         : "x"(w0), "x"(w1), "x"(w2), "x"(w3), "x"(x0), "x"(ones)
                         : "xmm14", "xmm15", "cc");
    else
        __asm__ volatile(S_BODY(S_Q8)
                         : "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3), "+x"(a4), "+x"(a5), "+x"(a6), "+x"(a7), "+r"(n)
                         : "x"(w0), "x"(w1), "x"(w2), "x"(w3), "x"(x0), "x"(ones)
                         : "xmm14", "xmm15", "cc");
    __m256i s = _mm256_xor_si256(_mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3)),
                                 _mm256_xor_si256(_mm256_xor_si256(a4, a5), _mm256_xor_si256(a6, a7)));
    return (uint64_t)_mm256_extract_epi64(s, 0) ^ (uint64_t)_mm256_extract_epi64(s, 3);
}

/* The AVX512-VNNI mixes: eight chains of one instruction, accumulating
 * in %0..%7, weights %9..%12, activations %13. */
#define S_VNNI(OP, a, w, x) OP " " x ", " w ", " a "\n\t"
#define S_BODY512(OP)                                                                         \
    "1:\n\t" S_VNNI(OP, "%0", "%9", "%13") S_VNNI(OP, "%1", "%10", "%13")                      \
        S_VNNI(OP, "%2", "%11", "%13") S_VNNI(OP, "%3", "%12", "%13")                           \
            S_VNNI(OP, "%4", "%9", "%13") S_VNNI(OP, "%5", "%10", "%13")                        \
                S_VNNI(OP, "%6", "%11", "%13") S_VNNI(OP, "%7", "%12", "%13") "dec %8\n\tjnz 1b\n\t"

__attribute__((target("avx512f,avx512vnni"))) static uint64_t s_run512(fi_peak_mix mix) {
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    const __m512i w0 = _mm512_set1_epi16(0x0305), w1 = _mm512_set1_epi16(0x0702),
                  w2 = _mm512_set1_epi16(-0x0b0d), w3 = _mm512_set1_epi16(0x0109),
                  x0 = _mm512_set1_epi16(0x11fe);
    long n = S_ITERS;
    if (mix == FI_PEAK_DPWSSD512)
        __asm__ volatile(S_BODY512("vpdpwssd")
                         : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5), "+v"(a6), "+v"(a7), "+r"(n)
                         : "v"(w0), "v"(w1), "v"(w2), "v"(w3), "v"(x0)
                         : "cc");
    else
        __asm__ volatile(S_BODY512("vpdpbusd")
                         : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5), "+v"(a6), "+v"(a7), "+r"(n)
                         : "v"(w0), "v"(w1), "v"(w2), "v"(w3), "v"(x0)
                         : "cc");
    __m512i s = _mm512_xor_si512(_mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3)),
                                 _mm512_xor_si512(_mm512_xor_si512(a4, a5), _mm512_xor_si512(a6, a7)));
    uint64_t v[8];
    _mm512_storeu_si512(v, s);
    return v[0] ^ v[7];
}

static void s_peak_task(void *arg, int ith, int nth) {
    (void)nth;
    peak *pk = arg;
    pk->sink[ith % 64] ^= pk->mix >= FI_PEAK_DPWSSD512 ? s_run512(pk->mix) : s_run(pk->mix);
}
#endif

const char *fi_peak_mix_name(fi_peak_mix mix) {
    static const char *const names[FI_PEAK_N] = {"vpmaddwd+vpaddd", "vpmaddubsw+vpaddw",
                                                 "vpsignb+vpmaddubsw+vpmaddwd+vpaddd",
                                                 "vpdpwssd (512-bit)", "vpdpbusd (512-bit)"};
    return mix >= 0 && mix < FI_PEAK_N ? names[mix] : "?";
}

double fi_bench_product_peak(fi_pool *pool, fi_peak_mix mix, int reps) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (mix < 0 || mix >= FI_PEAK_N || reps < 1) return 0;
    if (mix >= FI_PEAK_DPWSSD512 ? !__builtin_cpu_supports("avx512vnni") : !__builtin_cpu_supports("avx2"))
        return 0;
    peak pk = {.mix = mix};
    double best = s_best(pool, s_peak_task, &pk, reps);
    uint64_t x = 0;
    for (int i = 0; i < 64; i++) x ^= pk.sink[i];
    if (x == 0x5a5a5a5a5a5a5a5aULL) fprintf(stderr, " "); /* keep the sums observable */
    return (double)S_ITERS * 8 * s_macs[mix] * fi_pool_threads(pool) / best;
#else
    (void)pool, (void)mix, (void)reps;
    return 0;
#endif
}

/* Whether the processor has the AMX-INT8 tile unit (CPUID leaf 7, EDX
 * bit 25), which the avx512vnni flavour's 12- and 16-bit batches use
 * where the OS grants it: no instruction mix here bounds it. */
static int s_has_amx_int8(void) {
#if defined(__x86_64__)
    unsigned a, b, c, d;
    return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 25 & 1);
#else
    return 0;
#endif
}

double fi_bench_product_ceiling(fi_pool *pool, const fi_model *m, const char *simd, int act_bits, char *what,
                                size_t len) {
    snprintf(what, len, "no probe for this backend");
    /* the flavours whose quantised products are the AVX2 sequences: the
     * avxvnni one keeps AVX2's at 12 and 16 bits (vpdpbusd at 8); the
     * avx512vnni one has its own, but at 12 bits batches go to the AMX
     * tile unit where there is one (not probed) */
    const int avx2 = simd && (!strcmp(simd, "avx2") || (!strcmp(simd, "avxvnni") && act_bits != 8));
    const int avx512 = simd && !strcmp(simd, "avx512vnni");
    if (!avx2 && !avx512) return 0;
    if (avx512 && act_bits == 12 && s_has_amx_int8()) {
        snprintf(what, len, "no probe for the AMX tile unit");
        return 0;
    }
    const uint64_t all = fi_model_macs_per_token(m, -1), q8 = fi_model_macs_per_token(m, FI_DTYPE_Q8_0);
    const uint64_t q4 = fi_model_macs_per_token(m, FI_DTYPE_Q4_0) + fi_model_macs_per_token(m, FI_DTYPE_Q4_1);
    if (!all || q4 + q8 != all) { /* float weights take another path */
        snprintf(what, len, "no probe for float weights");
        return 0;
    }
    double sec; /* a token's products at the peak rates */
    if (avx512 || act_bits != 8) { /* one mix for every weight type */
        const fi_peak_mix mix = !avx512 ? FI_PEAK_MADDWD : act_bits == 8 ? FI_PEAK_DPBUSD512 : FI_PEAK_DPWSSD512;
        double p = fi_bench_product_peak(pool, mix, 3);
        if (p <= 0) return 0;
        sec = (double)all / p;
        snprintf(what, len, "%.1f GMAC/s of %s by %d thread%s, no loads, over %.1f M multiply-adds a token",
                 p / 1e9, fi_peak_mix_name(mix), fi_pool_threads(pool),
                 fi_pool_threads(pool) > 1 ? "s" : "", (double)all / 1e6);
    } else {
        double p4 = q4 ? fi_bench_product_peak(pool, FI_PEAK_MADDUBSW, 3) : 1;
        double p8 = q8 ? fi_bench_product_peak(pool, FI_PEAK_Q8_SIGNED, 3) : 1;
        if (p4 <= 0 || p8 <= 0) return 0;
        sec = (double)q4 / p4 + (double)q8 / p8;
        snprintf(what, len, "Q4 %.1f M multiply-adds a token at %.1f GMAC/s of %s, Q8_0 %.1f M at %.1f of %s; "
                 "%d thread%s, no loads", (double)q4 / 1e6, p4 / 1e9, fi_peak_mix_name(FI_PEAK_MADDUBSW),
                 (double)q8 / 1e6, p8 / 1e9, fi_peak_mix_name(FI_PEAK_Q8_SIGNED), fi_pool_threads(pool),
                 fi_pool_threads(pool) > 1 ? "s" : "");
    }
    return 1.0 / sec;
}

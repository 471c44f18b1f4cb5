/*
 * bench_amx.c - how the AMX tile unit and vector arithmetic share a core
 * (a program, not a test).
 *
 *   bench_amx
 *
 * Prints, on one thread, the rate of independent FMAs (twelve chains on
 * registers, no loads) on 512-bit and on 256-bit vectors: alone, with one
 * tile product (TDPBSUD, 16 x 16 x 64 bytes) issued every 96 FMAs, and
 * with one 1 KiB tile load every 96 FMAs, each as the best of five runs.
 *
 * Why: the AMX kernels (kernels/fi_cpu_q16_avx512.c) follow each block's
 * tile product with the block's float steps on 512-bit vectors (a
 * conversion, a multiply and two FMAs per 16 rows and token), and those
 * steps, not the tile products, bound a 16-token step. On the 2-core Xeon
 * of 2026-12-02 the 512-bit FMAs ran at about half their rate whenever
 * tile instructions were interleaved with them, while 256-bit FMAs kept
 * theirs: the same number of float lanes a cycle either way, so the float
 * steps cannot be made cheaper by narrowing them. This program measures
 * that on the machine at hand.
 */
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#include <immintrin.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#define BENCH_X86 1
#endif

enum { MODE_ALONE, MODE_PRODUCT, MODE_LOAD, MODE_N };

#define OUTER 2000000L /* iterations of 96 FMAs */
#define RUNS 5

static double s_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

#if defined(BENCH_X86)
#define ATTR_512 __attribute__((noinline, target("avx512f,amx-tile,amx-int8")))
#define ATTR_256 __attribute__((noinline, target("avx2,fma,amx-tile,amx-int8")))

static _Alignas(64) uint8_t s_tile_src[16][64]; /* the tile loads' bytes */

/* Twelve FMA chains, eight times (96 FMAs), then the mode's tile
 * instruction; the empty asm keeps every chain in its register. */
#define CHAINS(FMA)                                                                               \
    for (int i = 0; i < 8; i++) {                                                                 \
        a0 = FMA(a0, m, m); a1 = FMA(a1, m, m); a2 = FMA(a2, m, m); a3 = FMA(a3, m, m);           \
        a4 = FMA(a4, m, m); a5 = FMA(a5, m, m); a6 = FMA(a6, m, m); a7 = FMA(a7, m, m);           \
        a8 = FMA(a8, m, m); a9 = FMA(a9, m, m); a10 = FMA(a10, m, m); a11 = FMA(a11, m, m);       \
        __asm__ volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5),         \
                         "+v"(a6), "+v"(a7), "+v"(a8), "+v"(a9), "+v"(a10), "+v"(a11));           \
    }                                                                                             \
    if (mode == MODE_PRODUCT)                                                                     \
        _tile_dpbsud(0, 2, 4);                                                                    \
    else if (mode == MODE_LOAD)                                                                   \
        _tile_loadd(2, s_tile_src, 64)

/* NAME(mode, sink): seconds for OUTER x 96 FMAs on VEC vectors; *sink
 * keeps the sums observable. One definition per width. */
#define DEFINE_RUN(NAME, ATTR, VEC, SET1, FMA, ADD, STOREU)                                       \
    ATTR static double NAME(int mode, float *sink) {                                              \
        VEC m = SET1(1.0000001f), a0 = m, a1 = m, a2 = m, a3 = m, a4 = m, a5 = m, a6 = m, a7 = m, \
            a8 = m, a9 = m, a10 = m, a11 = m;                                                     \
        double t0 = s_now();                                                                      \
        for (long r = 0; r < OUTER; r++) {                                                        \
            CHAINS(FMA);                                                                          \
        }                                                                                         \
        double t = s_now() - t0;                                                                  \
        VEC s = ADD(ADD(ADD(a0, a1), ADD(a2, a3)), ADD(ADD(a4, a5), ADD(a6, a7)));                \
        s = ADD(s, ADD(ADD(a8, a9), ADD(a10, a11)));                                              \
        float v[16];                                                                              \
        STOREU(v, s);                                                                             \
        *sink += v[0];                                                                            \
        return t;                                                                                 \
    }

DEFINE_RUN(s_run512, ATTR_512, __m512, _mm512_set1_ps, _mm512_fmadd_ps, _mm512_add_ps, _mm512_storeu_ps)
DEFINE_RUN(s_run256, ATTR_256, __m256, _mm256_set1_ps, _mm256_fmadd_ps, _mm256_add_ps, _mm256_storeu_ps)

/* LDTILECFG's operand, palette 1: tiles 0, 2 and 4 of 16 rows of 64 bytes. */
typedef struct s_tilecfg {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} s_tilecfg;

ATTR_512 static void s_tiles_on(void) {
    s_tilecfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 8; i++) {
        c.rows[i] = 16;
        c.colsb[i] = 64;
    }
    __asm__ volatile("" : : "m"(c)); /* all 64 bytes read (see s_amx_config) */
    _tile_loadconfig(&c);
    _tile_zero(0);
    _tile_loadd(2, s_tile_src, 64);
    _tile_loadd(4, s_tile_src, 64);
}

ATTR_512 static void s_tiles_off(void) {
    _tile_release();
}

/* AVX512F and AMX-TILE/AMX-INT8 (CPUID.(7,0): EBX bit 16; EDX bits 24,
 * 25), the OS saving the ZMM state (XCR0 bits 5-7) and granting the tile
 * data (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA). */
static const char *s_amx_missing(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((b >> 16) & 1u))
        return "no AVX512F";
    if (!((d >> 24) & 1u) || !((d >> 25) & 1u))
        return "no AMX-TILE and AMX-INT8";
    if (!__get_cpuid(1, &a, &b, &c, &d) || !((c >> 27) & 1u))
        return "no OSXSAVE";
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & 0xe6u) != 0xe6u)
        return "the OS does not save the ZMM state";
#if defined(__linux__)
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) != 0)
        return "Linux did not grant the tile data state";
    return NULL;
#else
    return "not Linux (no way here to ask for the tile data state)";
#endif
}
#endif /* BENCH_X86 */

int main(int argc, char **argv) {
    if (argc > 1) {
        const int help = !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h");
        fprintf(help ? stdout : stderr,
                "usage: bench_amx\n\n"
                "FMA rates on 512- and 256-bit vectors, alone and with AMX tile\n"
                "instructions interleaved (one every 96 FMAs), on one thread.\n");
        return help ? 0 : 2;
    }
#if defined(BENCH_X86)
    const char *why = s_amx_missing();
    if (why) {
        printf("bench_amx: nothing to measure here: %s\n", why);
        return 0;
    }
    static const char *const names[MODE_N] = {"alone", "a tile product every 96", "a tile load every 96"};
    float sink = 0.0f;
    double best[2][MODE_N];
    s_tiles_on();
    for (int w = 0; w < 2; w++)
        for (int mode = 0; mode < MODE_N; mode++) {
            best[w][mode] = 1e30;
            for (int run = 0; run < RUNS; run++) {
                double t = w == 0 ? s_run512(mode, &sink) : s_run256(mode, &sink);
                best[w][mode] = t < best[w][mode] ? t : best[w][mode];
            }
        }
    s_tiles_off();
    printf("FMAs on one thread, 12 chains, best of %d runs of %ld x 96:\n", RUNS, OUTER);
    for (int w = 0; w < 2; w++)
        for (int mode = 0; mode < MODE_N; mode++) {
            double per_ns = (double)OUTER * 96 / best[w][mode] / 1e9;
            printf("  %3d-bit, %-24s %6.2f FMA/ns  %6.1f float lanes/ns  %.2fx the rate alone\n",
                   w == 0 ? 512 : 256, names[mode], per_ns, per_ns * (w == 0 ? 16 : 8),
                   best[w][MODE_ALONE] / best[w][mode]);
        }
    if (sink == 12345.0f)
        printf(" \n"); /* keep the sums observable */
    return 0;
#else
    printf("bench_amx: nothing to measure here: not x86-64\n");
    return 0;
#endif
}

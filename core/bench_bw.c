/*
 * bench_bw.c - the read-bandwidth probe of `fedinfer bench` and `bench
 * --serve`: how fast this machine's threads can read a buffer (wide loads,
 * no computation), which bounds the decode of a small model, as every
 * weight is read once a token.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "fi_cmd.h"

static double s_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
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
    fi_pool_run(pool, s_probe_task, &pr); /* warm */
    double best = 1e30;
    for (int r = 0; r < reps; r++) {
        double t0 = s_now();
        fi_pool_run(pool, s_probe_task, &pr);
        double dt = s_now() - t0;
        if (dt < best) best = dt;
    }
    uint64_t x = 0;
    for (int i = 0; i < 64; i++) x ^= pr.sink[i];
    free(buf);
    if (x == 0x5a5a5a5a5a5a5a5aULL) fprintf(stderr, " "); /* keep the reads observable */
    return (double)bytes / best;
}

/*
 * test_nccl.c - the NCCL all-reduce wrapper (kernels/cuda/fi_nccl.h).
 *
 * Needs two CUDA devices in this machine; with fewer it prints
 *     SKIPPED: needs 2 CUDA devices (<why>)
 * and exits 77 (registered as skipped by tests/cuda.cmake). With two or
 * more it sums a vector over every device and checks each result exactly
 * (small integers are exact in fp32 whatever the reduction order).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>

#include "fi_cuda.h"
#include "fi_nccl.h"

static int g_ndev;

static void test_allreduce_local(void **state) {
    char err[512];
    fi_nccl *x = fi_nccl_new_local(g_ndev, err, sizeof err);
    if (!x)
        fail_msg("fi_nccl_new_local: %s", err);
    assert_int_equal(fi_nccl_local_ranks(x), g_ndev);
    const size_t count = 1000003;
    fi_backend **be = calloc((size_t)g_ndev, sizeof *be);
    float **bufs = calloc((size_t)g_ndev, sizeof *bufs);
    float *h = malloc(count * sizeof *h);
    assert_non_null(be);
    assert_non_null(bufs);
    assert_non_null(h);
    for (int d = 0; d < g_ndev; d++) {
        be[d] = fi_cuda_backend_new(d, err, sizeof err);
        if (!be[d])
            fail_msg("device %d: %s", d, err);
        for (size_t i = 0; i < count; i++)
            h[i] = (float)((int)(i % 97) * (d + 1));
        bufs[d] = be[d]->ops->alloc(be[d]->ctx, count * sizeof *h);
        assert_non_null(bufs[d]);
        assert_int_equal(be[d]->ops->to_backend(be[d]->ctx, bufs[d], h, count * sizeof *h), 0);
        assert_int_equal(be[d]->ops->sync(be[d]->ctx), 0);
    }
    if (fi_nccl_allreduce_sum(x, bufs, count, err, sizeof err) != 0)
        fail_msg("all-reduce: %s", err);
    int sum_w = g_ndev * (g_ndev + 1) / 2;
    for (int d = 0; d < g_ndev; d++) {
        assert_int_equal(be[d]->ops->to_host(be[d]->ctx, h, bufs[d], count * sizeof *h), 0);
        size_t bad = 0;
        for (size_t i = 0; i < count; i++)
            bad += h[i] != (float)((int)(i % 97) * sum_w);
        printf("  device %d: %zu wrong of %zu\n", d, bad, count);
        assert_int_equal(bad, 0);
        be[d]->ops->free(be[d]->ctx, bufs[d]);
        fi_backend_destroy(&be[d]);
    }
    fi_nccl_destroy(&x);
    fi_nccl_destroy(&x); /* safe twice */
    free(be);
    free(bufs);
    free(h);
}

int main(void) {
    char why[256] = "";
    g_ndev = fi_cuda_device_count(why, sizeof why);
    if (g_ndev < 2) {
        if (g_ndev == 1)
            snprintf(why, sizeof why, "1 device present");
        printf("SKIPPED: needs 2 CUDA devices (%s)\n", why);
        return 77;
    }
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_allreduce_local)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}

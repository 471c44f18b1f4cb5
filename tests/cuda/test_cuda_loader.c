/*
 * test_cuda_loader.c - fi_cuda_backend_open in a process that links the
 * CUDA module itself (as test_cuda and fi_cuda_probe do).
 *
 * Such a process must use the copy it has mapped, whatever
 * FEDINFER_CUDA_MODULE says and wherever the build directory has moved
 * to: a second copy from another path would have its own operations table,
 * so fi_cuda_backend_is would not know the backends it makes. (The first
 * run on an H200 failed its end-to-end tests because the loader looked for
 * the module at the path of the build, which had been copied elsewhere.)
 *
 * tests/cuda.cmake runs this with LD_LIBRARY_PATH naming a stand-in
 * libcuda.so.1 that has no symbols, so that the loader's driver check
 * passes on any machine and the CUDA runtime then reports its own error,
 * and with FEDINFER_CUDA_MODULE naming a file that does not exist.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fi_cuda.h"
#include "fi_kernels.h"

static void test_mapped_copy_used(void **state) {
    (void)state;
    const char *env = getenv("FEDINFER_CUDA_MODULE");
    assert_non_null(env);
    char want[512], err[512] = "";
    /* the error of a backend made by the mapped copy: the runtime's own */
    fi_backend *direct = fi_cuda_backend_new(0, want, sizeof want);
    if (direct) { /* a real device behind the stand-in: nothing to compare */
        fi_backend_destroy(&direct);
        skip();
    }
    fi_backend *b = fi_cuda_backend_open(0, err, sizeof err);
    printf("  fi_cuda_backend_new: %s\n  fi_cuda_backend_open: %s\n", want, err);
    assert_null(b);
    assert_null(strstr(err, env));
    assert_string_equal(err, want);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_mapped_copy_used),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

/*
 * fi_group_nccl.c - kernels/cuda/fi_nccl through the CUDA module. See
 * fi_group_nccl.h.
 *
 * fi_nccl lives in libfi_cuda.so, which the binaries never link (it is
 * opened with dlopen when a GPU is asked for), so its four functions are
 * looked up by name in that module here. Their signatures are fi_nccl.h's;
 * the header is included in CUDA builds so that the compiler checks the
 * function pointer types against it.
 */
#include "fi_group_nccl.h"

#include <dlfcn.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#ifdef FI_CUDA_MODULE
#include "fi_nccl.h"
_Static_assert(FI_NCCL_ID_BYTES == FI_GNCCL_ID_BYTES, "NCCL id size");
#endif

typedef struct s_api {
    void *h; /* the module */
    int (*id_new)(unsigned char *, char *, size_t);
    void *(*new_rank)(const unsigned char *, int, int, int, char *, size_t);
    int (*sum)(void *, float *const *, size_t, char *, size_t);
    void (*destroy)(void **);
} s_api;

struct fi_gnccl {
    s_api api;  /* the module's functions */
    void *comm; /* fi_nccl * */
};

int fi_gnccl_built(void) {
#ifdef FI_CUDA_MODULE
    return 1;
#else
    return 0;
#endif
}

/* Opens the module and finds fi_nccl's functions. 0, or -1. */
static int s_load(s_api *a, char *err, size_t errlen) {
    memset(a, 0, sizeof *a);
#ifndef FI_CUDA_MODULE
    snprintf(err, errlen, "collective = nccl: this build has no CUDA backend (configure with "
                          "-DFEDINFER_CUDA=ON where the CUDA toolkit and NCCL are installed)");
    return -1;
#else
    char here[PATH_MAX], exe[PATH_MAX];
    const char *path = getenv("FEDINFER_CUDA_MODULE");
    if (!path || !*path) {
        path = FI_CUDA_MODULE;
        ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
        if (n > 0) {
            exe[n] = 0;
            char *slash = strrchr(exe, '/');
            if (slash) {
                *slash = 0;
                int w = snprintf(here, sizeof here, "%s/libfi_cuda.so", exe);
                if (w > 0 && (size_t)w < sizeof here && access(here, R_OK) == 0) path = here;
            }
        }
    }
    if (!(a->h = dlopen(path, RTLD_NOW | RTLD_LOCAL))) {
        snprintf(err, errlen, "collective = nccl: cannot load the CUDA module %s: %s", path,
                 dlerror());
        return -1;
    }
    /* Object to function pointers through memcpy, as POSIX allows. */
    void *s[4] = {dlsym(a->h, "fi_nccl_id_new"), dlsym(a->h, "fi_nccl_new_rank"),
                  dlsym(a->h, "fi_nccl_allreduce_sum"), dlsym(a->h, "fi_nccl_destroy")};
    for (int i = 0; i < 4; i++)
        if (!s[i]) {
            snprintf(err, errlen, "collective = nccl: %s lacks fi_nccl's functions", path);
            dlclose(a->h);
            a->h = NULL;
            return -1;
        }
    memcpy(&a->id_new, &s[0], sizeof s[0]);
    memcpy(&a->new_rank, &s[1], sizeof s[1]);
    memcpy(&a->sum, &s[2], sizeof s[2]);
    memcpy(&a->destroy, &s[3], sizeof s[3]);
    /* The types fi_nccl.h declares, checked by the compiler without a
     * reference to the symbols (they live in the library opened above: a
     * reference would not link where the optimiser keeps it, as in Debug) */
    _Static_assert(__builtin_types_compatible_p(__typeof__(&fi_nccl_id_new),
                                                int (*)(unsigned char[FI_NCCL_ID_BYTES], char *, size_t)),
                   "fi_nccl_id_new's type");
    _Static_assert(__builtin_types_compatible_p(__typeof__(&fi_nccl_allreduce_sum),
                                                int (*)(fi_nccl *, float *const *, size_t, char *, size_t)),
                   "fi_nccl_allreduce_sum's type");
    return 0;
#endif
}

int fi_gnccl_id_new(uint8_t id[FI_GNCCL_ID_BYTES], char *err, size_t errlen) {
    s_api a;
    if (s_load(&a, err, errlen) != 0) return -1;
    int rc = a.id_new(id, err, errlen);
    /* The module stays loaded (the CUDA backend holds it too). */
    return rc;
}

fi_gnccl *fi_gnccl_new(const uint8_t id[FI_GNCCL_ID_BYTES], int n, int rank, int device,
                       char *err, size_t errlen) {
    fi_gnccl *c = calloc(1, sizeof *c);
    if (!c) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    if (s_load(&c->api, err, errlen) != 0 ||
        !(c->comm = c->api.new_rank(id, n, rank, device, err, errlen))) {
        free(c);
        return NULL;
    }
    return c;
}

int fi_gnccl_sum(fi_gnccl *c, float *x, size_t count, char *err, size_t errlen) {
    float *const bufs[1] = {x};
    return c->api.sum(c->comm, bufs, count, err, errlen);
}

void fi_gnccl_destroy(fi_gnccl **cp) {
    if (!cp || !*cp) return;
    fi_gnccl *c = *cp;
    if (c->comm) c->api.destroy(&c->comm);
    free(c);
    *cp = NULL;
}

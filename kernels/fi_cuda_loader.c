/*
 * fi_cuda_loader.c - opens the CUDA backend on demand.
 *
 * The CUDA backend is a shared module (libfi_cuda.so, kernels/cuda/) loaded
 * with dlopen only when a caller asks for a GPU, so that a process running
 * on the CPU never maps the CUDA libraries: cuBLASLt alone adds about
 * 200 MiB of resident memory at load. Before loading anything we look for
 * the driver (libcuda.so.1): without it there can be no device, and the
 * answer costs nothing.
 *
 * A process that already has the module mapped (the CUDA tests link it)
 * uses that copy: a second copy from another path would have its own
 * operations table, and fi_cuda_backend_is would not know its backends.
 * Otherwise the module is looked for at $FEDINFER_CUDA_MODULE, then beside
 * the running executable, then where the build put it. Once a backend is
 * made the module stays loaded for the life of the process.
 */
#include "fi_kernels.h"

#include <dlfcn.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int fi_cuda_available(void) {
#ifdef FI_CUDA_MODULE
    return 1;
#else
    return 0;
#endif
}

#ifdef FI_CUDA_MODULE
/* Path of libfi_cuda.so beside /proc/self/exe, in buf; 0 or -1. */
static int s_beside_exe(char *buf, size_t cap) {
    char exe[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n <= 0) return -1;
    exe[n] = 0;
    char *slash = strrchr(exe, '/');
    if (!slash) return -1;
    *slash = 0;
    int w = snprintf(buf, cap, "%s/libfi_cuda.so", exe);
    return w > 0 && (size_t)w < cap && access(buf, R_OK) == 0 ? 0 : -1;
}
#endif

fi_backend *fi_cuda_backend_open(int device, char *err, size_t errlen) {
#ifndef FI_CUDA_MODULE
    (void)device;
    snprintf(err, errlen, "this build has no CUDA backend (configure with -DFEDINFER_CUDA=ON on a "
                          "machine with the CUDA toolkit)");
    return NULL;
#else
    void *drv = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
    if (!drv) {
        snprintf(err, errlen, "no CUDA driver on this machine (libcuda.so.1 cannot be loaded)");
        return NULL;
    }
    dlclose(drv);
    char here[PATH_MAX];
    const char *path = "libfi_cuda.so (already mapped)";
    void *h = dlopen("libfi_cuda.so", RTLD_NOW | RTLD_NOLOAD);
    if (!h) {
        path = getenv("FEDINFER_CUDA_MODULE");
        if (!path || !*path) path = s_beside_exe(here, sizeof here) == 0 ? here : FI_CUDA_MODULE;
        h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    }
    if (!h) {
        snprintf(err, errlen, "cannot load the CUDA backend module %s: %s", path, dlerror());
        return NULL;
    }
    fi_backend *(*make)(int, char *, size_t);
    void *sym = dlsym(h, "fi_cuda_backend_new");
    if (!sym) {
        snprintf(err, errlen, "%s has no fi_cuda_backend_new", path);
        dlclose(h);
        return NULL;
    }
    memcpy(&make, &sym, sizeof make); /* object pointer to function pointer, as POSIX allows */
    fi_backend *b = make(device, err, errlen);
    if (!b) dlclose(h);
    return b;
#endif
}

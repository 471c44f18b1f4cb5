/*
 * fi_nccl.c - NCCL all-reduce (see fi_nccl.h). One ncclComm_t and one CUDA
 * stream per local rank; a reduction is a group of ncclAllReduce calls (one
 * per local rank) followed by a wait on every stream. The wait polls the
 * stream and NCCL's asynchronous error, so that a lost rank or a reduction
 * that never ends aborts the communicators instead of hanging the process.
 */
#include "fi_nccl.h"

#include <cuda_runtime.h>
#include <nccl.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

_Static_assert(sizeof(ncclUniqueId) == FI_NCCL_ID_BYTES, "FI_NCCL_ID_BYTES is ncclUniqueId's size");

struct fi_nccl {
    int n;                  /* local ranks */
    int *dev;               /* (n) CUDA device of each local rank */
    ncclComm_t *comm;       /* (n) communicators (NULL once aborted) */
    cudaStream_t *stream;   /* (n) streams the reductions run on */
    char aborted[160];      /* why the communicators were aborted, or "" */
};

static int s_cuda(cudaError_t e, const char *what, char *err, size_t errlen) {
    if (e == cudaSuccess)
        return 0;
    snprintf(err, errlen, "cuda: %s: %s", what, cudaGetErrorString(e));
    (void)cudaGetLastError();
    return -1;
}

static int s_nccl(ncclResult_t r, const char *what, char *err, size_t errlen) {
    if (r == ncclSuccess)
        return 0;
    snprintf(err, errlen, "nccl: %s: %s", what, ncclGetErrorString(r));
    return -1;
}

static fi_nccl *s_new(int n, char *err, size_t errlen) {
    fi_nccl *x = calloc(1, sizeof *x);
    if (x) {
        x->n = n;
        x->dev = calloc((size_t)n, sizeof *x->dev);
        x->comm = calloc((size_t)n, sizeof *x->comm);
        x->stream = calloc((size_t)n, sizeof *x->stream);
    }
    if (!x || !x->dev || !x->comm || !x->stream) {
        snprintf(err, errlen, "nccl: out of host memory");
        fi_nccl_destroy(&x);
    }
    return x;
}

static int s_streams(fi_nccl *x, char *err, size_t errlen) {
    for (int i = 0; i < x->n; i++) {
        if (s_cuda(cudaSetDevice(x->dev[i]), "cudaSetDevice", err, errlen) ||
            s_cuda(cudaStreamCreateWithFlags(&x->stream[i], cudaStreamNonBlocking),
                   "cudaStreamCreate", err, errlen))
            return -1;
    }
    return 0;
}

fi_nccl *fi_nccl_new_local(int n_devices, char *err, size_t errlen) {
    int have = 0;
    if (n_devices < 1) {
        snprintf(err, errlen, "nccl: %d devices requested", n_devices);
        return NULL;
    }
    if (s_cuda(cudaGetDeviceCount(&have), "cudaGetDeviceCount", err, errlen))
        return NULL;
    if (have < n_devices) {
        snprintf(err, errlen, "nccl: %d devices requested, %d present", n_devices, have);
        return NULL;
    }
    fi_nccl *x = s_new(n_devices, err, errlen);
    if (!x)
        return NULL;
    for (int i = 0; i < n_devices; i++)
        x->dev[i] = i;
    if (s_nccl(ncclCommInitAll(x->comm, n_devices, x->dev), "ncclCommInitAll", err, errlen)) {
        memset(x->comm, 0, (size_t)n_devices * sizeof *x->comm);
        goto fail;
    }
    if (s_streams(x, err, errlen))
        goto fail;
    return x;
fail:
    fi_nccl_destroy(&x);
    return NULL;
}

int fi_nccl_id_new(unsigned char id[FI_NCCL_ID_BYTES], char *err, size_t errlen) {
    ncclUniqueId u;
    if (s_nccl(ncclGetUniqueId(&u), "ncclGetUniqueId", err, errlen))
        return -1;
    memcpy(id, &u, sizeof u);
    return 0;
}

fi_nccl *fi_nccl_new_rank(const unsigned char id[FI_NCCL_ID_BYTES], int n_ranks, int rank,
                          int device, char *err, size_t errlen) {
    if (n_ranks < 1 || rank < 0 || rank >= n_ranks) {
        snprintf(err, errlen, "nccl: rank %d of %d is out of range", rank, n_ranks);
        return NULL;
    }
    fi_nccl *x = s_new(1, err, errlen);
    if (!x)
        return NULL;
    x->dev[0] = device;
    ncclUniqueId u;
    memcpy(&u, id, sizeof u);
    if (s_cuda(cudaSetDevice(device), "cudaSetDevice", err, errlen))
        goto fail;
    if (s_nccl(ncclCommInitRank(&x->comm[0], n_ranks, u, rank), "ncclCommInitRank", err, errlen)) {
        x->comm[0] = NULL;
        goto fail;
    }
    if (s_streams(x, err, errlen))
        goto fail;
    return x;
fail:
    fi_nccl_destroy(&x);
    return NULL;
}

void fi_nccl_destroy(fi_nccl **p) {
    if (!p || !*p)
        return;
    fi_nccl *x = *p;
    for (int i = 0; x->comm && i < x->n; i++) {
        if (x->dev && cudaSetDevice(x->dev[i]) != cudaSuccess)
            (void)cudaGetLastError();
        if (x->stream && x->stream[i])
            (void)cudaStreamDestroy(x->stream[i]);
        if (x->comm[i])
            (void)ncclCommDestroy(x->comm[i]);
    }
    free(x->dev);
    free(x->comm);
    free(x->stream);
    free(x);
    *p = NULL;
}

int fi_nccl_local_ranks(const fi_nccl *x) {
    return x ? x->n : 0;
}

static long s_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long)ts.tv_sec * 1000L + ts.tv_nsec / 1000000L;
}

/* Aborts every communicator (a reduction in flight on a lost rank would
 * otherwise never end) and keeps the reason for later calls. */
static void s_abort(fi_nccl *x, const char *why) {
    snprintf(x->aborted, sizeof x->aborted, "%s", why && *why ? why : "an earlier failure");
    for (int i = 0; i < x->n; i++)
        if (x->comm[i]) {
            (void)ncclCommAbort(x->comm[i]);
            x->comm[i] = NULL;
        }
}

/* Waits for local rank i's reduction: the stream polled, and between polls
 * NCCL's asynchronous error (where a lost peer or a network failure shows,
 * while the stream just waits), until deadline (ms). 0, or -1 with why. */
static int s_wait(fi_nccl *x, int i, long deadline, char *err, size_t errlen) {
    for (unsigned spins = 0;; spins++) {
        cudaError_t e = cudaStreamQuery(x->stream[i]);
        if (e == cudaSuccess)
            return 0;
        if (e != cudaErrorNotReady)
            return s_cuda(e, "cudaStreamQuery (all-reduce)", err, errlen);
        ncclResult_t a = ncclSuccess;
        if (s_nccl(ncclCommGetAsyncError(x->comm[i], &a), "ncclCommGetAsyncError", err, errlen))
            return -1;
        if (a != ncclSuccess && a != ncclInProgress) {
            snprintf(err, errlen, "nccl: all-reduce failed on local rank %d: %s", i,
                     ncclGetErrorString(a));
            return -1;
        }
        if ((spins & 1023u) == 1023u) {
            if (s_now_ms() > deadline) {
                snprintf(err, errlen,
                         "nccl: all-reduce on local rank %d unfinished after %d ms (a rank lost?)",
                         i, FI_NCCL_WAIT_MS);
                return -1;
            }
            sched_yield();
        }
    }
}

int fi_nccl_allreduce_sum(fi_nccl *x, float *const *bufs, size_t count, char *err, size_t errlen) {
    if (x->aborted[0]) {
        snprintf(err, errlen, "nccl: the communicator was aborted (%s); make a new one", x->aborted);
        return -1;
    }
    if (s_nccl(ncclGroupStart(), "ncclGroupStart", err, errlen))
        return -1;
    int rc = 0;
    for (int i = 0; i < x->n && !rc; i++) {
        if (s_cuda(cudaSetDevice(x->dev[i]), "cudaSetDevice", err, errlen) ||
            s_nccl(ncclAllReduce(bufs[i], bufs[i], count, ncclFloat32, ncclSum, x->comm[i],
                                 x->stream[i]),
                   "ncclAllReduce", err, errlen))
            rc = -1;
    }
    /* the group must be closed even after a failure */
    if (s_nccl(ncclGroupEnd(), "ncclGroupEnd", rc ? NULL : err, rc ? 0 : errlen))
        rc = -1;
    if (rc) {
        /* the local ranks enqueued before the failure would wait for the
         * others for ever: abort, as after a failed wait */
        s_abort(x, err);
        return rc;
    }
    const long deadline = s_now_ms() + FI_NCCL_WAIT_MS;
    for (int i = 0; i < x->n && !rc; i++) {
        if (s_cuda(cudaSetDevice(x->dev[i]), "cudaSetDevice", err, errlen) ||
            s_wait(x, i, deadline, err, errlen)) {
            rc = -1;
            s_abort(x, err);
        }
    }
    return rc;
}

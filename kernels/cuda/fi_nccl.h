/*
 * fi_nccl.h - NCCL all-reduce for tensor parallelism inside one machine.
 *
 * Two ways to build a communicator:
 *   - one process driving n local GPUs (fi_nccl_new_local): rank r is
 *     device r, and fi_nccl_allreduce_sum takes one buffer per rank;
 *   - one process per GPU (shard workers that share a machine): rank 0 makes
 *     an id with fi_nccl_id_new, sends its FI_NCCL_ID_BYTES to the other
 *     ranks (over the fabric), and every rank calls fi_nccl_new_rank with it.
 *     fi_nccl_allreduce_sum then takes this rank's one buffer.
 * Buffers are device memory of the rank's device (for example from the CUDA
 * backend's ops->alloc). Each communicator has its own stream per rank, and
 * fi_nccl_allreduce_sum waits until the reduction has finished, so the
 * caller's stream ordering is simple: finish writing the buffers first
 * (ops->sync), then reduce.
 *
 * Errors come back as -1 / NULL with NCCL's or CUDA's message in err.
 */
#ifndef FI_NCCL_H
#define FI_NCCL_H

#include <stddef.h>

#include "fi_kernels.h" /* FI_MUST_CHECK */

#ifdef __cplusplus
extern "C" {
#endif

#define FI_NCCL_ID_BYTES 128 /* size of an ncclUniqueId */
#define FI_NCCL_WAIT_MS 60000 /* longest wait for one all-reduce (under the group's pass timeout) */

typedef struct fi_nccl fi_nccl;

/* A communicator over devices 0..n_devices-1 of this process (n_devices >= 1).
 * NULL with a message when there are fewer devices or NCCL fails. */
fi_nccl *fi_nccl_new_local(int n_devices, char *err, size_t errlen);

/* A fresh id for a multi-process communicator (rank 0 makes it). */
FI_MUST_CHECK int fi_nccl_id_new(unsigned char id[FI_NCCL_ID_BYTES], char *err, size_t errlen);
/* This process's rank of n_ranks, on CUDA device `device`. Blocks until all
 * ranks have joined. */
fi_nccl *fi_nccl_new_rank(const unsigned char id[FI_NCCL_ID_BYTES], int n_ranks, int rank,
                          int device, char *err, size_t errlen);

/* Frees the communicator and sets *p to NULL; safe on NULL. */
void fi_nccl_destroy(fi_nccl **p);
/* Ranks this process drives (n_devices for a local one, 1 for a rank). */
int fi_nccl_local_ranks(const fi_nccl *x);

/* In place: every buf[i] (count floats on the device of local rank i, one
 * per local rank) becomes the element-wise sum over all ranks. Waits for
 * completion. 0, or -1 with the message in err. A reduction that NCCL
 * reports failed (a rank lost, a network error) or that has not finished
 * within FI_NCCL_WAIT_MS aborts the communicator: this call and every
 * later one fail with the reason, and the caller makes a new one. */
FI_MUST_CHECK int fi_nccl_allreduce_sum(fi_nccl *x, float *const *bufs, size_t count, char *err,
                                        size_t errlen);

#ifdef __cplusplus
}
#endif
#endif /* FI_NCCL_H */

/*
 * fi_group_nccl.h - NCCL for a shard group's TP sums among the GPUs of one
 * machine (collective = nccl): kernels/cuda/fi_nccl's one-rank-per-process
 * communicator, reached through the CUDA backend's module.
 *
 * The module (libfi_cuda.so) is opened on demand, as the CUDA backend is
 * (fi_cuda_loader.c: $FEDINFER_CUDA_MODULE, beside the executable, then
 * where the build put it), so a CPU-only process never maps CUDA. In a
 * build without CUDA every call fails with a message saying so.
 */
#ifndef FI_GROUP_NCCL_H
#define FI_GROUP_NCCL_H

#include <stddef.h>
#include <stdint.h>

#include "fi_wire.h"

#ifdef __cplusplus
extern "C" {
#endif

#define FI_GNCCL_ID_BYTES 128 /* an ncclUniqueId (FI_NCCL_ID_BYTES) */

typedef struct fi_gnccl fi_gnccl;

/* 1 when this build has the CUDA module (NCCL may then work at run time). */
int fi_gnccl_built(void);
/* A fresh communicator id (made by the leader, sent to the ranks in the
 * group's NCCL message). 0, or -1 with a message. */
FI_WIRE_MUST_CHECK int fi_gnccl_id_new(uint8_t id[FI_GNCCL_ID_BYTES], char *err, size_t errlen);
/* This process's rank of n on CUDA device `device`; blocks until every
 * rank has called it with the same id. NULL with a message. */
fi_gnccl *fi_gnccl_new(const uint8_t id[FI_GNCCL_ID_BYTES], int n, int rank, int device,
                       char *err, size_t errlen);
/* In place: x (count floats of device memory) becomes the sum over the
 * ranks. Waits for the result. 0, or -1 with NCCL's or CUDA's message. */
FI_WIRE_MUST_CHECK int fi_gnccl_sum(fi_gnccl *c, float *x, size_t count, char *err,
                                    size_t errlen);
void fi_gnccl_destroy(fi_gnccl **c);

#ifdef __cplusplus
}
#endif
#endif /* FI_GROUP_NCCL_H */
